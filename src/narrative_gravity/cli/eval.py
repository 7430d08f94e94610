"""``ngrav eval``: profiles against control on a prompt set, with paired statistics and reports."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .common import (
    FLAG,
    DeviceOpt,
    EngineOpt,
    ModelOpt,
    TempOpt,
    TopKOpt,
    check_device,
    check_model,
    check_output,
    fail,
    guarded,
    read_text,
    vllm_engine,
)

__all__ = ["app"]

app = typer.Typer(rich_markup_mode="rich")


_PromptsOpt = Annotated[
    str,
    typer.Option(
        "--prompts",
        help="`topics` (the PPLM/FUDGE set), `empath` (25 Empath subject topics, the test half), `topics-tune` / "
        "`empath-tune` (tuning splits), any of them under neutral chat requests (`chat-topics`, `chat-empath`, "
        "`chat-topics-tune`, `chat-empath-tune`), a .txt file, or JSONL with `prompt`",
    ),
]
_OutOpt = Annotated[Path, typer.Option("--out", help="run folder: results.jsonl, summary.json, report.md/.html")]
_ProfileOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--profile",
        help="repeat for several arms: a profile file; `auto` (one profile per topic from its words, with "
        "the settings of profiles/topic.yaml); "
        "`auto:TEMPLATE.json` (the same, from a template, named after it); `article` (the blog-post "
        "processor); `weighted:λ` (weighted decoding); `ask` (the topic named in a system message, no pull); "
        "`cfg:γ` (ask with classifier-free guidance at scale γ)",
    ),
]
_SamplesOpt = Annotated[int | None, typer.Option("--samples", min=1, help="samples per prompt: seeds 0..N-1")]
_SeedsOpt = Annotated[str | None, typer.Option("--seeds", help="explicit seeds, e.g. 0,1,2 or 0-4")]
_RawOpt = Annotated[
    bool | None,
    typer.Option(
        "--raw/--chat", metavar=FLAG, help="plain continuation or chat template (default: --raw for topic sets)"
    ),
]
_BatchSizeOpt = Annotated[int, typer.Option("--batch-size", min=1, help="prompts per batch (left-padded)")]
_JudgeOpt = Annotated[
    str, typer.Option("--judge", help="perplexity judge: gemma3-270m (default), a model path, or none")
]
_MetricsOpt = Annotated[str | None, typer.Option("--metrics", help="comma-separated metric names (default: all)")]
_LimitPromptsOpt = Annotated[
    int | None, typer.Option("--limit-prompts", min=1, help="keep N prompts, spread over the topics")
]
_AutoTemplateOpt = Annotated[
    str | None, typer.Option("--auto-template", help="profile whose settings `auto` profiles start from")
]
_MaxNewOpt = Annotated[
    int, typer.Option("--max-new-tokens", min=1, help="token budget per prompt (60: the PPLM/FUDGE protocol)")
]
_ResumeOpt = Annotated[
    bool, typer.Option("--resume", metavar=FLAG, help="continue the run in --out; finished rows are kept")
]
_ChatFrameOpt = Annotated[
    str | None,
    typer.Option(
        "--chat-frame",
        help='chat only: `template` (the model\'s chat template) or `plain` ("User: …" / "Assistant:" lines, for '
        "base models); default: the template where the model has one, else plain",
    ),
]
_ReportOnlyOpt = Annotated[
    bool, typer.Option("--report-only", metavar=FLAG, help="rebuild the reports of --out, generate nothing")
]


@app.command("eval")
def eval_command(
    prompts: _PromptsOpt,
    out: _OutOpt,
    profile: _ProfileOpt = None,
    samples: _SamplesOpt = None,
    seeds: _SeedsOpt = None,
    max_new_tokens: _MaxNewOpt = 60,
    top_k: TopKOpt = 10,
    temperature: TempOpt = 1.0,
    raw: _RawOpt = None,
    batch_size: _BatchSizeOpt = 8,
    model: ModelOpt = None,
    judge: _JudgeOpt = "gemma3-270m",
    metrics: _MetricsOpt = None,
    limit_prompts: _LimitPromptsOpt = None,
    auto_template: _AutoTemplateOpt = None,
    resume: _ResumeOpt = False,
    report_only: _ReportOnlyOpt = False,
    engine: EngineOpt = "hf",
    chat_frame: _ChatFrameOpt = None,
    device: DeviceOpt = "cpu",
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
    stays on transformers; the `article` and `weighted:λ` baselines run on `--engine hf` only. `--device cuda`
    runs the model and the judge on a GPU (the transformers engine).
    """
    from ..eval import command, runner  # the evaluation imports torch: not for --help

    if not profile and not report_only:
        fail("give --profile FILE (repeat for several) or --profile auto")
    if not report_only:
        guarded(lambda: runner.check_engine_arms(profile or [], engine))
        if prompts not in runner.BUILT_IN_SETS:
            read_text(Path(prompts), "--prompts")
        check_output(out, "--out", folder=True)
        check_model(model)
        check_device(engine, device)
        if engine == "vllm":
            vllm_engine()
    if report_only:
        guarded(lambda: command.report_command(out))
        return
    settings = guarded(
        lambda: runner.EvalSettings(
            prompts=prompts,
            profiles=tuple(profile or []),
            seeds=command.parse_seeds(seeds, samples),
            max_new_tokens=max_new_tokens,
            top_k=top_k,
            temperature=temperature,
            raw=raw,
            batch_size=batch_size,
            model=model,
            judge=judge,
            metrics=command.parse_metrics(metrics),
            limit_prompts=limit_prompts,
            auto_template=auto_template,
            engine=engine,
            chat_frame=chat_frame,
            device=device,
        )
    )
    guarded(lambda: command.run_command(settings, out, resume=resume))
