"""Stages: a plan's sections as one field per stage, and per-row tracking of which stage each row is in.

A :class:`StagePlan` is a field source: the kernel pulls each row toward the field of its current stage.
A row moves on when its stage is *covered* (``cover_fraction`` of the stage's words generated, at least
one) or *spent* (its share of the row's own token budget used). :func:`advance_stages` does that for every
row at once, each at its own step and with its own budget.

>>> import torch
>>> from narrative_gravity.gravity.field import NarrativeField
>>> plan = StagePlan(fields=(NarrativeField(values=torch.tensor([0.0, 1.0])),
...                          NarrativeField(values=torch.tensor([1.0, 0.0]))), shares=(0.5, 0.5))
>>> plan.need, plan.n_words
([1000000000, 1000000000], 1)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import ConfigurationError
from .field import NarrativeField, match_suffixes

__all__ = ["NEVER", "StagePlan", "advance_stages"]

NEVER = 10**9
"""The word count a stage without words needs to be covered: it ends on its share alone."""


@dataclass(frozen=True)
class StagePlan:
    """The stages of a plan for one tokenizer.

    Args:
        fields: one field per stage, in order.
        shares: each stage's fraction of the row's token budget (a stage ends when it has used that many).
        words: for each stage, for each of its words, the token-id sequences of the word's surface forms; a
            word counts as generated when a row's last tokens spell one of its forms. ``None`` = stages
            advance on their share only.
        cover_fraction: a stage is covered once this share of its words (at least one) has been generated.
        names: shown in traces and plan tables.
    """

    fields: tuple[NarrativeField, ...]
    shares: tuple[float, ...]
    words: tuple[tuple[tuple[tuple[int, ...], ...], ...], ...] | None = None
    cover_fraction: float = 0.5
    names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        fields, shares, words = self.fields, self.shares, self.words
        if not fields or any(not isinstance(f, NarrativeField) for f in fields):
            raise ConfigurationError("`fields` has to be a non-empty list of NarrativeField, one per stage")
        if len(shares) != len(fields) or any(
            isinstance(s, bool) or not (isinstance(s, (int, float)) and s > 0) for s in shares
        ):
            raise ConfigurationError(
                f"`shares` needs one positive number per stage ({len(fields)}), but is {list(shares)!r}"
            )
        if words is not None and len(words) != len(fields):
            raise ConfigurationError(f"`words` needs one list per stage ({len(fields)}), but has {len(words)}")
        if not 0 < self.cover_fraction <= 1:
            raise ConfigurationError(f"`cover_fraction` has to be in (0, 1], but is {self.cover_fraction!r}")

    @property
    def n_stages(self) -> int:
        return len(self.fields)

    @property
    def n_words(self) -> int:
        """The most words any stage has (at least 1): the width of a row's covered-word set."""
        return max(1, *(len(w) for w in self.words)) if self.words else 1

    @property
    def need(self) -> list[int]:
        """Per stage, how many of its words must be generated to cover it (:data:`NEVER` without words)."""
        counts = [len(w) for w in self.words] if self.words else [0] * self.n_stages
        return [max(1, math.ceil(self.cover_fraction * k)) if k else NEVER for k in counts]

    def forms(self, vocab: int) -> list[tuple[int, int, tuple[int, ...]]]:
        """``(stage, word, form)`` for every surface form whose ids are all in ``[0, vocab)``."""
        return [
            (s, j, tuple(form))
            for s, ws in enumerate(self.words or ())
            for j, fs in enumerate(ws)
            for form in fs
            if form and all(0 <= t < vocab for t in form)
        ]


def advance_stages(
    stage: torch.Tensor,
    start: torch.Tensor,
    seen: torch.Tensor,
    step: torch.Tensor,
    budget: torch.Tensor,
    recent: torch.Tensor,
    first: torch.Tensor,
    last: torch.Tensor,
    share: torch.Tensor,
    need: torch.Tensor,
    forms: Sequence[torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Move rows whose stage is covered or spent to their next stage; returns ``(stage, start, seen)``.

    All ``[R]`` unless noted, each row at its own ``step`` (tokens generated, the newest included):
    ``stage`` (index within the row's plan), ``start`` (the step the stage began), ``seen [R, W]`` (words of
    the current stage generated so far), ``budget`` (the row's token budget), ``recent [R, L]`` (its last
    tokens), ``first`` (the field row of its first stage), ``last`` (its last stage index). ``share`` and
    ``need`` are per field row (``[F]``). ``forms`` = ``(patterns [P, Lf], field row [P], word [P])`` of
    every stage word's surface forms, or ``None``.
    """
    frow = first + stage
    if forms is not None:
        patterns, form_frow, form_word = forms
        done = match_suffixes(recent, patterns) & (form_frow[None] == frow[:, None])  # [R, P]
        hits = torch.zeros(seen.shape, dtype=torch.float32, device=seen.device)
        hits.scatter_add_(1, form_word[None].expand(seen.shape[0], -1), done.float())
        seen = seen | (hits > 0)
    covered = seen.sum(dim=-1)
    spent = step - start
    stage_budget = (share[frow] * budget.to(torch.float64)).round().clamp_min(1.0)
    move = ((covered >= need[frow]) | (spent >= stage_budget)) & (stage < last)
    stage = stage + move.long()
    start = torch.where(move, step, start)
    seen = seen & ~move[:, None]
    return stage, start, seen
