"""Best of n drafts: would keeping the most fluent of several continuations buy the required words' perplexity back?

Reads an ``ngrav eval`` run on a required-words prompt set made with several seeds per prompt (``--seeds 0-3``),
scores every continuation with the generator's own model (SmolLM2, the visible prompt as context: what a
deployment could compute, never the judge), and for k = 1, 2, 4, … keeps, per arm and prompt, the draft of the
first k seeds with the lowest own perplexity among those that contain every required word (all of them where
none does). Reported per arm and k: the share of required words contained, the judge's perplexity ratio
(geometric mean of the paired ratios, 95% bootstrap interval) against plain decoding's first seed, and against
plain decoding's best of the same k by the same rule, and Dist-3.

    ngrav eval --prompts out/require-tune.jsonl --raw --profile auto:bench/require/tuning/lead-alone.yaml \\
        --seeds 0-3 --batch-size 20 --limit-prompts 40 --metrics required_inclusion,distinct_3,judge_ppl \\
        --out out/require-bestof
    python bench/require/rerank.py out/require-bestof --json bench/results/require-tune-bestof.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from summary import CONTROL, finite_number  # this folder's table of one draft each

from narrative_gravity.eval.judge import load_judge
from narrative_gravity.eval.report import load_run
from narrative_gravity.eval.stats import bootstrap_ci


def own_perplexity(rows: list[dict[str, Any]], model: str) -> None:
    """Add ``own``: the mean NLL per token of each row's text under ``model``, given its visible prompt."""
    scorer = load_judge(model)
    for r, (nll, n) in zip(rows, scorer.nll([r["prompt"] for r in rows], [r["text"] for r in rows])):
        r["own"] = nll / n if n else math.inf


def best_of(drafts: list[dict[str, Any]], need_words: bool) -> dict[str, Any]:
    """The draft with the lowest own perplexity; among those that contain every required word, where asked."""
    if need_words:
        drafts = [d for d in drafts if d["metrics"]["required_inclusion"] >= 1.0] or drafts
    return min(drafts, key=lambda d: d["own"])


def _geo(logs: list[float]) -> list[float]:
    return [math.exp(x) for x in bootstrap_ci(logs)]


def summarize(rows: list[dict[str, Any]], ks: list[int]) -> dict[str, Any]:
    cells: dict[tuple[str, int], dict[int, dict[str, Any]]] = defaultdict(dict)
    for r in rows:
        cells[(r["profile"], r["prompt_index"])][r["seed"]] = r
    seeds = sorted({r["seed"] for r in rows})
    prompts = sorted({i for _, i in cells})
    arms = list(dict.fromkeys(r["profile"] for r in rows))
    if CONTROL not in arms:
        raise SystemExit("the run has no control arm (plain decoding) to compare with")

    def pick(arm: str, i: int, k: int) -> dict[str, Any]:
        return best_of([cells[(arm, i)][s] for s in seeds[:k]], need_words=arm != CONTROL)

    out: dict[str, Any] = {"seeds": seeds, "prompts": len(prompts), "arms": {}}
    for k in ks:
        if k > len(seeds):
            continue
        plain1 = {i: pick(CONTROL, i, 1)["metrics"]["judge_ppl"] for i in prompts}
        plaink = {i: pick(CONTROL, i, k)["metrics"]["judge_ppl"] for i in prompts}
        for arm in arms:
            kept = {i: pick(arm, i, k) for i in prompts}
            ppl = {i: kept[i]["metrics"]["judge_ppl"] for i in prompts}
            d3 = [x for i in prompts if finite_number(x := kept[i]["metrics"].get("distinct_3"))]
            out["arms"].setdefault(arm, {})[str(k)] = {
                "required_inclusion": statistics.fmean(kept[i]["metrics"]["required_inclusion"] for i in prompts),
                "ppl_vs_plain_first": _geo([math.log(ppl[i] / plain1[i]) for i in prompts]),
                "ppl_vs_plain_best_of_k": _geo([math.log(ppl[i] / plaink[i]) for i in prompts]),
                "distinct_3": statistics.fmean(d3),
            }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="the --out folder of an ngrav eval run with several seeds")
    ap.add_argument("--k", default="1,2,4", help="draft counts to report (comma-separated)")
    ap.add_argument("--model", default="smollm2", help="the model whose own perplexity ranks the drafts")
    ap.add_argument("--json", type=Path, default=None, help="write the table here")
    args = ap.parse_args()
    rows, _, _ = load_run(args.run)
    own_perplexity(rows, args.model)
    table = summarize(rows, [int(k) for k in args.k.split(",")])
    d3_plain = table["arms"][CONTROL]["1"]["distinct_3"]
    print(
        "| arm | drafts | required words contained | PPL vs plain (first seed) | PPL vs plain's best of k | Dist-3 ratio |"
    )
    print("|---|---:|---:|---|---|---:|")
    for arm, by_k in table["arms"].items():
        for k, t in by_k.items():
            a, b = t["ppl_vs_plain_first"], t["ppl_vs_plain_best_of_k"]
            print(
                f"| {arm} | {k} | {t['required_inclusion']:.3f} | {a[0]:.2f} [{a[1]:.2f}, {a[2]:.2f}] | "
                f"{b[0]:.2f} [{b[1]:.2f}, {b[2]:.2f}] | {t['distinct_3'] / d3_plain:.3f} |"
            )
    if args.json is not None:
        args.json.write_text(json.dumps({"run": str(args.run), **table}, indent=2) + "\n")


if __name__ == "__main__":
    main()
