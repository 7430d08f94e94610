"""The chat benchmark's table: every arm of an ``ngrav eval`` run on a chat set against ``ask`` and plain.

Columns: held-out success (mean, 95% interval), its ratio to ``ask`` and the paired difference from ``ask``
(95% interval), relevance to the topic's description (MiniLM; no arm is given the description), judge
perplexity as median and as mean with their ratios to ``ask`` (95% intervals), Dist-1 and Dist-3 (Dist-3's
ratio to ``ask``), answer length in tokens, KL per token (arms with a pull), and seconds per token relative to
plain (median over batches: a batch decodes until its longest row ends, so speed is read per batch).

Every interval resamples (request, seed) clusters: the topics of one request and seed share the request's
text, and plain's answer to it does not depend on the topic. The ratios of success and of perplexity are
ratios of the resampled aggregates, not means of per-pair ratios.

Usage::

    python bench/chat/chat_table.py RUN_DIR [RUN_DIR ...] [--base ask] [--json OUT.json] [--plot OUT.png]

``--plot`` draws each arm's held-out success against its judge perplexity (median ÷ ``ask``; ``--x mean``
for the mean), with their intervals, and the 1.10× bound: the trade-off between following the topic and
reading well, in one picture. ``--tables`` plots tables this script wrote with ``--json`` instead of runs
(an arm named in several keeps its first table's row)::

    python bench/chat/chat_table.py --tables bench/results/chat_test_empath.json --plot docs/img/x.png

Several runs (say, ``chat-topics`` and ``chat-empath``) are pooled: their rows are keyed by run, so prompts
of different runs never pair.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from narrative_gravity.plots import pyplot

N_BOOT = 2000
ORDER = ("control", "ask", "cfg-1.5", "cfg-3", "auto")
LABELS = {"control": "plain", "ask": "ask (the topic in a system message, no pull)"}
SHORT = {
    "control": "plain",
    "auto": "the chat default",
    "cfg-1.5": "ask + CFG 1.5",
    "cfg-3": "ask + CFG 3",
    "ask-auto-kl12": "the pull at 0.12 nats",
}
TICKS = (0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0)

Row = dict[str, Any]


def load(runs: list[Path]) -> list[Row]:
    """Every row of every run, with ``key`` = (run, prompt index, seed) and ``cluster`` = (run, request, seed)."""
    rows = []
    for n, run in enumerate(runs):
        for line in (run / "results.jsonl").read_text(encoding="utf-8").splitlines():
            if line.strip():
                r = json.loads(line)
                r["key"] = (n, r["prompt_index"], r["seed"])
                r["cluster"] = (n, r["prompt"], r["seed"])
                rows.append(r)
    return rows


def metric(r: Row, name: str) -> float:
    v = r["metrics"].get(name)
    return float("nan") if v is None else float(v)


def _nanmedian(x: np.ndarray) -> float:
    return float(np.nanmedian(x)) if np.isfinite(x).any() else float("nan")


def _nanmean(x: np.ndarray) -> float:
    return float(np.nanmean(x)) if np.isfinite(x).any() else float("nan")


def cluster_draws(
    pairs: list[tuple[Any, float, float]], stat: Callable[[np.ndarray, np.ndarray], float], seed: int = 0
) -> tuple[float, np.ndarray]:
    """``stat(arm values, base values)`` on ``(cluster, base, arm)`` pairs, and ``N_BOOT`` draws of it that
    resample clusters.

    >>> est, draws = cluster_draws([("a", 1.0, 2.0), ("a", 1.0, 2.0), ("b", 2.0, 4.0)], lambda t, c: t.mean() / c.mean())
    >>> est, bool(np.all(np.isclose(draws, 2.0)))
    (2.0, True)
    """
    if not pairs:
        return float("nan"), np.full(N_BOOT, np.nan)
    keys = sorted({k for k, _, _ in pairs}, key=repr)
    members: dict[Any, list[int]] = defaultdict(list)
    for i, (k, _, _) in enumerate(pairs):
        members[k].append(i)
    c = np.array([x for _, x, _ in pairs], dtype=float)
    t = np.array([x for _, _, x in pairs], dtype=float)
    rng = np.random.default_rng(seed)
    draws = np.empty(N_BOOT)
    for b in range(N_BOOT):
        idx = np.concatenate([members[keys[j]] for j in rng.integers(0, len(keys), len(keys))])
        draws[b] = stat(t[idx], c[idx])
    return stat(t, c), draws


def interval(draws: np.ndarray) -> tuple[float, float]:
    if not np.isfinite(draws).any():
        return float("nan"), float("nan")
    lo, hi = np.nanquantile(draws, [0.025, 0.975])
    return float(lo), float(hi)


def paired(base: list[Row], arm: list[Row], name: str) -> list[tuple[Any, float, float]]:
    """``(cluster, base value, arm value)`` for every prompt both arms ran, where both values are defined."""
    by = {r["key"]: metric(r, name) for r in base}
    out = []
    for r in arm:
        b, a = by.get(r["key"], float("nan")), metric(r, name)
        if b == b and a == a:
            out.append((r["cluster"], b, a))
    return out


def step_seconds(rows: list[Row]) -> dict[tuple[Any, ...], float]:
    """Seconds per decoding step of each batch, keyed by (run, first prompt of the batch, seed)."""
    chunks: dict[tuple[Any, ...], list[Row]] = defaultdict(list)
    for r in rows:
        chunks[(r["key"][0], r["seed"], r["batch_s"], r["batch_size"])].append(r)
    out = {}
    for (run, seed, batch_s, _), rs in chunks.items():
        first = min(r["prompt_index"] for r in rs)
        out[(run, first, seed)] = batch_s / max(1, max(r["new_tokens"] for r in rs))
    return out


def _ratio_of(agg: Callable[[np.ndarray], float]) -> Callable[[np.ndarray, np.ndarray], float]:
    def ratio(t: np.ndarray, c: np.ndarray) -> float:
        below = agg(c)
        return float(agg(t) / below) if below else float("nan")

    return ratio


def arm_row(arm: str, rs: list[Row], base: list[Row], plain: list[Row]) -> dict[str, Any]:
    """One arm's figures against ``base`` (the ``ask`` arm) and plain."""
    succ = paired(base, rs, "topic_success")
    s_ratio, s_draws = cluster_draws(succ, _ratio_of(np.mean))
    s_diff, d_draws = cluster_draws(succ, lambda t, c: float(np.mean(t - c)))
    own = [(r["cluster"], 0.0, metric(r, "topic_success")) for r in rs]
    s_mean, own_draws = cluster_draws(own, lambda t, _: float(np.mean(t)))
    ppl = paired(base, rs, "judge_ppl")
    med, med_draws = cluster_draws(ppl, _ratio_of(np.median))
    mean, mean_draws = cluster_draws(ppl, _ratio_of(np.mean))
    values = {k: np.array([metric(r, k) for r in rs]) for k in ("judge_ppl", "distinct_1", "distinct_3", "length")}
    base_d3 = _nanmean(np.array([metric(r, "distinct_3") for r in base]))
    kl = np.array([metric(r, "mean_kl") for r in rs])
    plain_steps, steps = step_seconds(plain), step_seconds(rs)
    cost = [v / plain_steps[k] for k, v in steps.items() if k in plain_steps]
    return {
        "arm": arm,
        "n": len(rs),
        "success": s_mean,
        "success_ci": interval(own_draws),
        "success_ratio_vs_base": s_ratio,
        "success_ratio_ci": interval(s_draws),
        "success_diff_vs_base": s_diff,
        "success_diff_ci": interval(d_draws),
        "description_relevance": _nanmean(np.array([metric(r, "description_relevance") for r in rs])),
        "ppl_median": _nanmedian(values["judge_ppl"]),
        "ppl_mean": _nanmean(values["judge_ppl"]),
        "ppl_median_ratio": med,
        "ppl_median_ratio_ci": interval(med_draws),
        "ppl_mean_ratio": mean,
        "ppl_mean_ratio_ci": interval(mean_draws),
        "dist1": _nanmean(values["distinct_1"]),
        "dist3": _nanmean(values["distinct_3"]),
        "dist3_ratio": _nanmean(values["distinct_3"]) / base_d3,
        "length": _nanmean(values["length"]),
        "kl": _nanmean(kl),
        "seconds_per_token_vs_plain": statistics.median(cost) if cost else float("nan"),
    }


