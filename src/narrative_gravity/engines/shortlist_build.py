"""Build a frequency list for the shortlist head (``ngrav shortlist build``), the way VocabTrim builds its head:
count the tokens the model itself samples on a broad, varied prompt set.

The prompt set is made here, from templates of many kinds of text (stories, explanations, letters, recipes, news,
dialogue, lists, poems, reviews, questions) crossed with subjects from many fields, so no corpus is downloaded.
The model continues each prompt with plain sampling (temperature 1, no top-k); every sampled token counts once,
and the probability the model gave every token at every step is added beside it (the expected count, which also
ranks the tokens it seldom samples). Prompts go in as plain text and, where the tokenizer has one, through its chat
template (every other prompt).

>>> len(broad_prompts(50, seed=0)), len(set(broad_prompts(50, seed=0)))
(50, 50)
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from transformers import LogitsProcessor

from .hf_generate import sample_ids
from .options import GenerationOptions
from .prompts import encode_prompts, eos_token_ids, generated_length
from .shortlist import FrequencyList, tokenizer_fingerprint

__all__ = ["TEMPLATES", "FrequencyRun", "broad_prompts", "build_frequency_list"]

TEMPLATES = (
    "Once upon a time, {s}",
    "Write a short story about {s}.",
    "Explain to a child how {s} works.",
    "Here is a short explanation of {s}:",
    "Dear friend, I wanted to tell you about {s}.",
    "BREAKING NEWS: {s}",
    "The history of {s} begins",
    "Q: What should I know about {s}?\nA:",
    "A recipe inspired by {s}. Ingredients:",
    "Five facts about {s}:\n1.",
    "My review of {s}: ",
    "A poem about {s}\n\n",
    '"Have you heard about {s}?" she asked.',
    "In this lecture we will discuss {s}.",
    "The main problem with {s} is",
    "Today I learned something about {s}.",
    "How to get started with {s}, step by step:",
    "The report on {s} concludes that",
    "Customer support chat about {s}.\nCustomer:",
    "Why do people care about {s}?",
    "A travel diary: day one, {s}.",
    "The debate over {s} has",
    "Notes from a meeting about {s}:",
    "An advertisement for {s}!",
)
SUBJECTS = (
    "the ocean", "a small village", "black holes", "the stock market", "a lost dog", "baking bread", "the moon",
    "ancient Rome", "quantum computers", "football", "a new phone", "climate change", "the human heart", "jazz music",
    "a haunted house", "elections", "volcanoes", "learning to swim", "the internet", "a dragon", "coffee",
    "the French revolution", "a robot", "gardening", "vaccines", "mountain climbing", "taxes", "a wedding", "chess",
    "the desert", "electric cars", "a detective", "medieval castles", "photosynthesis", "a birthday party", "rain",
    "the library", "a pirate ship", "mathematics", "fashion", "a hospital", "a rainy city", "bees", "the army",
    "a painter", "video games", "friendship", "the kitchen", "a long train journey", "the law", "money", "winter",
    "a spaceship", "the brain", "a farm", "cooking rice", "a school", "the weather", "a king", "the river",
    "software bugs", "a concert", "yoga", "a football match", "the night sky", "a bakery", "a storm at sea",
)  # fmt: skip


def broad_prompts(n: int, *, seed: int = 0) -> list[str]:
    """``n`` different prompts, templates crossed with subjects in a seeded order."""
    pairs = [(t, s) for t in TEMPLATES for s in SUBJECTS]
    random.Random(seed).shuffle(pairs)
    if n > len(pairs):
        raise ValueError(f"asked for {n} prompts, but the set holds {len(pairs)}")
    return [t.format(s=s) for t, s in pairs[:n]]


class _Counter(LogitsProcessor):
    """Adds each step's softmax over the live rows to a running ``[V]`` sum (the expected counts); reads only."""

    def __init__(self, vocab: int, eos: set[int]) -> None:
        self.mass = torch.zeros(vocab, dtype=torch.float64)
        self.eos = torch.tensor(sorted(eos), dtype=torch.long)
        self.width: int | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.width is None or input_ids.shape[-1] <= self.width:
            self.width = input_ids.shape[-1]
        live = torch.ones(input_ids.shape[0], dtype=torch.bool)
        new = input_ids[:, self.width :].cpu()
        if new.numel() and self.eos.numel():
            live = ~torch.isin(new, self.eos).any(dim=-1)
        probs = scores.float().softmax(dim=-1)[live.to(scores.device)]
        self.mass[: probs.shape[-1]] += probs.sum(dim=0).double().cpu()
        return scores


