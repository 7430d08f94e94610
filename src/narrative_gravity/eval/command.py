"""The ``ngrav eval`` handler: parse the options, run (or resume) the eval, print the verdict."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from ..errors import ConfigurationError
from .judge import DEFAULT_JUDGE
from .report import comparison_table, write_reports
from .runner import EvalSettings, run_eval
from .store import RESULTS

__all__ = ["DEFAULT_SAMPLES", "parse_seeds", "run_command"]

DEFAULT_SAMPLES = 3


def parse_seeds(seeds: str | None, samples: int | None) -> tuple[int, ...]:
    """Seeds from ``--seeds`` (``0,1,2``, ranges like ``0-4``) or ``--samples N`` (seeds ``0..N-1``).

    >>> parse_seeds("0-2,7", None), parse_seeds(None, 2), parse_seeds(None, None)
    ((0, 1, 2, 7), (0, 1), (0, 1, 2))
    """
    if seeds is None:
        n = DEFAULT_SAMPLES if samples is None else samples
        if n < 1:
            raise ConfigurationError(f"--samples has to be >= 1, but is {n}")
        return tuple(range(n))
    out: list[int] = []
    for part in seeds.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if "-" in part[1:]:
                lo, hi = (int(x) for x in part.split("-", 1))
                if hi < lo:
                    raise ValueError
                out.extend(range(lo, hi + 1))
            else:
                out.append(int(part))
        except ValueError:
            raise ConfigurationError(
                f"--seeds: cannot read {part!r}; write seeds as 0,1,2 or a range like 0-4"
            ) from None
    if any(s < 0 for s in out):
        raise ConfigurationError(f"--seeds must be >= 0, got {out}")
    if not out:
        raise ConfigurationError("--seeds is empty; write seeds as 0,1,2 or a range like 0-4")
    if len(set(out)) != len(out):
        raise ConfigurationError(f"--seeds has duplicates: {out}")
    if samples is not None and samples != len(out):
        raise ConfigurationError(f"--samples {samples} disagrees with --seeds {seeds!r} ({len(out)} seeds); give one")
    return tuple(out)


def run_command(
    *,
    prompts: str,
    profiles: list[str],
    out: Path,
    samples: int | None = None,
    seeds: str | None = None,
    max_new_tokens: int = 60,
    top_k: int = 10,
    temperature: float = 1.0,
    raw: bool | None = None,
    batch_size: int = 8,
    model: str | None = None,
    judge: str = DEFAULT_JUDGE,
    metrics: str | None = None,
    limit_prompts: int | None = None,
    auto_template: str | None = None,
    resume: bool = False,
    report_only: bool = False,
    engine: str = "hf",
    chat_frame: str | None = None,
) -> dict[str, Any]:
    """Run ``ngrav eval``; returns the summary."""

    console = Console(stderr=True, soft_wrap=True)
    if report_only:
        if not (out / RESULTS).exists():
            raise ConfigurationError(f"--report-only: {out / RESULTS} does not exist; run the eval first")
        summary = write_reports(out)
        _print(summary, out)
        return summary
    settings = EvalSettings(
        prompts=prompts,
        profiles=tuple(profiles),
        seeds=parse_seeds(seeds, samples),
        max_new_tokens=max_new_tokens,
        top_k=top_k,
        temperature=temperature,
        raw=raw,
        batch_size=batch_size,
        model=model,
        judge=judge,
        metrics=tuple(m.strip() for m in metrics.split(",") if m.strip()) if metrics else None,
        limit_prompts=limit_prompts,
        auto_template=auto_template,
        engine=engine,
        chat_frame=chat_frame,
    )
    t0 = time.perf_counter()
    try:
        summary = run_eval(settings, out, resume=resume, console=console)
    except KeyboardInterrupt:
        console.print(
            f"\n[yellow]interrupted[/]: finished generations are saved in {out / RESULTS}; "
            "run the same command with --resume to continue",
            highlight=False,
        )
        raise SystemExit(130) from None
    console.print(f"session wall time {time.perf_counter() - t0:.1f} s", highlight=False)
    _print(summary, out)
    return summary


def _print(summary: dict[str, Any], out: Path) -> None:
    console = Console(width=None if sys.stdout.isatty() else 150)
    style = {"better": "green", "worse": "red"}
    for arm in summary.get("comparisons", {}):
        table = Table(title=f"{arm} vs control, paired (prompt, seed): aggregate and 95% bootstrap interval")
        for col in ("metric", "", "control", arm, "difference [95% CI]", "verdict", "pairs"):
            table.add_column(col)
        for row in comparison_table(summary, arm):
            table.add_row(*row, style=style.get(row[5]))
        console.print(table)
    for line in summary.get("summary_lines", []):
        console.print(line, highlight=False)
    n_fail = len(summary.get("failures", []))
    console.print(
        f"{summary.get('rows', 0)} generations of {summary.get('expected_rows', 0)} planned"
        + (f", {n_fail} skipped (see failures.jsonl)" if n_fail else "")
        + f"; reports: {out / 'report.md'}, {out / 'report.html'}, {out / 'summary.json'}",
        highlight=False,
    )