def table(rows: list[Row], base: str = "ask") -> list[dict[str, Any]]:
    by: dict[str, list[Row]] = defaultdict(list)
    for r in rows:
        by[r["profile"]].append(r)
    if base not in by:
        raise SystemExit(f"the runs have no `{base}` arm (arms: {', '.join(sorted(by))}); pass --base ARM")
    arms = [a for a in ORDER if a in by] + sorted(set(by) - set(ORDER))
    return [arm_row(a, by[a], by[base], by["control"]) for a in arms]


def markdown(t: list[dict[str, Any]], base: str = "ask") -> str:
    def f(x: float, d: int = 3) -> str:
        return "–" if x != x else f"{x:.{d}f}"

    def ci(pair: tuple[float, float], d: int = 2) -> str:
        return "" if pair[0] != pair[0] else f" [{f(pair[0], d)}, {f(pair[1], d)}]"

    lines = [
        f"| arm | held-out success | ÷ {base} | − {base} | description rel. | judge PPL median (÷ {base}) "
        f"| judge PPL mean (÷ {base}) | Dist-1 | Dist-3 (÷ {base}) | length | KL/token | s/token ÷ plain |",
        "|---|---|---|---|---:|---|---|---:|---|---:|---:|---:|",
    ]
    for r in t:
        lines.append(
            f"| {LABELS.get(r['arm'], r['arm'])} | {f(r['success'])}{ci(r['success_ci'], 3)} "
            f"| {f(r['success_ratio_vs_base'], 2)}{ci(r['success_ratio_ci'])} "
            f"| {f(r['success_diff_vs_base'], 3)}{ci(r['success_diff_ci'], 3)} | {f(r['description_relevance'])} "
            f"| {f(r['ppl_median'], 2)} ({f(r['ppl_median_ratio'], 2)}{ci(r['ppl_median_ratio_ci'])}) "
            f"| {f(r['ppl_mean'], 2)} ({f(r['ppl_mean_ratio'], 2)}{ci(r['ppl_mean_ratio_ci'])}) "
            f"| {f(r['dist1'])} | {f(r['dist3'])} ({f(r['dist3_ratio'], 2)}) | {f(r['length'], 1)} | {f(r['kl'])} "
            f"| {f(r['seconds_per_token_vs_plain'], 3)} |"
        )
    return "\n".join(lines)


