"""The field of a sentence's contrast: the words a topic sentence makes the model itself more likely to write.

Classifier-free guidance amplifies ``log p(v | sentence, x) − log p(v | x)`` with a second forward pass at every
step. This field reads that contrast once, when a profile is built, and pulls toward it at no cost per step:

1. a few neutral requests (:data:`CONTRAST_REQUESTS`; in plain continuation, :data:`CONTRAST_STARTS`) are answered
   with the sentence read first: ``positions`` tokens each, sampled (top-k 10) with a fixed seed;
2. the answers are read again without the sentence (one forward pass each);
3. the contrast is averaged over positions and requests, and its ``top`` best whole-word tokens (a letter, a
   leading space) become the field, valued from 1 (the largest contrast) down to ``min_value``.

Where the MiniLM field reads the topic's words, this one reads what the sentence does to the model: for "Write
about law, trial and verdict." it names courtroom, jurors, litigation, attorney (bench/chat/contrast_probe.py).
It needs the generator itself (``model``): the transformers model one generates with, or on vLLM a CPU copy of
the served checkpoint (:func:`narrative_gravity.engines.vllm.checkpoint_model`).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any

import torch

from ..errors import ConfigurationError, FieldError
from ..gravity.field import NarrativeField
from ..text import chat_ids, lead_messages, lead_text
from .semantic import vocab_of

__all__ = ["CONTRAST_REQUESTS", "CONTRAST_STARTS", "build_contrast_field", "sentence_contrast"]

CONTRAST_REQUESTS = (
    "Say something.",
    "Write a few sentences.",
    "What is on your mind?",
    "Write a paragraph.",
    "Tell me something.",
    "Share a thought.",
    "Write anything you like.",
    "Give me a short text.",
)
"""Chat requests the contrast is read over: open, and naming no topic (none of them is a benchmark request)."""

CONTRAST_STARTS = ("The", "It", "In", "When", "There", "One", "This", "After")
"""Openings the contrast is read over in plain continuation."""


def _contexts(tokenizer: Any, sentence: str, *, raw: bool) -> list[tuple[list[int], list[int]]]:
    """``(with the sentence, without it)`` token ids for every request."""
    if raw:
        pairs = [(lead_text(s, sentence), s) for s in CONTRAST_STARTS]
        return [(list(tokenizer(a)["input_ids"]), list(tokenizer(b)["input_ids"])) for a, b in pairs]
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigurationError(
            "a contrast field in chat reads the sentence as a system message, but this tokenizer has no chat "
            "template; set field.contrast.raw to true for plain continuation"
        )
    out = []
    for request in CONTRAST_REQUESTS:
        user = [{"role": "user", "content": request}]
        out.append((chat_ids(tokenizer, lead_messages(user, sentence)), chat_ids(tokenizer, user)))
    return out


# Most recently used last: (model id, tokenizer id, sentence, raw, positions) -> (model ref, tokenizer, contrast)
_CACHE: OrderedDict[tuple[int, int, str, bool, int], tuple[Any, Any, torch.Tensor]] = OrderedDict()
CACHE_SIZE = 256


def sentence_contrast(model: Any, tokenizer: Any, sentence: str, *, raw: bool, positions: int = 24) -> torch.Tensor:
    """``log p(v | sentence, x) − log p(v | x)`` averaged over ``positions`` answer tokens of every request, ``[V]``.

    The answers are sampled with the sentence read (top-k 10, seed 0, under a forked RNG: the caller's random
    state is untouched); an answer that ends early is read up to its end-of-sequence token. Each contrast is
    read once per model, tokenizer and sentence, and kept in memory (fields of other sizes share it).
    """
    if positions < 1:
        raise ConfigurationError(f"`positions` has to be at least 1, but is {positions!r}")
    key = (id(model), id(tokenizer), sentence, raw, positions)
    hit = _CACHE.get(key)
    if hit is not None and hit[0]() is model and hit[1] is tokenizer:
        _CACHE.move_to_end(key)
        return hit[2]
    contrast = _read_contrast(model, tokenizer, sentence, raw=raw, positions=positions)
    _CACHE[key] = (weakref.ref(model), tokenizer, contrast)  # weakly: the cache must not keep a model alive
    while len(_CACHE) > CACHE_SIZE:
        _CACHE.popitem(last=False)
    return contrast


@torch.no_grad()
def _read_contrast(model: Any, tokenizer: Any, sentence: str, *, raw: bool, positions: int) -> torch.Tensor:
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos]) | {tokenizer.eos_token_id}
    pairs = _contexts(tokenizer, sentence, raw=raw)
    width = max(len(a) for a, _ in pairs)
    ids = torch.tensor([[pad] * (width - len(a)) + a for a, _ in pairs], device=device)
    mask = torch.tensor([[0] * (width - len(a)) + [1] * len(a) for a, _ in pairs], device=device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=positions,
            do_sample=True,
            top_k=10,
            top_p=1.0,
            temperature=1.0,
            pad_token_id=pad,
        )
    total = torch.zeros(model.config.vocab_size, dtype=torch.float64, device=device)
    for (ask, plain), row in zip(pairs, out[:, width:].tolist(), strict=True):
        answer = row[: next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))]  # up to its end
        logp = []
        for ctx in (ask, plain):
            seq = torch.tensor([ctx + answer], device=device)
            logits = model(seq).logits[0, len(ctx) - 1 : -1].float()
            logp.append(torch.log_softmax(logits, dim=-1)[:, : total.shape[0]])
        total += (logp[0] - logp[1]).mean(dim=0).double()
    return (total / len(pairs)).float().cpu()


def build_contrast_field(
    model: Any,
    tokenizer: Any,
    sentence: str,
    *,
    raw: bool,
    top: int = 100,
    positions: int = 24,
    min_value: float = 0.2,
    name: str = "contrast",
) -> NarrativeField:
    """The field of ``sentence``'s contrast (see the module doc): its ``top`` best whole-word tokens."""
    if model is None:
        raise ConfigurationError(
            "field.contrast reads the generator itself; pass model= (the transformers model you generate with; "
            "on vLLM, narrative_gravity.engines.vllm.checkpoint_model(folder)), or leave field.contrast out"
        )
    if not sentence.strip():
        raise FieldError("the contrast sentence is blank; give the sentence the model reads")
    contrast = sentence_contrast(model, tokenizer, sentence, raw=raw, positions=positions)
    vocab = vocab_of(tokenizer, contrast.shape[0])
    words = vocab.valid & (vocab.spaced if bool(vocab.spaced.any()) else vocab.valid)
    scores = torch.where(words & (contrast > 0), contrast, torch.tensor(float("-inf")))
    k = min(top, int(torch.isfinite(scores).sum()))
    values = torch.zeros(contrast.shape[0])
    if k == 0:
        return NarrativeField(values=values, name=name)
    best, idx = torch.topk(scores, k)
    low, high = float(best[-1]), float(best[0])
    span = high - low if high > low else 1.0
    values[idx] = min_value + (1.0 - min_value) * (best - low) / span
    return NarrativeField(values=values, name=name)
