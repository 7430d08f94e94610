"""Plan-then-write against best-of-4 full generations: cost (generated tokens, seconds) and topic relevance.

For every topic prompt and seed, on SmolLM2-135M-Instruct (sampling: temperature 1, top-k 10):

- ``best-of-4``: four full generations of ``--new-tokens`` tokens in one batch; the one whose MiniLM cosine to
  the topic sentence is highest is kept (an oracle choice: it is picked with the very metric it is scored on).
  Cost: the tokens of all four and the batch's seconds.
- ``best-of-4, picked by the prompt``: the same four samples, but the one kept is the one a deployed best-of-4
  could pick: the highest MiniLM cosine to the *prompt* (the topic sentence is the evaluation's, unseen). The
  plan's openings pick with the same scorer.
- ``plan``: :func:`narrative_gravity.levels.write.plan_then_write` with its defaults: ``--drafts`` (2) outline drafts
  of at most ``--outline-tokens`` (28) tokens in one batch, the best by fit and coherence kept; then
  ``--openings`` (3) openings of ``--opening-tokens`` (24) tokens sampled in one batch under the staged field,
  the one closest to the prompt kept and continued to ``--new-tokens`` tokens in all. The outline is written
  into the prompt, and the staged field pulls toward the current section (the semantic field of the prompt's
  topic words under every stage, the topic default's thermostat, repeat weight 0). Cost: drafts + every
  opening + the continuation.
- ``plan, fields only``: the same plan, but the outline is not written into the prompt: only the staged
  field carries it (SmolLM2-135M's outlines are often poor, and in the prompt they can lead the text away).
  This is ``plan_then_write``'s default.
- ``plan, one text`` (``--one-text-arm``): fields only, with four outline drafts and one text of
  ``--new-tokens`` tokens (no openings).
- ``plan, constant λ (earlier default)`` (``--constant-arm``): four drafts, one text, with the earlier pull:
  lexical stage fields alone, a constant λ = 3, repeat weight 1.
- ``plan, no pull`` (``--ablation``): the first arm with strength 0 (only the outline in the prompt), to
  separate the two effects.
- ``best-of-k`` for k = 1..4 from the same four samples (the mean over all k-subsets of the best relevance), to
  read the cost at which sampling more reaches the plan's relevance.

Relevance: MiniLM cosine of the final text to the topic sentence. Intervals: percentile bootstrap over prompts
and seeds (paired for differences). Fluency (unless ``--no-judge``): the median judge perplexity (Gemma 3 270M,
given the prompt) of each method's kept text, and of all four samples ("samples", i.e. plain decoding).

Topics 0-7 are the first set (``--topics 8``, the default); 8-15 were added later as a held-out set
(``--first-topic 8 --topics 8``).

Run::

    python bench/plan_pruning.py --first-topic 4 --topics 12 --seeds 3 --no-outline-arm --one-text-arm \
        --json bench/results/plan_pruning_heldout.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from typing import Any

import numpy as np

from common import machine, write_json
from narrative_gravity.eval.text_metrics import mean_ci

TOPICS = [
    ("Write a short article about the history of the telescope.", "the history of the telescope and astronomy"),
    ("Write a short article about how bees make honey.", "bees, hives and making honey"),
    ("Write a short article about the causes of volcanic eruptions.", "volcanoes, magma and eruptions"),
    ("Write a short article about training for a marathon.", "running and training for a marathon"),
    ("Write a short article about how vaccines work.", "vaccines, the immune system and antibodies"),
    ("Write a short article about the invention of the printing press.", "the printing press, books and printing"),
    ("Write a short article about coral reefs.", "coral reefs, the ocean and marine life"),
    ("Write a short article about saving money on a small budget.", "saving money, budgets and personal finance"),
    # 8-15: added after the repeat weight was chosen on topics 0-3, as a held-out set
    ("Write a short article about the life cycle of a butterfly.", "butterflies, caterpillars and metamorphosis"),
    ("Write a short article about how solar panels produce electricity.", "solar panels, sunlight and electricity"),
    ("Write a short article about the history of the Olympic Games.", "the Olympic Games, athletes and sport"),
    ("Write a short article about growing tomatoes in a home garden.", "gardening and growing tomatoes"),
    ("Write a short article about how earthquakes happen.", "earthquakes, faults and tectonic plates"),
    ("Write a short article about learning a second language.", "learning a foreign language"),
    ("Write a short article about how bread is baked.", "baking bread with flour, dough and yeast"),
    ("Write a short article about the migration of birds.", "bird migration and flight"),
]


def _rel(enc: Any, texts: list[str], topic: str) -> list[float]:
    e = enc([topic, *texts]).numpy()
    return [float(x) for x in e[1:] @ e[0]]


PICKED = "best4, picked by the prompt"
CONSTANT = "plan, constant λ (earlier default)"
LABELS = {PICKED: "best-of-4, picked by the prompt", "plan, fields only": "plan-then-write (the default)"}


def _judge(rows: list[dict[str, Any]], plans: list[str]) -> None:
    """Judge perplexity (Gemma 3 270M, given the prompt) of every text: best-of-4's pick, all four samples,
    each plan arm's text. A pull that stuffs topic words into broken prose shows here."""
    from narrative_gravity.eval.judge import load_judge

    judge = load_judge()
    ctx, texts, where = [], [], []
    for i, r in enumerate(rows):
        for name in ["best4", PICKED, *plans]:
            ctx.append(r["prompt"])
            texts.append(r[name]["text"])
            where.append((i, name))
        for j, t in enumerate(r["sample_texts"]):
            ctx.append(r["prompt"])
            texts.append(t)
            where.append((i, f"sample {j}"))
    for (i, name), ppl in zip(where, judge.perplexity(ctx, texts)):
        if name.startswith("sample"):
            rows[i].setdefault("samples_judge_ppl", []).append(ppl)
        else:
            rows[i][name]["judge_ppl"] = ppl


