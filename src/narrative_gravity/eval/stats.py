"""Paired statistics: control and a profile share prompt and seed, so we bootstrap the pairs.

Each bootstrap draw resamples pair indices and computes ``aggregate(profile) − aggregate(control)`` on the
same pairs; the percentile interval of those draws is the 95% interval of the difference. The verdict reads
the interval against ``higher_is_better``:

>>> r = paired_bootstrap([1.0, 2.0, 3.0, 4.0], [2.0, 3.0, 4.0, 5.0], higher_is_better=True)
>>> round(r.difference, 6), round(r.low, 6), round(r.high, 6), r.verdict
(1.0, 1.0, 1.0, 'better')
>>> paired_bootstrap([1.0, 2.0], [2.0, 3.0], higher_is_better=False).verdict
'worse'
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

__all__ = [
    "AGGREGATIONS",
    "BETTER",
    "NO_CLEAR",
    "WORSE",
    "PairedComparison",
    "aggregate",
    "bootstrap_ci",
    "paired_bootstrap",
    "summary_line",
]

BETTER, WORSE, NO_CLEAR = "better", "worse", "no clear difference"
TOO_FEW = "too few pairs"


def _mean(x: np.ndarray, axis: int | None = None) -> Any:
    return np.mean(x, axis=axis)


def _geomean(x: np.ndarray, axis: int | None = None) -> Any:
    return np.exp(np.mean(np.log(np.maximum(x, 1e-300)), axis=axis))


# Name → f(values, axis) for arrays without NaN. Perplexity aggregates as a geometric mean (the perplexity
# of the pooled log-likelihood per text), so one degenerate text does not dominate.
AGGREGATIONS: dict[str, Callable[..., Any]] = {"mean": _mean, "geomean": _geomean}


def aggregate(values: Sequence[float], how: str = "mean") -> float:
    """Aggregate the finite values (NaN for none).

    >>> aggregate([1.0, float("nan"), 3.0]), round(aggregate([1.0, 100.0], "geomean"), 6)
    (2.0, 10.0)
    """
    x = np.asarray(values, dtype=float)
    x = x[np.isfinite(x)]
    return float(AGGREGATIONS[how](x)) if x.size else float("nan")


def bootstrap_ci(
    values: Sequence[float], how: str = "mean", *, level: float = 0.95, n_boot: int = 2000, seed: int = 0
) -> tuple[float, float, float]:
    """``(aggregate, low, high)`` with a percentile-bootstrap interval over the finite values."""
    x = np.asarray(values, dtype=float)
    x = x[np.isfinite(x)]
    if x.size == 0:
        return float("nan"), float("nan"), float("nan")
    f = AGGREGATIONS[how]
    rng = np.random.default_rng(seed)
    boots = f(x[rng.integers(0, x.size, size=(n_boot, x.size))], axis=1)
    lo, hi = np.quantile(boots, [(1 - level) / 2, 1 - (1 - level) / 2])
    return float(f(x)), float(lo), float(hi)


@dataclass(frozen=True)
class PairedComparison:
    """Profile against control on ``n`` complete pairs."""

    n: int
    control: float
    treated: float
    difference: float
    low: float
    high: float
    verdict: str
    higher_is_better: bool | None

    def to_json(self) -> dict[str, Any]:
        return {k: (None if isinstance(v, float) and not np.isfinite(v) else v) for k, v in asdict(self).items()}


def paired_bootstrap(
    control: Sequence[float],
    treated: Sequence[float],
    *,
    higher_is_better: bool | None,
    how: str = "mean",
    level: float = 0.95,
    n_boot: int = 2000,
    seed: int = 0,
) -> PairedComparison:
    """Bootstrap the paired difference ``aggregate(treated) − aggregate(control)``.

    Pairs with a non-finite value on either side are dropped. The verdict is ``better``/``worse`` when the
    interval excludes 0 (by ``higher_is_better``; ``higher``/``lower`` when that is ``None``), ``no clear
    difference`` when it contains 0, and ``too few pairs`` below two pairs.
    """
    c = np.asarray(control, dtype=float)
    t = np.asarray(treated, dtype=float)
    if c.shape != t.shape or c.ndim != 1:
        raise ValueError(f"control and treated must be 1-D and paired, got shapes {c.shape} and {t.shape}")
    if how not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {how!r}; use one of {sorted(AGGREGATIONS)}")
    ok = np.isfinite(c) & np.isfinite(t)
    c, t = c[ok], t[ok]
    n = int(c.size)
    f = AGGREGATIONS[how]
    if n == 0:
        nan = float("nan")
        return PairedComparison(0, nan, nan, nan, nan, nan, TOO_FEW, higher_is_better)
    diff = float(f(t) - f(c))
    if n < 2:
        return PairedComparison(n, float(f(c)), float(f(t)), diff, diff, diff, TOO_FEW, higher_is_better)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(n_boot, n))
    boots = f(t[idx], axis=1) - f(c[idx], axis=1)
    lo, hi = (float(v) for v in np.quantile(boots, [(1 - level) / 2, 1 - (1 - level) / 2]))
    # Guard the edges against rounding: an interval that touches 0 is not a clear difference.
    if lo > 0 or hi < 0:
        up = lo > 0
        if higher_is_better is None:
            verdict = "higher" if up else "lower"
        else:
            verdict = BETTER if up == higher_is_better else WORSE
    else:
        verdict = NO_CLEAR
    return PairedComparison(n, float(f(c)), float(f(t)), diff, lo, hi, verdict, higher_is_better)


def summary_line(name: str, comparisons: dict[str, PairedComparison]) -> str:
    """One sentence: did every judged metric move the right way, and if not, which did not.

    >>> a = PairedComparison(9, 0, 1, 1, 0.5, 1.5, BETTER, True)
    >>> b = PairedComparison(9, 0, 0, 0, -1, 1, NO_CLEAR, False)
    >>> summary_line("auto", {"success": a})
    'auto vs control: every judged metric moved the right way (1 of 1: success).'
    >>> summary_line("auto", {"success": a, "ppl": b})
    'auto vs control: 1 of 2 judged metrics moved the right way (success); not: ppl (no clear difference).'
    """
    judged = {k: v for k, v in comparisons.items() if v.higher_is_better is not None and v.verdict != TOO_FEW}
    good = [k for k, v in judged.items() if v.verdict == BETTER]
    bad = [f"{k} ({v.verdict})" for k, v in judged.items() if v.verdict != BETTER]
    if not judged:
        return f"{name} vs control: no judged metric has enough pairs."
    if not bad:
        return f"{name} vs control: every judged metric moved the right way ({len(good)} of {len(judged)}: {', '.join(good)})."
    right = f" ({', '.join(good)})" if good else ""
    return (
        f"{name} vs control: {len(good)} of {len(judged)} judged metrics moved the right way{right}; "
        f"not: {', '.join(bad)}."
    )
