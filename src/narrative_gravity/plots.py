"""Plots of thermometer traces (matplotlib is imported lazily; install the ``plot`` extra)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ConfigurationError

__all__ = ["plot_traces", "pyplot"]

_PANELS = (
    ("entropy", "entropy H(p) [nats]"),
    ("mass_after", "narrative mass (after pull)"),
    ("strength", "strength λ"),
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


def plot_traces(
    runs: Mapping[str, Sequence[Mapping[str, Sequence[float]]]], path: str | Path, *, title: str = ""
) -> Path:
    """Save a PNG with entropy, narrative mass and λ over the steps, one line (mean ± band) per run.

    ``runs`` maps a label (``control``, ``gravity``) to a list of per-generation traces, each a mapping of
    metric name to per-step values.
    """
    plt = pyplot()
    if plt is None:  # pragma: no cover - depends on the environment
        raise ConfigurationError("plots need matplotlib; install it with:\n    pip install 'narrative-gravity[plot]'")
    fig, axes = plt.subplots(1, len(_PANELS), figsize=(4.2 * len(_PANELS), 3.4), constrained_layout=True)
    for label, traces in runs.items():
        traces = [t for t in traces if t]
        if not traces:
            continue
        for ax, (key, ylabel) in zip(axes, _PANELS, strict=True):
            data = _stack(traces, key)
            steps = np.arange(data.shape[1])
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                mean = np.nanmean(data, axis=0)
                sd = np.nanstd(data, axis=0)
            (line,) = ax.plot(steps, mean, label=label)
            ax.fill_between(steps, mean - sd, mean + sd, alpha=0.2, color=line.get_color())
            ax.set_xlabel("generated token")
            ax.set_ylabel(ylabel)
    axes[0].legend()
    if title:
        fig.suptitle(title)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
