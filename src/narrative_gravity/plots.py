"""Plots of thermometer traces (matplotlib is imported lazily; install the ``plot`` extra)."""

from __future__ import annotations

import textwrap
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ConfigurationError

__all__ = ["BAND", "CAPTION", "plot_traces", "pyplot", "trace_figure"]

# (trace key, axis label, the quantity's range): the bands are clipped to it (entropy, mass and λ are never negative)
_PANELS = (
    ("entropy", "entropy H(p) [nats]", (0.0, None)),
    ("mass_after", "narrative mass (after pull)", (0.0, 1.0)),
    ("strength", "strength λ", (0.0, None)),
)
BAND = (10, 90)  # percentiles across generations, per step
CAPTION = (
    "Lines: the mean over a run's generations at each generated token. Bands: the 10th to 90th percentile "
    "across those generations, within the quantity's range."
)


def pyplot() -> Any | None:
    """``matplotlib.pyplot`` on the non-interactive Agg backend, or ``None`` without the ``plot`` extra."""
    try:
        import matplotlib  # the `plot` extra, imported on first use

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # after use("Agg"): the backend is chosen before pyplot loads
    except ImportError:  # pragma: no cover - depends on the environment
        return None
    return plt


def _stack(traces: Sequence[Mapping[str, Sequence[float]]], key: str) -> np.ndarray:
    """Rows of unequal length padded with NaN, so means ignore finished rows."""
    width = max((len(t[key]) for t in traces), default=0)
    out = np.full((len(traces), width), np.nan)
    for i, t in enumerate(traces):
        out[i, : len(t[key])] = t[key]
    return out


def _band(data: np.ndarray, limits: tuple[float | None, float | None]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(mean, low, high)`` per step: the mean and the :data:`BAND` percentiles, clipped to ``limits``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a step no generation reached is all NaN
        mean = np.nanmean(data, axis=0)
        low, high = np.nanpercentile(data, BAND, axis=0)
    lo, hi = limits
    return mean, np.clip(low, lo, hi), np.clip(high, lo, hi)


def plot_traces(
    runs: Mapping[str, Sequence[Mapping[str, Sequence[float]]]], path: str | Path, *, title: str = ""
) -> Path:
    """Save a PNG with entropy, narrative mass and λ over the steps: per run a line (the mean over its
    generations) and a band (their 10th to 90th percentile, clipped to the quantity's range), with a caption
    that says so. A long ``title`` wraps.

    ``runs`` maps a label (``control``, ``gravity``) to a list of per-generation traces, each a mapping of
    metric name to per-step values.
    """
    plt = pyplot()
    if plt is None:  # pragma: no cover - depends on the environment
        raise ConfigurationError("plots need matplotlib; install it with:\n    pip install 'narrative-gravity[plot]'")
    fig = trace_figure(runs, title=title)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def trace_figure(runs: Mapping[str, Sequence[Mapping[str, Sequence[float]]]], *, title: str = "") -> Any:
    """The figure :func:`plot_traces` saves (matplotlib's ``Figure``); the caller closes it."""
    plt = pyplot()
    if plt is None:  # pragma: no cover - depends on the environment
        raise ConfigurationError("plots need matplotlib; install it with:\n    pip install 'narrative-gravity[plot]'")
    width = 4.2 * len(_PANELS)
    fig, axes = plt.subplots(1, len(_PANELS), figsize=(width, 3.8), constrained_layout=True)
    for label, traces in runs.items():
        traces = [t for t in traces if t]
        if not traces:
            continue
        for ax, (key, _, limits) in zip(axes, _PANELS, strict=True):
            mean, low, high = _band(_stack(traces, key), limits)
            steps = np.arange(mean.shape[0])
            (line,) = ax.plot(steps, mean, label=f"{label}: mean of {len(traces)}")
            ax.fill_between(
                steps, low, high, alpha=0.2, color=line.get_color(), label=f"{label}: {BAND[0]}th–{BAND[1]}th pct"
            )
    for ax, (_, ylabel, limits) in zip(axes, _PANELS, strict=True):
        ax.set_xlabel("generated token")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=limits[0])  # after every run: a limit set earlier stops the axis scaling to later runs
    axes[0].legend(fontsize="small")
    chars = int(width * 12)  # about the characters a line of the suptitle holds at its default size
    if title:
        fig.suptitle("\n".join(textwrap.wrap(title, chars, max_lines=3, placeholder=" …")))
    fig.get_layout_engine().set(h_pad=0.1)
    fig.supxlabel(textwrap.fill(CAPTION, int(chars * 1.25)), fontsize="small", color="0.3")
    return fig
