"""Schedules: the pull λ for every row at every step, from each row's own step, budget and measurements.

A schedule is a row of named numbers (:data:`COLUMNS`): rows at different steps, with different budgets and
different schedules, are the normal case and share one pass of tensor work. Each rule is written once:

- :func:`phase_value`: explore → converge → strict over the budget (multipliers for ``phases``, target
  masses for the thermostat);
- :func:`decay_factor`: the classic ``decay_after_steps`` fade;
- :func:`scheduled_strength`: ``constant`` and ``phases``;
- :func:`thermostat_target` and :func:`solve_strength`: the thermostat, the smallest λ that lifts the
  narrative mass to a target.

The controller classes are the user-facing way to name a schedule (``ConstantController(1.2)``); they turn
into schedule rows for the kernel, and can still be called on one :class:`StepContext` (all rows at one
step, a dense field), which goes through the same functions. A controller of your own (any callable that
maps a :class:`StepContext` to a ``[B]`` tensor) runs too, in the transformers engine.

>>> import torch
>>> ctx = StepContext(step=0, max_new_tokens=100, batch_size=2)
>>> ConstantController(1.2)(ctx).tolist()
[1.2000000476837158, 1.2000000476837158]
>>> sched = PhaseScheduleController(2.0)
>>> [round(sched.scale(t, 100), 2) for t in (0, 50, 95)]
[0.5, 1.0, 1.5]
>>> rows = sched.schedule(2)  # [2, len(COLUMNS)] float64, one row per sequence
>>> scheduled_strength(torch.tensor([0, 95]), torch.tensor([100, 100]), Columns(torch.from_numpy(rows))).tolist()
[1.0, 3.0]
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
from .thermo import probabilities

__all__ = [
    "COLUMNS",
    "DRIFT_SCOPES",
    "Columns",
    "ConstantController",
    "MassProblem",
    "PhaseScheduleController",
    "ScheduleController",
    "StepContext",
    "StrengthController",
    "ThermostatController",
    "decay_factor",
    "off_topic_share",
    "phase_value",
    "scheduled_strength",
    "solve_strength",
    "thermostat_target",
]


DRIFT_SCOPES = ("generated", "text")

# The named numbers of one row's schedule. `explore`/`converge`/`strict` are the phase values: multipliers of
# `base` for constant and phases, target masses for the thermostat (whose `base` is λ_max).
COLUMNS = (
    "thermostat",  # 1 for the thermostat, 0 for constant and phases
    "base",  # λ, or λ_max for the thermostat
    "explore_until",
    "strict_from",
    "explore",
    "converge",
    "strict",
    "explore_steps",
    "decay_after",  # -1: no decay
    "half_life",
    "drift_window",
    "drift_gain",
    "drift_share",
    "drift_text",  # 1: the drift window reaches into the prompt
    "max_target",
    "entropy_low",
    "entropy_high",
    "iterations",
    "candidates",
)
_COL = {name: i for i, name in enumerate(COLUMNS)}


class Columns:
    """Named ``[R]`` views of a ``[R, len(COLUMNS)]`` schedule table: ``Columns(t).explore_until``."""

    __slots__ = ("table",)

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table

    def __getattr__(self, name: str) -> torch.Tensor:
        try:
            return self.table[:, _COL[name]]
        except KeyError:
            raise AttributeError(name) from None


def _row(**values: float) -> np.ndarray:
    row = np.zeros(len(COLUMNS), dtype=np.float64)
    row[_COL["decay_after"]] = -1.0
    row[_COL["half_life"]] = 1.0
    row[_COL["drift_window"]] = row[_COL["drift_share"]] = row[_COL["iterations"]] = row[_COL["candidates"]] = 1.0
    row[_COL["entropy_high"]] = 1.0
    for k, v in values.items():
        row[_COL[k]] = v
    return row


# --------------------------------------------------------------------------------------------------
# The rules, each once, per row


def phase_value(
    step: torch.Tensor, budget: torch.Tensor, p: Columns, values: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """The value of each row's phase: ``values[0]`` before ``explore_until`` × budget, ``values[2]`` from
    ``strict_from`` × budget on, ``values[1]`` between. Without a budget (0): explore for ``explore_steps``,
    then converge; never strict. All ``[R]``; float64, so boundaries match Python floats exactly."""
    step = step.to(torch.float64)
    budget = budget.to(torch.float64)
    explore, converge, strict = values
    frac = step / budget.clamp_min(1.0)
    with_budget = torch.where(frac < p.explore_until, explore, torch.where(frac >= p.strict_from, strict, converge))
    without = torch.where(step < p.explore_steps, explore, converge)
    return torch.where(budget > 0, with_budget, without)


def decay_factor(step: torch.Tensor, p: Columns) -> torch.Tensor:
    """``0.5 ** ((step − decay_after) / half_life)`` once a row is past ``decay_after`` (≥ 0), else 1."""
    step = step.to(torch.float64)
    after = p.decay_after
    decays = (after >= 0) & (step > after)
    return torch.where(decays, 0.5 ** ((step - after) / p.half_life), torch.ones_like(step))


def scheduled_strength(step: torch.Tensor, budget: torch.Tensor, p: Columns) -> torch.Tensor:
    """λ of the ``constant`` and ``phases`` schedules: ``base × phase multiplier × decay`` (float64 ``[R]``)."""
    scale = phase_value(step, budget, p, (p.explore, p.converge, p.strict)) * decay_factor(step, p)
    return p.base * scale


def off_topic_share(recent: torch.Tensor, on: torch.Tensor, step: torch.Tensor, p: Columns) -> torch.Tensor:
    """Per row, the share of its ``drift_window`` taken by tokens off the narrative.

    ``recent [R, L]`` are each row's last tokens (``L`` ≥ every window; no token: any id, ``on`` False),
    ``on [R, L]`` whether each is on the narrative. With ``drift_text`` 0 the window holds generated tokens
    only, and before the window is full the missing tokens count as on the narrative; with ``drift_text`` 1
    it is the text's last tokens, prompt included, and positions before the text count as off.
    """
    width = recent.shape[1]
    window = p.drift_window.to(torch.float32)
    k = torch.where(p.drift_text > 0, window, torch.minimum(window, step.to(torch.float32)))
    pos = torch.arange(width, device=recent.device, dtype=torch.float32)
    in_window = pos[None, :] >= (width - k)[:, None]
    on_in = (on & in_window).sum(dim=-1).to(torch.float32)
    return (k - on_in) / window


def thermostat_target(
    step: torch.Tensor, budget: torch.Tensor, p: Columns, entropy: torch.Tensor, vocab: int, off: torch.Tensor
) -> torch.Tensor:
    """The target narrative mass per row (see :class:`ThermostatController`): phase, drift, decay, entropy gate."""
    base = phase_value(step, budget, p, (p.explore, p.converge, p.strict)).to(torch.float32)
    drift = p.drift_gain.float() * (1.0 - (1.0 - off) / p.drift_share.float()).clamp(0.0, 1.0)
    h = entropy.float() / math.log(max(vocab, 2))
    low, high = p.entropy_low.float(), p.entropy_high.float()
    gate = ((h - low) / (high - low)).clamp(0.0, 1.0)
    decay = decay_factor(step, p).to(torch.float32)
    return torch.minimum(((base + drift) * decay * gate).clamp_min(0.0), p.max_target.float())


# --------------------------------------------------------------------------------------------------
# The thermostat's solver: the smallest pull that reaches a target mass


class MassProblem:
    """Everything the solver needs for one step, for fields given on a support.

    Tokens with ``a = 0`` do not move when λ changes, so with ``p = softmax(l)`` the narrative mass of
    ``softmax(l + λ·a)`` is ``m(λ) = Σ_{a>0} p·e^{λa} / Σ_v p·e^{λa}``, and only the support changes from one
    λ to the next. Per row, ``candidates`` support columns take part (``columns``, or else the ones with the
    largest ``|a|``); the probability outside them enters as a constant (mass on pulled tokens outside the
    candidates is kept at its λ = 0 value, so λ then errs on the strong side).

    Args:
        probs: ``softmax(logits)`` on the field's columns, ``[R, S]`` (NaN rows where every logit is ``-inf``).
        entropy: ``[R]``.
        field: ``[R, S]`` (or ``[S]``).
        complete: the columns are the whole vocabulary (else the probability outside them is a constant).
        candidates: how many columns take part (the most any row asks for).
        row_candidates: optional ``[R]``: each row's own count (``≤ candidates``).
        columns: optional ``[R, candidates]`` positions in ``field`` to use, best first (the kernel picks
            them once per field, from its base values).
    """

    def __init__(
        self,
        probs: torch.Tensor,
        entropy: torch.Tensor,
        field: torch.Tensor,
        complete: bool,
        candidates: int,
        row_candidates: torch.Tensor | None = None,
        columns: torch.Tensor | None = None,
    ) -> None:
        self.p, self.entropy = probs, entropy
        b = probs.shape[0]
        p_s = probs
        a = field.to(device=probs.device, dtype=torch.float32).expand(b, -1)
        pos = (a > 0).float()
        mass0 = (p_s * pos).sum(-1)
        self.alive = ~torch.isnan(mass0)
        self.mass0 = torch.nan_to_num(mass0, nan=0.0)
        p_s = torch.nan_to_num(p_s, nan=0.0)
        width = a.shape[1]
        k_max = min(candidates, width)  # a host int: no device read to learn the widest row
        if k_max >= width and columns is None:
            q, a_c, pos_c = p_s, a, pos
        else:
            idx = columns[:, :k_max] if columns is not None else torch.topk(a.abs(), k_max, dim=-1).indices
            q = p_s.gather(1, idx)
            if row_candidates is not None:  # rows that asked for fewer candidates drop the rest
                q = q * (torch.arange(k_max, device=a.device)[None] < row_candidates.to(a.device)[:, None])
            a_c, pos_c = a.gather(1, idx), pos.gather(1, idx)
        if not (k_max >= width and complete and columns is None):
            # the probability outside the candidates is a constant of the solver: one more column with a = 0
            out_pos = (self.mass0 - (q * pos_c).sum(-1)).clamp_min(0.0)
            out_all = (self.alive.float() - q.sum(-1)).clamp_min(0.0)
            q = torch.cat([q, out_all[:, None]], dim=1)
            pos_c = torch.cat([pos_c, (out_pos / out_all.clamp_min(1e-30))[:, None]], dim=1)
            a_c = torch.cat([a_c, torch.zeros_like(a_c[:, :1])], dim=1)
        self.q = torch.stack([q * pos_c, q], dim=1)  # [R, 2, K]: numerator and denominator weights
        self.a = a_c

    def mass(self, lam: torch.Tensor) -> torch.Tensor:
        """``m(λ)`` for one λ per row (``[R]``); 0 for rows without a finite logit."""
        w = torch.exp(lam[:, None] * self.a)  # [R, K]
        s = (w.unsqueeze(1) * self.q).sum(-1)  # [R, 2]; an elementwise product beats bmm at this shape on CPUs
        return (s[:, 0] / s[:, 1].clamp_min(1e-30)).clamp_max(1.0)

    def solve(
        self,
        target: torch.Tensor,
        max_strength: torch.Tensor,
        iterations: int,
        row_iterations: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The smallest λ ∈ [0, λ_max] per row whose mass reaches ``target`` (vectorized bisection).

        ``m(λ)`` is non-decreasing, so a fixed number of ``iterations`` halves the bracket each time, with no
        host synchronisation and no loop over rows. The returned λ is the upper end of the final bracket, so
        its mass reaches the target. Rows already at the target get 0; rows where λ_max falls short get
        λ_max; rows without a finite logit get 0. ``row_iterations`` (``[R]``, each ``≤ iterations``): a row
        stops narrowing after its own count.
        """
        hi = max_strength.to(torch.float32).clone()
        lo = torch.zeros_like(hi)
        for i in range(iterations):
            mid = 0.5 * (lo + hi)
            reached = self.mass(mid) >= target
            if row_iterations is not None:
                live = row_iterations > i
                hi = torch.where(reached & live, mid, hi)
                lo = torch.where(~reached & live, mid, lo)
            else:
                hi = torch.where(reached, mid, hi)
                lo = torch.where(reached, lo, mid)
        done = (self.mass0 >= target) | ~self.alive
        return torch.where(done, torch.zeros_like(hi), hi)


