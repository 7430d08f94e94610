"""The required-words table from an ``ngrav eval`` run: inclusion, judge perplexity and Dist-3 per arm.

    python bench/require/summary.py out/require-test --json bench/results/require-test.json

For each arm: the share of required words contained (``required_inclusion``, averaged over prompts), the
median judge perplexity and its ratio to the control's median, the geometric mean of the paired (same
prompt and seed) perplexity ratios with a 95% bootstrap interval, and the mean Dist-3 and its ratio.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from narrative_gravity.eval.report import load_run
from narrative_gravity.eval.stats import bootstrap_ci

CONTROL = "control"


def finite_number(x: object) -> bool:
    """A finite metric value (Dist-3 is ``None`` or NaN for a text too short to have trigrams)."""
    return isinstance(x, (int, float)) and math.isfinite(x)


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm figures (see the module doc); arms in the order they first appear."""
    by_arm: dict[str, dict[tuple[int, int], dict[str, float]]] = defaultdict(dict)
    for r in rows:
        by_arm[r["profile"]][(r["prompt_index"], r["seed"])] = r["metrics"]
    if CONTROL not in by_arm:
        raise SystemExit("the run has no control arm (plain decoding) to compare with")
    control = by_arm[CONTROL]
    c_ppl = statistics.median(m["judge_ppl"] for m in control.values())
    c_d3 = statistics.fmean(d for m in control.values() if finite_number(d := m["distinct_3"]))
    out: dict[str, Any] = {}
    for arm, cells in by_arm.items():
        ppl = [m["judge_ppl"] for m in cells.values()]
        d3 = [d for m in cells.values() if finite_number(d := m["distinct_3"])]
        logs = [math.log(cells[k]["judge_ppl"] / control[k]["judge_ppl"]) for k in cells if k in control]
        geo, lo, hi = (math.exp(x) for x in bootstrap_ci(logs))  # the mean log ratio, and its interval
        out[arm] = {
            "prompts": len(cells),
            "required_inclusion": statistics.fmean(m["required_inclusion"] for m in cells.values()),
            "topic_success": statistics.fmean(m.get("topic_success", math.nan) for m in cells.values()),
            "judge_ppl_median": statistics.median(ppl),
            "judge_ppl_ratio_of_medians": statistics.median(ppl) / c_ppl,
            "judge_ppl_paired_geo_mean": [geo, lo, hi],
            "distinct_3": statistics.fmean(d3),
            "distinct_3_ratio": statistics.fmean(d3) / c_d3,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="the --out folder of the ngrav eval run")
    ap.add_argument("--json", type=Path, default=None, help="write the table here")
    args = ap.parse_args()
    rows, _, _ = load_run(args.run)
    table = summarize(rows)
    print(
        "| arm | required words contained | judge PPL (median) | ratio of medians | paired ratio [95% CI] | Dist-3 ratio |"
    )
    print("|---|---:|---:|---:|---|---:|")
    for arm, t in table.items():
        g, lo, hi = t["judge_ppl_paired_geo_mean"]
        print(
            f"| {arm} | {t['required_inclusion']:.3f} | {t['judge_ppl_median']:.2f} | "
            f"{t['judge_ppl_ratio_of_medians']:.2f} | {g:.2f} [{lo:.2f}, {hi:.2f}] | {t['distinct_3_ratio']:.3f} |"
        )
    if args.json is not None:
        payload = {"run": str(args.run), "prompts": len(rows) // max(len(table), 1), "arms": table}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
