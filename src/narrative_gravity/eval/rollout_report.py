"""Compare the arms of a stored profile from what the server recorded (:mod:`~narrative_gravity.profiles.armlog`).

Per arm and version (``live@3``, ``split:b@4``, ``shadow@3``, ...): the mean of each per-request figure with a 95%
percentile-bootstrap interval (:func:`~narrative_gravity.eval.stats.bootstrap_ci`). Then the comparisons:

- **split**: ``split:b − split:a``, each arm's requests resampled on their own (the arms served different requests);
- **shadow**: the arm that answered − its shadow, *paired* by request (the same prompt and seed with and without the
  pull; :func:`~narrative_gravity.eval.stats.paired_bootstrap`): the effect of gravity on this traffic.

>>> recs = [{"request": f"r{i}", "arm": "live", "version": 3, "narrative_mass": 0.5 + i / 100} for i in range(4)]
>>> recs += [{"request": f"r{i}:shadow", "of": f"r{i}", "arm": "shadow", "version": 3, "narrative_mass": 0.2}
...          for i in range(4)]
>>> rep = build_report("space", recs)
>>> [(a["arm"], a["version"], a["n"]) for a in rep["arms"]]
[('live', 3, 4), ('shadow', 3, 4)]
>>> c = rep["comparisons"][0]
>>> c["name"], c["kind"], c["pairs"], round(c["metrics"]["narrative_mass"]["difference"], 3)
('live@3 − shadow@3', 'paired', 4, 0.315)
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from ..profiles.rollout import ARMS, SHADOW, SPLIT_A, SPLIT_B
from .stats import bootstrap_ci, paired_bootstrap

__all__ = ["REPORT_METRICS", "build_report", "render_report"]

REPORT_METRICS: dict[str, tuple[str, bool | None]] = {
    "narrative_mass": ("narrative mass (after the pull)", True),
    "narrative_mass_before": ("narrative mass before the pull", None),
    "kl": ("KL per token [nats]", None),
    "off_topic_rate": ("off-topic rate (field value ≤ 0)", False),
    "completion_tokens": ("completion tokens", None),
    "latency_s": ("latency [s]", False),
}
"""Figure → (label, higher is better; ``None`` for figures that are reported, not judged)."""


def _values(records: Iterable[dict[str, Any]], key: str) -> list[float]:
    out = []
    for r in records:
        v = r.get(key)
        out.append(float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else float("nan"))
    return out


def _clean(x: float) -> float | None:
    return x if isinstance(x, float) and math.isfinite(x) else None


def _two_sample(
    a: Sequence[float], b: Sequence[float], *, level: float = 0.95, n_boot: int = 2000, seed: int = 0
) -> tuple[float, float, float]:
    """``mean(b) − mean(a)`` with a percentile-bootstrap interval, each side resampled on its own.

    >>> d, lo, hi = _two_sample([1.0, 1.0, 1.0], [2.0, 2.0, 2.0])
    >>> d, lo, hi
    (1.0, 1.0, 1.0)
    """
    x = np.asarray(a, dtype=float)
    y = np.asarray(b, dtype=float)
    x, y = x[np.isfinite(x)], y[np.isfinite(y)]
    if not x.size or not y.size:
        return float("nan"), float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    bx = x[rng.integers(0, x.size, size=(n_boot, x.size))].mean(axis=1)
    by = y[rng.integers(0, y.size, size=(n_boot, y.size))].mean(axis=1)
    lo, hi = np.quantile(by - bx, [(1 - level) / 2, 1 - (1 - level) / 2])
    return float(y.mean() - x.mean()), float(lo), float(hi)


def _group_name(arm: str, version: Any) -> str:
    return f"{arm}@{version}"


def build_report(name: str, records: Sequence[dict[str, Any]], *, n_boot: int = 2000) -> dict[str, Any]:
    """The report of profile ``name`` from its arm records (JSON-ready: no NaN, ``None`` instead)."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        arm, version = r.get("arm"), r.get("version")
        if isinstance(arm, str) and isinstance(version, int):
            groups[(arm, version)].append(r)
    keys = sorted(groups, key=lambda k: (_ORDER.get(k[0], len(_ORDER)), k[0], k[1]))
    arms = [_arm(arm, version, groups[(arm, version)], n_boot) for arm, version in keys]
    comparisons = [
        _split(groups, a, b, n_boot)
        for b in [k for k in keys if k[0] == SPLIT_B]
        for a in [k for k in keys if k[0] == SPLIT_A]
    ]
    comparisons += _shadow_pairs(records, n_boot)
    times = sorted(r["t"] for r in records if isinstance(r.get("t"), str))
    return {
        "profile": name,
        "records": len(records),
        "since": times[0] if times else None,
        "until": times[-1] if times else None,
        "arms": arms,
        "comparisons": comparisons,
    }


_ORDER = {a: i for i, a in enumerate(ARMS)}


