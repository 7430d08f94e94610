"""Strength controllers: pick the pull λ for every row at every step.

Controllers only decide; :mod:`narrative_gravity.thermo` only observes. Each controller maps a
:class:`StepContext` to a ``[B]`` tensor of strengths. The step is derived from the inputs by the
caller, so a controller holds no per-generation counters.

>>> import torch
>>> ctx = StepContext(step=0, max_new_tokens=100, batch_size=2)
>>> ConstantController(1.2)(ctx).tolist()
[1.2000000476837158, 1.2000000476837158]
>>> sched = PhaseScheduleController(2.0)
>>> [round(sched.scale(t, 100), 2) for t in (0, 50, 95)]
[0.5, 1.0, 1.5]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from .errors import ConfigurationError

__all__ = [
    "ConstantController",
    "PhaseScheduleController",
    "StepContext",
    "StrengthController",
]


@dataclass(frozen=True)
class StepContext:
    """What a controller may look at for one decoding step.

    ``logits`` and ``field`` are optional so that schedule-only controllers stay free of tensor work.
    """

    step: int
    max_new_tokens: int | None
    batch_size: int
    device: torch.device | str = "cpu"
    logits: torch.Tensor | None = None
    field: torch.Tensor | None = None
    input_ids: torch.Tensor | None = None


@runtime_checkable
class StrengthController(Protocol):
    """Anything that maps a :class:`StepContext` to a ``[B]`` strength tensor."""

    def __call__(self, ctx: StepContext) -> torch.Tensor: ...


def _check_strength(value: float, name: str = "strength") -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        raise ConfigurationError(
            f"`{name}` has to be a finite number >= 0, but is {value!r}; use 0 to switch gravity off"
        )
    return float(value)


class _BaseStrength:
    """Holds one base λ, or one per row, and broadcasts it to the batch (beams included)."""

    def __init__(self, strength: float | Sequence[float]) -> None:
        if isinstance(strength, (int, float)):
            self._rows: tuple[float, ...] = (_check_strength(strength),)
        else:
            vals = tuple(_check_strength(v, "strength[i]") for v in strength)
            if not vals:
                raise ConfigurationError("`strength` was an empty sequence; give one float, or one per row")
            self._rows = vals
        self._cache: dict[tuple[int, str], torch.Tensor] = {}

    def __repr__(self) -> str:
        rows = self._rows[0] if len(self._rows) == 1 else list(self._rows)
        return f"{type(self).__name__}({rows})"

    def base(self, batch_size: int, device: torch.device | str) -> torch.Tensor:
        key = (batch_size, str(device))
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        n = len(self._rows)
        if n == 1:
            t = torch.full((batch_size,), self._rows[0], dtype=torch.float32)
        elif batch_size % n == 0:  # beam search or num_return_sequences repeat each row
            t = torch.tensor(self._rows, dtype=torch.float32).repeat_interleave(batch_size // n)
        else:
            raise ConfigurationError(
                f"{n} per-row strengths were given but the batch has {batch_size} rows; give one strength per "
                "prompt (or a single float)"
            )
        t = t.to(device)
        self._cache[key] = t
        return t


class ConstantController(_BaseStrength):
    """The same λ at every step (the classic keyword-boost behaviour)."""

    def __call__(self, ctx: StepContext) -> torch.Tensor:
        return self.base(ctx.batch_size, ctx.device)


class PhaseScheduleController(_BaseStrength):
    """Explore (weak), converge, then strict near the end of the token budget, with an optional decay.

    Phases are fractions of ``max_new_tokens``: steps before ``explore_until`` use ``explore`` × λ, steps
    from ``strict_from`` on use ``strict`` × λ, and the steps between use ``converge`` × λ. Without a
    budget the strict phase never starts and the explore phase lasts ``explore_steps``.

    ``decay_after_steps`` (the classic profile key): after that many generated tokens the pull fades
    with a half-life of ``decay_half_life`` steps, so long answers can close naturally.
    """

    def __init__(
        self,
        strength: float | Sequence[float],
        *,
        explore_until: float = 0.2,
        strict_from: float = 0.8,
        explore: float = 0.5,
        converge: float = 1.0,
        strict: float = 1.5,
        explore_steps: int = 8,
        decay_after_steps: int | None = None,
        decay_half_life: float = 25.0,
    ) -> None:
        super().__init__(strength)
        if not 0.0 <= explore_until <= strict_from <= 1.0:
            raise ConfigurationError(
                f"phase bounds must satisfy 0 <= explore_until <= strict_from <= 1, but are "
                f"explore_until={explore_until}, strict_from={strict_from}"
            )
        for name, v in (("explore", explore), ("converge", converge), ("strict", strict)):
            _check_strength(v, name)
        if decay_after_steps is not None and (not isinstance(decay_after_steps, int) or decay_after_steps < 0):
            raise ConfigurationError(
                f"`decay_after_steps` has to be an integer >= 0 or None, but is {decay_after_steps!r}"
            )
        if not decay_half_life > 0:
            raise ConfigurationError(f"`decay_half_life` has to be > 0 steps, but is {decay_half_life!r}")
        self.explore_until, self.strict_from = explore_until, strict_from
        self.explore, self.converge, self.strict = explore, converge, strict
        self.explore_steps = explore_steps
        self.decay_after_steps, self.decay_half_life = decay_after_steps, decay_half_life

    def scale(self, step: int, max_new_tokens: int | None) -> float:
        """The multiplier on the base λ at ``step`` (pure Python; no tensors)."""
        if max_new_tokens:
            frac = step / max_new_tokens
            if frac < self.explore_until:
                s = self.explore
            elif frac >= self.strict_from:
                s = self.strict
            else:
                s = self.converge
        else:
            s = self.explore if step < self.explore_steps else self.converge
        if self.decay_after_steps is not None and step > self.decay_after_steps:
            s *= 0.5 ** ((step - self.decay_after_steps) / self.decay_half_life)
        return s

    def __call__(self, ctx: StepContext) -> torch.Tensor:
        return self.base(ctx.batch_size, ctx.device) * self.scale(ctx.step, ctx.max_new_tokens)
