"""The ``ngrav eval`` handler: parse the options, run (or resume) the eval, print the verdict."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from ..errors import ConfigurationError
from .report import comparison_table, write_reports
from .runner import EvalSettings, run_eval
from .store import RESULTS

__all__ = ["DEFAULT_SAMPLES", "parse_metrics", "parse_seeds", "report_command", "run_command"]

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


def parse_metrics(metrics: str | None) -> tuple[str, ...] | None:
    """Metric names from ``--metrics`` (comma-separated); ``None``: every metric.

    >>> parse_metrics("distinct_2, judge_ppl,"), parse_metrics(None)
    (('distinct_2', 'judge_ppl'), None)
    """
    return tuple(m.strip() for m in metrics.split(",") if m.strip()) if metrics else None


def report_command(out: Path) -> dict[str, Any]:
    """``ngrav eval --report-only``: rebuild the reports of the run in ``out``; returns the summary."""
    if not (out / RESULTS).exists():
        raise ConfigurationError(f"--report-only: {out / RESULTS} does not exist; run the eval first")
    summary = write_reports(out)
    _print(summary, out)
    return summary


def run_command(settings: EvalSettings, out: Path, *, resume: bool = False) -> dict[str, Any]:
    """Run ``ngrav eval`` (``settings`` as the options gave them, see :func:`parse_seeds` and
    :func:`parse_metrics`); returns the summary."""
    console = Console(stderr=True, soft_wrap=True)
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