def _check_iterations(iterations: int) -> int:
    if isinstance(iterations, bool) or not isinstance(iterations, int) or not 1 <= iterations <= 64:
        raise ConfigurationError(f"`iterations` has to be an integer in [1, 64], but is {iterations!r}")
    return iterations


MAX_THERMOSTAT_STRENGTH = 50.0


def _check_max_strength(value: torch.Tensor | float) -> None:
    if isinstance(value, torch.Tensor):
        return  # per-row tensors come from the controller, which checked the floats
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= MAX_THERMOSTAT_STRENGTH:
        raise ConfigurationError(
            f"`max_strength` has to be a number in [0, {MAX_THERMOSTAT_STRENGTH:g}], but is {value!r}; "
            "e^50 already multiplies a token's odds by 5e21"
        )


def _check_candidates(candidates: int) -> int:
    if isinstance(candidates, bool) or not isinstance(candidates, int) or candidates < 1:
        raise ConfigurationError(f"`candidates` has to be a positive integer, but is {candidates!r}")
    return candidates


def solve_strength(
    logits: torch.Tensor,
    field: torch.Tensor,
    target: torch.Tensor | float,
    max_strength: torch.Tensor | float,
    *,
    iterations: int = 14,
    candidates: int = 1024,
) -> torch.Tensor:
    """The smallest λ ∈ [0, λ_max] per row whose pulled distribution has narrative mass ≥ ``target``.

    ``m(λ) = Σ_v softmax(logits + λ·a)_v · [a_v > 0]`` is non-decreasing in λ (pulled tokens rise, pushed
    tokens sink), so a vectorized bisection finds it: a fixed number of ``iterations``, no host
    synchronisation, no loop over rows (:class:`MassProblem`). Among all distributions with a given
    narrative mass, the exponential tilt with the smallest such λ is the cheapest in ``KL(p'‖p)`` along
    this family: the pull stops as soon as the mass is reached.

    Args:
        logits: ``[B, V]`` next-token scores (``-inf`` allowed).
        field: ``[V]`` or ``[B, V]`` field values.
        target: the mass to reach, a float or ``[B]``.
        max_strength: λ_max, a float or ``[B]``.
        iterations: bisection steps.
        candidates: how many field columns (largest ``|a|``, per row) take part in each iteration.

    >>> import torch
    >>> logits = torch.zeros(2, 4)
    >>> field = torch.tensor([1.0, 0.0, 0.0, 0.0])
    >>> lam = solve_strength(logits, field, torch.tensor([0.2, 0.5]), 8.0)
    >>> lam[0].item(), round(lam[1].item(), 2)  # mass 0.25 already reaches 0.2; ln 3 for 0.5
    (0.0, 1.1)
    """
    _check_iterations(iterations)
    _check_max_strength(max_strength)
    _check_candidates(candidates)
    b, device = logits.shape[0], logits.device
    p, entropy = probabilities(logits)
    prob = MassProblem(p, entropy, field, True, candidates)
    target_t = torch.as_tensor(target, dtype=torch.float32, device=device).expand(b)
    hi = torch.as_tensor(max_strength, dtype=torch.float32, device=device).expand(b)
    return prob.solve(target_t, hi, iterations)


