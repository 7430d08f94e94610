"""``ngrav profile``: the profile store from the command line (the store needs no torch; promote and report do).

Examples::

    ngrav profile set space profiles/space.yaml --message "first cut"
    ngrav profile list
    ngrav profile show space --version 1 > space_v1.json
    ngrav profile history space
    ngrav profile diff space 1 2
    ngrav profile rollback space --to 1
    ngrav profile stage space profiles/space_v2.yaml --message "stronger pull"
    ngrav profile rollout space --shadow 0.05 --split-version 4 --split-share 0.1
    ngrav profile report space
    ngrav profile promote space --prompts topics --limit distinct_2:0.05 --limit rep_2:0.05
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..engines.options import GenerationOptions
from ..profiles.schema import load_profile
from ..profiles.store import ProfileStore, StoreDamagedError
from .common import fail as _fail
from .common import guarded as _guard

__all__ = ["profile_app"]

profile_app = typer.Typer(
    no_args_is_help=True,
    rich_markup_mode="rich",
    help=(
        "Named, versioned profiles: every [bold]set[/] is a new numbered snapshot; history, diff and rollback. "
        "[bold]stage[/] stores a version that is not live yet; [bold]promote[/] makes it live once an eval shows no "
        "regression; [bold]rollout[/] shadows or splits a profile's traffic and [bold]report[/] compares the arms.\n\n"
        "The store folder is --store, else $NARRATIVE_GRAVITY_STORE, else "
        "~/.local/share/narrative-gravity/profiles.\n\n"
        "Examples:\n\n"
        "ngrav profile set space profiles/space.yaml --message 'first cut'\n\n"
        "ngrav profile list\n\n"
        "ngrav profile show space --version 1 > space_v1.json\n\n"
        "ngrav profile diff space 1 2\n\n"
        "ngrav profile rollback space --to 1\n\n"
        "ngrav profile stage space profiles/space_v2.yaml\n\n"
        "ngrav profile rollout space --shadow 0.05 --split-version 4 --split-share 0.1\n\n"
        "ngrav profile report space\n\n"
        "ngrav profile promote space --prompts prompts.txt --limit distinct_2:0.05"
    ),
)

NameArg = Annotated[str, typer.Argument(help="profile name: letters, digits, '-', '_' or '.'")]


@profile_app.callback()
def _options(
    ctx: typer.Context,
    store: Annotated[
        Path | None,
        typer.Option(
            "--store",
            envvar="NARRATIVE_GRAVITY_STORE",
            help="store folder (default ~/.local/share/narrative-gravity/profiles)",
        ),
    ] = None,
) -> None:
    ctx.ensure_object(dict)["store"] = store


def _store(ctx: typer.Context) -> ProfileStore:
    return _guard(lambda: ProfileStore(ctx.ensure_object(dict).get("store")))


def _console(*, wide: bool = False) -> Any:
    """The stdout console; ``wide`` tables get 150 columns when stdout is not a terminal (a pipe, a file)."""
    return Console(width=150 if wide and not sys.stdout.isatty() else None)


@profile_app.command("list")
def list_profiles(ctx: typer.Context) -> None:
    """List the stored profiles with their live and newest version, and what is staged.

    Example: ngrav profile list
    """
    store = _store(ctx)
    infos = _guard(store.list)
    if not infos:
        typer.echo(f"no profiles in {store.root}; add one with: ngrav profile set NAME FILE")
        return
    table = Table(title=f"profiles in {escape(str(store.root))}")
    for col in ("name", "live", "newest", "staged", "updated (UTC)", "message"):
        table.add_column(col)
    for info in infos:
        live = "?" if info.live is None else str(info.live)
        staged = ", ".join(str(v) for v in info.staged)
        if info.error is not None:
            table.add_row(f"[red]{escape(info.name)}[/]", live, str(info.version), staged, "[red]damaged[/]", "")
        else:
            row = (escape(info.name), live, str(info.version), staged, info.created, escape(info.message or ""))
            table.add_row(*row)
    console = _console()
    console.print(table)
    for info in infos:
        if info.error is not None:
            console.print(f"[bold red]damaged:[/] {escape(info.name)}: {escape(info.error)}", highlight=False)


@profile_app.command()
def show(
    ctx: typer.Context,
    name: NameArg,
    version: Annotated[int | None, typer.Option("--version", "-v", min=1, help="a past version")] = None,
) -> None:
    """Print a profile as JSON (ready for `set`): the live version unless --version names another.

    Its version, whether it is live or staged, its date and message go to stderr.

    Example: ngrav profile show space --version 1 > space_v1.json
    """
    store = _store(ctx)
    snap, live = _guard(lambda: (store.snapshot(name, version), store.live_version(name)))
    note = f" ({snap.message})" if snap.message else ""
    state = "live" if snap.version == live else ("staged" if snap.version > live else f"not live; live is {live}")
    typer.echo(f"# {name} version {snap.version} [{state}], {snap.created}{note}", err=True)
    typer.echo(json.dumps(snap.profile.model_dump(mode="json"), indent=2, ensure_ascii=False))


@profile_app.command("set")
def set_profile(
    ctx: typer.Context,
    name: NameArg,
    file: Annotated[Path, typer.Argument(help="profile file (.json/.yaml)")],
    message: Annotated[str | None, typer.Option("--message", "-m", help="why it changed")] = None,
) -> None:
    """Validate a profile file and store it as the next version of NAME, live at once (see `stage` for not live).

    Example: ngrav profile set space profiles/space.yaml --message "stronger pull"
    """
    store = _store(ctx)
    profile = _guard(lambda: load_profile(file))
    version = _guard(lambda: store.set(name, profile, message=message))
    typer.echo(f"{name}: stored version {version}")


@profile_app.command()
def history(ctx: typer.Context, name: NameArg) -> None:
    """Show every version of a profile, oldest first, which one is live and which are staged.

    Example: ngrav profile history space
    """
    store = _store(ctx)
    infos, live, moves = _guard(lambda: (store.history(name), store.live_version(name), store.live_history(name)))
    table = Table(title=f"history of {escape(name)} (live: version {live})")
    for col in ("version", "", "created (UTC)", "message"):
        table.add_column(col)
    for info in infos:
        state = "[bold green]live[/]" if info.version == live else ("staged" if info.version > live else "")
        table.add_row(str(info.version), state, info.created, escape(info.message or ""))
    console = _console()
    console.print(table)
    if moves:
        pointer = Table(title=f"live pointer of {escape(name)}")
        for col in ("updated (UTC)", "from", "to", "message"):
            pointer.add_column(col)
        for m in moves:
            before = "newest" if m.previous is None else str(m.previous)
            pointer.add_row(m.updated, before, str(m.version), escape(m.message or ""))
        console.print(pointer)


@profile_app.command()
def diff(
    ctx: typer.Context,
    name: NameArg,
    a: Annotated[int, typer.Argument(min=1, help="older version")],
    b: Annotated[int, typer.Argument(min=1, help="newer version")],
    keys: Annotated[bool, typer.Option("--keys", help="a table of changed keys instead of a unified diff")] = False,
) -> None:
    """Show what changed between two versions of a profile.

    Example: ngrav profile diff space 1 2
    """
    store = _store(ctx)
    if keys:
        changes = _guard(lambda: store.changes(name, a, b))
        if not changes:
            typer.echo(f"{name}: versions {a} and {b} are identical")
            return
        table = Table(title=f"{escape(name)}: version {a} → {b}")
        for col in ("key", "kind", f"version {a}", f"version {b}"):
            table.add_column(col)
        for c in changes:
            old = "" if c.kind == "added" else json.dumps(c.old, ensure_ascii=False)
            new = "" if c.kind == "removed" else json.dumps(c.new, ensure_ascii=False)
            table.add_row(escape(c.key), c.kind, escape(old), escape(new))
        _console().print(table)
        return
    text = _guard(lambda: store.diff(name, a, b))
    typer.echo(text.rstrip("\n") if text else f"{name}: versions {a} and {b} are identical")


@profile_app.command()
def rollback(
    ctx: typer.Context,
    name: NameArg,
    to: Annotated[int, typer.Option("--to", min=1, help="the version to restore")],
) -> None:
    """Restore an old version as a NEW version, and make it live; history is never rewritten.

    Versions staged before the rollback stay in the history (no longer staged, since the new version is the newest)
    and can still be made live with `promote --version V`. To go back to an older version without a new snapshot,
    use `promote NAME --version V --no-check`.

    Example: ngrav profile rollback space --to 1
    """
    version = _guard(lambda: _store(ctx).rollback(name, to))
    typer.echo(f"{name}: stored version {version} (= version {to})")


@profile_app.command()
def stage(
    ctx: typer.Context,
    name: NameArg,
    file: Annotated[Path, typer.Argument(help="profile file (.json/.yaml)")],
    message: Annotated[str | None, typer.Option("--message", "-m", help="why it changed")] = None,
) -> None:
    """Store a profile file as the next version of NAME without making it live.

    Requests that name no version keep getting the live version; compare the two with `rollout --split-version`,
    then `promote`.

    Example: ngrav profile stage space profiles/space_v2.yaml --message "stronger pull"
    """
    store = _store(ctx)
    profile = _guard(lambda: load_profile(file))
    version = _guard(lambda: store.stage(name, profile, message=message))
    live = _guard(lambda: store.live_version(name))
    typer.echo(f"{name}: staged version {version}; version {live} stays live")


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
_MaxNewTokensOpt = Annotated[int, typer.Option("--max-new-tokens", min=1, help="token budget per prompt")]
_TopKOpt = Annotated[int, typer.Option("--top-k", min=0, help="top-k sampling (0 = off)")]
_TemperatureOpt = Annotated[float, typer.Option("--temperature", min=0.0, help="0 = greedy")]
_RawOpt = Annotated[
    bool | None, typer.Option("--raw/--chat", help="plain continuation or chat template (default: as ngrav eval)")
]
_BatchSizeOpt = Annotated[int, typer.Option("--batch-size", min=1, help="prompts per batch")]
_LimitPromptsOpt = Annotated[int | None, typer.Option("--limit-prompts", min=1, help="keep N prompts")]
_ModelOpt = Annotated[str | None, typer.Option("--model", help="smollm2 (default), gemma3-270m, a folder, .gguf")]
_JudgeOpt = Annotated[
    str | None, typer.Option("--judge", help="perplexity judge (default: none unless a limit is judge_ppl)")
]
_OutOpt = Annotated[Path | None, typer.Option("--out", help="keep the eval's run folder and reports here")]
_NoCheckOpt = Annotated[
    bool, typer.Option("--no-check", help="move the live pointer without an eval (an emergency switch)")
]
_WhyPromotedOpt = Annotated[str | None, typer.Option("--message", "-m", help="why it is promoted")]
_JsonOutOpt = Annotated[bool, typer.Option("--json", help="print the checks as JSON")]


@profile_app.command()
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
    out: _OutOpt = None,
    no_check: _NoCheckOpt = False,
    message: _WhyPromotedOpt = None,
    json_out: _JsonOutOpt = False,
) -> None:
    """Make a staged version live once an eval on a prompt set shows no regression beyond the limits.

    The live and the candidate version run through `ngrav eval` on the same prompts and seeds; each --limit is the
    paired difference of one metric's aggregate, read by the metric's direction (higher_is_better). A regression
    beyond its limit refuses the promotion (exit code 1, with the figures) and the live version keeps serving.

    Examples:

        ngrav profile promote space --prompts topics --limit-prompts 14 --limit distinct_2:0.05 --limit rep_2:0.05

        ngrav profile promote space --version 3 --no-check
    """
    store = _store(ctx)
    if no_check:
        if prompts or limit:
            _fail("--no-check moves the pointer without an eval; leave out --prompts and --limit, or --no-check")
        try:
            before: int | str = store.live_version(name)
        except StoreDamagedError:
            before = "a damaged pointer"  # promoting a named version repairs it
        if version is None and not _guard(lambda: store.staged(name)):
            _fail(f"nothing is staged for {name!r}: live version {before} is the newest; give --version V")
        live = _guard(lambda: store.promote(name, version, message=message or "promoted without a check"))
        typer.echo(f"{name}: version {live} is live (was {before}); no eval was run")
        return
    if not prompts or not limit:
        _fail(
            "give --prompts SET and at least one --limit METRIC:DELTA (e.g. --limit distinct_2:0.05), "
            "or --no-check to move the live pointer without an eval"
        )
    from ..eval.promote import Limit, PromotionCheck, evaluate_promotion  # the evaluation: not for --help

    limits = [_guard(lambda spec=spec: Limit.parse(spec)) for spec in limit or []]
    if prompts not in ("topics", "topics-tune", "empath", "empath-tune") and not Path(prompts).is_file():
        _fail(f"--prompts {prompts!r} is neither a built-in set (topics, empath) nor a file; check the path")
    err = Console(stderr=True, soft_wrap=True)
    options = _guard(lambda: GenerationOptions(max_new_tokens, top_k, temperature, raw=raw, batch_size=batch_size))
    check = PromotionCheck(
        prompts=prompts, version=version, out=out, seeds=tuple(range(samples)), options=options, model_name=model,
        judge=judge, limit_prompts=limit_prompts, message=message,
    )  # fmt: skip
    result = _guard(lambda: evaluate_promotion(store, name, limits, check, console=err))
    if json_out:
        typer.echo(json.dumps(result.to_json(), indent=2, ensure_ascii=False))
    else:
        _console(wide=True).print(_checks_table(result))
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
_NoSplitOpt = Annotated[bool, typer.Option("--no-split", help="end the split (keep the shadow)")]
_ClearOpt = Annotated[bool, typer.Option("--clear", help="turn the rollout off: no shadow, no split")]
_HistoryOpt = Annotated[bool, typer.Option("--history", help="show every revision")]
_WhyChangedOpt = Annotated[str | None, typer.Option("--message", "-m", help="why it changed")]


@profile_app.command()
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
    store = _store(ctx)
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
        _console().print(table)
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
    console = _console()
    console.print(
        f"[bold]{escape(name)}[/] rollout revision {st.revision}: live version {live}; "
        f"shadow {cfg.shadow:.1%} of requests; split {split}",
        highlight=False,
        soft_wrap=True,
    )


@profile_app.command()
def report(
    ctx: typer.Context,
    name: NameArg,
    server: Annotated[
        str | None, typer.Option("--server", help="ask a running server (e.g. http://127.0.0.1:8000) instead")
    ] = None,
    api_key: Annotated[str | None, typer.Option("--api-key", envvar="NGRAV_API_KEY", help="the server's key")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
) -> None:
    """Compare the arms of NAME (live, split, shadow) from what the server recorded, with 95% intervals.

    Reads the profile's arm log in the store (the server appends one record per finished request), or asks
    --server. Split arms are compared unpaired (split:b − split:a); each arm is compared with its shadows paired by
    request (the same prompt and seed without the pull).

    Examples:

        ngrav profile report space

        ngrav profile report space --server http://127.0.0.1:8000 --json
    """
    from ..eval.rollout_report import build_report, render_report  # the statistics import the evaluation

    if server is not None:
        data = _remote_report(server, name, api_key)
    else:
        store = _store(ctx)
        live = _guard(lambda: store.live_version(name))  # an unknown name fails here, with a did-you-mean
        data = _guard(lambda: build_report(name, store.arms_log(name).read()))
        data["live"] = live
    if json_out:
        typer.echo(json.dumps(data, indent=2, ensure_ascii=False))
        return
    console = _console(wide=True)
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
