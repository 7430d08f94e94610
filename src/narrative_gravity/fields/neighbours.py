"""Neighbour words: the whole English words nearest a topic, for a lexical field to pull.

A semantic field scores single tokens, so a topic word that the generator's tokenizer splits into several
pieces (`` sofa`` → `` so`` + ``fa``, ``revolver``, ``penitentiary``) cannot be pulled by it: only its first
piece can get a value, and that piece mostly stands for other words. Choosing whole *words* near the topic
and giving them to the lexical field (:func:`~narrative_gravity.fields.lexical.weighted_lexical_field`, which
pulls a word's first piece and then its continuation pieces) reaches them.

The candidates are the ``vocabulary`` most frequent English words of :mod:`wordfreq`, kept when lowercase,
alphabetic and at least three letters long. Each is embedded with all-MiniLM-L6-v2 (the encoder of
:mod:`~narrative_gravity.fields.semantic`); the matrix is computed once per word list and cached on disk.
The scores follow the ``minilm`` rule of the semantic field: embeddings centred on the candidates' mean and
normalized, the topic centre the normalized mean of the normalized topic vectors (the topic words, or the
one topic sentence), z-scores of the cosines over the candidates. The ``count`` best words, the topic's
own words and ``exclude`` left out, get weights linear in z from 1 (the nearest) down to ``min_value``.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import math
import os
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch
import wordfreq

from ..errors import FieldError
from . import cache as disk
from . import minilm, semantic

__all__ = ["neighbour_words"]

_CACHE_VERSION = 1
_WORD = re.compile(r"[a-z]{3,}")
_LETTERS = re.compile(r"[^\W\d_]+")


def neighbour_words(
    topic: Sequence[str] | str,
    *,
    count: int,
    vocabulary: int = 40000,
    exclude: Iterable[str] = (),
    min_value: float = 0.2,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
) -> dict[str, float]:
    """The ``count`` English words nearest ``topic``, each with a weight in ``[min_value, 1]`` (see the module doc).

    The result is ordered from the nearest word (weight 1) to the ``count``-th (weight ``min_value``) and
    can be passed as is to :func:`~narrative_gravity.fields.lexical.weighted_lexical_field`.

    Args:
        topic: topic words (``snake_case`` compounds are split, as for lexical fields) or one string
            describing the topic. Its words are never returned.
        count: how many words to return.
        vocabulary: how many of wordfreq's most frequent English words to draw the candidates from
            (before dropping non-words, words shorter than three letters and words with capitals).
        exclude: words never to return (compared case-insensitively).
        min_value: the weight of the ``count``-th word, in ``(0, 1]``.
        cache_dir: where to cache the word embeddings; defaults to the package cache directory.
        progress: show a progress bar while MiniLM embeds the word list (the first time only).

    Raises:
        FieldError: an argument is out of range, the topic is empty, or fewer than ``count`` candidates are
            left after the exclusions.
        ModelNotFoundError: the MiniLM package is not installed (the message has the install command).
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise FieldError(f"count must be an integer >= 1 (the number of words to return), got {count!r}")
    if isinstance(vocabulary, bool) or not isinstance(vocabulary, int) or vocabulary < count:
        raise FieldError(
            f"vocabulary must be an integer >= count ({count}), got {vocabulary!r}; the words are drawn from the "
            "`vocabulary` most frequent English words, so raise vocabulary (default 40000) or lower count"
        )
    ok = isinstance(min_value, (int, float)) and not isinstance(min_value, bool) and math.isfinite(min_value)
    if not ok or not 0 < min_value <= 1:
        raise FieldError(f"min_value must be a number in (0, 1] (the weight of the last word), got {min_value!r}")
    if isinstance(exclude, str):
        exclude = [exclude]
    words = semantic._topic_words(topic)
    texts = [topic] if isinstance(topic, str) else words

    candidates = _candidate_words(vocabulary)
    dropped = {w.casefold() for t in [*texts, *exclude] for w in _LETTERS.findall(str(t))}
    keep = torch.tensor([w not in dropped for w in candidates], dtype=torch.bool)
    available = int(keep.sum())
    if available < count:
        raise FieldError(
            f"only {available} candidate words are left from vocabulary={vocabulary} after dropping the topic's "
            f"words and exclude, fewer than count={count}; raise vocabulary or lower count"
        )

    cache = disk.resolve_semantic_cache(cache_dir)
    encode = minilm.encoder()
    emb = _word_matrix(candidates, encode, cache, progress)
    topic_vecs = encode(texts).float()
    z = semantic._zscores(emb, topic_vecs, torch.ones(len(candidates), dtype=torch.bool), center=True)
    z = torch.where(keep, z, torch.full_like(z, float("-inf")))
    top = torch.topk(z, count)
    lo, hi = float(top.values[-1]), float(top.values[0])
    scaled = torch.ones_like(top.values) if hi <= lo else (top.values - lo) / (hi - lo)
    weights = min_value + (1.0 - min_value) * scaled
    return {candidates[i]: float(x) for i, x in zip(top.indices.tolist(), weights.clamp(min_value, 1.0).tolist())}


# --------------------------------------------------------------------------------------------------
# internals


def _candidate_words(vocabulary: int) -> list[str]:
    """Lowercase alphabetic words of at least three letters among wordfreq's ``vocabulary`` most frequent."""

    return [w for w in wordfreq.top_n_list("en", vocabulary) if _WORD.fullmatch(w)]


def _minilm_version() -> str:
    """The MiniLM weights (file size) and the installed package's version: a new release is a new key."""
    try:
        version = importlib.metadata.version(minilm.MINILM_MODULE.replace("_", "-"))
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return f"{semantic._source_id('minilm', None)}:{version}"


def _word_matrix(words: list[str], encode: Callable[..., torch.Tensor], cache: Path, progress: bool) -> torch.Tensor:
    """MiniLM embeddings of ``words`` (``[n, 384]``), cached on disk per word list and MiniLM version."""
    digest = hashlib.sha256(json.dumps(words, ensure_ascii=False).encode()).hexdigest()
    key = f"words-v{_CACHE_VERSION}-{digest}-{_minilm_version()}"
    path = cache / "words" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.pt"
    stored = disk.load(path)
    emb = stored.get("emb") if stored is not None and stored.get("key") == key else None
    if isinstance(emb, torch.Tensor) and emb.dim() == 2 and emb.shape[0] == len(words):
        disk.touch(path)
        return emb.float()
    vecs = minilm.encode_with_progress(encode, words, f"{len(words)} words (once per word list)", progress)
    emb = vecs.to(torch.float16)
    disk.save(path, {"key": key, "emb": emb})
    return emb.float()
