"""Per-topic lift: held-out success (and rare-word success) of one method against plain, topic by topic.

Reads an ``ngrav eval`` run on a topic set (``topics``, ``empath``, …) with a control arm and one method arm
(default ``auto``, the topic default). For every topic: plain's and the method's mean held-out success, their
paired difference with a 95% bootstrap interval over the topic's (prompt, seed) pairs, and the same for
``rare_success`` (held-out words under Zipf frequency 4). Then overall figures: the success ratio with its
interval over all pairs, the share of topics that gain (point estimate above 0), and the topics that lose with
an interval below 0. ``--plot`` draws each topic's plain and pulled success, sorted by lift.

Usage::

    VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/ngrav eval --engine vllm --prompts empath --profile auto \\
        --seeds 0-1 --batch-size 20 --out /tmp/empath
    python bench/topics/per_topic.py /tmp/empath --json bench/results/empath-per-topic.json \\
        --plot docs/img/empath-per-topic.png
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
from run_io import read_run, write_outputs

from narrative_gravity.eval.stats import bootstrap_ci, paired_bootstrap


def pairs(rows: list[dict[str, Any]], arm: str, metric: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{topic: (plain values, arm values)}`` over the (prompt, seed) keys both arms have."""
    by: dict[str, dict[tuple[str, int, int], float]] = defaultdict(dict)
    topic_of: dict[tuple[int, int], str] = {}
    for r in rows:
        v = r["metrics"].get(metric)
        by[r["profile"]][(r["prompt_index"], r["seed"])] = np.nan if v is None else float(v)
        topic_of[(r["prompt_index"], r["seed"])] = r.get("topic") or "?"
    out: dict[str, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for key in sorted(set(by["control"]) & set(by[arm])):
        c, t = out[topic_of[key]]
        c.append(by["control"][key])
        t.append(by[arm][key])
    return {k: (np.array(c), np.array(t)) for k, (c, t) in out.items()}


def ratio_ci(control: np.ndarray, treated: np.ndarray, n_boot: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """``mean(treated) / mean(control)`` with a paired percentile-bootstrap interval."""
    ok = np.isfinite(control) & np.isfinite(treated)
    c, t = control[ok], treated[ok]
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, c.size, size=(n_boot, c.size))
    with np.errstate(divide="ignore", invalid="ignore"):
        boots = t[idx].mean(axis=1) / c[idx].mean(axis=1)
    lo, hi = np.nanquantile(boots, [0.025, 0.975])
    return float(t.mean() / c.mean()), float(lo), float(hi)


def summarize(rows: list[dict[str, Any]], arm: str) -> dict[str, Any]:
    topics: dict[str, Any] = {}
    succ = pairs(rows, arm, "topic_success")
    rare = pairs(rows, arm, "rare_success")
    for topic, (c, t) in sorted(succ.items()):
        d = paired_bootstrap(c, t, higher_is_better=True)
        rc, rt = rare.get(topic, (np.array([]), np.array([])))
        topics[topic] = {
            "pairs": d.n,
            "plain": d.control,
            "method": d.treated,
            "difference": [d.difference, d.low, d.high],
            "verdict": d.verdict,
            "rare_plain": bootstrap_ci(rc)[0] if np.isfinite(rc).any() else None,
            "rare_method": bootstrap_ci(rt)[0] if np.isfinite(rt).any() else None,
        }
    all_c = np.concatenate([c for c, _ in succ.values()])
    all_t = np.concatenate([t for _, t in succ.values()])
    rare_c = np.concatenate([c for c, _ in rare.values()]) if rare else np.array([])
    rare_t = np.concatenate([t for _, t in rare.values()]) if rare else np.array([])
    if not np.isfinite(rare_c).any():  # a run made before the metric existed
        rare_c = rare_t = np.array([])
    gains = [k for k, v in topics.items() if v["difference"][0] > 0]
    losses = [k for k, v in topics.items() if v["difference"][2] < 0]
    return {
        "arm": arm,
        "topics": topics,
        "overall": {
            "plain": bootstrap_ci(all_c),
            "method": bootstrap_ci(all_t),
            "ratio": ratio_ci(all_c, all_t),
            "rare_plain": bootstrap_ci(rare_c) if rare_c.size else None,
            "rare_method": bootstrap_ci(rare_t) if rare_t.size else None,
            "rare_ratio": ratio_ci(rare_c, rare_t) if rare_c.size and np.nanmean(rare_c) > 0 else None,
            "topics": len(topics),
            "gain": len(gains),
            "lose_significantly": losses,
        },
    }


def markdown(s: dict[str, Any]) -> str:
    o = s["overall"]

    def ci(v: tuple[float, float, float] | list[float] | None, fmt: str = ".3f") -> str:
        return "n/a" if v is None else f"{v[0]:{fmt}} [{v[1]:{fmt}}, {v[2]:{fmt}}]"

    lines = [
        f"Overall: held-out success plain {ci(o['plain'])}, {s['arm']} {ci(o['method'])}, ratio "
        f"{ci(o['ratio'], '.2f')}; rare-word success plain {ci(o['rare_plain'])}, {s['arm']} {ci(o['rare_method'])}, "
        f"ratio {ci(o['rare_ratio'], '.2f')}. Topics that gain: {o['gain']} of {o['topics']}; "
        f"losing significantly: {', '.join(o['lose_significantly']) or 'none'}.",
        "",
        "| topic | plain | method | difference [95% CI] | rare: plain → method |",
        "|---|---:|---:|---:|---:|",
    ]
    order = sorted(s["topics"].items(), key=lambda kv: kv[1]["difference"][0])
    for topic, v in order:
        d = v["difference"]
        rare = "n/a" if v["rare_plain"] is None else f"{v['rare_plain']:.3f} → {v['rare_method']:.3f}"
        lines.append(
            f"| {topic} | {v['plain']:.3f} | {v['method']:.3f} | {d[0]:+.3f} [{d[1]:+.3f}, {d[2]:+.3f}] | {rare} |"
        )
    return "\n".join(lines)


def plot(s: dict[str, Any]) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = sorted(s["topics"].items(), key=lambda kv: kv[1]["difference"][0])
    names = [k for k, _ in order]
    y = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(6.4, 0.26 * len(names) + 1.2))
    ax.barh(y - 0.2, [v["plain"] for _, v in order], height=0.4, label="plain decoding")
    ax.barh(y + 0.2, [v["method"] for _, v in order], height=0.4, label=f"{s['arm']} (topic default)")
    ax.set_yticks(y, names)
    ax.set_xlabel("held-out success")
    ax.set_title("Held-out success per topic (sorted by lift)")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="an `ngrav eval` output folder on a topic set, with a control arm")
    ap.add_argument("--arm", default="auto", help="the method arm (default: auto)")
    ap.add_argument("--json", type=Path, default=None, help="write the summary here")
    ap.add_argument("--plot", type=Path, default=None, help="write the per-topic plot here (PNG)")
    args = ap.parse_args(argv)
    rows, _ = read_run(args.run)
    arms = {r["profile"] for r in rows}
    if "control" not in arms or args.arm not in arms:
        sys.exit(f"error: the run needs arms `control` and `{args.arm}`; it has {sorted(arms)}")
    summary = summarize(rows, args.arm)
    write_outputs(summary, markdown(summary), args.json, args.plot, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
