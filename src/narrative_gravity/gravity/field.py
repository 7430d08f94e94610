"""The narrative field: one value in [-1, 1] per vocabulary token, plus multi-token continuations.

A field has two parts:

- ``values[V]``: the pull on every token regardless of context (single-token words and the first
  piece of multi-token words).
- a continuation table: for a multi-token word ``t1 t2 … tn``, the piece ``t(j+1)`` gets a value only
  in rows whose last generated tokens are ``t1 … tj``. The table is stored as right-aligned prefixes
  ``prefixes[E, L]`` (padded with ``-1``), the piece that continues each prefix ``next_ids[E]`` and
  its value ``next_values[E]``. Matching is one broadcast comparison over ``[B, E, L]``.

>>> import torch
>>> f = NarrativeField(values=torch.tensor([0.0, 1.0, 0.5, 0.0]),
...                    prefixes=torch.tensor([[-1, 2]]), next_ids=torch.tensor([3]),
...                    next_values=torch.tensor([1.0]))
>>> f.for_step(torch.tensor([[0, 2], [0, 1]])).tolist()
[[0.0, 1.0, 0.5, 1.0], [0.0, 1.0, 0.5, 0.0]]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

import torch

from ..errors import FieldError, VocabularyError

__all__ = ["NO_TOKEN", "NarrativeField", "WordReport", "last_tokens", "match_suffixes", "merge_fields"]


@dataclass(frozen=True)
class WordReport:
    """What happened to each word when a field was built.

    ``used`` maps each usable word to its surface forms as token-piece tuples; ``unusable`` maps each
    word that could not be used to the reason.
    """

    used: dict[str, list[tuple[str, ...]]] = field(default_factory=dict)
    unusable: dict[str, str] = field(default_factory=dict)

    @property
    def n_used(self) -> int:
        return len(self.used)

    @property
    def n_unusable(self) -> int:
        return len(self.unusable)


@dataclass(frozen=True)
class NarrativeField:
    """A vocabulary field with an optional multi-token continuation table (see the module doc)."""

    values: torch.Tensor
    prefixes: torch.Tensor | None = None
    next_ids: torch.Tensor | None = None
    next_values: torch.Tensor | None = None
    report: WordReport = field(default_factory=WordReport)
    name: str = "field"

    def __post_init__(self) -> None:
        if self.values.dim() != 1:
            raise VocabularyError(
                f"`values` must be a 1-D tensor over the vocabulary, got shape {tuple(self.values.shape)}"
            )
        parts = (self.prefixes, self.next_ids, self.next_values)
        if any(p is None for p in parts) and not all(p is None for p in parts):
            raise VocabularyError("`prefixes`, `next_ids` and `next_values` must be given together or not at all")
        if self.prefixes is not None:
            e = self.prefixes.shape[0]
            if self.prefixes.dim() != 2 or self.next_ids.shape != (e,) or self.next_values.shape != (e,):
                raise VocabularyError(
                    "continuation table shapes disagree: prefixes must be [E, L], next_ids and next_values [E]; got "
                    f"{tuple(self.prefixes.shape)}, {tuple(self.next_ids.shape)}, {tuple(self.next_values.shape)}"
                )
            bad = self.next_ids[(self.next_ids < 0) | (self.next_ids >= self.vocab_size)]
            if bad.numel():
                raise VocabularyError(
                    f"continuation token ids {sorted(set(bad.tolist()))[:10]} are outside the vocabulary "
                    f"[0, {self.vocab_size}); build the field with the tokenizer of the model you generate with"
                )

    @property
    def vocab_size(self) -> int:
        return int(self.values.shape[0])

    @property
    def has_continuations(self) -> bool:
        return self.prefixes is not None and self.prefixes.shape[0] > 0

    @property
    def max_prefix_len(self) -> int:
        return int(self.prefixes.shape[1]) if self.has_continuations else 0

    def support(self) -> torch.Tensor:
        """Token ids whose value can be non-zero in some context: base non-zeros and continuation pieces.

        >>> NarrativeField(values=torch.tensor([0.0, 1.0, 0.0, -1.0])).support().tolist()
        [1, 3]
        """
        ids = torch.nonzero(self.values).flatten()
        if self.has_continuations:
            ids = torch.cat([ids, self.next_ids.to(ids.device)])
        return torch.unique(ids)

    @cached_property
    def _support_tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(support [S], values on it [S], position in the support of each continuation entry [E])``."""
        support = self.support()
        pos = torch.searchsorted(support, self.next_ids) if self.has_continuations else None
        return support, self.values[support], pos

    def on_support(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The field for the next token, gathered on :meth:`support`: ``(ids [S], values [S] or [B, S])``.

        Equal to ``for_step(input_ids)[..., ids]`` and zero elsewhere, at a cost of ``B × (E + S)``
        instead of ``B × V``: the processor adds it with one ``index_add``.

        >>> f = NarrativeField(values=torch.tensor([0.0, 1.0, 0.5, 0.0]),
        ...                    prefixes=torch.tensor([[-1, 2]]), next_ids=torch.tensor([3]),
        ...                    next_values=torch.tensor([1.0]))
        >>> ids, vals = f.on_support(torch.tensor([[0, 2], [0, 1]]))
        >>> ids.tolist(), vals.tolist()
        ([1, 2, 3], [[1.0, 0.5, 1.0], [1.0, 0.5, 0.0]])
        """
        support, base, pos = self._support_tables
        if pos is None:
            return support, base
        contrib = self._matches(input_ids).to(base.dtype) * self.next_values[None]  # [B, E]
        step = torch.zeros(input_ids.shape[0], support.shape[0], dtype=base.dtype, device=base.device)
        step.index_add_(1, pos, contrib)
        return support, step.add_(base).clamp_(-1.0, 1.0)

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> NarrativeField:
        """Move the field to a device (and the values to a float dtype)."""

        def mv(t: torch.Tensor | None, float_: bool) -> torch.Tensor | None:
            if t is None:
                return None
            return t.to(device=device, dtype=dtype if (float_ and dtype is not None) else t.dtype)

        return replace(
            self,
            values=mv(self.values, True),
            prefixes=mv(self.prefixes, False),
            next_ids=mv(self.next_ids, False),
            next_values=mv(self.next_values, True),
        )

    def fit_vocab(self, width: int) -> NarrativeField:
        """Return a field whose vocabulary is ``width`` wide.

        A model may pad its output layer beyond the tokenizer (``width > vocab_size``): the extra
        tokens get 0. A narrower output layer cannot hold the field's tokens and raises an error
        that names them.
        """
        if width == self.vocab_size:
            return self
        if width > self.vocab_size:
            pad = torch.zeros(width - self.vocab_size, dtype=self.values.dtype, device=self.values.device)
            return replace(self, values=torch.cat([self.values, pad]))
        nz = torch.nonzero(self.values[width:]).flatten() + width
        ids = sorted(set(nz.tolist()) | set(self._continuation_ids_at_or_above(width)))
        if ids:
            raise VocabularyError(
                f"the logits have {width} columns but the field gives values to token ids {ids[:10]}"
                f"{' …' if len(ids) > 10 else ''} (field vocabulary {self.vocab_size}); build the field with the "
                "tokenizer of the model you generate with"
            )
        return replace(self, values=self.values[:width].contiguous())

    def _continuation_ids_at_or_above(self, width: int) -> list[int]:
        if not self.has_continuations:
            return []
        return self.next_ids[self.next_ids >= width].tolist()

    def for_step(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The field for the next token of each row: ``[V]`` without continuations, else ``[B, V]``.

        Vectorized over the batch and the continuation table; no host synchronisation.
        """
        if not self.has_continuations:
            return self.values
        return (self.values + self.continuation(input_ids)).clamp_(-1.0, 1.0)

    def continuation(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The context-dependent part ``[B, V]``: values of pieces that continue the rows' last tokens."""
        b = input_ids.shape[0]
        out = torch.zeros(b, self.vocab_size, dtype=self.values.dtype, device=self.values.device)
        if not self.has_continuations:
            return out
        contrib = self._matches(input_ids).to(self.values.dtype) * self.next_values[None]
        out.scatter_add_(1, self.next_ids[None].expand(b, -1), contrib)
        return out

    def _matches(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[B, E]``: whether each row's last tokens end with each entry's prefix."""
        return match_suffixes(input_ids, self.prefixes)


NO_TOKEN = -2
"""The id that fills a row's history where it has no token: no prefix (padded with ``-1``) matches it."""


def last_tokens(ids: torch.Tensor, width: int) -> torch.Tensor:
    """The last ``width`` columns of ``ids [B, T]``, left-padded with :data:`NO_TOKEN` when ``T < width``."""
    tail = ids[:, -width:] if width else ids[:, :0]
    if tail.shape[1] < width:
        tail = torch.nn.functional.pad(tail, (width - tail.shape[1], 0), value=NO_TOKEN)
    return tail


def match_suffixes(ids: torch.Tensor, patterns: torch.Tensor) -> torch.Tensor:
    """``[B, P]``: whether each row of ``ids [B, T]`` ends with each right-aligned pattern ``[P, L]``.

    Patterns are padded on the left with ``-1``, which matches anything. This is the one place where
    multi-token words are matched: continuation prefixes, and the words a stage has covered.

    >>> match_suffixes(torch.tensor([[5, 6, 7]]), torch.tensor([[-1, 6, 7], [-1, 5, 7], [-1, -1, 7]])).tolist()
    [[True, False, True]]
    """
    tail = last_tokens(ids, patterns.shape[1])
    return ((tail[:, None, :] == patterns[None]) | (patterns[None] < 0)).all(dim=-1)


def _pad_prefixes(p: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(p, (width - p.shape[1], 0), value=-1)


def merge_fields(fields: Sequence[NarrativeField], *, name: str = "merged") -> NarrativeField:
    """Combine fields: positive values by ``max``, a negative value wins; continuation tables are stacked."""
    if not fields:
        raise FieldError("`fields` has to hold at least one field")
    width = max(f.vocab_size for f in fields)
    fitted = [f.fit_vocab(width) for f in fields]
    vals = torch.stack([f.values for f in fitted])
    pos = vals.clamp_min(0.0).max(dim=0).values
    neg = vals.clamp_max(0.0).min(dim=0).values
    values = torch.where(neg < 0, neg, pos)
    tables = [f for f in fitted if f.has_continuations]
    if not tables:
        return NarrativeField(values=values, name=name)
    lp = max(f.max_prefix_len for f in tables)
    return NarrativeField(
        values=values,
        prefixes=torch.cat([_pad_prefixes(f.prefixes, lp) for f in tables]),
        next_ids=torch.cat([f.next_ids for f in tables]),
        next_values=torch.cat([f.next_values for f in tables]),
        name=name,
    )
