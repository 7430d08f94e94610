"""Context-level pruning for RAG: keep the retrieved chunks that serve the question and its narrative.

Every chunk gets a score and a decision with a reason. The steps, in order:

1. **Score** each chunk against the question: a hybrid of lexical BM25 (implemented here with numpy, scaled
   by the best chunk's score) and the cosine similarity of MiniLM sentence embeddings,
   ``relevance = (1 - lexical_weight)·cos + lexical_weight·bm25/max(bm25)``. With a narrative (a profile or
   a sentence), ``relevance = (1 - narrative_weight)·relevance + narrative_weight·cos(chunk, narrative)``.
2. **Cluster** the chunks by embedding (average-linkage agglomerative clustering with a cosine threshold)
   and drop every cluster whose centroid lies far (more than ``cluster_margin`` of cosine) below the
   best cluster's similarity to the question and narrative: the "several topics pulling at once" case.
   The cluster that holds the best chunk is always kept.
3. **Select** with MMR (maximal marginal relevance): the next chunk maximizes
   ``mmr_lambda·relevance - (1 - mmr_lambda)·max cos(chunk, already kept)``; a chunk at or above
   ``duplicate_threshold`` cosine to a kept one is a near-duplicate, and a chunk that does not fit in what
   is left of ``budget_tokens`` (counted with the generator's tokenizer) is skipped.

Kept chunks are returned in their original order (:meth:`PruneResult.context`), so the prompt reads as
the retriever ordered it.

BM25, the clustering and a hashing encoder for tests are :mod:`.ranking`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from rich.markup import escape
from rich.table import Table

from ..embeddings import encode
from ..errors import ConfigurationError
from ..text import STOPWORDS, content_words, stem, words
from .ranking import BM25, Encoder, cluster_embeddings, terms

__all__ = [
    "STOPWORDS",
    "ChunkDecision",
    "PruneResult",
    "PruneSettings",
    "content_words",
    "count_tokens",
    "narrative_text",
    "prune_context",
    "result_table",
    "stem",
    "words",
]


def _default_encoder() -> Encoder:
    return encode


def _embed(encoder: Encoder, texts: Sequence[str]) -> np.ndarray:
    out = encoder(list(texts))
    arr = out.detach().cpu().numpy() if hasattr(out, "detach") else np.asarray(out)
    arr = arr.astype(np.float64)
    norms = np.linalg.norm(arr, axis=1, keepdims=True)
    return arr / np.where(norms > 0, norms, 1.0)


def count_tokens(texts: Sequence[str], tokenizer: Any = None) -> list[int]:
    """Tokens per text with the generator's tokenizer (no special tokens); whitespace words without one."""
    if not texts:
        return []
    if tokenizer is None:
        return [len(t.split()) for t in texts]
    return [len(ids) for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]


def narrative_text(profile: Any) -> str:
    """The sentence a profile's narrative is scored with: ``field.semantic_topic``, else the description,
    else the core words."""
    opts = getattr(profile, "field", None)
    topic = getattr(opts, "semantic_topic", None)
    if topic:
        return str(topic)
    if getattr(profile, "description", None):
        return str(profile.description)
    return " ".join(profile.keywords())


@dataclass(frozen=True)
class ChunkDecision:
    """What happened to one chunk. ``rank`` is the order it was picked in (kept chunks only)."""

    index: int
    id: str
    text: str
    tokens: int
    score: float
    lexical: float
    semantic: float
    narrative: float | None
    cluster: int
    kept: bool
    reason: str
    rank: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "id": self.id,
            "tokens": self.tokens,
            "score": round(self.score, 4),
            "lexical": round(self.lexical, 4),
            "semantic": round(self.semantic, 4),
            "narrative": None if self.narrative is None else round(self.narrative, 4),
            "cluster": self.cluster,
            "kept": self.kept,
            "reason": self.reason,
            "rank": self.rank,
        }