def plot(
    t: list[dict[str, Any]],
    path: Path,
    title: str,
    base: str = "ask",
    x_of: str = "median",
    bound: float = 1.10,
    labels: dict[str, str] | None = None,
) -> None:
    """Held-out success against judge perplexity (``x_of``: median or mean, ÷ ``base``), each arm with its 95%
    intervals; ``labels`` name arms on top of :data:`SHORT`."""
    names = SHORT | (labels or {})
    plt = pyplot()
    if plt is None:
        raise SystemExit("--plot needs matplotlib: pip install 'narrative-gravity[plot]'")
    from matplotlib import ticker

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    placed: list[tuple[float, float]] = []
    for r in t:
        x, y, xci = r[f"ppl_{x_of}_ratio"], r["success"], r[f"ppl_{x_of}_ratio_ci"]
        if x != x or y != y:
            continue
        xerr = [[x - xci[0]], [xci[1] - x]]
        yerr = [[y - r["success_ci"][0]], [r["success_ci"][1] - y]]
        ax.errorbar(x, y, xerr=xerr, yerr=yerr, fmt="o", capsize=3, alpha=0.85)
        near = sum(abs(np.log(x / px)) < 0.05 and abs(y - py) < 0.04 for px, py in placed)  # labels that would touch
        placed.append((x, y))
        ax.annotate(names.get(r["arm"], r["arm"]), (x, y), textcoords="offset points", xytext=(6, 4 - 14 * near))
    ax.axvline(bound, color="grey", linestyle="--", linewidth=1)
    ax.text(bound, ax.get_ylim()[0], f" {bound:.2f}× {base}", color="grey", va="bottom")
    ax.set_xscale("log")
    lo, hi = ax.get_xlim()
    ax.xaxis.set_major_locator(ticker.FixedLocator([v for v in TICKS if lo <= v <= hi]))
    ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}×"))
    ax.xaxis.set_minor_formatter(ticker.NullFormatter())
    ax.set_xlabel(f"judge perplexity, {x_of} ÷ {base} (log scale)")
    ax.set_ylabel("held-out success")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", type=Path, nargs="*", help="ngrav eval run folders (each holds results.jsonl)")
    ap.add_argument("--tables", type=Path, nargs="+", default=None, help="plot these --json tables instead of runs")
    ap.add_argument("--base", default="ask", help="the arm every ratio is taken against (default: ask)")
    ap.add_argument("--json", type=Path, default=None, help="also write the table as JSON")
    ap.add_argument("--plot", type=Path, default=None, help="also draw success against perplexity (PNG)")
    ap.add_argument("--title", default="Chat: held-out success against fluency", help="the plot's title")
    ap.add_argument("--x", choices=("median", "mean"), default="median", help="the plot's perplexity ratio")
    ap.add_argument("--label", action="append", default=[], metavar="ARM=TEXT", help="name an arm in the plot")
    args = ap.parse_args(argv)
    if any("=" not in x for x in args.label):
        ap.error("--label takes ARM=TEXT, e.g. --label auto='the chat default'")
    labels = dict(x.split("=", 1) for x in args.label)
    if args.tables:
        if not args.plot:
            ap.error("--tables only plots; give --plot OUT.png")
        t = []
        for path in args.tables:
            t += [r for r in json.loads(path.read_text(encoding="utf-8")) if r["arm"] not in {x["arm"] for x in t}]
        plot(t, args.plot, args.title, args.base, args.x, labels=labels)
        return 0
    if not args.runs:
        ap.error("give run folders, or --tables with --plot")
    t = table(load(args.runs), args.base)
    print(markdown(t, args.base))
    if args.json:
        args.json.write_text(json.dumps(t, indent=1), encoding="utf-8")
    if args.plot:
        plot(t, args.plot, args.title, args.base, args.x, labels=labels)
    return 0


if __name__ == "__main__":
    sys.exit(main())