# --------------------------------------------------------------------------------------------------
# Controllers: how users name a schedule


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


def _check_decay(decay_after_steps: int | None, decay_half_life: float) -> None:
    if decay_after_steps is not None and (
        isinstance(decay_after_steps, bool) or not isinstance(decay_after_steps, int) or decay_after_steps < 0
    ):
        raise ConfigurationError(f"`decay_after_steps` has to be an integer >= 0 or None, but is {decay_after_steps!r}")
    if not decay_half_life > 0:
        raise ConfigurationError(f"`decay_half_life` has to be > 0 steps, but is {decay_half_life!r}")


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
        one = _row(**self.row())
        table = np.repeat(one[None], batch_size, axis=0)
        table[:, _COL["base"]] = self._bases(batch_size)
        return table

    def _columns(self, ctx: StepContext) -> tuple[Columns, torch.Tensor, torch.Tensor]:
        b = ctx.batch_size
        cols = Columns(torch.from_numpy(self.schedule(b)))
        step = torch.full((b,), ctx.step, dtype=torch.int64)
        budget = torch.full((b,), ctx.max_new_tokens or 0, dtype=torch.int64)
        return cols, step, budget

    def __call__(self, ctx: StepContext) -> torch.Tensor:
        cols, step, budget = self._columns(ctx)
        return scheduled_strength(step, budget, cols).to(device=ctx.device, dtype=torch.float32)


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
        _check_phase_bounds(explore_until, strict_from)
        for name, v in (("explore", explore), ("converge", converge), ("strict", strict)):
            _check_strength(v, name)
        _check_decay(decay_after_steps, decay_half_life)
        self.explore_until, self.strict_from = explore_until, strict_from
        self.explore, self.converge, self.strict = explore, converge, strict
        self.explore_steps = explore_steps
        self.decay_after_steps, self.decay_half_life = decay_after_steps, decay_half_life

    def row(self) -> dict[str, float]:
        return {
            "explore_until": self.explore_until,
            "strict_from": self.strict_from,
            "explore": self.explore,
            "converge": self.converge,
            "strict": self.strict,
            "explore_steps": self.explore_steps,
            "decay_after": -1.0 if self.decay_after_steps is None else self.decay_after_steps,
            "half_life": self.decay_half_life,
        }

    def scale(self, step: int, max_new_tokens: int | None) -> float:
        """The multiplier on the base λ at ``step`` (:func:`phase_value` × :func:`decay_factor`)."""
        cols = Columns(torch.from_numpy(_row(**self.row(), base=1.0)[None]))
        lam = scheduled_strength(torch.tensor([step]), torch.tensor([max_new_tokens or 0]), cols)
        return float(lam[0])


