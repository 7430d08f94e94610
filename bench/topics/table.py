"""The topic benchmark table: one row per method, from an ``ngrav eval`` run on the PPLM/FUDGE protocol.

Columns: held-out success (mean, 95% bootstrap interval over the (prompt, seed) pairs), judge perplexity
(median, and its ratio to plain), Dist-1/2/3 (mean over texts, and Dist-3's ratio to plain), decode speed
relative to plain (median over chunks of plain's seconds per generated step divided by the method's, same
prompts, same seed, same batch), mean KL per token, and the share of steps where the pull was exactly zero.

Speed is read per chunk, not per text: a batch decodes until its longest row ends, so a text that stops early
would otherwise look slow. Every method decodes the same (prompt, seed) batches, one after another.

Usage::

    python bench/topics/table.py RUN_DIR [--markdown]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from narrative_gravity.eval.stats import bootstrap_ci

ORDER = ("control", "article", "weighted-2", "weighted-4", "weighted-8", "lexical", "semantic", "auto")
LABELS = {
    "control": "plain decoding",
    "article": "the article's processor (replica)",
    "weighted-2": "weighted decoding, λ=2",
    "weighted-4": "weighted decoding, λ=4",
    "weighted-8": "weighted decoding, λ=8",
    "lexical": "our lexical field, constant λ",
    "semantic": "our semantic field, constant λ",
    "auto": "**thermostat (default topic profile)**",
}


def load(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "results.jsonl").read_text(encoding="utf-8").splitlines() if line]


def values(rows: list[dict[str, Any]], key: str) -> list[float]:
    """The metric ``key`` of every row where it is defined (an empty text has no Dist-n)."""
    return [r["metrics"][key] for r in rows if r["metrics"].get(key) is not None]


def step_seconds(rows: list[dict[str, Any]]) -> dict[tuple[int, int], float]:
    """Seconds per decoding step of each (first prompt of the chunk, seed) batch."""
    chunks: dict[tuple[int, int, float], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        chunks[(r["seed"], r["batch_s"], r["batch_size"])].append(r)
    out = {}
    for (seed, batch_s, _), rs in chunks.items():
        first = min(r["prompt_index"] for r in rs)
        out[(first, seed)] = batch_s / max(r["new_tokens"] for r in rs)
    return out


def table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by[r["profile"]].append(r)
    plain = {(r["prompt_index"], r["seed"]): r for r in by["control"]}
    plain_steps = step_seconds(by["control"])
    base_ppl = statistics.median(values(by["control"], "judge_ppl"))
    base_d3 = statistics.mean(values(by["control"], "distinct_3"))
    out = []
    for arm in [a for a in ORDER if a in by] + sorted(set(by) - set(ORDER)):
        rs = sorted(by[arm], key=lambda r: (r["prompt_index"], r["seed"]))
        succ = np.array([r["metrics"]["topic_success"] for r in rs], dtype=float)
        _, lo, hi = bootstrap_ci(succ)
        ppl = statistics.median(values(rs, "judge_ppl"))
        d = {n: statistics.mean(values(rs, f"distinct_{n}")) for n in (1, 2, 3)}
        steps = step_seconds(rs)
        speed = [plain_steps[k] / v for k, v in steps.items() if k in plain_steps]
        kls = values(rs, "mean_kl")
        lam = [x for r in rs if r.get("trace") for x in r["trace"]["strength"]]
        out.append(
            {
                "arm": arm,
                "n": len(rs),
                "pairs": sum((r["prompt_index"], r["seed"]) in plain for r in rs),
                "success": float(succ.mean()),
                "success_ci": (lo, hi),
                "ppl": ppl,
                "ppl_ratio": ppl / base_ppl,
                **{f"dist{n}": v for n, v in d.items()},
                "dist3_ratio": d[3] / base_d3,
                "speed": statistics.median(speed) if speed else float("nan"),
                "kl": statistics.mean(kls) if kls and arm != "control" else float("nan"),
                "untouched": float(np.mean([x == 0 for x in lam])) if lam and arm != "control" else float("nan"),
            }
        )
    return out


def markdown(t: list[dict[str, Any]]) -> str:
    def f(x: float, d: int = 3) -> str:
        return "–" if x != x else f"{x:.{d}f}"

    lines = [
        "| method | held-out success [95% CI] | judge PPL (median) | PPL ratio | Dist-1 | Dist-2 | Dist-3 | Dist-3 ratio "
        "| speed vs plain | KL/token | λ = 0 steps |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in t:
        lo, hi = r["success_ci"]
        lines.append(
            f"| {LABELS.get(r['arm'], r['arm'])} | {f(r['success'])} [{f(lo)}, {f(hi)}] | {f(r['ppl'], 2)} "
            f"| {f(r['ppl_ratio'], 2)} | {f(r['dist1'])} | {f(r['dist2'])} | {f(r['dist3'])} | {f(r['dist3_ratio'], 2)} "
            f"| {f(r['speed'], 3)} | {f(r['kl'])} | {f(r['untouched'] * 100, 1) + ' %' if r['untouched'] == r['untouched'] else '–'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="the ngrav eval run folder (holds results.jsonl)")
    ap.add_argument("--json", type=Path, default=None, help="also write the table as JSON")
    args = ap.parse_args(argv)
    t = table(load(args.run))
    print(markdown(t))
    if args.json:
        args.json.write_text(json.dumps(t, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
