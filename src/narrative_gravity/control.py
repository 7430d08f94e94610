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
    "DRIFT_SCOPES",
    "ConstantController",
    "PhaseScheduleController",
    "StepContext",
    "StrengthController",
    "ThermostatController",
    "solve_strength",
]


DRIFT_SCOPES = ("generated", "text")


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
    """Anything that maps a :class:`StepContext` to a ``[B]`` strength tensor.

    A controller that never reads ``ctx.field`` may say so with a class attribute ``needs_field = False``;
    the processors then skip building the dense ``[B, V]`` field and apply gravity on the field's support
    alone. Without the attribute the field is built (safe for any controller).
    """

    def __call__(self, ctx: StepContext) -> torch.Tensor: ...


def _check_strength(value: float, name: str = "strength") -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        raise ConfigurationError(
            f"`{name}` has to be a finite number >= 0, but is {value!r}; use 0 to switch gravity off"
        )
    return float(value)


class _BaseStrength:
    """Holds one base λ, or one per row, and broadcasts it to the batch (beams included)."""

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


# --------------------------------------------------------------------------------------------------
# Thermostat: the smallest pull that reaches a target narrative mass


class _MassProblem:
    """Everything the bisection needs for one step, precomputed from one dense pass over ``[B, V]``.

    Tokens with ``a = 0`` do not move when λ changes, so with ``p = softmax(l)`` the narrative mass of
    ``softmax(l + λ·a)`` is

        m(λ) = Σ_{a>0} p·e^{λa} / Σ_v p·e^{λa}

    and only the field's non-zero tokens change from one λ to the next. They are gathered once into a
    fixed number ``K`` of candidate columns (``candidates``: the columns with the largest ``|a|``); the
    probability outside them enters as a constant. Mass on non-zero tokens outside the candidates (only
    possible when the field has more than ``K`` non-zero columns) is kept at its λ = 0 value, so ``m(λ)``
    is then slightly underestimated and λ errs on the strong side.

    Each evaluation is one ``exp`` and one small batched matmul over ``[B, K]``. Probabilities are at most
    1 and ``e^{λa} <= e^{λ_max}`` with ``λ_max <= 50``, so float32 neither overflows nor loses mass that
    matters (a term that underflows is below 1e-23).
    """

    def __init__(self, logits: torch.Tensor, field: torch.Tensor, idx: torch.Tensor | None) -> None:
        self.logits = logits  # which step this is (the processor reuses `p` and `entropy` for its trace)
        logp = torch.log_softmax(logits.float(), dim=-1)  # NaN rows where every logit is -inf
        p = logp.exp()
        self.p = p
        self.entropy = -(p * logp).nansum(dim=-1)  # 0·log 0 = NaN is skipped
        a = field.to(device=logp.device, dtype=torch.float32)
        pos = (a > 0).float()
        mass0 = p @ pos if a.dim() == 1 else (p * pos).sum(-1)
        self.alive = ~torch.isnan(mass0)
        self.mass0 = torch.nan_to_num(mass0, nan=0.0)
        if idx is None:  # the whole vocabulary takes part
            q, a_c, pos_c = p, a, pos
        else:
            q = p.index_select(-1, idx)
            a_c, pos_c = a.index_select(-1, idx), pos.index_select(-1, idx)
        q = torch.nan_to_num(q, nan=0.0)
        q_pos = q * pos_c
        self.q = torch.stack([q_pos, q], dim=1)  # [B, 2, K]: numerator and denominator weights
        self.a = a_c
        if idx is None:
            self.out_pos = self.out_all = None
        else:
            s_pos, s_all = q_pos.sum(-1), q.sum(-1)
            self.out_pos = (self.mass0 - s_pos).clamp_min(0.0)
            self.out_all = (self.alive.float() - s_all).clamp_min(0.0)

    def mass(self, lam: torch.Tensor) -> torch.Tensor:
        """``m(λ)`` for one λ per row (``[B]``); 0 for rows without a finite logit."""
        w = torch.exp(lam[:, None] * self.a)  # [B, K]
        s = torch.bmm(self.q, w.unsqueeze(-1)).squeeze(-1)  # [B, 2]
        num, den = s[:, 0], s[:, 1]
        if self.out_pos is not None:
            num, den = num + self.out_pos, den + self.out_all
        return torch.nan_to_num(num / den, nan=0.0)


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


