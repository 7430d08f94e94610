"""One arm against another of the same ``ngrav eval`` run, paired on (prompt, seed): the difference in a metric
with a 95% bootstrap interval, overall and per topic.

``ngrav eval``'s own report pairs every arm with plain decoding; a tuning rule such as "its paired difference in
held-out success from ``auto`` has a 95% interval above zero" needs two arms paired with each other.

Usage::

    python bench/topics/paired.py RUN_DIR --base auto --arm lead-only [--arm lead-kl05 ...] \
        [--metric topic_success] [--json OUT.json]
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path
from typing import Any

from run_io import read_run, write_outputs

from narrative_gravity.eval.stats import paired_bootstrap


def metric_by_pair(rows: list[dict[str, Any]], arm: str, metric: str) -> dict[tuple[int, int], tuple[str, float]]:
    """``(prompt_index, seed) -> (topic, value)`` for one arm's rows that scored ``metric``."""
    out: dict[tuple[int, int], tuple[str, float]] = {}
    for r in rows:
        if r.get("profile") == arm and metric in (r.get("metrics") or {}):
            out[(r["prompt_index"], r["seed"])] = (r.get("topic") or "", float(r["metrics"][metric]))
    return out


def compare(rows: list[dict[str, Any]], base: str, arm: str, metric: str) -> dict[str, Any]:
    """``arm − base`` on their shared pairs: overall and per topic (mean, interval, verdict)."""
    a, b = metric_by_pair(rows, arm, metric), metric_by_pair(rows, base, metric)
    shared = sorted(set(a) & set(b))
    if not shared:
        raise SystemExit(f"error: arms {base!r} and {arm!r} share no (prompt, seed) pair with {metric!r}")
    c = paired_bootstrap([b[k][1] for k in shared], [a[k][1] for k in shared], higher_is_better=True)
    by_topic: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for k in shared:
        by_topic[a[k][0]].append(k)
    topics = {}
    for topic, keys in sorted(by_topic.items()):
        t = paired_bootstrap([b[k][1] for k in keys], [a[k][1] for k in keys], higher_is_better=True)
        topics[topic] = {"n": t.n, "base": t.control, "arm": t.treated, "diff": t.difference, "ci": [t.low, t.high]}
    return {
        "arm": arm,
        "base": base,
        "metric": metric,
        "n": c.n,
        "base_mean": c.control,
        "arm_mean": c.treated,
        "diff": c.difference,
        "ci": [c.low, c.high],
        "verdict": c.verdict,
        "topics_ahead": sum(t["diff"] > 0 for t in topics.values()),
        "topics_behind": sum(t["diff"] < 0 for t in topics.values()),
        "topics": topics,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="the ngrav eval run folder (holds results.jsonl)")
    ap.add_argument("--base", default="auto", help="the arm compared against (default: auto)")
    ap.add_argument("--arm", action="append", required=True, help="an arm to compare (repeat for more)")
    ap.add_argument("--metric", default="topic_success", help="the per-text metric (default: topic_success)")
    ap.add_argument("--json", type=Path, default=None, help="also write the comparison as JSON")
    args = ap.parse_args()
    rows, _ = read_run(args.run)
    results = [compare(rows, args.base, arm, args.metric) for arm in args.arm]
    lines = [
        f"| arm | {args.base} | arm | arm − {args.base} [95% CI] | pairs | topics ahead / behind |",
        "|---|---:|---:|---|---:|---|",
    ]
    for r in results:
        lo, hi = r["ci"]
        lines.append(
            f"| {r['arm']} | {r['base_mean']:.3f} | {r['arm_mean']:.3f} | {r['diff']:+.3f} [{lo:+.3f}, {hi:+.3f}] "
            f"({r['verdict']}) | {r['n']} | {r['topics_ahead']} / {r['topics_behind']} |"
        )
    write_outputs({"metric": args.metric, "base": args.base, "arms": results}, "\n".join(lines), args.json)


if __name__ == "__main__":
    main()