@dataclass(frozen=True)
class PruneResult:
    """Every chunk with its decision, in input order, and the token accounting."""

    question: str
    decisions: list[ChunkDecision]
    budget_tokens: int | None
    clusters: dict[int, float] = field(default_factory=dict)  # cluster -> centroid cosine to the target

    @property
    def kept(self) -> list[ChunkDecision]:
        return [d for d in self.decisions if d.kept]

    @property
    def dropped(self) -> list[ChunkDecision]:
        return [d for d in self.decisions if not d.kept]

    @property
    def tokens_total(self) -> int:
        return sum(d.tokens for d in self.decisions)

    @property
    def tokens_kept(self) -> int:
        return sum(d.tokens for d in self.kept)

    @property
    def tokens_saved(self) -> int:
        return self.tokens_total - self.tokens_kept

    @property
    def saved_fraction(self) -> float:
        return self.tokens_saved / self.tokens_total if self.tokens_total else 0.0

    def context(self, separator: str = "\n\n") -> str:
        """The kept chunks joined in their original order."""
        return separator.join(d.text for d in self.kept)

    def to_json(self) -> dict[str, Any]:
        return {
            "question": self.question,
            "budget_tokens": self.budget_tokens,
            "tokens_total": self.tokens_total,
            "tokens_kept": self.tokens_kept,
            "tokens_saved": self.tokens_saved,
            "chunks": [d.to_json() for d in self.decisions],
        }


