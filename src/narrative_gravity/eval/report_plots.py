"""The figures of an eval report (:mod:`narrative_gravity.eval.report`): each arm's metrics with their intervals,
topic success against fluency, and the thermometer traces. Each needs matplotlib (the ``plot`` extra) and returns
``None`` without it, or when the run has nothing to draw."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..plots import plot_traces, pyplot

__all__ = ["plot_metrics", "plot_pareto", "plot_thermo"]


def _plt() -> Any:
    return pyplot()


def _arm_colors(arms: Sequence[str]) -> dict[str, str]:
    palette = ["#7f7f7f", "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2"]
    return {a: palette[i % len(palette)] for i, a in enumerate(arms)}


def plot_metrics(summary: dict[str, Any], path: Path) -> Path | None:
    """One small bar chart per metric: each arm's aggregate with its 95% bootstrap interval."""
    plt = _plt()
    metrics = list(summary["metrics"])
    arms = [a for a in summary["arms"] if summary["per_arm"].get(a, {}).get("n")]
    if plt is None or not metrics or not arms:
        return None
    cols = 4
    nrows = math.ceil(len(metrics) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.3 * cols, 2.6 * nrows), constrained_layout=True, squeeze=False)
    colors = _arm_colors(summary["arms"])
    for ax, m in zip(axes.flat, metrics):
        vals, errs = [], [[], []]
        for a in arms:
            e = summary["per_arm"][a]["metrics"].get(m, {})
            v, lo, hi = (np.nan if e.get(k) is None else e[k] for k in ("value", "low", "high"))
            vals.append(v)
            errs[0].append(max(0.0, v - lo) if np.isfinite(v) and np.isfinite(lo) else 0.0)
            errs[1].append(max(0.0, hi - v) if np.isfinite(v) and np.isfinite(hi) else 0.0)
        ax.bar(range(len(arms)), np.nan_to_num(vals), yerr=errs, color=[colors[a] for a in arms], capsize=3)
        ax.set_xticks(range(len(arms)), arms, fontsize=8, rotation=20)
        hib = summary["metrics"][m]["higher_is_better"]
        arrow = " ↑" if hib is True else " ↓" if hib is False else ""
        unit = summary["metrics"][m].get("unit")
        ax.set_title(f"{m}{arrow}" + (f" [{unit}]" if unit else ""), fontsize=9)
        ax.tick_params(axis="y", labelsize=8)
    for ax in list(axes.flat)[len(metrics) :]:
        ax.axis("off")
    fig.suptitle(
        "per metric: aggregate and 95% bootstrap interval (↑ higher is better, ↓ lower is better)", fontsize=10
    )
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _err(e: dict[str, Any]) -> list[list[float]]:
    v = e["value"]
    lo = v if e.get("low") is None else e["low"]
    hi = v if e.get("high") is None else e["high"]
    return [[max(0.0, v - lo)], [max(0.0, hi - v)]]


def plot_pareto(summary: dict[str, Any], path: Path) -> Path | None:
    """Topic success against judge perplexity: one point per arm (intervals as error bars), topics faint."""
    plt = _plt()
    metrics = summary["metrics"]
    if plt is None or "topic_success" not in metrics or "judge_ppl" not in metrics:
        return None
    arms = [a for a in summary["arms"] if summary["per_arm"].get(a, {}).get("n")]
    colors = _arm_colors(summary["arms"])
    fig, ax = plt.subplots(figsize=(6.4, 4.6), constrained_layout=True)
    plotted = False
    for topic, per in summary.get("topics", {}).items():
        for a in arms:
            e = per.get(a, {})
            if e.get("judge_ppl") is not None and e.get("topic_success") is not None:
                ax.scatter(e["judge_ppl"], e["topic_success"], color=colors[a], alpha=0.3, s=18)
                ax.annotate(topic, (e["judge_ppl"], e["topic_success"]), fontsize=6, alpha=0.5)
    for a in arms:
        s = summary["per_arm"][a]["metrics"]
        x, y = s["judge_ppl"], s["topic_success"]
        if x.get("value") is None or y.get("value") is None:
            continue
        plotted = True
        ax.errorbar(
            x["value"],
            y["value"],
            xerr=_err(x),
            yerr=_err(y),
            fmt="o",
            ms=9,
            color=colors[a],
            capsize=4,
            label=a,
        )
    if not plotted:
        plt.close(fig)
        return None
    ax.set_xlabel("judge perplexity (geometric mean) ← better")
    ax.set_ylabel("topic success (held-out / scoring words) → better")
    ax.set_title("topic control vs fluency (faint points: per topic)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_thermo(traces: dict[str, list[dict[str, list[float]]]], path: Path) -> Path | None:
    if _plt() is None or not any(traces.values()):
        return None

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return plot_traces(traces, path, title="thermometer traces over prompts and seeds")