class ThermostatController(ScheduleController):
    """Per row and step, the smallest λ ∈ [0, λ_max] that brings the narrative mass up to a target m*.

    The target (all parts per row, all tensor work, no host synchronisation; :func:`thermostat_target`):

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
    3. **Decay** (``decay_after_steps``, the classic key): after that many steps the target halves every
       ``decay_half_life`` steps.
    4. **Entropy gate**: the target is multiplied by ``clip((H/log V − entropy_low) / (entropy_high −
       entropy_low), 0, 1)``: a confident step is left alone, a disordered one gets the full target.
    5. The target is clipped to ``[0, max_target]``.

    Then :meth:`MassProblem.solve` finds λ. A row that already has the mass gets λ = 0.

    ``strength`` is λ_max, one float or one per prompt (beams repeat rows, as for the other controllers).
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
        *,
        explore_until: float = 0.2,
        strict_from: float = 0.8,
        explore_target: float = 0.08,
        converge_target: float = 0.25,
        strict_target: float = 0.4,
        explore_steps: int = 8,
        drift_window: int = 8,
        drift_gain: float = 0.15,
        drift_share: float = 0.125,
        drift_scope: str = "generated",
        max_target: float = 0.95,
        entropy_low: float = 0.05,
        entropy_high: float = 0.25,
        decay_after_steps: int | None = None,
        decay_half_life: float = 25.0,
        iterations: int = 14,
        candidates: int = 1024,
        drift_values: torch.Tensor | None = None,
    ) -> None:
        super().__init__(max_strength)
        for row in self._rows:
            _check_max_strength(row)
        _check_phase_bounds(explore_until, strict_from)
        for name, v in (
            ("explore_target", explore_target),
            ("converge_target", converge_target),
            ("strict_target", strict_target),
            ("drift_gain", drift_gain),
            ("drift_share", drift_share),
            ("max_target", max_target),
        ):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0.0 <= v <= 1.0:
                raise ConfigurationError(f"`{name}` has to be a number in [0, 1], but is {v!r}")
        if not max_target < 1.0:
            raise ConfigurationError(
                f"`max_target` has to be below 1 (a mass of 1 needs an infinite pull), but is {max_target!r}"
            )
        if not 0.0 <= entropy_low < entropy_high <= 1.0:
            raise ConfigurationError(
                f"the entropy gate needs 0 <= entropy_low < entropy_high <= 1 (normalized entropy H/log V), but "
                f"entropy_low={entropy_low!r}, entropy_high={entropy_high!r}"
            )
        for name, n in (("drift_window", drift_window), ("explore_steps", explore_steps)):
            if isinstance(n, bool) or not isinstance(n, int) or n < (1 if name == "drift_window" else 0):
                raise ConfigurationError(f"`{name}` has to be a whole number >= 1, but is {n!r}")
        _check_decay(decay_after_steps, decay_half_life)
        if drift_scope not in DRIFT_SCOPES:
            raise ConfigurationError(
                f"`drift_scope` has to be one of {', '.join(map(repr, DRIFT_SCOPES))}, but is {drift_scope!r}"
            )
        self.drift_scope = drift_scope
        if drift_values is not None and (not isinstance(drift_values, torch.Tensor) or drift_values.dim() != 1):
            raise ConfigurationError("`drift_values` has to be a 1-D tensor over the vocabulary (a field's `values`)")
        self.explore_until, self.strict_from = explore_until, strict_from
        self.explore_target, self.converge_target, self.strict_target = explore_target, converge_target, strict_target
        self.explore_steps = explore_steps
        self.drift_window, self.drift_gain, self.max_target = drift_window, drift_gain, max_target
        self.entropy_low, self.entropy_high = entropy_low, entropy_high
        self.decay_after_steps, self.decay_half_life = decay_after_steps, decay_half_life
        self.iterations = _check_iterations(iterations)
        self.candidates = _check_candidates(candidates)
        if not drift_share > 0:
            raise ConfigurationError(f"`drift_share` has to be in (0, 1], but is {drift_share!r}")
        self.drift_share = drift_share
        self.drift_values = drift_values

    def __repr__(self) -> str:
        rows = self._rows[0] if len(self._rows) == 1 else list(self._rows)
        return f"{type(self).__name__}(max_strength={rows})"

    def row(self) -> dict[str, float]:
        return {
            "thermostat": 1.0,
            "explore_until": self.explore_until,
            "strict_from": self.strict_from,
            "explore": self.explore_target,
            "converge": self.converge_target,
            "strict": self.strict_target,
            "explore_steps": self.explore_steps,
            "decay_after": -1.0 if self.decay_after_steps is None else self.decay_after_steps,
            "half_life": self.decay_half_life,
            "drift_window": self.drift_window,
            "drift_gain": self.drift_gain,
            "drift_share": self.drift_share,
            "drift_text": 1.0 if self.drift_scope == "text" else 0.0,
            "max_target": self.max_target,
            "entropy_low": self.entropy_low,
            "entropy_high": self.entropy_high,
            "iterations": self.iterations,
            "candidates": self.candidates,
        }

    def phase_target(self, step: int, max_new_tokens: int | None) -> float:
        """The phase part of the target at ``step`` (:func:`phase_value` of the targets)."""
        cols = Columns(torch.from_numpy(_row(**self.row())[None]))
        return float(
            phase_value(
                torch.tensor([step]),
                torch.tensor([max_new_tokens or 0]),
                cols,
                (cols.explore, cols.converge, cols.strict),
            )
        )

    def off_topic_share(self, ctx: StepContext) -> torch.Tensor:
        """Per row, the share of the drift window off the narrative (:func:`off_topic_share`)."""
        b = ctx.batch_size
        if ctx.input_ids is None:
            return torch.zeros(b, device=ctx.device)
        recent = last_tokens(ctx.input_ids.long(), self.drift_window)
        if self.drift_values is not None:
            on_src = (self.drift_values > 0).to(recent.device)
        elif ctx.field is not None:
            on_src = (ctx.field > 0).to(recent.device)
        else:
            return torch.zeros(b, device=ctx.device)
        v = on_src.shape[-1]
        ids = recent.clamp(0, v - 1)
        on = on_src[ids] if on_src.dim() == 1 else on_src.gather(1, ids)
        on = on & (recent >= 0) & (recent < v)
        cols, step, _ = self._columns(ctx)
        return off_topic_share(recent, on, step.to(recent.device), cols).to(ctx.device)

    def drift(self, ctx: StepContext) -> torch.Tensor:
        """Per row, how far the recent tokens are from the narrative: ``clip(1 − s / drift_share, 0, 1)``."""
        on_share = 1.0 - self.off_topic_share(ctx)
        return (1.0 - on_share / self.drift_share).clamp(0.0, 1.0)

    def _problem(self, ctx: StepContext) -> MassProblem:
        if ctx.logits is None or ctx.field is None:
            raise ConfigurationError(
                "ThermostatController needs `logits` and `field` in the StepContext; use it through "
                "NarrativeGravityLogitsProcessor (which passes them), or pass them yourself"
            )
        p, entropy = probabilities(ctx.logits)
        return MassProblem(p, entropy, ctx.field, True, self.candidates)

    def _target(self, ctx: StepContext, prob: MassProblem) -> torch.Tensor:
        cols, step, budget = self._columns(ctx)
        off = self.off_topic_share(ctx).to(prob.entropy.device)
        return thermostat_target(step, budget, cols, prob.entropy, ctx.logits.shape[-1], off)

    def target(self, ctx: StepContext) -> torch.Tensor:
        """The target mass m* per row (``[B]``) for this step."""
        return self._target(ctx, self._problem(ctx))

    def __call__(self, ctx: StepContext) -> torch.Tensor:
        prob = self._problem(ctx)
        target = self._target(ctx, prob)
        lam_max = self.base(ctx.batch_size, ctx.logits.device)
        return prob.solve(target, lam_max, self.iterations)