def _check_unit(name: str, value: float, *, lo: float = 0.0, hi: float = 1.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigurationError(f"`{name}` has to be a number in [{lo}, {hi}], but is {value!r}")
    if not lo <= value <= hi:
        raise ConfigurationError(f"`{name}` has to be in [{lo}, {hi}], but is {value!r}")
    return float(value)


def _normalize_chunks(chunks: Sequence[str | Mapping[str, Any]]) -> tuple[list[str], list[str]]:
    if isinstance(chunks, (str, bytes)):
        raise ConfigurationError("`chunks` has to be a list of strings (or of {'text': ...} mappings), not one string")
    texts, ids = [], []
    for i, c in enumerate(chunks):
        if isinstance(c, str):
            text, cid = c, str(i)
        elif isinstance(c, Mapping) and isinstance(c.get("text"), str):
            text, cid = c["text"], str(c.get("id", i))
        else:
            raise ConfigurationError(
                f"chunk {i} has to be a string or a mapping with a string `text`, but is {type(c).__name__}"
            )
        texts.append(text)
        ids.append(cid)
    return texts, ids


@dataclass(frozen=True)
class PruneSettings:
    """How chunks are scored, clustered and selected (see the module doc); checked when made.

    Args:
        lexical_weight: share of BM25 in the question score; ``narrative_weight``: share of the narrative.
        cluster_threshold: average-linkage cosine at which chunks merge into one cluster.
        cluster_margin: a cluster is dropped when its centroid's cosine to the target is more than this below
            the best cluster's; ``1`` (or more) turns cluster pruning off.
        mmr_lambda: relevance against redundancy in MMR (1 = relevance only).
        duplicate_threshold: cosine to a kept chunk at or above which a chunk is a near-duplicate.
        min_score: drop chunks whose score is below this.

    >>> PruneSettings(mmr_lambda=1.5)
    Traceback (most recent call last):
    ...
    narrative_gravity.errors.ConfigurationError: `mmr_lambda` has to be in [0.0, 1.0], but is 1.5
    """

    lexical_weight: float = 0.3
    narrative_weight: float = 0.3
    cluster_threshold: float = 0.35
    cluster_margin: float = 0.2
    mmr_lambda: float = 0.9
    duplicate_threshold: float = 0.95
    min_score: float | None = None

    def __post_init__(self) -> None:
        _check_unit("lexical_weight", self.lexical_weight)
        _check_unit("narrative_weight", self.narrative_weight)
        _check_unit("cluster_threshold", self.cluster_threshold, lo=-1.0)
        _check_unit("cluster_margin", self.cluster_margin, hi=2.0)
        _check_unit("mmr_lambda", self.mmr_lambda)
        _check_unit("duplicate_threshold", self.duplicate_threshold, lo=-1.0)

    @classmethod
    def of(cls, level: Any) -> PruneSettings:
        """The settings of a profile's ``context`` level (:class:`~narrative_gravity.profiles.schema.ContextLevel`)."""
        names = ("lexical_weight", "narrative_weight", "cluster_threshold", "cluster_margin", "mmr_lambda")
        return cls(**{n: getattr(level, n) for n in names}, duplicate_threshold=level.duplicate_threshold)


def prune_context(
    question: str,
    chunks: Sequence[str | Mapping[str, Any]],
    budget_tokens: int | None = None,
    *,
    profile: Any = None,
    narrative: str | None = None,
    tokenizer: Any = None,
    encoder: Encoder | None = None,
    settings: PruneSettings = PruneSettings(),
) -> PruneResult:
    """Score, cluster and trim ``chunks`` for ``question`` (see the module doc for the rules).

    Args:
        question: what the chunks must answer.
        chunks: strings, or mappings with a ``text`` (and optionally an ``id``), e.g. rows of a JSONL file.
        budget_tokens: at most this many chunk tokens are kept; ``None`` = no budget (only clusters,
            duplicates and ``min_score`` prune).
        profile: a :class:`~narrative_gravity.profiles.schema.Profile`; its narrative (``field.semantic_topic``, else
            ``description``, else the core words) joins the question in the score and the cluster test.
        narrative: a sentence describing the narrative (overrides the profile's).
        tokenizer: the generator's tokenizer, to count tokens; without it whitespace words are counted.
        encoder: ``texts -> [n, d]`` unit embeddings; defaults to MiniLM (:mod:`narrative_gravity.embeddings`).
        settings: the weights and thresholds of :class:`PruneSettings`.

    Raises:
        ConfigurationError: an argument is out of range, or a chunk is neither a string nor has a ``text``.
    """
    if not isinstance(question, str) or not question.strip():
        raise ConfigurationError("`question` has to be a non-empty string")
    if budget_tokens is not None and (
        isinstance(budget_tokens, bool) or not isinstance(budget_tokens, int) or budget_tokens < 0
    ):
        raise ConfigurationError(f"`budget_tokens` has to be an integer >= 0 or None, but is {budget_tokens!r}")
    texts, ids = _normalize_chunks(chunks)
    if narrative is None and profile is not None:
        narrative = narrative_text(profile)
    if not texts:
        return PruneResult(question, [], budget_tokens)
    sc = _Scores.of(question, narrative, texts, encoder or _default_encoder(), settings)
    tokens = count_tokens(texts, tokenizer)
    reasons, cluster_sim = sc.cluster_reasons(settings)
    ranks = sc.select(reasons, tokens, ids, budget_tokens, settings)
    decisions = []
    for i in range(len(texts)):
        kept = i in ranks
        decisions.append(
            ChunkDecision(
                index=i,
                id=ids[i],
                text=texts[i],
                tokens=tokens[i],
                score=float(sc.score[i]),
                lexical=float(sc.lexical[i]),
                semantic=float(sc.semantic[i]),
                narrative=None if sc.narrative is None else float(sc.narrative[i]),
                cluster=int(sc.labels[i]),
                kept=kept,
                reason=f"kept #{ranks[i]}" if kept else str(reasons[i]),
                rank=ranks.get(i),
            )
        )
    return PruneResult(question, decisions, budget_tokens, cluster_sim)


@dataclass
class _Scores:
    """Every chunk's scores against the question (and narrative), its embedding and its cluster."""

    score: np.ndarray
    lexical: np.ndarray
    semantic: np.ndarray
    narrative: np.ndarray | None
    emb: np.ndarray
    target: np.ndarray
    labels: np.ndarray

    @classmethod
    def of(
        cls, question: str, narrative: str | None, texts: list[str], encoder: Encoder, settings: PruneSettings
    ) -> _Scores:
        targets = [question] + ([narrative] if narrative else [])
        emb = _embed(encoder, targets + texts)
        q_vec, n_vec, c_emb = emb[0], (emb[1] if narrative else None), emb[len(targets) :]
        semantic = c_emb @ q_vec
        bm = BM25([terms(t) for t in texts]).scores(terms(question))
        lexical = bm / bm.max() if bm.max() > 0 else np.zeros_like(bm)
        score = (1.0 - settings.lexical_weight) * semantic + settings.lexical_weight * lexical
        nar, target = None, q_vec
        if n_vec is not None:
            nar = c_emb @ n_vec
            score = (1.0 - settings.narrative_weight) * score + settings.narrative_weight * nar
            t = q_vec + n_vec
            target = t / (np.linalg.norm(t) or 1.0)
        labels = cluster_embeddings(c_emb, settings.cluster_threshold)
        return cls(score, lexical, semantic, nar, c_emb, target, labels)

    def cluster_reasons(self, settings: PruneSettings) -> tuple[list[str | None], dict[int, float]]:
        """Why each chunk is dropped before selection (an off-narrative cluster, ``min_score``), else ``None``;
        and each cluster's centroid cosine to the target."""
        cluster_sim: dict[int, float] = {}
        for k in np.unique(self.labels):
            centroid = self.emb[self.labels == k].mean(axis=0)
            centroid /= np.linalg.norm(centroid) or 1.0
            cluster_sim[int(k)] = float(centroid @ self.target)
        best_cluster = int(self.labels[int(np.argmax(self.score))])
        cutoff = max(cluster_sim.values()) - settings.cluster_margin
        reasons: list[str | None] = [None] * len(self.score)
        for i, k in enumerate(int(x) for x in self.labels):
            if k != best_cluster and cluster_sim[k] < cutoff:
                reasons[i] = f"off-narrative cluster {k} (centroid cos {cluster_sim[k]:.2f} < {cutoff:.2f})"
            elif settings.min_score is not None and self.score[i] < settings.min_score:
                reasons[i] = f"score {self.score[i]:.2f} below min_score {settings.min_score:.2f}"
        return reasons, cluster_sim

    def select(
        self,
        reasons: list[str | None],
        tokens: list[int],
        ids: list[str],
        budget: int | None,
        settings: PruneSettings,
    ) -> dict[int, int]:
        """MMR over the chunks left: each kept chunk's rank; ``reasons`` gets why the others were skipped."""
        ranks: dict[int, int] = {}
        left, lam = budget, settings.mmr_lambda
        candidates = [i for i, r in enumerate(reasons) if r is None]
        max_sim = np.full(len(reasons), -np.inf)
        while candidates:
            redundancy = np.where(np.isfinite(max_sim), max_sim, 0.0)
            mmr = lam * self.score - (1.0 - lam) * redundancy
            i = max(candidates, key=lambda j: (mmr[j], -j))
            candidates.remove(i)
            if ranks and max_sim[i] >= settings.duplicate_threshold:
                twin = max(ranks, key=lambda j: float(self.emb[j] @ self.emb[i]))
                reasons[i] = f"near-duplicate of chunk {ids[twin]} (cos {max_sim[i]:.2f})"
                continue
            if left is not None and tokens[i] > left:
                reasons[i] = f"over budget ({tokens[i]} tokens, {left} left)"
                continue
            ranks[i] = len(ranks) + 1
            if left is not None:
                left -= tokens[i]
            max_sim = np.maximum(max_sim, self.emb @ self.emb[i])
        return ranks


def result_table(result: PruneResult, *, width: int = 60) -> Any:
    """A ``rich`` table of the decisions, kept chunks first (by rank), then dropped ones (by score)."""

    title = (
        f"{len(result.kept)} of {len(result.decisions)} chunks kept: {result.tokens_kept} of "
        f"{result.tokens_total} tokens ({result.tokens_saved} saved, {100 * result.saved_fraction:.0f}%)"
    )
    table = Table(title=title)
    for col, justify in (
        ("id", "left"),
        ("kept", "center"),
        ("score", "right"),
        ("bm25", "right"),
        ("cos", "right"),
        ("cluster", "right"),
        ("tokens", "right"),
        ("reason", "left"),
        ("text", "left"),
    ):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    order = sorted(result.kept, key=lambda d: d.rank or 0) + sorted(result.dropped, key=lambda d: -d.score)
    for d in order:
        snippet = d.text if len(d.text) <= width else d.text[: width - 1] + "…"
        table.add_row(
            escape(d.id),
            "[green]yes[/]" if d.kept else "[red]no[/]",
            f"{d.score:.3f}",
            f"{d.lexical:.2f}",
            f"{d.semantic:.2f}",
            str(d.cluster),
            str(d.tokens),
            escape(d.reason),
            escape(snippet.replace("\n", " ")),
        )
    return table
