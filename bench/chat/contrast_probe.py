"""Which field points at a topic's held-out words: the MiniLM field, or the system message's own effect?

The contrast of a system message is what classifier-free guidance amplifies: ``log p(v | ask) − log p(v | plain)``.
CFG pays a second forward pass for it at every step. This probe measures whether the contrast, computed once
over the first ``--positions`` tokens of an answer (one extra forward pass over them, without the system
message), names the topic's held-out words as well as the field does, before anything is built on it.

For each topic of a chat tuning set and each of its first ``--requests`` requests: the answer's first tokens
are sampled with the ``ask`` system message (top-k 10, seed 0), then read under both contexts; the contrast is
averaged over positions and requests. Both candidates are ranked over whole-word tokens (a leading space); the
score is how many of the ``--top`` first are held-out words, and how many are conditioning words.

Usage::

    python bench/chat/contrast_probe.py --prompts chat-topics-tune --json bench/results/chat_contrast_probe.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from narrative_gravity.engines.prompts import chat_ids
from narrative_gravity.eval.chat import load_chat
from narrative_gravity.fields.semantic import vocab_of
from narrative_gravity.lead import lead_sentence
from narrative_gravity.models import load_model
from narrative_gravity.profiles.build import field_from_profile
from narrative_gravity.profiles.schema import Profile


@torch.no_grad()
def contrast(model: Any, tok: Any, sentence: str, requests: list[str], positions: int) -> torch.Tensor:
    """``log p(v | ask) − log p(v | plain)`` over the first ``positions`` answer tokens, averaged ``[V]``."""
    total = torch.zeros(model.config.vocab_size)
    for request in requests:
        ask = torch.tensor(
            chat_ids(tok, [{"role": "system", "content": sentence}, {"role": "user", "content": request}])
        )
        plain = torch.tensor(chat_ids(tok, [{"role": "user", "content": request}]))
        torch.manual_seed(0)
        out = model.generate(ask[None], max_new_tokens=positions, do_sample=True, top_k=10)
        answer = out[0, ask.shape[0] :]
        logp = []
        for ctx in (ask, plain):
            logits = model(torch.cat([ctx, answer])[None]).logits[0, ctx.shape[0] - 1 : -1].float()
            logp.append(torch.log_softmax(logits, dim=-1))
        total += (logp[0] - logp[1]).mean(dim=0)
    return total / len(requests)


def top_words(scores: torch.Tensor, spaced: torch.Tensor, tok: Any, k: int) -> list[str]:
    """The ``k`` best-scored whole-word tokens, as lower-case words."""
    ranked = torch.where(spaced, scores, torch.tensor(float("-inf")))
    return [tok.decode([i]).strip().lower() for i in torch.topk(ranked, k).indices.tolist()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", default="chat-topics-tune", help="a chat tuning set (never a test set)")
    ap.add_argument("--requests", type=int, default=8, help="requests per topic")
    ap.add_argument("--positions", type=int, default=24, help="answer tokens the contrast is read over")
    ap.add_argument("--top", type=int, default=100, help="how many best-ranked tokens are scored")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if not args.prompts.endswith("-tune"):
        ap.error("probe the tuning splits only: choosing a field on the test words would leak them")
    model, tok = load_model()
    vocab = model.config.vocab_size
    spaced = vocab_of(tok, vocab).spaced  # whole words: tokens that start with a space
    topics: dict[str, list[Any]] = defaultdict(list)
    for p in load_chat(args.prompts):
        topics[p.topic_name].append(p)
    rows = []
    for name, prompts in topics.items():
        profile = Profile(core_semantics=list(prompts[0].topic_words))
        sentence = lead_sentence(profile, raw=False)
        held = {w.lower() for w in prompts[0].heldout_words}
        cond = {w.lower() for w in prompts[0].topic_words}
        requests = [p.text for p in prompts[: args.requests]]
        c = contrast(model, tok, sentence, requests, args.positions)
        field = field_from_profile(profile, tok).values[:vocab].float()
        row: dict[str, Any] = {"topic": name, "sentence": sentence}
        for label, scores in (("contrast", c), ("field", field)):
            words = set(top_words(scores, spaced, tok, args.top))
            row[f"{label}_heldout"] = len(words & held)
            row[f"{label}_conditioning"] = len(words & cond)
        row["contrast_top"] = top_words(c, spaced, tok, 15)
        rows.append(row)
        print(
            f"{name}: {sentence} contrast {row['contrast_heldout']} held-out / {row['contrast_conditioning']} "
            f"conditioning, field {row['field_heldout']} / {row['field_conditioning']}; contrast's first: "
            f"{', '.join(row['contrast_top'])}"
        )
    totals = {k: sum(r[k] for r in rows) for k in rows[0] if k.endswith(("_heldout", "_conditioning"))}
    print(f"of the top {args.top} whole-word tokens per topic, summed over {len(rows)} topics: {totals}")
    if args.json:
        args.json.write_text(
            json.dumps({"settings": vars(args) | {"json": str(args.json)}, "totals": totals, "topics": rows}, indent=1),
            encoding="utf-8",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
