"""Controllers: how users name a schedule (constant, phases, decay, the thermostat), per row.

The controller classes are the user-facing way to name a schedule (``ConstantController(1.2)``); they turn
into rows of the schedule table (:mod:`.schedule`) for the kernel, and can still be called on one
:class:`StepContext` (all rows at one step, a dense field), which goes through the same rules. A controller
of your own (any callable that maps a :class:`StepContext` to a ``[B]`` tensor) runs too, in the
transformers engine.

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

import numpy as np
import torch

from ..errors import ConfigurationError
from .field import last_tokens
from .schedule import (
    _COL,
    DRIFT_SCOPES,
    RowSchedule,
    kl_budget_at,
    off_topic_share,
    phase_value,
    schedule_row,
    scheduled_strength,
    thermostat_target,
)
from .solve import MassProblem, _check_candidates, _check_iterations, _check_max_strength
from .thermo import probabilities

__all__ = [
    "ConstantController",
    "DecayOptions",
    "PhaseScheduleController",
    "ScheduleController",
    "StepContext",
    "StrengthController",
    "ThermostatController",
    "ThermostatOptions",
]


@dataclass(frozen=True)
class StepContext:
    """What a controller called on its own may look at for one decoding step (every row at ``step``).

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
    """Anything that maps a :class:`StepContext` to a ``[B]`` strength tensor.

    The built-in controllers are :class:`ScheduleController` s and run inside the kernel, per row. A
    controller of your own gets a :class:`StepContext` with the dense ``[B, V]`` field of the step.
    """

    def __call__(self, ctx: StepContext) -> torch.Tensor: ...


def _check_strength(value: float, name: str = "strength") -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        raise ConfigurationError(
            f"`{name}` has to be a finite number >= 0, but is {value!r}; use 0 to switch gravity off"
        )
    return float(value)


def _check_phase_bounds(explore_until: float, strict_from: float) -> None:
    if not 0.0 <= explore_until <= strict_from <= 1.0:
        raise ConfigurationError(
            f"phase bounds must satisfy 0 <= explore_until <= strict_from <= 1, but are "
            f"explore_until={explore_until}, strict_from={strict_from}"
        )


@dataclass(frozen=True)
class DecayOptions:
    """The classic fade (the profile's ``decay_after_steps`` and ``decay_half_life``): after ``after_steps``
    generated tokens the pull (the thermostat: its target) halves every ``half_life`` steps. ``after_steps=None``:
    no fade.

    >>> DecayOptions(after_steps=50).row()
    {'decay_after': 50, 'half_life': 25.0}
    """

    after_steps: int | None = None
    half_life: float = 25.0

    def __post_init__(self) -> None:
        n = self.after_steps
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise ConfigurationError(f"`decay_after_steps` has to be an integer >= 0 or None, but is {n!r}")
        if not self.half_life > 0:
            raise ConfigurationError(f"`decay_half_life` has to be > 0 steps, but is {self.half_life!r}")

    def row(self) -> dict[str, float]:
        """The decay's columns of a schedule row."""
        return {"decay_after": -1.0 if self.after_steps is None else self.after_steps, "half_life": self.half_life}