@dataclass(frozen=True)
class FrequencyRun:
    """How a frequency list is sampled: ``new_tokens`` after each of ``prompts`` :func:`broad_prompts`, in
    batches of ``batch_size``, seeded with ``seed``; the ``keep`` best-ranked tokens are kept.

    >>> FrequencyRun(prompts=8).replace(seed=3)
    FrequencyRun(prompts=8, new_tokens=40, batch_size=16, keep=65536, seed=3)
    """

    prompts: int = 256
    new_tokens: int = 40
    batch_size: int = 16
    keep: int = 65536
    seed: int = 0

    def replace(self, **changes: int) -> FrequencyRun:
        return replace(self, **changes)


def build_frequency_list(
    model: Any,
    tokenizer: Any,
    *,
    model_name: str,
    run: FrequencyRun = FrequencyRun(),  # frozen: one shared default is safe
    progress: Callable[[int], None] | None = None,
) -> FrequencyList:
    """Sample ``run.new_tokens`` from ``model`` after each of ``run.prompts`` :func:`broad_prompts` and rank the
    tokens.

    The rank is the sampled count plus the expected count (both sum to the tokens generated), so the tokens the
    model samples most come first and the rest follow by the probability the model gave them. The ``run.keep``
    best are kept (at most the vocabulary).
    """
    prompts, new_tokens, batch_size, keep, seed = run.prompts, run.new_tokens, run.batch_size, run.keep, run.seed
    vocab = int(model.get_output_embeddings().weight.shape[0])
    eos = eos_token_ids(model, tokenizer)
    texts = broad_prompts(prompts, seed=seed)
    chat = bool(getattr(tokenizer, "chat_template", None))
    encoded = [
        encode_prompts(tokenizer, [t], raw=not (chat and i % 2))[0] for i, t in enumerate(texts)
    ]  # every other prompt through the chat template, where there is one
    opts = GenerationOptions(max_new_tokens=new_tokens, temperature=1.0, top_k=0, seed=seed, batch_size=batch_size)
    counts = np.zeros(vocab, dtype=np.int64)
    expected = torch.zeros(vocab, dtype=torch.float64)
    sampled = 0
    for start in range(0, len(encoded), batch_size):
        chunk = encoded[start : start + batch_size]
        counter = _Counter(vocab, eos)
        rows = sample_ids(model, tokenizer, chunk, opts.replace(seed=seed + start), [counter])
        for row in rows:
            toks = row[: generated_length(row, eos)]
            np.add.at(counts, np.asarray(toks, dtype=np.int64), 1)
            sampled += len(toks)
        expected += counter.mass
        if progress is not None:
            progress(len(chunk))
    score = counts + expected.numpy()
    order = np.lexsort((np.arange(vocab), -score))  # best first; ties by id
    kept = order[: min(keep, vocab)]
    return FrequencyList(
        ids=kept,
        vocab_size=vocab,
        fingerprint=tokenizer_fingerprint(tokenizer),
        model=model_name,
        counts=counts[kept],
        meta={
            "built_from": "the model's own samples (temperature 1, no top-k) after broad_prompts(): "
            f"{len(TEMPLATES)} kinds of text x {len(SUBJECTS)} subjects, seeded; every other prompt through the "
            "chat template where the tokenizer has one (narrative_gravity.engines.shortlist_build)",
            "ranked_by": "sampled count + expected count (the probability given to each token at every step)",
            "prompts": len(texts),
            "new_tokens": new_tokens,
            "sampled_tokens": int(sampled),
            "distinct_sampled": int((counts > 0).sum()),
            "seed": seed,
        },
    )
