"""``ngrav profile promote``, ``rollout`` and ``report``: a staged version made live once an eval shows no
regression, the traffic shadowed and split, and the arms compared. They join the ``ngrav profile`` group."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..engines.options import GenerationOptions
from ..profiles.store import StoreDamagedError
from .common import FLAG, DeviceOpt, renamed
from .common import fail as _fail
from .common import guarded as _guard
from .profile import NameArg, stdout, store_of

__all__ = ["app"]

app = typer.Typer(rich_markup_mode="rich")

_VersionOpt = Annotated[int | None, typer.Option("--version", "-v", min=1, help="default: the newest staged")]
_PromptsOpt = Annotated[
    str | None, typer.Option("--prompts", help="eval prompt set: topics, empath, a .txt file or JSONL")
]
_LimitOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--limit",
        help="METRIC:DELTA, repeatable: refuse when the candidate is worse than live by more than DELTA "
        "(absolute, or DELTA% of the live value), e.g. distinct_2:0.05 or rep_2:10%",
    ),
]
_SamplesOpt = Annotated[int, typer.Option("--samples", min=1, help="seeds 0..N-1 per prompt")]
_MaxNewTokensOpt = Annotated[
    int, typer.Option("--max-new-tokens", min=1, help="token budget per prompt (60: as ngrav eval)")
]
_TopKOpt = Annotated[int, typer.Option("--top-k", min=0, help="top-k sampling (0 = off)")]
_TemperatureOpt = Annotated[float, typer.Option("--temperature", min=0.0, help="0 = greedy")]
_RawOpt = Annotated[
    bool | None,
    typer.Option("--raw/--chat", metavar=FLAG, help="plain continuation or chat template (default: as ngrav eval)"),
]
_BatchSizeOpt = Annotated[int, typer.Option("--batch-size", min=1, help="prompts per batch")]
_LimitPromptsOpt = Annotated[int | None, typer.Option("--limit-prompts", min=1, help="keep N prompts")]
_ModelOpt = Annotated[str | None, typer.Option("--model", help="smollm2 (default), gemma3-270m, a folder, .gguf")]
_JudgeOpt = Annotated[
    str | None, typer.Option("--judge", help="perplexity judge (default: none unless a limit is judge_ppl)")
]
_OutOpt = Annotated[Path | None, typer.Option("--out", help="keep the eval's run folder and reports here")]
_NoCheckOpt = Annotated[
    bool, typer.Option("--no-check", metavar=FLAG, help="move the live pointer without an eval (an emergency switch)")
]
_WhyPromotedOpt = Annotated[str | None, typer.Option("--message", "-m", help="why it is promoted")]
_FormatOpt = Annotated[str, typer.Option("--format", help="text (a table) or json, on stdout")]
_JsonRenamedOpt = Annotated[
    bool, renamed("--json", "is now --format json (--json FILE saves a file elsewhere)", switch=True)
]


def _format(value: str) -> bool:
    """``--format``: True for json, False for text; anything else is one error line."""
    if value not in ("text", "json"):
        _fail(f"--format must be text or json, got {value!r}")
    return value == "json"


def _promote_unchecked(store: Any, name: str, version: int | None, message: str | None) -> None:
    """``promote --no-check``: move the live pointer to ``version`` (default: the newest staged), with no eval."""
    try:
        before: int | str = store.live_version(name)
    except StoreDamagedError:
        before = "a damaged pointer"  # promoting a named version repairs it
    if version is None and not _guard(lambda: store.staged(name)):
        _fail(f"nothing is staged for {name!r}: live version {before} is the newest; give --version V")
    live = _guard(lambda: store.promote(name, version, message=message or "promoted without a check"))
    typer.echo(f"{name}: version {live} is live (was {before}); no eval was run")


def _check_prompts(prompts: str) -> None:
    """``--prompts``: a built-in topic set or a file; anything else is one error line."""
    if prompts not in ("topics", "topics-tune", "empath", "empath-tune") and not Path(prompts).is_file():
        _fail(f"--prompts {prompts!r} is neither a built-in set (topics, empath) nor a file; check the path")


@app.command()
def promote(
    ctx: typer.Context,
    name: NameArg,
    version: _VersionOpt = None,
    prompts: _PromptsOpt = None,
    limit: _LimitOpt = None,
    samples: _SamplesOpt = 3,
    max_new_tokens: _MaxNewTokensOpt = 60,
    top_k: _TopKOpt = 10,
    temperature: _TemperatureOpt = 1.0,
    raw: _RawOpt = None,
    batch_size: _BatchSizeOpt = 8,
    limit_prompts: _LimitPromptsOpt = None,
    model: _ModelOpt = None,
    judge: _JudgeOpt = None,
    device: DeviceOpt = "cpu",
    out: _OutOpt = None,
    no_check: _NoCheckOpt = False,
    message: _WhyPromotedOpt = None,
    output_format: _FormatOpt = "text",
    json_renamed: _JsonRenamedOpt = False,
) -> None:
    """Make a staged version live once an eval on a prompt set shows no regression beyond the limits.

    The live and the candidate version run through `ngrav eval` on the same prompts and seeds; each --limit is the
    paired difference of one metric's aggregate, read by the metric's direction (higher_is_better). A regression
    beyond its limit refuses the promotion (exit code 1, with the figures) and the live version keeps serving.

    Examples:

        ngrav profile promote space --prompts topics --limit-prompts 14 --limit distinct_2:0.05 --limit rep_2:0.05

        ngrav profile promote space --version 3 --no-check
    """
    as_json = _format(output_format)
    store = store_of(ctx)
    if no_check:
        if prompts or limit:
            _fail("--no-check moves the pointer without an eval; leave out --prompts and --limit, or --no-check")
        _promote_unchecked(store, name, version, message)
        return
    if not prompts or not limit:
        _fail(
            "give --prompts SET and at least one --limit METRIC:DELTA (e.g. --limit distinct_2:0.05), "
            "or --no-check to move the live pointer without an eval"
        )
    from ..eval.promote import Limit, PromotionCheck, evaluate_promotion  # the evaluation: not for --help

    limits = [_guard(lambda spec=spec: Limit.parse(spec)) for spec in limit or []]
    _check_prompts(prompts)
    err = Console(stderr=True, soft_wrap=True)
    options = _guard(
        lambda: GenerationOptions(max_new_tokens, top_k, temperature, raw=raw, batch_size=batch_size, device=device)
    )
    check = PromotionCheck(
        prompts=prompts, version=version, out=out, seeds=tuple(range(samples)), options=options, model_name=model,
        judge=judge, limit_prompts=limit_prompts, message=message,
    )  # fmt: skip
    result = _guard(lambda: evaluate_promotion(store, name, limits, check, console=err))
    if as_json:
        typer.echo(json.dumps(result.to_json(), indent=2, ensure_ascii=False))
    else:
        stdout(wide=True).print(_checks_table(result))
    if result.promoted:
        err.print(f"{escape(name)}: version {result.candidate} is live (was {result.live})", highlight=False)
        return
    lines = "\n  ".join(escape(c.describe()) for c in result.failed)
    err.print(
        f"[bold red]refused:[/] version {result.candidate} of {escape(name)} regresses beyond its limits:\n  {lines}\n"
        f"version {result.live} stays live.",
        highlight=False,
    )
    raise typer.Exit(1)


def _checks_table(result: Any) -> Any:
    table = Table(
        title=f"{escape(result.name)}: candidate {result.candidate} vs live {result.live}, paired (prompt, seed), "
        "95% bootstrap interval"
    )
    for col in ("metric", "better", "live", "candidate", "difference [95% CI]", "regression", "allowed", "pairs", ""):
        table.add_column(col)
    for c in result.checks:
        better = {True: "higher", False: "lower", None: "–"}[c.higher_is_better]
        table.add_row(
            escape(c.metric),
            better,
            f"{c.live:.4g}",
            f"{c.candidate:.4g}",
            f"{c.difference:+.4g} [{c.low:+.4g}, {c.high:+.4g}]",
            f"{c.regression:.4g}",
            f"{c.allowed:.4g}",
            str(c.pairs),
            "[green]ok[/]" if c.passed else "[bold red]refused[/]",
        )
    return table


_ShadowOpt = Annotated[
    float | None, typer.Option("--shadow", help="share of requests also run without gravity, e.g. 0.05")
]
_SplitVersionOpt = Annotated[
    int | None, typer.Option("--split-version", min=1, help="the version arm split:b serves (a staged one)")
]
_SplitShareOpt = Annotated[float | None, typer.Option("--split-share", help="share of requests on split:b, e.g. 0.1")]
_NoSplitOpt = Annotated[bool, typer.Option("--no-split", metavar=FLAG, help="end the split (keep the shadow)")]
_ClearOpt = Annotated[bool, typer.Option("--clear", metavar=FLAG, help="turn the rollout off: no shadow, no split")]
_HistoryOpt = Annotated[bool, typer.Option("--history", metavar=FLAG, help="show every revision")]
_WhyChangedOpt = Annotated[str | None, typer.Option("--message", "-m", help="why it changed")]


@app.command()
def rollout(
    ctx: typer.Context,
    name: NameArg,
    shadow: _ShadowOpt = None,
    split_version: _SplitVersionOpt = None,
    split_share: _SplitShareOpt = None,
    no_split: _NoSplitOpt = False,
    clear: _ClearOpt = False,
    history: _HistoryOpt = False,
    message: _WhyChangedOpt = None,
) -> None:
    """Show or change how NAME's traffic is shadowed and split; the server applies it to the next request.

    Options left out keep their current value. A split sends --split-share of the requests without a version to
    --split-version (arm split:b), the rest to the live version (split:a); a request's arm follows its `user`,
    else its `seed` (random without either). A shadow runs the same request without gravity after it is
    answered, for comparison; its text is not returned.

    Examples:

        ngrav profile rollout space --shadow 0.05

        ngrav profile rollout space --split-version 4 --split-share 0.1 -m "canary"

        ngrav profile rollout space --clear
    """
    store = store_of(ctx)
    changing = clear or no_split or shadow is not None or split_version is not None or split_share is not None
    if history:
        if changing:
            _fail("--history only shows; change the rollout in another call")
        states = _guard(lambda: store.rollout_history(name))
        table = Table(title=f"rollout history of {escape(name)}")
        for col in ("revision", "updated (UTC)", "rollout", "message"):
            table.add_column(col)
        for st in states:
            body = json.dumps(st.config.model_dump(mode="json", exclude_defaults=True))
            table.add_row(str(st.revision), st.updated, escape(body), escape(st.message or ""))
        stdout().print(table)
        return
    if changing:
        if clear and (no_split or shadow is not None or split_version is not None or split_share is not None):
            _fail("--clear turns everything off; give it alone")
        if no_split and (split_version is not None or split_share is not None):
            _fail("--no-split ends the split; leave out --split-version and --split-share")
        current = _guard(lambda: store.rollout(name)).config.model_dump(mode="json", exclude_none=True)
        data: dict[str, Any] = {} if clear else current
        if shadow is not None:
            data["shadow"] = shadow
        if no_split:
            data.pop("split", None)
        elif split_version is not None or split_share is not None:
            split = dict(data.get("split") or {})
            if split_version is not None:
                split["version"] = split_version
            if split_share is not None:
                split["share"] = split_share
            data["split"] = split
        _guard(lambda: store.set_rollout(name, data, message=message))
    st = _guard(lambda: store.rollout(name))
    live = _guard(lambda: store.live_version(name))
    cfg = st.config
    split = (
        "off" if cfg.split is None else f"{cfg.split.share:.1%} of requests to version {cfg.split.version} (split:b)"
    )
    if cfg.split is not None and cfg.split.version == live:
        split += f" [yellow](inactive: version {live} is live now)[/]"
    console = stdout()
    console.print(
        f"[bold]{escape(name)}[/] rollout revision {st.revision}: live version {live}; "
        f"shadow {cfg.shadow:.1%} of requests; split {split}",
        highlight=False,
        soft_wrap=True,
    )


@app.command()
def report(
    ctx: typer.Context,
    name: NameArg,
    server: Annotated[
        str | None, typer.Option("--server", help="ask a running server (e.g. http://127.0.0.1:8000) instead")
    ] = None,
    api_key: Annotated[str | None, typer.Option("--api-key", envvar="NGRAV_API_KEY", help="the server's key")] = None,
    output_format: _FormatOpt = "text",
    json_renamed: _JsonRenamedOpt = False,
) -> None:
    """Compare the arms of NAME (live, split, shadow) from what the server recorded, with 95% intervals.

    Reads the profile's arm log in the store (the server appends one record per finished request), or asks
    --server. Split arms are compared unpaired (split:b − split:a); each arm is compared with its shadows paired by
    request (the same prompt and seed without the pull).

    Examples:

        ngrav profile report space

        ngrav profile report space --server http://127.0.0.1:8000 --format json
    """
    as_json = _format(output_format)
    from ..eval.rollout_report import (  # the statistics import the evaluation (torch): not for --help
        build_report,
        render_report,
    )

    if server is not None:
        data = _remote_report(server, name, api_key)
    else:
        store = store_of(ctx)
        live = _guard(lambda: store.live_version(name))  # an unknown name fails here, with a did-you-mean
        data = _guard(lambda: build_report(name, store.arms_log(name).read()))
        data["live"] = live
    if as_json:
        typer.echo(json.dumps(data, indent=2, ensure_ascii=False))
        return
    console = stdout(wide=True)
    for part in render_report(data):
        console.print(part)


def _remote_report(server: str, name: str, api_key: str | None) -> dict[str, Any]:
    import httpx  # the `dev` extra; only this option needs it

    url = server.rstrip("/") + f"/v1/profiles/{name}/report"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(url, headers=headers, timeout=60, trust_env=False)
    except httpx.HTTPError as exc:
        _fail(f"cannot reach {server}: {exc}; check --server (e.g. http://127.0.0.1:8000)")
    try:
        body = resp.json()
    except ValueError:
        body = {}
    if resp.status_code != 200:
        message = body.get("error", {}).get("message") if isinstance(body, dict) else None
        _fail(f"{url} answered {resp.status_code}: {message or resp.text[:200]}")
    return body
