"""Ranking a few retrieved chunks: BM25 over their terms, average-linkage clustering of their embeddings, and a
hashing encoder that needs no model (for tests, and machines without MiniLM).

BM25 is written here (about 20 lines of numpy) instead of depending on ``rank-bm25``: the candidate set is
small, we need the term statistics of exactly these chunks, and ``rank-bm25``'s Okapi variant floors negative
IDF with an epsilon heuristic; here IDF is Lucene's ``log(1 + (N - df + 0.5) / (df + 0.5))``, always positive.

>>> bm = BM25([["orbit", "planet"], ["recip", "bak"], ["planet"]])
>>> [round(float(s), 3) for s in bm.scores(["planet"])]  # idf = ln(1.6); doc lengths 2, 2, 1
[0.431, 0.0, 0.573]
>>> cluster_embeddings(np.array([[1.0, 0.0], [0.99, 0.141], [0.0, 1.0]]), threshold=0.5).tolist()
[0, 0, 1]
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..errors import ConfigurationError
from ..text import content_words, stem

__all__ = ["BM25", "Encoder", "cluster_embeddings", "hashing_encoder", "terms"]

Encoder = Callable[[Sequence[str]], Any]
"""``texts -> [n, d]`` embeddings (unit rows)."""


def terms(text: str) -> list[str]:
    """The stemmed content words of ``text``."""
    return [stem(w) for w in content_words(text)]


class BM25:
    """Okapi BM25 over a small set of tokenized documents (dense numpy term-frequency matrix).

    Args:
        docs: each document as a list of terms (e.g. stemmed content words).
        k1: term-frequency saturation; ``b``: length normalization.
    """

    def __init__(self, docs: Sequence[Sequence[str]], *, k1: float = 1.5, b: float = 0.75) -> None:
        if k1 < 0 or not 0 <= b <= 1:
            raise ConfigurationError(f"BM25 needs k1 >= 0 and 0 <= b <= 1, got k1={k1!r}, b={b!r}")
        vocab: dict[str, int] = {}
        for doc in docs:
            for t in doc:
                vocab.setdefault(t, len(vocab))
        self.vocab = vocab
        tf = np.zeros((len(docs), max(1, len(vocab))), dtype=np.float64)
        for i, doc in enumerate(docs):
            for t, c in Counter(doc).items():
                tf[i, vocab[t]] = c
        n = len(docs)
        df = (tf > 0).sum(axis=0)
        self.idf = np.log1p((n - df + 0.5) / (df + 0.5))
        lengths = tf.sum(axis=1)
        avg = lengths.mean() if n and lengths.mean() > 0 else 1.0
        norm = k1 * (1.0 - b + b * lengths / avg)
        self._weights = tf * (k1 + 1.0) / (tf + norm[:, None] + 1e-12)  # [N, T], 0 where tf == 0

    def scores(self, query: Sequence[str]) -> np.ndarray:
        """BM25 score of every document for ``query`` (a list of terms; repeated terms count again)."""
        out = np.zeros(self._weights.shape[0])
        for t, c in Counter(query).items():
            j = self.vocab.get(t)
            if j is not None:
                out += c * self.idf[j] * self._weights[:, j]
        return out


def cluster_embeddings(emb: np.ndarray, threshold: float) -> np.ndarray:
    """Average-linkage agglomerative clustering of unit rows: merge while two clusters' mean cosine is at
    least ``threshold``. Returns labels ``0..k-1`` numbered in order of first appearance."""
    n = emb.shape[0]
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    sim = (emb @ emb.T).astype(np.float64)
    np.fill_diagonal(sim, -np.inf)
    sizes = np.ones(n)
    labels = np.arange(n)
    for _ in range(n - 1):
        flat = int(np.argmax(sim))
        i, j = divmod(flat, n)
        if sim[i, j] < threshold:
            break
        merged = (sizes[i] * sim[i] + sizes[j] * sim[j]) / (sizes[i] + sizes[j])  # Lance-Williams, average
        sim[i, :] = merged
        sim[:, i] = merged
        sim[j, :] = -np.inf
        sim[:, j] = -np.inf
        sim[i, i] = -np.inf
        sizes[i] += sizes[j]
        labels[labels == j] = i
    _, first = np.unique(labels, return_index=True)
    order = {int(labels[f]): k for k, f in enumerate(sorted(first))}
    return np.array([order[int(x)] for x in labels], dtype=np.int64)


def hashing_encoder(dim: int = 512) -> Encoder:
    """A tiny deterministic encoder (hashed bag of stemmed content words, L2-normalized), for tests and for
    machines without MiniLM. It sees word overlap only, not meaning.

    >>> enc = hashing_encoder(64)
    >>> e = enc(["orbit of the planet", "planet orbits", "a cake recipe"])
    >>> bool(e[0] @ e[1] > 0.99), bool(abs(e[0] @ e[2]) < 1e-6)
    (True, True)
    """

    def encode(texts: Sequence[str]) -> np.ndarray:
        out = np.zeros((len(texts), dim), dtype=np.float32)
        for i, t in enumerate(texts):
            for term in terms(t):
                h = int.from_bytes(hashlib.blake2b(term.encode(), digest_size=8).digest(), "little")
                out[i, h % dim] += 1.0 if (h >> 32) & 1 else -1.0
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        return out / np.where(norms > 0, norms, 1.0)

    return encode