def _ppl_of(row: dict[str, Any], name: str) -> list[float]:
    vals = row["samples_judge_ppl"] if name == "samples" else [row[name]["judge_ppl"]]
    return [v for v in vals if v == v]  # NaN: an empty text


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--topics", type=int, default=8, help="how many topics (default 8: the first set)")
    ap.add_argument("--first-topic", type=int, default=0, help=f"start at this topic (0-{len(TOPICS) - 1})")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--outline-tokens", type=int, default=28)
    ap.add_argument("--strength", type=float, default=None, help="λ_max of the plan's pull (default 4.25)")
    ap.add_argument(
        "--constant-arm",
        action="store_true",
        help="also run the earlier default: lexical stages only, constant λ 3, repeat weight 1",
    )
    ap.add_argument("--ablation", action="store_true", help="also run plan-then-write with strength 0")
    ap.add_argument("--drafts", type=int, default=2, help="outline drafts of the plan")
    ap.add_argument("--openings", type=int, default=3, help="openings the plan picks from (1 = one text)")
    ap.add_argument("--opening-tokens", type=int, default=24)
    ap.add_argument("--one-text-arm", action="store_true", help="also run four drafts and one text")
    ap.add_argument("--no-outline-arm", action="store_true", help="skip the arm with the outline in the prompt")
    ap.add_argument("--no-judge", action="store_true", help="skip the judge perplexity (Gemma 3 270M)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="save relevance against generated tokens as a PNG")
    ap.add_argument("--replot", default=None, metavar="JSON", help="only draw --plot from a saved --json")
    args = ap.parse_args(argv)
    if args.replot:
        if not args.plot:
            ap.error("--replot needs --plot PATH")
        with open(args.replot, encoding="utf-8") as fh:
            saved = json.load(fh)
        plot(saved, args.plot)
        return saved
    if not 0 <= args.first_topic < len(TOPICS) or args.topics < 1:
        ap.error(f"--first-topic has to be in 0-{len(TOPICS) - 1} and --topics at least 1")

    import torch

    from narrative_gravity.embeddings import encode
    from narrative_gravity.engines.hf_generate import generate
    from narrative_gravity.engines.options import GenerationOptions
    from narrative_gravity.levels.write import PLAN_OPTIONS, PlanSettings, plan_then_write
    from narrative_gravity.models import load_model

    model, tok = load_model()
    rows: list[dict[str, Any]] = []
    for (prompt, topic), seed in itertools.product(
        TOPICS[args.first_topic : args.first_topic + args.topics], range(args.seeds)
    ):
        opts = GenerationOptions(max_new_tokens=args.new_tokens, top_k=10, temperature=1.0, seed=seed, batch_size=4)
        t0 = time.perf_counter()
        samples = generate(model, tok, [prompt] * 4, opts)
        best_s = time.perf_counter() - t0
        rel = _rel(encode, [s.text for s in samples], topic)
        fit = _rel(encode, [s.text for s in samples], prompt)  # what a deployed best-of-4 can see
        pick = int(np.argmax(fit))
        best4_tokens = sum(s.new_tokens for s in samples)
        row: dict[str, Any] = {
            "prompt": prompt,
            "seed": seed,
            "samples_relevance": rel,
            "best4": {
                "relevance": max(rel),
                "tokens": best4_tokens,
                "seconds": best_s,
                "text": samples[int(np.argmax(rel))].text,
            },
            PICKED: {"relevance": rel[pick], "tokens": best4_tokens, "seconds": best_s, "text": samples[pick].text},
            "best_k": {k: float(np.mean([max(c) for c in itertools.combinations(rel, k)])) for k in range(1, 5)},
            "sample_tokens": statistics.mean(s.new_tokens for s in samples),
        }
        common = {"outline_tokens": args.outline_tokens}
        options = PLAN_OPTIONS.replace(max_new_tokens=args.new_tokens, seed=seed)
        main_plan = {"n_drafts": args.drafts, "openings": args.openings, "opening_tokens": args.opening_tokens}
        one_text = {"n_drafts": 4, "openings": 1}
        arms: list[tuple[str, dict[str, Any]]] = []
        if not args.no_outline_arm:
            arms += [("plan", {**main_plan, "strength": args.strength, "include_outline": True})]
        arms += [("plan, fields only", {**main_plan, "strength": args.strength})]
        if args.one_text_arm:
            arms += [("plan, one text", {**one_text, "strength": args.strength})]
        if args.constant_arm:
            earlier = {"schedule": "constant", "strength": 3.0, "semantic": False, "repeat_weight": 1.0}
            arms += [(CONSTANT, {**one_text, **earlier})]
        if args.ablation:
            arms += [("plan, no pull", {**main_plan, "strength": 0.0, "include_outline": True})]
        for name, kwargs in arms:
            settings = PlanSettings(**common, **kwargs)
            res = plan_then_write(model, tok, prompt, settings=settings, options=options, encoder=encode)
            row[name] = {
                "relevance": _rel(encode, [res.text], topic)[0],
                "tokens": res.generated_tokens,
                "draft_tokens": res.draft_tokens,
                "seconds": res.seconds,
                "outline": res.outline.sections if res.outline else [],
                "text": res.text,
            }
        row["sample_texts"] = [s.text for s in samples]
        rows.append(row)
        plans = [name for name, _ in arms]
        print(
            f"{prompt[:50]:50s} best4 {row['best4']['relevance']:.3f} ({row['best4']['tokens']} tok) "
            + " ".join(f"{n} {row[n]['relevance']:.3f} ({row[n]['tokens']} tok)" for n in plans),
            flush=True,
        )

    names = ["best4", PICKED, *plans]
    if not args.no_judge:
        _judge(rows, plans)
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
    if not args.no_judge:
        print("\n| text | judge perplexity (median) | / best-of-4's |")
        print("|---|---|---|")
        ref = statistics.median(r["best4"]["judge_ppl"] for r in rows)
        for name in ["samples", *names]:
            med = statistics.median(x for r in rows for x in _ppl_of(r, name))
            summary.setdefault(name, {})["judge_ppl"] = med
            print(f"| {name} | {med:.2f} | {med / ref:.2f} |")
    diffs = {n: mean_ci([r[n]["relevance"] - r["best4"]["relevance"] for r in rows]) for n in plans}
    diffs_picked = {n: mean_ci([r[n]["relevance"] - r[PICKED]["relevance"] for r in rows]) for n in plans}
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
        d = diffs_picked[n]
        print(f"{n} - best4 picked by the prompt: {d[0]:+.3f} [{d[1]:+.3f}, {d[2]:+.3f}]")
    result = {
        "args": vars(args),
        "machine": machine(torch.get_num_threads()),
        "summary": summary,
        "minus_best4": diffs,
        "minus_best4_picked": diffs_picked,
        "token_ratio": ratios,
        "rows": rows,
    }
    write_json(args.json, result)
    if args.plot:
        plot(result, args.plot)
    return result


def plot(result: dict[str, Any], path: str) -> None:
    """Relevance against generated tokens: the oracle best-of-k curve, the best-of-4 a deployment can pick,
    and each plan arm, with their 95% intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = result["summary"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ks = [summary[f"best-of-{k}"] for k in range(1, 5)]
    ax.plot([x["tokens"] for x in ks], [x["relevance"][0] for x in ks], "o-", color="0.45", label="best-of-k (oracle)")
    for k, x in enumerate(ks, 1):
        ax.annotate(f"k={k}", (x["tokens"], x["relevance"][0]), textcoords="offset points", xytext=(4, -12))
    names = [n for n in summary if n == PICKED or n.startswith("plan")]
    for i, name in enumerate(names):
        m, lo, hi = summary[name]["relevance"]
        ax.errorbar(
            summary[name]["tokens"], m, yerr=[[m - lo], [hi - m]], fmt="s" if name == PICKED else "D",
            capsize=3, color=f"C{i}", label=LABELS.get(name, name),
        )  # fmt: skip
    half = summary["best4"]["tokens"] / 2
    ax.axvline(half, ls=":", color="0.6")
    ax.text(half, ax.get_ylim()[0], " half of best-of-4's tokens", va="bottom", fontsize=8, color="0.4")
    args = result["args"]
    n = len(result["rows"])
    ax.set(
        xlabel="generated tokens per prompt (drafts, openings and text)",
        ylabel="topic relevance (MiniLM cosine)",
        title=f"Plan-then-write vs best-of-k: topics {args['first_topic']}-"
        f"{args['first_topic'] + args['topics'] - 1}, {n} prompt-seed pairs",
    )
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
