"""Decode speed of the shortlist head (``prune: {head: {shortlist: N}}``) against the full head, on the CPU.

Arms, on the same prompts, seeds and batch sizes, with the topic default's pull (``profiles/topic.yaml``, plain
continuation, its topic sentence read first, top-k 10, temperature 1):

- ``full``: the model's whole output head;
- ``shortlist``: the same profile with ``prune: {head: {shortlist: N}}`` (the packaged frequency list); ``N`` is
  ``--shortlist``, by default the size chosen for the model on the topic benchmark's tuning split (65536 for
  Gemma 3 270M, 32768 otherwise).

Every generation writes exactly ``--new-tokens`` tokens (``min_new_tokens``), so both arms do the same number of
steps. ``--rounds`` rounds; in each, every (batch size, arm) pair runs once in an order shuffled per round with a
fixed seed, so machine noise hits both arms alike. Reported per batch size: each arm's median tokens/s and the
median of the per-round paired ratios (``speedup``: shortlist tokens/s over full-head tokens/s). The time is the
whole ``generate`` call (prefill of a short prompt included).

With ``--audit`` one extra shortlist generation per batch size runs the full head beside it on every step and
records the probability mass outside the shortlist (mean and 99th percentile), untimed.

Run (docs/shortlist.md has the results)::

    python bench/shortlist.py --model gemma3-270m --rounds 3 --new-tokens 128 --batch-sizes 1 8 \\
        --json bench/results/shortlist-gemma3-64k.json
    python bench/shortlist.py --model smollm2 --rounds 3 --new-tokens 128 --batch-sizes 1 8 \\
        --json bench/results/shortlist-smollm2.json

On a shared machine ``--threads 1`` (the default) keeps the timings proportional.
"""

from __future__ import annotations

import argparse
import datetime as dt
import random
import statistics
import sys
import time
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from common import REPO, machine, write_json

PROMPTS = [
    "The old house at the end of the street",
    "Yesterday the committee announced",
    "She opened the letter and",
    "In the morning the village",
    "The best way to begin is",
    "After the storm passed, we",
    "According to the report,",
    "He looked at the map and",
]


def _run(model: Any, tok: Any, profile: Any, batch: int, new_tokens: int, seed: int, audit: bool = False) -> Any:
    from narrative_gravity.engines.hf import processor_from_profile
    from narrative_gravity.engines.hf_generate import profile_head_plan
    from narrative_gravity.engines.prompts import encode_prompts, left_pad
    from narrative_gravity.engines.shortlist import HeadPlan, shortlist_head
    from narrative_gravity.lead import lead_sentence, reading_profile

    lead = lead_sentence(profile, raw=True)
    pull = reading_profile(profile, raw=True)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    ids, mask = left_pad(encode_prompts(tok, prompts, raw=True, lead=lead), tok.pad_token_id or tok.eos_token_id)
    proc = processor_from_profile(pull, tok, max_new_tokens=new_tokens, model=model, inplace=True)
    head = profile_head_plan(model, tok, pull)
    if head is not None and audit:
        head = HeadPlan(frequent=head.frequent, extra=head.extra, audit=1.0)
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.inference_mode(), shortlist_head(model, head) as short:
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            logits_processor=[proc],
            do_sample=True,
            top_k=10,
            temperature=1.0,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=tok.pad_token_id or tok.eos_token_id,
        )
    seconds = time.perf_counter() - t0
    cuts = [c for row in short.cut_masses([new_tokens] * batch) for c in row] if (short is not None and audit) else []
    return batch * new_tokens / seconds, (None if head is None else head.size), cuts


CHOSEN_SIZE = {"gemma3-270m": 65536, "smollm2": 32768}
"""The shortlist size chosen per packaged model on the topic benchmark's tuning split (the smallest that meets every
quality bound); other models get 32768."""


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument(
        "--shortlist", type=int, default=None, help="prune.head.shortlist (default: the size chosen for the model)"
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--audit", action="store_true", help="also measure the mass outside the shortlist (untimed)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.shortlist is None:  # chosen on the topic benchmark's tuning split (docs/benchmarks.md)
        args.shortlist = CHOSEN_SIZE.get(args.model, 32768)

    from narrative_gravity.models import load_model
    from narrative_gravity.profiles.schema import load_profile

    torch.set_num_threads(args.threads)
    console = Console()
    model, tok = load_model(args.model)
    base = load_profile(REPO / "profiles" / "topic.yaml")
    short = {**base.model_dump(exclude_none=True), "prune": {"head": {"shortlist": args.shortlist}}}
    arms = {"full": base, "shortlist": type(base).from_mapping(short)}
    # warm-up: build the field, gather the frequent rows, touch every weight once
    for arm in arms.values():
        _run(model, tok, arm, 1, 4, 0)
    tps: dict[int, dict[str, list[float]]] = {b: {a: [] for a in arms} for b in args.batch_sizes}
    sizes: dict[int, int | None] = {}
    order = [(b, a) for b in args.batch_sizes for a in arms]
    rng = random.Random(0)
    for r in range(args.rounds):
        rng.shuffle(order)
        for b, a in order:
            speed, size, _ = _run(model, tok, arms[a], b, args.new_tokens, seed=r)
            tps[b][a].append(speed)
            if a == "shortlist":
                sizes[b] = size
            console.print(f"round {r + 1}/{args.rounds} · batch {b} · {a}: {speed:.1f} tok/s", highlight=False)
    results: dict[str, Any] = {}
    table = Table(title=f"{args.model}: shortlist {args.shortlist} vs full head, {args.new_tokens} new tokens")
    for col in ("batch", "full tok/s", "shortlist tok/s", "speedup (paired median)", "rows computed"):
        table.add_column(col)
    for b in args.batch_sizes:
        ratios = [s / f for s, f in zip(tps[b]["shortlist"], tps[b]["full"])]
        results[str(b)] = {
            "speedup": round(statistics.median(ratios), 3),
            "ratios": [round(x, 3) for x in ratios],
            "full_tok_s": round(statistics.median(tps[b]["full"]), 2),
            "shortlist_tok_s": round(statistics.median(tps[b]["shortlist"]), 2),
            "rows_computed": sizes.get(b),
        }
        if args.audit:
            _, _, cuts = _run(model, tok, arms["shortlist"], b, args.new_tokens, seed=0, audit=True)
            cuts.sort()
            results[str(b)]["cut_mass_mean"] = round(statistics.fmean(cuts), 6)
            results[str(b)]["cut_mass_p99"] = round(cuts[min(len(cuts) - 1, int(0.99 * len(cuts)))], 6)
        row = results[str(b)]
        table.add_row(str(b), f"{row['full_tok_s']:.1f}", f"{row['shortlist_tok_s']:.1f}", f"{row['speedup']:.2f}×",
                      str(row["rows_computed"]))  # fmt: skip
    console.print(table)
    out = {
        "benchmark": "shortlist",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": "python bench/shortlist.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "model": args.model,
        "vocab_size": int(model.get_output_embeddings().weight.shape[0]),
        "hidden_size": int(model.get_output_embeddings().weight.shape[1]),
        "shortlist": args.shortlist,
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "profile": "profiles/topic.yaml (raw continuation, its topic sentence read first), top-k 10, temperature 1",
        "machine": machine(args.threads),
        "results": results,
    }
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
