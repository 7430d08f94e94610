"""The topic benchmark table: one row per method, from an ``ngrav eval`` run on the PPLM/FUDGE protocol.

Columns: held-out success (mean, 95% bootstrap interval over the (prompt, seed) pairs), judge perplexity
(median, and its ratio to plain), Dist-1/2/3 (mean over texts, and Dist-3's ratio to plain), decode speed
relative to plain (median over chunks of plain's seconds per generated step divided by the method's, same
prompts, same seed, same batch), mean KL per token, and the share of steps where the pull was exactly zero.

The perplexity ratio's interval resamples (prefix, seed) clusters, not single pairs: every topic of a prefix and
seed is one cluster, because plain's continuation does not depend on the topic (the same plain text stands in
every topic's pair). ``--compare RUN2`` also prints the ratio of the two runs' perplexity ratios for each arm
with an interval (the runs resampled independently): whether, say, vLLM's ratio differs from transformers'.

Speed is read per chunk, not per text: a batch decodes until its longest row ends, so a text that stops early
would otherwise look slow. Every method decodes the same (prompt, seed) batches, one after another.

Usage::

    python bench/topics/table.py RUN_DIR [--json OUT.json] [--compare RUN2]
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


N_BOOT = 2000


def ppl_ratio_draws(
    control: list[dict[str, Any]], arm: list[dict[str, Any]], seed: int = 0
) -> tuple[float, np.ndarray]:
    """The ratio of the arm's median judge perplexity to plain's on their common (prompt, seed) pairs, and
    ``N_BOOT`` bootstrap draws of it that resample (prefix text, seed) clusters."""
    plain = {(r["prompt_index"], r["seed"]): r["metrics"].get("judge_ppl") for r in control}
    pairs = [
        ((r["prompt"], r["seed"]), plain[(r["prompt_index"], r["seed"])], r["metrics"].get("judge_ppl"))
        for r in arm
        if plain.get((r["prompt_index"], r["seed"])) is not None and r["metrics"].get("judge_ppl") is not None
    ]
    if not pairs:
        return float("nan"), np.full(N_BOOT, np.nan)
    keys = sorted({k for k, _, _ in pairs})
    members: dict[Any, list[int]] = defaultdict(list)
    for i, (k, _, _) in enumerate(pairs):
        members[k].append(i)
    c = np.array([x for _, x, _ in pairs])
    t = np.array([x for _, _, x in pairs])
    rng = np.random.default_rng(seed)
    draws = np.empty(N_BOOT)
    for b in range(N_BOOT):
        idx = np.concatenate([members[keys[j]] for j in rng.integers(0, len(keys), len(keys))])
        draws[b] = np.median(t[idx]) / np.median(c[idx])
    return float(np.median(t) / np.median(c)), draws


def interval(draws: np.ndarray) -> tuple[float, float]:
    lo, hi = np.nanquantile(draws, [0.025, 0.975])
    return float(lo), float(hi)


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
        ratio, draws = ppl_ratio_draws(by["control"], rs)
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
                "ppl_ratio_paired": ratio,
                "ppl_ratio_ci": interval(draws) if arm != "control" else (float("nan"), float("nan")),
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
        "| method | held-out success [95% CI] | judge PPL (median) | PPL ratio [95% CI] | Dist-1 | Dist-2 | Dist-3 "
        "| Dist-3 ratio | speed vs plain | KL/token | λ = 0 steps |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in t:
        lo, hi = r["success_ci"]
        plo, phi = r["ppl_ratio_ci"]
        ci = f" [{f(plo, 2)}, {f(phi, 2)}]" if plo == plo else ""
        lines.append(
            f"| {LABELS.get(r['arm'], r['arm'])} | {f(r['success'])} [{f(lo)}, {f(hi)}] | {f(r['ppl'], 2)} "
            f"| {f(r['ppl_ratio'], 2)}{ci} | {f(r['dist1'])} | {f(r['dist2'])} | {f(r['dist3'])} | {f(r['dist3_ratio'], 2)} "
            f"| {f(r['speed'], 3)} | {f(r['kl'])} | {f(r['untouched'] * 100, 1) + ' %' if r['untouched'] == r['untouched'] else '–'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="the ngrav eval run folder (holds results.jsonl)")
    ap.add_argument("--json", type=Path, default=None, help="also write the table as JSON")
    ap.add_argument("--compare", type=Path, default=None, help="a second run: the ratio of the perplexity ratios")
    args = ap.parse_args(argv)
    rows = load(args.run)
    t = table(rows)
    print(markdown(t))
    if args.compare is not None:
        t = {"table": t, "compare": compare(rows, load(args.compare), args.run, args.compare)}
    if args.json:
        args.json.write_text(json.dumps(t, indent=1), encoding="utf-8")
    return 0


def compare(a: list[dict[str, Any]], b: list[dict[str, Any]], name_a: Path, name_b: Path) -> list[dict[str, Any]]:
    """Per arm in both runs: run A's perplexity ratio over run B's, with an interval (independent resamples)."""
    split = [{arm: [r for r in rows if r["profile"] == arm] for arm in {r["profile"] for r in rows}} for rows in (a, b)]
    out = []
    print(f"\nperplexity ratio of {name_a} over that of {name_b} (95% interval, clusters resampled in each run):")
    for arm in sorted(set(split[0]) & set(split[1]) - {"control"}):
        ra, da = ppl_ratio_draws(split[0]["control"], split[0][arm], seed=0)
        rb, db = ppl_ratio_draws(split[1]["control"], split[1][arm], seed=1)
        lo, hi = interval(da / db)
        print(f"  {arm}: {ra:.3f} / {rb:.3f} = {ra / rb:.3f} [{lo:.3f}, {hi:.3f}]")
        out.append({"arm": arm, "ratio_a": ra, "ratio_b": rb, "quotient": ra / rb, "ci": (lo, hi)})
    return out


if __name__ == "__main__":
    sys.exit(main())
