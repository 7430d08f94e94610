"""The trace plot: a title that wraps, bands of percentiles kept in the quantity's range, a caption that says so."""

from __future__ import annotations

import numpy as np
import pytest

from narrative_gravity.plots import CAPTION, plot_traces, trace_figure

plt = pytest.importorskip("matplotlib.pyplot")


def _runs() -> dict[str, list[dict[str, list[float]]]]:
    rng = np.random.default_rng(0)
    runs: dict[str, list[dict[str, list[float]]]] = {}
    for label, scale in (("control", 0.0), ("gravity", 1.0)):
        runs[label] = [
            {  # values near zero, spread wide: a mean ± sd band would cross zero
                "entropy": list(np.abs(rng.normal(0.05, 0.4, 30))),
                "mass_after": list(np.clip(rng.normal(0.05, 0.2, 30), 0, 1)),
                "strength": list(scale * np.abs(rng.normal(0.0, 1.0, 30))),
            }
            for _ in range(6)
        ]
    return runs


def test_bands_stay_in_range_and_the_figure_says_what_they_are() -> None:
    title = "binary_search: Write a binary search in Java and explain its time complexity, then its space use. " * 2
    fig = trace_figure(_runs(), title=title)
    try:
        assert "\n" in fig._suptitle.get_text() and "complexity" in fig._suptitle.get_text()  # wrapped, not cut
        assert " ".join(fig._supxlabel.get_text().split()) == CAPTION
        for ax in fig.axes:
            for band in ax.collections:
                ys = np.concatenate([p.vertices[:, 1] for p in band.get_paths()])
                assert ys.min() >= 0.0
            labels = ax.get_legend_handles_labels()[1]
            assert "gravity: 10th–90th pct" in labels and "control: mean of 6" in labels
        for ax in fig.axes:  # every run's line fits its panel (a limit set after the first run once cut the rest)
            top = max(float(np.nanmax(line.get_ydata())) for line in ax.get_lines())
            assert ax.get_ylim()[1] >= top
        mass = fig.axes[1]
        assert max(p.vertices[:, 1].max() for band in mass.collections for p in band.get_paths()) <= 1.0
    finally:
        plt.close(fig)


def test_plot_traces_writes_a_png(tmp_path) -> None:
    out = plot_traces(_runs(), tmp_path / "t.png", title="t")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
