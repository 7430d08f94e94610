"""What the scripts in this folder share: reading a finished ``ngrav eval`` run, and writing a summary.

Imported by the scripts here (``python bench/topics/NAME.py`` puts this folder on ``sys.path``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from narrative_gravity.eval.report import load_run


def read_run(run: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``(rows, manifest)`` of an eval run folder (the reader of ``ngrav eval`` itself); exits when it has no rows."""
    rows, manifest, _ = load_run(run)
    if not rows:
        sys.exit(f"error: {run / 'results.jsonl'} has no rows; is the run finished?")
    return rows, manifest


def write_outputs(
    summary: dict[str, Any],
    table: str,
    json_path: Path | None,
    plot_path: Path | None = None,
    plot: Callable[[dict[str, Any]], Any] | None = None,
) -> None:
    """Print ``table``, then write ``summary`` as JSON, and ``plot(summary)``'s matplotlib figure as a PNG, where
    asked."""
    print(table)
    if json_path is not None:
        json_path.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {json_path}")
    if plot_path is not None and plot is not None:
        import matplotlib.pyplot as plt

        fig = plot(summary)
        plot_path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(plot_path, dpi=120)
        plt.close(fig)
        print(f"wrote {plot_path}")