def _arm(arm: str, version: int, rs: list[dict[str, Any]], n_boot: int) -> dict[str, Any]:
    """One arm's means with 95% bootstrap intervals."""
    metrics = {}
    for m in REPORT_METRICS:
        vals = _values(rs, m)
        mean, lo, hi = bootstrap_ci(vals, n_boot=n_boot)
        metrics[m] = {"mean": _clean(mean), "low": _clean(lo), "high": _clean(hi), "n": int(np.isfinite(vals).sum())}
    return {"arm": arm, "version": version, "n": len(rs), "metrics": metrics}


def _split(
    groups: dict[tuple[str, int], list[dict[str, Any]]], ka: tuple[str, int], kb: tuple[str, int], n_boot: int
) -> dict[str, Any]:
    """split:b against split:a, unpaired."""
    a, b = groups[ka], groups[kb]
    metrics = {}
    for m in REPORT_METRICS:
        d, lo, hi = _two_sample(_values(a, m), _values(b, m), n_boot=n_boot)
        metrics[m] = {"difference": _clean(d), "low": _clean(lo), "high": _clean(hi)}
    return {
        "name": f"{_group_name(*kb)} − {_group_name(*ka)}",
        "kind": "unpaired",
        "a": _group_name(*ka),
        "b": _group_name(*kb),
        "n_a": len(a),
        "n_b": len(b),
        "metrics": metrics,
    }


def _shadow_pairs(records: Sequence[dict[str, Any]], n_boot: int) -> list[dict[str, Any]]:
    """Each arm against its shadows, paired by request (the same prompt and seed without the pull)."""
    by_request = {r["request"]: r for r in records if isinstance(r.get("request"), str) and r.get("arm") != SHADOW}
    pairs: dict[tuple[str, int], list[tuple[dict[str, Any], dict[str, Any]]]] = defaultdict(list)
    for r in records:
        main = by_request.get(r.get("of")) if r.get("arm") == SHADOW else None
        if main is not None and isinstance(main.get("version"), int):
            pairs[(main["arm"], main["version"])].append((main, r))
    out = []
    for (arm, version), pr in sorted(pairs.items(), key=lambda kv: (_ORDER.get(kv[0][0], 99), kv[0])):
        metrics = {}
        for m in REPORT_METRICS:
            if m in ("latency_s", "completion_tokens"):
                continue  # a shadow is capped at its request's length and runs in idle time: not comparable
            shadow, treated = _values([s for _, s in pr], m), _values([t for t, _ in pr], m)
            c = paired_bootstrap(shadow, treated, higher_is_better=REPORT_METRICS[m][1], n_boot=n_boot)
            metrics[m] = {
                "difference": _clean(c.difference),
                "low": _clean(c.low),
                "high": _clean(c.high),
                "verdict": c.verdict,
            }
        out.append(
            {
                "name": f"{_group_name(arm, version)} − {_group_name(SHADOW, version)}",
                "kind": "paired",
                "a": _group_name(SHADOW, version),
                "b": _group_name(arm, version),
                "pairs": len(pr),
                "metrics": metrics,
            }
        )
    return out


def _fmt(v: float | None, m: str, *, signed: bool = False) -> str:
    if v is None:
        return "–"
    digits = 1 if m == "completion_tokens" else 3
    v = round(v, digits) + 0.0  # no "-0.000"
    return f"{v:+.{digits}f}" if signed else f"{v:.{digits}f}"


def _interval(d: dict[str, Any], m: str, key: str, *, signed: bool = False) -> str:
    if d.get(key) is None:
        return "–"
    return f"{_fmt(d[key], m, signed=signed)} [{_fmt(d.get('low'), m, signed=signed)}, {_fmt(d.get('high'), m, signed=signed)}]"


def render_report(report: dict[str, Any]) -> list[Any]:
    """Rich tables of a report: the arms (means, 95% intervals), then the comparisons."""

    name = escape(str(report["profile"]))
    if not report["arms"]:
        return [
            Text(f"{report['profile']}: nothing recorded yet (requests of stored profiles are recorded by the server)")
        ]
    arms = Table(title=f"{name}: {report['records']} records, mean per request [95% bootstrap interval]")
    arms.add_column("figure")
    for a in report["arms"]:
        arms.add_column(f"{escape(a['arm'])}@{a['version']} (n={a['n']})")
    for m, (label, _) in REPORT_METRICS.items():
        arms.add_row(escape(label), *(_interval(a["metrics"][m], m, "mean") for a in report["arms"]))
    out: list[Any] = [arms]
    if report["comparisons"]:
        comp = Table(title=f"{name}: differences [95% bootstrap interval]")
        for col in ("comparison", "kind", "n", "figure", "difference"):
            comp.add_column(col)
        for c in report["comparisons"]:
            n = str(c["pairs"]) if c["kind"] == "paired" else f"{c['n_b']} vs {c['n_a']}"
            for i, (m, d) in enumerate(c["metrics"].items()):
                style = {"better": "green", "worse": "red"}.get(d.get("verdict", ""))
                comp.add_row(
                    escape(c["name"]) if i == 0 else "",
                    c["kind"] if i == 0 else "",
                    n if i == 0 else "",
                    escape(REPORT_METRICS[m][0]),
                    _interval(d, m, "difference", signed=True),
                    style=style,
                )
        out.append(comp)
    return out
