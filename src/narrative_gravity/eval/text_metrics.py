"""Text and token metrics for comparing control against gravity.

>>> distinct_n(["the cat sat on the mat"], 1)
0.8333333333333334
>>> penalized_hits("A movie, then a Restaurant; movies too.", ["movie", "restaurant"])
2
>>> m, lo, hi = mean_ci([1.0, 1.0, 1.0])
>>> (m, lo, hi)
(1.0, 1.0, 1.0)
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from ..fields import NarrativeField
from ..text import ngrams

__all__ = ["distinct_n", "is_cjk", "mean_ci", "narrative_token_rate", "penalized_hits", "token_field_values"]


def token_field_values(field: NarrativeField, prompt_ids: Sequence[int], token_ids: Sequence[int]) -> torch.Tensor:
    """The field value each generated token had when it was chosen (continuations included), ``[N]``."""
    if not token_ids:
        return torch.zeros(0)
    seq = torch.tensor([*prompt_ids, *token_ids], dtype=torch.long)
    n, p = len(token_ids), len(prompt_ids)
    chosen = seq[p:]
    base = field.values[chosen.clamp(max=field.vocab_size - 1)]
    base = torch.where(chosen < field.vocab_size, base, torch.zeros_like(base))
    if not field.has_continuations:
        return base
    lp = field.max_prefix_len
    padded = torch.cat([torch.full((lp,), -2, dtype=torch.long), seq])
    # windows[i] = the lp tokens before generated token i
    windows = padded.unfold(0, lp, 1)[p : p + n]
    cont = field.continuation(windows)
    cont_vals = cont.gather(1, chosen.clamp(max=field.vocab_size - 1)[:, None]).squeeze(1)
    vals = base + torch.where(chosen < field.vocab_size, cont_vals, torch.zeros_like(cont_vals))
    return vals.clamp(-1.0, 1.0)


def narrative_token_rate(field: NarrativeField, prompt_ids: Sequence[int], token_ids: Sequence[int]) -> float:
    """Share of generated tokens whose field value was positive when chosen."""
    vals = token_field_values(field, prompt_ids, token_ids)
    return float((vals > 0).float().mean()) if vals.numel() else 0.0


def is_cjk(word: str) -> bool:
    """Whether ``word`` has wide (CJK) characters, which are matched without word boundaries.

    >>> is_cjk("二分查找"), is_cjk("binary")
    (True, False)
    """
    return any(unicodedata.east_asian_width(ch) in ("W", "F") for ch in word)


def penalized_hits(text: str, words: Iterable[str]) -> int:
    """Occurrences of the words in ``text``: case-insensitive whole words (substrings for CJK words)."""
    total = 0
    for w in words:
        w = w.strip()
        if not w:
            continue
        if is_cjk(w):
            total += text.count(w)
        else:
            total += len(re.findall(rf"(?<!\w){re.escape(w)}(?!\w)", text, flags=re.IGNORECASE))
    return total


def distinct_n(texts: Iterable[str], n: int) -> float:
    """Unique n-grams over all n-grams, pooled over ``texts``: n-grams of words, or of characters in scripts
    written without spaces (:func:`~narrative_gravity.text.units`).

    >>> round(distinct_n(["每一步都把范围减半，每一步都"], 2), 3)
    0.769
    """
    grams: list[tuple[str, ...]] = []
    for t in texts:
        grams.extend(ngrams(t, n))
    return len(set(grams)) / len(grams) if grams else 0.0


def mean_ci(
    values: Sequence[float], *, level: float = 0.95, n_boot: int = 2000, seed: int = 0
) -> tuple[float, float, float]:
    """Mean with a percentile-bootstrap interval (deterministic for a fixed ``seed``)."""
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        return float("nan"), float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    boots = x[rng.integers(0, x.size, size=(n_boot, x.size))].mean(axis=1)
    lo, hi = np.quantile(boots, [(1 - level) / 2, 1 - (1 - level) / 2])
    return float(x.mean()), float(lo), float(hi)