def _candidate_columns(field: torch.Tensor, candidates: int) -> torch.Tensor | None:
    """The ``K`` columns with the largest ``|a|`` (over all rows), or ``None`` when ``K`` covers the vocabulary."""
    v = field.shape[-1]
    if candidates >= v:
        return None
    score = field.abs() if field.dim() == 1 else field.abs().amax(dim=0)
    return torch.topk(score.float(), candidates, sorted=False).indices


def solve_strength(
    logits: torch.Tensor,
    field: torch.Tensor,
    target: torch.Tensor | float,
    max_strength: torch.Tensor | float,
    *,
    iterations: int = 14,
    candidates: int = 1024,
    _problem: _MassProblem | None = None,
) -> torch.Tensor:
    """The smallest λ ∈ [0, λ_max] per row whose pulled distribution has narrative mass ≥ ``target``.

    ``m(λ) = Σ_v softmax(logits + λ·a)_v · [a_v > 0]`` is non-decreasing in λ (pulled tokens rise, pushed
    tokens sink), so a vectorized bisection finds it: a fixed number of ``iterations``, no host
    synchronisation, no loop over rows. The returned λ is the upper end of the final bracket, so its mass
    reaches the target; the bracket is ``λ_max / 2**iterations`` wide. Rows whose mass at λ = 0 already
    reaches the target get 0; rows where even λ_max falls short get λ_max; rows without a finite logit get 0.

    Among all distributions with a given narrative mass, the exponential tilt ``p·exp(λa)`` with the
    smallest such λ is the cheapest in ``KL(p'‖p)`` along this family: the pull stops as soon as the mass
    is reached.

    Args:
        logits: ``[B, V]`` next-token scores (``-inf`` allowed).
        field: ``[V]`` or ``[B, V]`` field values.
        target: the mass to reach, a float or ``[B]``.
        max_strength: λ_max, a float or ``[B]``.
        iterations: bisection steps.
        candidates: how many field columns (largest ``|a|``) take part in each iteration (see
            :class:`_MassProblem`); exact whenever the field has at most this many non-zero columns.

    >>> import torch
    >>> logits = torch.zeros(2, 4)
    >>> field = torch.tensor([1.0, 0.0, 0.0, 0.0])
    >>> lam = solve_strength(logits, field, torch.tensor([0.2, 0.5]), 8.0)
    >>> lam[0].item(), round(lam[1].item(), 2)  # mass 0.25 already reaches 0.2; ln 3 for 0.5
    (0.0, 1.1)
    """
    _check_iterations(iterations)
    _check_max_strength(max_strength)
    prob = _problem if _problem is not None else _MassProblem(logits, field, _candidate_columns(field, candidates))
    b, device = logits.shape[0], logits.device
    target_t = torch.as_tensor(target, dtype=torch.float32, device=device).expand(b)
    hi = torch.as_tensor(max_strength, dtype=torch.float32, device=device).expand(b).clone()
    lo = torch.zeros_like(hi)
    for _ in range(iterations):
        mid = 0.5 * (lo + hi)
        reached = prob.mass(mid) >= target_t
        hi = torch.where(reached, mid, hi)
        lo = torch.where(reached, lo, mid)
    done = (prob.mass0 >= target_t) | ~prob.alive
    return torch.where(done, torch.zeros_like(hi), hi)