class ScheduleController:
    """A built-in schedule: one base λ (or one per prompt), and the rest of its row (:data:`COLUMNS`).

    :meth:`schedule` gives the kernel one row per sequence (beams repeat each prompt's row). Calling the
    controller on a :class:`StepContext` computes the same λ for every row at ``ctx.step``.
    """

    needs_field = False

    def __init__(self, strength: float | Sequence[float]) -> None:
        if isinstance(strength, (str, bytes)):
            raise ConfigurationError(
                f"`strength` has to be a number or a sequence of numbers, but is the string {strength!r}; "
                "convert it first, e.g. float(value)"
            )
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

    def _bases(self, batch_size: int) -> list[float]:
        n = len(self._rows)
        if n == 1:
            return [self._rows[0]] * batch_size
        if batch_size % n == 0:  # beam search or num_return_sequences repeat each row
            return [r for r in self._rows for _ in range(batch_size // n)]
        raise ConfigurationError(
            f"{n} per-row strengths were given but the batch has {batch_size} rows; give one strength per "
            "prompt (or a single float)"
        )

    def base(self, batch_size: int, device: torch.device | str) -> torch.Tensor:
        """The base λ of every row, ``[batch_size]`` float32 on ``device`` (cached)."""
        key = (batch_size, str(device))
        cached = self._cache.get(key)
        if cached is None:
            cached = torch.tensor(self._bases(batch_size), dtype=torch.float32).to(device)
            self._cache[key] = cached
        return cached

    def row(self) -> dict[str, float]:
        """This schedule's columns other than ``base``."""
        raise NotImplementedError

    def schedule(self, batch_size: int) -> np.ndarray:
        """``[batch_size, len(COLUMNS)]`` float64: one schedule row per sequence."""
        one = schedule_row(**self.row())
        table = np.repeat(one[None], batch_size, axis=0)
        table[:, _COL["base"]] = self._bases(batch_size)
        return table

    def _rows_at(self, ctx: StepContext) -> tuple[RowSchedule, torch.Tensor]:
        """Every row's schedule and step for a call on one :class:`StepContext`."""
        b = ctx.batch_size
        rs = RowSchedule(self.schedule(b), np.full(b, ctx.max_new_tokens or 0), ctx.device)
        return rs, torch.full((b,), ctx.step, dtype=torch.int64, device=ctx.device)

    def __call__(self, ctx: StepContext) -> torch.Tensor:
        rs, step = self._rows_at(ctx)
        return scheduled_strength(step, rs).to(device=ctx.device, dtype=torch.float32)


class ConstantController(ScheduleController):
    """The same λ at every step (the classic keyword-boost behaviour)."""

    def row(self) -> dict[str, float]:
        return {"explore": 1.0, "converge": 1.0, "strict": 1.0, "strict_from": 1.0}

    def __call__(self, ctx: StepContext) -> torch.Tensor:
        return self.base(ctx.batch_size, ctx.device)


class PhaseScheduleController(ScheduleController):
    """Explore (weak), converge, then strict near the end of the token budget, with an optional decay.

    Phases are fractions of ``max_new_tokens``: steps before ``explore_until`` use ``explore`` × λ, steps
    from ``strict_from`` on use ``strict`` × λ, and the steps between use ``converge`` × λ. Without a
    budget the strict phase never starts and the explore phase lasts ``explore_steps``.

    ``decay`` (:class:`DecayOptions`, the classic profile keys): after ``decay.after_steps`` generated tokens
    the pull fades with a half-life of ``decay.half_life`` steps, so long answers can close naturally.
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
        decay: DecayOptions = DecayOptions(),
    ) -> None:
        super().__init__(strength)
        _check_phase_bounds(explore_until, strict_from)
        for name, v in (("explore", explore), ("converge", converge), ("strict", strict)):
            _check_strength(v, name)
        if not isinstance(decay, DecayOptions):
            raise ConfigurationError(f"`decay` has to be a DecayOptions, but is {type(decay).__name__}")
        self.explore_until, self.strict_from = explore_until, strict_from
        self.explore, self.converge, self.strict = explore, converge, strict
        self.explore_steps = explore_steps
        self.decay = decay

    def row(self) -> dict[str, float]:
        return {
            "explore_until": self.explore_until,
            "strict_from": self.strict_from,
            "explore": self.explore,
            "converge": self.converge,
            "strict": self.strict,
            "explore_steps": self.explore_steps,
            **self.decay.row(),
        }

    def scale(self, step: int, max_new_tokens: int | None) -> float:
        """The multiplier on the base λ at ``step`` (:func:`phase_value` × :func:`decay_factor`)."""
        rs = RowSchedule(schedule_row(**self.row(), base=1.0)[None], np.array([max_new_tokens or 0]))
        return float(scheduled_strength(torch.tensor([step]), rs)[0])


@dataclass(frozen=True)
class ThermostatOptions:
    """The thermostat's rule, as the profile's ``thermostat`` block names it (all but ``max_strength``).

    See :class:`ThermostatController` for what each part does. Validated here, once.

    >>> ThermostatOptions(drift_gain=0.0).converge_target
    0.25
    """

    explore_until: float = 0.2
    strict_from: float = 0.8
    explore_target: float = 0.08
    converge_target: float = 0.25
    strict_target: float = 0.4
    explore_steps: int = 8
    drift_window: int = 8
    drift_gain: float = 0.15
    drift_share: float = 0.125
    drift_scope: str = "generated"
    max_target: float = 0.95
    entropy_low: float = 0.05
    entropy_high: float = 0.25
    iterations: int = 14
    candidates: int = 1024
    kl_budget: float | None = None
    kl_budget_steps: int | None = None
    late_kl_budget: float | None = None

    def __post_init__(self) -> None:
        _check_phase_bounds(self.explore_until, self.strict_from)
        for name in ("explore_target", "converge_target", "strict_target", "drift_gain", "drift_share", "max_target"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0.0 <= v <= 1.0:
                raise ConfigurationError(f"`{name}` has to be a number in [0, 1], but is {v!r}")
        if not self.max_target < 1.0:
            raise ConfigurationError(
                f"`max_target` has to be below 1 (a mass of 1 needs an infinite pull), but is {self.max_target!r}"
            )
        if not 0.0 <= self.entropy_low < self.entropy_high <= 1.0:
            raise ConfigurationError(
                f"the entropy gate needs 0 <= entropy_low < entropy_high <= 1 (normalized entropy H/log V), but "
                f"entropy_low={self.entropy_low!r}, entropy_high={self.entropy_high!r}"
            )
        for name, n in (("drift_window", self.drift_window), ("explore_steps", self.explore_steps)):
            if isinstance(n, bool) or not isinstance(n, int) or n < (1 if name == "drift_window" else 0):
                raise ConfigurationError(f"`{name}` has to be a whole number >= 1, but is {n!r}")
        if self.drift_scope not in DRIFT_SCOPES:
            raise ConfigurationError(
                f"`drift_scope` has to be one of {', '.join(map(repr, DRIFT_SCOPES))}, but is {self.drift_scope!r}"
            )
        _check_iterations(self.iterations)
        _check_candidates(self.candidates)
        if not self.drift_share > 0:
            raise ConfigurationError(f"`drift_share` has to be in (0, 1], but is {self.drift_share!r}")
        for name in ("kl_budget", "late_kl_budget"):
            v = getattr(self, name)
            if not (v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 10)):
                raise ConfigurationError(
                    f"`{name}` has to be None (no limit) or a number in (0, 10] (nats per step), but is {v!r}"
                )
        n = self.kl_budget_steps
        if not (n is None or (isinstance(n, int) and not isinstance(n, bool) and n >= 1)):
            raise ConfigurationError(
                f"`kl_budget_steps` has to be None (the budget holds throughout) or a whole number >= 1, but is {n!r}"
            )

    def row(self) -> dict[str, float]:
        """The thermostat's columns of a schedule row (the decay's come from :class:`DecayOptions`)."""
        return {
            "thermostat": 1.0,
            "explore_until": self.explore_until,
            "strict_from": self.strict_from,
            "explore": self.explore_target,
            "converge": self.converge_target,
            "strict": self.strict_target,
            "explore_steps": self.explore_steps,
            "drift_window": self.drift_window,
            "drift_gain": self.drift_gain,
            "drift_share": self.drift_share,
            "drift_text": 1.0 if self.drift_scope == "text" else 0.0,
            "max_target": self.max_target,
            "entropy_low": self.entropy_low,
            "entropy_high": self.entropy_high,
            "iterations": self.iterations,
            "candidates": self.candidates,
            "kl_budget": 0.0 if self.kl_budget is None else self.kl_budget,
            "kl_budget_steps": 0.0 if self.kl_budget_steps is None else self.kl_budget_steps,
            "late_kl_budget": 0.0 if self.late_kl_budget is None else self.late_kl_budget,
        }


class ThermostatController(ScheduleController):
    """Per row and step, the smallest λ ∈ [0, λ_max] that brings the narrative mass up to a target m*.

    The target (all parts per row, all tensor work, no host synchronisation; :func:`thermostat_target`), each
    part set in ``options`` (:class:`ThermostatOptions`):

    1. **Phase**: ``explore_target`` before ``explore_until`` × budget, ``strict_target`` from
       ``strict_from`` × budget on, ``converge_target`` in between (without a budget: explore for
       ``explore_steps`` steps, then converge).
    2. **Drift**: ``+ drift_gain × clip(1 − s / drift_share, 0, 1)`` where ``s`` is the share of the last
       ``drift_window`` tokens with ``a > 0`` (:func:`off_topic_share`). Even on-topic prose is mostly
       function words, so ``drift_share`` is the share that already counts as "on the narrative" (default
       1/8). The tokens are read through the field's base values (``drift_values``; else the step's
       field). With ``drift_scope="generated"`` the window holds generated tokens only; with
       ``drift_scope="text"`` it reaches back into the prompt (positions before the text count as off), so
       a prompt that ends off the narrative is pulled until the text reaches it.
    3. **Decay** (``decay``, a :class:`DecayOptions`): after ``decay.after_steps`` steps the target halves every
       ``decay.half_life`` steps.
    4. **Entropy gate**: the target is multiplied by ``clip((H/log V − entropy_low) / (entropy_high −
       entropy_low), 0, 1)``: a confident step is left alone, a disordered one gets the full target.
    5. The target is clipped to ``[0, max_target]``.

    Then :meth:`MassProblem.solve` finds λ (``iterations``, ``candidates``; at most ``kl_budget`` nats a step, and
    ``late_kl_budget`` after ``kl_budget_steps``). A row that already has the mass gets λ = 0.

    ``max_strength`` is λ_max, one float or one per prompt (beams repeat rows, as for the other controllers).
    Called on its own it needs ``logits`` and ``field`` in the :class:`StepContext`.

    >>> import torch
    >>> c = ThermostatController(6.0)
    >>> logits = torch.zeros(1, 100)  # flat: maximal entropy, full target
    >>> field = torch.zeros(100); field[:2] = 1.0  # mass 0.02 before the pull
    >>> ctx = StepContext(step=50, max_new_tokens=100, batch_size=1, logits=logits, field=field)
    >>> round(c.target(ctx).item(), 3), round(c(ctx).item(), 2)  # converge target 0.25: e^λ = 0.25/0.75 · 98/2
    (0.25, 2.79)
    >>> confident = logits.clone(); confident[0, 50] = 30.0
    >>> c(StepContext(step=50, max_new_tokens=100, batch_size=1, logits=confident, field=field)).item()
    0.0
    """

    needs_field = True

    def __init__(
        self,
        max_strength: float | Sequence[float] = 6.0,
        options: ThermostatOptions = ThermostatOptions(),
        *,
        decay: DecayOptions = DecayOptions(),
        drift_values: torch.Tensor | None = None,
    ) -> None:
        super().__init__(max_strength)
        for row in self._rows:
            _check_max_strength(row)
        if not isinstance(options, ThermostatOptions):
            raise ConfigurationError(
                f"`options` has to be a ThermostatOptions, but is {type(options).__name__}; "
                "build one with ThermostatOptions(explore_target=..., ...)"
            )
        if not isinstance(decay, DecayOptions):
            raise ConfigurationError(f"`decay` has to be a DecayOptions, but is {type(decay).__name__}")
        if drift_values is not None and (not isinstance(drift_values, torch.Tensor) or drift_values.dim() != 1):
            raise ConfigurationError("`drift_values` has to be a 1-D tensor over the vocabulary (a field's `values`)")
        self.options, self.decay, self.drift_values = options, decay, drift_values

    def __repr__(self) -> str:
        rows = self._rows[0] if len(self._rows) == 1 else list(self._rows)
        return f"{type(self).__name__}(max_strength={rows})"

    def row(self) -> dict[str, float]:
        return {**self.options.row(), **self.decay.row()}

    def phase_target(self, step: int, max_new_tokens: int | None) -> float:
        """The phase part of the target at ``step`` (:func:`phase_value` of the targets)."""
        rs = RowSchedule(schedule_row(**self.row())[None], np.array([max_new_tokens or 0]))
        return float(phase_value(torch.tensor([step]), rs, rs.phase64)[0])

    def off_topic_share(self, ctx: StepContext) -> torch.Tensor:
        """Per row, the share of the drift window off the narrative (:func:`off_topic_share`)."""
        return self._off_topic_share(ctx, self._rows_at(ctx))

    def _off_topic_share(self, ctx: StepContext, rows: tuple[RowSchedule, torch.Tensor]) -> torch.Tensor:
        b = ctx.batch_size
        if ctx.input_ids is None:
            return torch.zeros(b, device=ctx.device)
        recent = last_tokens(ctx.input_ids.long(), self.options.drift_window)
        if self.drift_values is not None:
            on_src = (self.drift_values > 0).to(recent.device)
        elif ctx.field is not None:
            on_src = (ctx.field > 0).to(recent.device)
        else:
            return torch.zeros(b, device=ctx.device)
        v = on_src.shape[-1]
        ids = recent.clamp(0, v - 1)
        on = on_src[ids] if on_src.dim() == 1 else on_src.gather(1, ids)
        on = (on & (recent >= 0) & (recent < v)).to(ctx.device)
        rs, step = rows
        return off_topic_share(on, step, rs)

    def drift(self, ctx: StepContext) -> torch.Tensor:
        """Per row, how far the recent tokens are from the narrative: ``clip(1 − s / drift_share, 0, 1)``."""
        on_share = 1.0 - self.off_topic_share(ctx)
        return (1.0 - on_share / self.options.drift_share).clamp(0.0, 1.0)

    def _problem(self, ctx: StepContext) -> MassProblem:
        if ctx.logits is None or ctx.field is None:
            raise ConfigurationError(
                "ThermostatController needs `logits` and `field` in the StepContext; use it through "
                "NarrativeGravityLogitsProcessor (which passes them), or pass them yourself"
            )
        p, entropy = probabilities(ctx.logits)
        return MassProblem(p, entropy, ctx.field, True, self.options.candidates)

    def _target(self, ctx: StepContext, prob: MassProblem, rows: tuple[RowSchedule, torch.Tensor]) -> torch.Tensor:
        rs, step = rows
        off = self._off_topic_share(ctx, rows).to(prob.entropy.device)
        return thermostat_target(step, rs, prob.entropy, ctx.logits.shape[-1], off)

    def target(self, ctx: StepContext) -> torch.Tensor:
        """The target mass m* per row (``[B]``) for this step."""
        return self._target(ctx, self._problem(ctx), self._rows_at(ctx))

    def __call__(self, ctx: StepContext) -> torch.Tensor:
        prob = self._problem(ctx)
        rows = self._rows_at(ctx)  # the schedule, derived once for the target and the budget
        target = self._target(ctx, prob, rows)
        lam_max = self.base(ctx.batch_size, ctx.logits.device)
        budget = kl_budget_at(rows[1], rows[0])
        if budget is not None:
            budget = budget.to(lam_max.device)
        return prob.solve(target, lam_max, self.options.iterations, kl_budget=budget)
