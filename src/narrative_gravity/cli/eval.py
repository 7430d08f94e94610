"""``ngrav eval``: profiles against control on a prompt set, with paired statistics and reports."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .common import (
    EngineOpt,
    MaxNewOpt,
    ModelOpt,
    TempOpt,
    TopKOpt,
    check_model,
    check_output,
    fail,
    guarded,
    read_text,
    vllm_engine,
)

__all__ = ["app"]

app = typer.Typer(rich_markup_mode="rich")


@app.command("eval")
def eval_command(
    prompts: Annotated[
        str,
        typer.Option(
            "--prompts",
            help="`topics` (the PPLM/FUDGE set), `empath` (25 Empath subject topics, the test half), `topics-tune` / "
            "`empath-tune` (tuning splits), a .txt file, or JSONL with `prompt`",
        ),
    ],
    out: Annotated[Path, typer.Option("--out", help="run folder: results.jsonl, summary.json, report.md/.html")],
    profile: Annotated[
        list[str] | None,
        typer.Option(
            "--profile",
            help="repeat for several arms: a profile file; `auto` (one profile per topic from its words, with "
            "the settings of profiles/topic.yaml); "
            "`auto:TEMPLATE.json` (the same, from a template, named after it); `article` (the blog-post "
            "processor); `weighted:λ` (weighted decoding)",
        ),
    ] = None,
    samples: Annotated[int | None, typer.Option("--samples", min=1, help="samples per prompt: seeds 0..N-1")] = None,
    seeds: Annotated[str | None, typer.Option("--seeds", help="explicit seeds, e.g. 0,1,2 or 0-4")] = None,
    max_new_tokens: MaxNewOpt = 60,
    top_k: TopKOpt = 10,
    temperature: TempOpt = 1.0,
    raw: Annotated[
        bool | None,
        typer.Option("--raw/--chat", help="plain continuation or chat template (default: --raw for topic sets)"),
    ] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="prompts per batch (left-padded)")] = 8,
    model: ModelOpt = None,
    judge: Annotated[
        str, typer.Option("--judge", help="perplexity judge: gemma3-270m (default), a model path, or none")
    ] = "gemma3-270m",
    metrics: Annotated[
        str | None, typer.Option("--metrics", help="comma-separated metric names (default: all)")
    ] = None,
    limit_prompts: Annotated[
        int | None, typer.Option("--limit-prompts", min=1, help="keep N prompts, spread over the topics")
    ] = None,
    auto_template: Annotated[
        str | None, typer.Option("--auto-template", help="profile whose settings `auto` profiles start from")
    ] = None,
    resume: Annotated[bool, typer.Option("--resume", help="continue the run in --out; finished rows are kept")] = False,
    report_only: Annotated[
        bool, typer.Option("--report-only", help="rebuild the reports of --out, generate nothing")
    ] = False,
    engine: EngineOpt = "hf",
) -> None:
    """Evaluate profiles against control (no gravity) on a prompt set, with paired statistics and reports.

    Control runs with the same seeds, batches and settings as every profile. `--profile auto` (with `--prompts
    topics` or `empath`, or JSONL prompts that carry a `topic` list) builds one profile per topic from the
    conditioning half of its word list; the held-out half only scores. Results are appended as they are made:
    after Ctrl-C or a kill, rerun the same command with `--resume`.

    Examples:

        ngrav eval --prompts topics --profile auto --samples 1 --max-new-tokens 40 --out out/topics

        ngrav eval --prompts prompts.jsonl --profile profiles/space.yaml --seeds 0-4 --out out/space --resume

    With `--engine vllm` (run from .venv-vllm) every profile arm runs on an in-process vLLM engine and the judge
    stays on transformers; the `article` and `weighted:λ` baselines run on `--engine hf` only.
    """
    from ..eval import command, runner  # the evaluation imports torch: not for --help

    if not profile and not report_only:
        fail("give --profile FILE (repeat for several) or --profile auto")
    if not report_only:
        guarded(lambda: runner.check_engine_arms(profile or [], engine))
        if prompts not in runner.TOPIC_SETS:
            read_text(Path(prompts), "--prompts")
        check_output(out, "--out", folder=True)
        check_model(model)
        if engine == "vllm":
            vllm_engine()
    guarded(
        lambda: command.run_command(
            prompts=prompts,
            profiles=list(profile or []),
            out=out,
            samples=samples,
            seeds=seeds,
            max_new_tokens=max_new_tokens,
            top_k=top_k,
            temperature=temperature,
            raw=raw,
            batch_size=batch_size,
            model=model,
            judge=judge,
            metrics=metrics,
            limit_prompts=limit_prompts,
            auto_template=auto_template,
            resume=resume,
            report_only=report_only,
            engine=engine,
        )
    )
