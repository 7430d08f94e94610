"""``ngrav compare``: control and gravity with the same seeds, the texts side by side and a metrics table."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from ..engines.options import GenerationOptions
from ..profiles.schema import Profile
from .common import (
    DEFAULT_MAX_NEW_TOKENS,
    DeviceOpt,
    JsonAliasOpt,
    MaxNewOpt,
    ModelOpt,
    OutputOpt,
    RawOpt,
    TempOpt,
    TopKOpt,
    alias,
    check_output,
    guarded,
    load,
    read_profile,
    renamed,
)

__all__ = ["app"]

app = typer.Typer(rich_markup_mode="rich")


@app.command()
def compare(
    profile: Annotated[Path, typer.Option("--profile", help="profile file (.json/.yaml)")],
    prompt: Annotated[str, typer.Option("--prompt", help="the prompt to continue")],
    samples: Annotated[int, typer.Option("--samples", min=1, help="seeds 0..N-1; control and gravity share each")] = 3,
    raw: RawOpt = False,
    model: ModelOpt = None,
    max_new_tokens: MaxNewOpt = DEFAULT_MAX_NEW_TOKENS,
    top_k: TopKOpt = 10,
    temperature: TempOpt = 1.0,
    plot: Annotated[Path | None, typer.Option("--plot", help="save a PNG of the thermometer traces")] = None,
    output: OutputOpt = None,
    device: DeviceOpt = "cpu",
    show: Annotated[int, typer.Option("--show", min=0, help="how many seed pairs to print side by side")] = 2,
    held_out: Annotated[
        str | None,
        typer.Option(
            "--held-out",
            help="comma-separated topic words the profile does not name, scored as a measure the pull does not define",
        ),
    ] = None,
    description: Annotated[
        str | None,
        typer.Option(
            "--description",
            help="a sentence describing the topic, scored by MiniLM similarity (default: the profile's `description`)",
        ),
    ] = None,
    output_alias: JsonAliasOpt = None,
    seeds_renamed: Annotated[
        str | None, renamed("--seeds", "is now --samples N in compare (seeds 0..N-1); e.g. --samples 8")
    ] = None,
) -> None:
    """Run control (no gravity) and gravity with the same seeds; print texts side by side and a metrics table.

    The table leads with measures independent of the pull (--held-out words, similarity to --description); the
    narrative-token rate follows, as what the pull pushes.

    Example: ngrav compare --profile profiles/topic.yaml --prompt "Describe a place you like." --held-out moon,star --samples 8
    """
    prof = read_profile(profile)
    check_output(plot, "--plot")
    json_out = alias("--json", "--output", output, output_alias)
    check_output(json_out, "--output")
    options = guarded(lambda: GenerationOptions(max_new_tokens, top_k, temperature, raw=raw, device=device))
    words = tuple((held_out or "").split(","))  # Scoring trims them and drops blanks
    scoring = compare_scoring(words, description if description is not None else prof.description)
    guarded(lambda: scoring.check(prof))
    m, tok = load(model, device)
    report = _Report(seeds=samples, show=show, plot=plot, json_out=json_out, scoring=scoring)
    guarded(lambda: _run(m, tok, prof, prompt, options, report))


@dataclass(frozen=True)
class _Report:
    """How many seeds to run, how many pairs to print, and where to plot and save."""

    seeds: int
    show: int
    plot: Path | None
    json_out: Path | None
    scoring: Any = None


def _run(model: Any, tok: Any, prof: Profile, prompt: str, options: GenerationOptions, out: _Report) -> None:
    """Run, print, and plot and save as ``out`` says."""
    from .. import compare, plots  # torch and transformers (matplotlib only once a plot is drawn): not for --help

    seeds = out.seeds
    console = Console()
    with Progress(transient=True, console=console) as bar:
        task = bar.add_task("control vs gravity", total=2 * seeds)
        rows = compare.compare_runs(
            model, tok, prof, prompt, options, seeds=seeds, progress=lambda: bar.advance(task), scoring=out.scoring
        )
    summary = compare.summarize(rows)
    console.print(headline(summary, seeds))
    texts = Table(title=f"prompt: {prompt!r}", show_lines=True)
    texts.add_column("seed", justify="right")
    texts.add_column("control (no gravity)", ratio=1)
    texts.add_column(f"gravity ({prof.name})", ratio=1)
    for r in rows[: out.show]:
        texts.add_row(str(r.seed), r.control.text, r.gravity.text)
    console.print(texts)
    table = Table(title=f"{seeds} seeds, mean [95% bootstrap interval]")
    for col in ("metric", "control", "gravity", "gravity − control (paired)"):
        table.add_column(col)
    for s in summary.values():
        if s["control"][0] != s["control"][0] and s["gravity"][0] != s["gravity"][0]:  # nothing to score against
            continue
        table.add_row(s["label"], _fmt(s["control"]), _fmt(s["gravity"]), _fmt(s["difference"]))
    console.print(table)
    if out.plot is not None:
        traces = {"control": [r.control.trace for r in rows], "gravity": [r.gravity.trace for r in rows]}
        path = plots.plot_traces(traces, out.plot, title=f"{prof.name}: {prompt}")
        console.print(f"trace plot saved to {path}")
    if out.json_out is not None:
        _save(out.json_out, prompt, prof, summary, rows)
        console.print(f"results saved to {out.json_out}")


def compare_scoring(held_out: tuple[str, ...], description: str | None) -> Any:
    """The independent scoring of a comparison (:class:`narrative_gravity.compare.Scoring`)."""
    from ..compare import Scoring  # torch and MiniLM: not for --help

    return Scoring(held_out=held_out, description=description)


def headline(summary: dict[str, Any], seeds: int) -> str:
    """The first line of the result: the first independent measure there is, with its paired interval, or a
    note that there is none (the narrative rate alone shows only what the pull pushes)."""
    for key in ("held_out_words", "description_similarity"):
        s = summary.get(key)
        if s and s["difference"][0] == s["difference"][0]:
            (c, _, _), (g, _, _), (d, lo, hi) = s["control"], s["gravity"], s["difference"]
            return (
                f"[bold]{s['label']}[/bold]: control {c:.3f} → gravity {g:.3f}, "
                f"paired difference {d:+.3f} [{lo:+.3f}, {hi:+.3f}] over {seeds} seeds"
            )
    return (
        "no independent measure: give --held-out words or a --description (or a profile `description`); "
        "the narrative-token rate shows only what the pull pushes"
    )


def _save(path: Path, prompt: str, prof: Profile, summary: dict[str, Any], rows: list[Any]) -> None:
    runs = [
        {"seed": r.seed, "control": r.control.to_json(), "gravity": r.gravity.to_json(), "metrics": r.metrics}
        for r in rows
    ]
    payload = {"prompt": prompt, "profile": prof.model_dump(), "summary": summary, "runs": runs}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, ensure_ascii=False), encoding="utf-8")


def _fmt(ci: tuple[float, float, float]) -> str:
    m, lo, hi = ci
    if m != m:  # nan
        return "n/a"
    return f"{m:.3f} [{lo:.3f}, {hi:.3f}]"