class ThermostatController(_BaseStrength):
    """Per row and step, the smallest λ ∈ [0, λ_max] that brings the narrative mass up to a target m*.

    The target (all parts per row, all tensor work, no host synchronisation):

    1. **Phase**: ``explore_target`` before ``explore_until`` × budget, ``strict_target`` from
       ``strict_from`` × budget on, ``converge_target`` in between (without a budget: explore for
       ``explore_steps`` steps, then converge).
    2. **Drift**: ``+ drift_gain × clip(1 − s / drift_share, 0, 1)`` where ``s`` is the share of the last
       ``drift_window`` generated tokens with ``a > 0`` (while the window is not yet full, the missing
       tokens count as on the narrative). Even on-topic prose is mostly function words, so
       ``drift_share`` is the share that already counts as "on the narrative" (default 1/8: one narrative
       token in the last 8 is enough); ``drift_share = 1`` gives the plain ``drift_gain × (1 − s)``. The
       tokens are read from ``input_ids`` through the field's base values (``drift_values``; else the
       step's field). With ``drift_scope="generated"`` the window holds generated tokens only: before the
       first one there is no drift. With ``drift_scope="text"`` it reaches back into the prompt (positions
       before the text count as off the narrative): a prompt that ends off the narrative is drift too, so the
       first steps are pulled until the text reaches the narrative, and then the model carries it.
    3. **Decay** (``decay_after_steps``, the classic key): after that many steps the target halves every
       ``decay_half_life`` steps.
    4. **Entropy gate**: the target is multiplied by ``clip((H/log V − entropy_low) / (entropy_high −
       entropy_low), 0, 1)`` where ``H`` is the entropy of the model's own next-token distribution. A
       confident step (normalized entropy at or below ``entropy_low``) gets target 0 and is left alone; a
       disordered one (at or above ``entropy_high``) gets the full target.
    5. The target is clipped to ``[0, max_target]``.

    Then :func:`solve_strength` finds λ. A row that already has the mass gets λ = 0: the model stays on
    its narrative by itself and is not touched.

    ``strength`` is λ_max, one float or one per prompt (beams repeat rows, as for the other controllers).
    The controller needs ``logits`` and ``field`` in the :class:`StepContext` (the HF processor passes them).

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
        if not 0.0 <= explore_until <= strict_from <= 1.0:
            raise ConfigurationError(
                f"phase bounds must satisfy 0 <= explore_until <= strict_from <= 1, but are "
                f"explore_until={explore_until}, strict_from={strict_from}"
            )
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
        if decay_after_steps is not None and (
            isinstance(decay_after_steps, bool) or not isinstance(decay_after_steps, int) or decay_after_steps < 0
        ):
            raise ConfigurationError(
                f"`decay_after_steps` has to be an integer >= 0 or None, but is {decay_after_steps!r}"
            )
        if not decay_half_life > 0:
            raise ConfigurationError(f"`decay_half_life` has to be > 0 steps, but is {decay_half_life!r}")
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
        self._on_topic: dict[str, torch.Tensor] = {}
        self._columns: tuple[torch.Tensor, int, torch.Tensor | None] | None = None

    def __repr__(self) -> str:
        rows = self._rows[0] if len(self._rows) == 1 else list(self._rows)
        return f"{type(self).__name__}(max_strength={rows})"

    def phase_target(self, step: int, max_new_tokens: int | None) -> float:
        """The phase part of the target at ``step`` (pure Python; no tensors)."""
        if max_new_tokens:
            frac = step / max_new_tokens
            if frac < self.explore_until:
                t = self.explore_target
            elif frac >= self.strict_from:
                t = self.strict_target
            else:
                t = self.converge_target
        else:
            t = self.explore_target if step < self.explore_steps else self.converge_target
        return t

    def _decay(self, step: int) -> float:
        if self.decay_after_steps is not None and step > self.decay_after_steps:
            return 0.5 ** ((step - self.decay_after_steps) / self.decay_half_life)
        return 1.0

    def _on_topic_table(self, device: torch.device | str) -> torch.Tensor | None:
        if self.drift_values is None:
            return None
        key = str(device)
        table = self._on_topic.get(key)
        if table is None:
            table = (self.drift_values > 0).to(device=device, dtype=torch.float32)
            self._on_topic[key] = table
        return table

    def off_topic_share(self, ctx: StepContext) -> torch.Tensor:
        """Per row, the share of the ``drift_window`` window taken by tokens whose field value is not > 0.

        ``drift_scope="generated"``: the window holds generated tokens only, and before ``drift_window``
        tokens are generated the missing ones count as on the narrative (a short start is no evidence of
        drift). ``drift_scope="text"``: the window is the text's last ``drift_window`` tokens, prompt
        included, and positions before the text count as off the narrative.
        """
        b = ctx.batch_size
        if self.drift_scope == "text":
            if ctx.input_ids is None:
                return torch.zeros(b, device=ctx.device)
            k = min(self.drift_window, ctx.input_ids.shape[1])
            before = self.drift_window - k  # positions before the text
        else:
            k = min(self.drift_window, ctx.step)
            before = 0
            if k <= 0 or ctx.input_ids is None or ctx.input_ids.shape[1] < k:
                return torch.zeros(b, device=ctx.device)
        if k <= 0:
            return torch.ones(b, device=ctx.device)
        recent = ctx.input_ids[:, -k:].long()
        table = self._on_topic_table(recent.device)
        if table is None:
            field = ctx.field
            if field is None:
                return torch.zeros(b, device=ctx.device)
            on_src = (field > 0).float()
            v = on_src.shape[-1]
            ids = recent.clamp(0, v - 1)
            on = on_src[ids] if on_src.dim() == 1 else on_src.gather(1, ids)
        else:
            v = table.shape[0]
            on = table[recent.clamp(0, v - 1)]
        on = on * ((recent >= 0) & (recent < v))
        return (k + before - on.sum(dim=-1)) / self.drift_window

    def drift(self, ctx: StepContext) -> torch.Tensor:
        """Per row, how far the recent tokens are from the narrative: ``clip(1 − s / drift_share, 0, 1)``."""
        on_share = 1.0 - self.off_topic_share(ctx)
        return (1.0 - on_share / self.drift_share).clamp(0.0, 1.0)

    def _gate(self, entropy: torch.Tensor, vocab: int) -> torch.Tensor:
        h = entropy / math.log(max(vocab, 2))
        return ((h - self.entropy_low) / (self.entropy_high - self.entropy_low)).clamp(0.0, 1.0)

    def _problem(self, ctx: StepContext) -> _MassProblem:
        if ctx.logits is None or ctx.field is None:
            raise ConfigurationError(
                "ThermostatController needs `logits` and `field` in the StepContext; use it through "
                "NarrativeGravityLogitsProcessor (which passes them), or pass them yourself"
            )
        field = ctx.field
        if field.dim() == 1:  # the same field tensor every step: pick its candidate columns once
            cached = self._columns
            if cached is None or cached[0] is not field or cached[1] != field._version:
                self._columns = (field, field._version, _candidate_columns(field, self.candidates))
            idx = self._columns[2]
        else:
            idx = _candidate_columns(field, self.candidates)
        return _MassProblem(ctx.logits, field, idx)

    def _target(self, ctx: StepContext, prob: _MassProblem) -> torch.Tensor:
        base = self.phase_target(ctx.step, ctx.max_new_tokens)
        drift = self.drift_gain * self.drift(ctx).to(prob.entropy.device)
        gate = self._gate(prob.entropy, ctx.logits.shape[-1])
        return ((base + drift) * self._decay(ctx.step) * gate).clamp(0.0, self.max_target)

    def target(self, ctx: StepContext) -> torch.Tensor:
        """The target mass m* per row (``[B]``) for this step."""
        return self._target(ctx, self._problem(ctx))

    def __call__(self, ctx: StepContext) -> torch.Tensor:
        prob = self._problem(ctx)
        self.last_problem = prob  # the step's softmax and entropy, for a thermometer that runs next
        target = self._target(ctx, prob)
        lam_max = self.base(ctx.batch_size, ctx.logits.device)
        return solve_strength(ctx.logits, ctx.field, target, lam_max, iterations=self.iterations, _problem=prob)
