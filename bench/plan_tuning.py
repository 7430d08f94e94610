"""Tune plan-then-write against stored best-of-4 samples: run only the plan arms, pair them with a saved run.

Best-of-4 is the expensive part of ``bench/plan_pruning.py`` and its samples do not change with the plan's
settings, so a tuning round reuses them: each arm (keyword arguments of
:func:`narrative_gravity.levels.write.plan_then_write`) is run on the given topics and seeds, and its relevance is
paired with the saved run's oracle best-of-4 for the same prompt and seed.

Run (the arms of docs/pruning.md's tuning table)::

    OMP_NUM_THREADS=2 python bench/plan_tuning.py --arms bench/plan/tuning-arms.json --topics 0,1,2,3 \\
        --seeds 0,1,2 --reference bench/results/plan_pruning.json --json /tmp/plan_tuning.json
"""

from __future__ import annotations

import argparse
import itertools
import json
from typing import Any

import numpy as np

from common import machine, write_json
from narrative_gravity.eval.text_metrics import mean_ci
from plan_pruning import TOPICS, _rel


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arms", required=True, help="JSON file: {name: PlanSettings keyword arguments}")
    ap.add_argument("--topics", type=_ints, default=[0, 1, 2, 3], help="comma-separated topic indices")
    ap.add_argument("--seeds", type=_ints, default=[0, 1, 2], help="comma-separated seeds")
    ap.add_argument("--reference", default="bench/results/plan_pruning.json", help="a saved plan_pruning run")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    with open(args.arms, encoding="utf-8") as fh:
        arms: dict[str, dict[str, Any]] = json.load(fh)
    with open(args.reference, encoding="utf-8") as fh:
        ref = {(r["prompt"], r["seed"]): r["best4"]["relevance"] for r in json.load(fh)["rows"]}
    pairs = [(TOPICS[t], s) for t, s in itertools.product(args.topics, args.seeds)]
    missing = [f"topic {p!r} seed {s}" for (p, _), s in pairs if (p, s) not in ref]
    if missing:
        ap.error(f"{args.reference} has no best-of-4 for {', '.join(missing)}; run plan_pruning.py on them first")

    import torch

    from narrative_gravity.embeddings import encode
    from narrative_gravity.levels.write import PLAN_OPTIONS, PlanSettings, plan_then_write
    from narrative_gravity.models import load_model

    model, tok = load_model()
    rows: list[dict[str, Any]] = []
    for (prompt, topic), seed in pairs:
        row: dict[str, Any] = {"prompt": prompt, "seed": seed, "best4": ref[(prompt, seed)]}
        for name, kwargs in arms.items():
            options = PLAN_OPTIONS.replace(max_new_tokens=args.new_tokens, seed=seed)
            res = plan_then_write(model, tok, prompt, settings=PlanSettings(**kwargs), options=options, encoder=encode)
            row[name] = {"relevance": _rel(encode, [res.text], topic)[0], "tokens": res.generated_tokens}
            row[name]["text"] = res.text
        rows.append(row)
        print(
            f"{prompt[:40]:40s} s{seed} best4 {row['best4']:.3f} | "
            + " | ".join(f"{n} {row[n]['relevance']:.3f} ({row[n]['tokens']})" for n in arms),
            flush=True,
        )
    best4 = float(np.mean([r["best4"] for r in rows]))
    print(f"\n| arm | relevance [95% CI] | − oracle best-of-4 ({best4:.3f}) | generated tokens |")
    print("|---|---|---|---|")
    summary = {}
    for name in arms:
        m = mean_ci([r[name]["relevance"] for r in rows])
        d = mean_ci([r[name]["relevance"] - r["best4"] for r in rows])
        toks = float(np.mean([r[name]["tokens"] for r in rows]))
        summary[name] = {"relevance": m, "minus_best4": d, "tokens": toks}
        print(f"| {name} | {m[0]:.3f} [{m[1]:.3f}, {m[2]:.3f}] | {d[0]:+.3f} [{d[1]:+.3f}, {d[2]:+.3f}] | {toks:.0f} |")
    result = {"args": vars(args), "arms": arms, "machine": machine(torch.get_num_threads()), "summary": summary}
    result["rows"] = rows
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
