"""Score a finished topic run's texts again with the judge (Gemma 3 270M) as it loads now.

The runs made while Gemma's converted tokenizer lacked its BOS token were judged without it
(docs/benchmarks.md); this gives their perplexity ratios with the fixed judge, without generating again.

Usage::

    python bench/topics/rejudge.py RUN_DIR --json OUT.json

Prints plain's and the topic default's median judge perplexity, the ratio of the medians and the geometric
mean of the paired ratios, beside the stored (old-judge) figures.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

from run_io import read_run, write_outputs

from narrative_gravity.eval.judge import load_judge


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="an `ngrav eval` output folder with `control` and `auto` arms")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    ap.add_argument("--batch", type=int, default=40, help="texts per judge call")
    args = ap.parse_args(argv)
    rows, _ = read_run(args.run)
    judge = load_judge()
    todo = [r for r in rows if r["text"].strip()]
    t0 = time.perf_counter()
    scored: dict[tuple[str, int, int], float] = {}
    for i in range(0, len(todo), args.batch):
        chunk = todo[i : i + args.batch]
        values = judge.perplexity([r["prompt"] for r in chunk], [r["text"] for r in chunk])
        scored.update({(r["profile"], r["prompt_index"], r["seed"]): v for r, v in zip(chunk, values)})
    keys = [(p, s) for (arm, p, s) in scored if arm == "control" and ("auto", p, s) in scored]
    plain = [scored[("control", p, s)] for p, s in keys]
    pulled = [scored[("auto", p, s)] for p, s in keys]
    stored = {arm: [r["metrics"]["judge_ppl"] for r in rows if r["profile"] == arm] for arm in ("control", "auto")}
    out = {
        "pairs": len(keys),
        "median_plain": statistics.median(plain),
        "median_auto": statistics.median(pulled),
        "ratio_of_medians": statistics.median(pulled) / statistics.median(plain),
        "geomean_ratio": math.exp(statistics.mean(math.log(a / c) for a, c in zip(pulled, plain))),
        "stored_ratio_of_medians": statistics.median(stored["auto"]) / statistics.median(stored["control"]),
        "seconds": time.perf_counter() - t0,
    }
    write_outputs(out, json.dumps(out, indent=2), args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
