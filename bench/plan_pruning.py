"""Plan-then-write against best-of-4 full generations: cost (generated tokens, seconds) and topic relevance.

For every topic prompt and seed, on SmolLM2-135M-Instruct (sampling: temperature 1, top-k 10):

- ``best-of-4``: four full generations of ``--new-tokens`` tokens in one batch; the one whose MiniLM cosine to
  the topic sentence is highest is kept (an oracle choice: it is picked with the very metric it is scored on).
  Cost: the tokens of all four and the batch's seconds.
- ``plan``: :func:`narrative_gravity.plan.plan_then_write`: four outline drafts of at most ``--outline-tokens``
  tokens in one batch, the best by fit and coherence kept, then one generation of ``--new-tokens`` tokens with
  the outline in the prompt and the staged field pulling toward the current section. Cost: drafts + text.
- ``plan, fields only``: the same plan, but the outline is not written into the prompt: only the staged
  field carries it (SmolLM2-135M's outlines are often poor, and in the prompt they can lead the text away).
- ``plan, semantic`` (``--semantic``): fields only, with every stage also keeping the semantic field
  (MiniLM neighbours) of the prompt's topic words under its own (``plan_then_write(semantic=True)``).
- ``plan, K openings`` (``--openings K``): fields only, with ``--opening-drafts`` outline drafts, and the text
  written from the best of K sampled openings of ``--opening-tokens`` tokens (closest to the prompt), so that
  drafts, openings and text together stay within half of best-of-4's tokens.
- ``plan, no pull`` (``--ablation``): the same with strength 0 (only the outline in the prompt), to separate
  the two effects.
- ``best-of-k`` for k = 1..4 from the same four samples (the mean over all k-subsets of the best relevance), to
  read the cost at which sampling more reaches the plan's relevance.

Relevance: MiniLM cosine of the final text to the topic sentence. Intervals: percentile bootstrap over prompts
and seeds (paired for differences).

Run::

    python bench/plan_pruning.py --seeds 1 --new-tokens 128 --outline-tokens 32 --json bench/plan_pruning.json
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from typing import Any

import numpy as np

from common import machine, write_json
from narrative_gravity.metrics import mean_ci

TOPICS = [
    ("Write a short article about the history of the telescope.", "the history of the telescope and astronomy"),
    ("Write a short article about how bees make honey.", "bees, hives and making honey"),
    ("Write a short article about the causes of volcanic eruptions.", "volcanoes, magma and eruptions"),
    ("Write a short article about training for a marathon.", "running and training for a marathon"),
    ("Write a short article about how vaccines work.", "vaccines, the immune system and antibodies"),
    ("Write a short article about the invention of the printing press.", "the printing press, books and printing"),
    ("Write a short article about coral reefs.", "coral reefs, the ocean and marine life"),
    ("Write a short article about saving money on a small budget.", "saving money, budgets and personal finance"),
]


def _rel(enc: Any, texts: list[str], topic: str) -> list[float]:
    e = enc([topic, *texts]).numpy()
    return [float(x) for x in e[1:] @ e[0]]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--topics", type=int, default=len(TOPICS))
    ap.add_argument("--first-topic", type=int, default=0, help="start at this topic (0-7)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--outline-tokens", type=int, default=32)
    ap.add_argument("--strength", type=float, default=3.0)
    ap.add_argument("--ablation", action="store_true", help="also run plan-then-write with strength 0")
    ap.add_argument("--semantic", action="store_true", help="also run fields only with the semantic base field")
    ap.add_argument("--semantic-strength", type=float, default=None, help="strength of that arm (default --strength)")
    ap.add_argument("--openings", type=int, default=0, help="also run fields only from the best of K openings")
    ap.add_argument("--opening-tokens", type=int, default=24)
    ap.add_argument("--opening-drafts", type=int, default=3, help="outline drafts for the openings arm")
    ap.add_argument("--no-outline-arm", action="store_true", help="skip the arm with the outline in the prompt")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import torch

    from narrative_gravity.embeddings import encode
    from narrative_gravity.generation import SamplingOptions, generate
    from narrative_gravity.models import load_model
    from narrative_gravity.plan import plan_then_write

    model, tok = load_model()
    rows: list[dict[str, Any]] = []
    for (prompt, topic), seed in itertools.product(
        TOPICS[args.first_topic : args.first_topic + args.topics], range(args.seeds)
    ):
        opts = SamplingOptions(max_new_tokens=args.new_tokens, top_k=10, temperature=1.0, seed=seed)
        t0 = time.perf_counter()
        samples = generate(model, tok, [prompt] * 4, options=opts, batch_size=4)
        best_s = time.perf_counter() - t0
        rel = _rel(encode, [s.text for s in samples], topic)
        row: dict[str, Any] = {
            "prompt": prompt,
            "seed": seed,
            "samples_relevance": rel,
            "best4": {"relevance": max(rel), "tokens": sum(s.new_tokens for s in samples), "seconds": best_s},
            "best_k": {k: float(np.mean([max(c) for c in itertools.combinations(rel, k)])) for k in range(1, 5)},
            "sample_tokens": statistics.mean(s.new_tokens for s in samples),
        }
        arms = [] if args.no_outline_arm else [("plan", args.strength, True, False, 1)]
        arms += [("plan, fields only", args.strength, False, False, 1)]
        if args.semantic:
            arms += [("plan, semantic", args.semantic_strength or args.strength, False, True, 1)]
        if args.openings > 1:
            arms += [(f"plan, {args.openings} openings", args.strength, False, False, args.openings)]
        arms += [("plan, no pull", 0.0, True, False, 1)] if args.ablation else []
        for name, strength, in_prompt, semantic, openings in arms:
            res = plan_then_write(
                model,
                tok,
                prompt,
                n_drafts=4 if openings == 1 else args.opening_drafts,
                outline_tokens=args.outline_tokens,
                max_new_tokens=args.new_tokens,
                strength=strength,
                seed=seed,
                encoder=encode,
                include_outline=in_prompt,
                semantic=semantic,
                openings=openings,
                opening_tokens=args.opening_tokens,
            )
            row[name] = {
                "relevance": _rel(encode, [res.text], topic)[0],
                "tokens": res.generated_tokens,
                "draft_tokens": res.draft_tokens,
                "seconds": res.seconds,
                "outline": res.outline.sections if res.outline else [],
                "text": res.text,
            }
        row["best4_text"] = samples[int(np.argmax(rel))].text
        rows.append(row)
        plans = [a[0] for a in arms]
        print(
            f"{prompt[:50]:50s} best4 {row['best4']['relevance']:.3f} ({row['best4']['tokens']} tok) "
            + " ".join(f"{n} {row[n]['relevance']:.3f} ({row[n]['tokens']} tok)" for n in plans),
            flush=True,
        )

    names = ["best4", *plans]
    summary: dict[str, Any] = {}
    print("\n| method | topic relevance [95% CI] | generated tokens (mean) | seconds (mean) |")
    print("|---|---|---|---|")
    for k in range(1, 5):
        vals = [r["best_k"][k] for r in rows]
        m, lo, hi = mean_ci(vals)
        toks = k * statistics.mean(r["sample_tokens"] for r in rows)
        summary[f"best-of-{k}"] = {"relevance": (m, lo, hi), "tokens": toks}
        if k < 4:
            print(f"| best-of-{k} (from the 4 samples) | {m:.3f} [{lo:.3f}, {hi:.3f}] | {toks:.0f} | |")
    for name in names:
        m, lo, hi = mean_ci([r[name]["relevance"] for r in rows])
        toks = statistics.mean(r[name]["tokens"] for r in rows)
        secs = statistics.mean(r[name]["seconds"] for r in rows)
        summary[name] = {"relevance": (m, lo, hi), "tokens": toks, "seconds": secs}
        print(f"| {name} | {m:.3f} [{lo:.3f}, {hi:.3f}] | {toks:.0f} | {secs:.2f} |")
    diffs = {n: mean_ci([r[n]["relevance"] - r["best4"]["relevance"] for r in rows]) for n in plans}
    ratios = {n: summary[n]["tokens"] / summary["best4"]["tokens"] for n in plans}
    for n in plans:
        d = diffs[n]
        target = summary[n]["relevance"][0]
        k = next((k for k in range(1, 5) if summary[f"best-of-{k}"]["relevance"][0] >= target), None)
        print(
            f"{n} - best4 relevance: {d[0]:+.3f} [{d[1]:+.3f}, {d[2]:+.3f}]; tokens / best4 tokens: {ratios[n]:.2f}; "
            f"seconds ratio {summary[n]['seconds'] / summary['best4']['seconds']:.2f}; smallest best-of-k reaching "
            "its mean relevance: " + (f"k={k}" if k else "none of k<=4")
        )
    result = {
        "args": vars(args),
        "machine": machine(torch.get_num_threads()),
        "summary": summary,
        "minus_best4": diffs,
        "token_ratio": ratios,
        "rows": rows,
    }
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
