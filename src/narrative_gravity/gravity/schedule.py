"""Schedules: the pull λ for every row at every step, from each row's own step, budget and measurements.

A schedule is a row of named numbers (:data:`COLUMNS`), made step-ready per row by :class:`RowSchedule`:
rows at different steps, with different budgets and different schedules, are the normal case and share one
pass of tensor work. Each rule is written once:

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
>>> rows = RowSchedule(sched.schedule(2), np.array([100, 100]))  # one schedule row per sequence
>>> scheduled_strength(torch.tensor([0, 95]), rows).tolist()
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
from .thermo import Workspace, probabilities

__all__ = [
    "COLUMNS",
    "DRIFT_SCOPES",
    "ConstantController",
    "MassProblem",
    "PhaseScheduleController",
    "RowSchedule",
    "ScheduleController",
    "StepContext",
    "StrengthController",
    "ThermostatController",
    "decay_factor",
    "grid_bits",
    "kl_budget_at",
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
    "kl_budget",  # the thermostat's most KL (nats) per step; 0: no limit
    "kl_budget_steps",  # kl_budget holds for this many generated tokens; 0: throughout
    "late_kl_budget",  # the budget after kl_budget_steps; 0: no limit
)
_COL = {name: i for i, name in enumerate(COLUMNS)}


class RowSchedule:
    """Per-row schedule numbers in the form a step needs, derived once from a schedule table.

    A schedule table is ``[R, len(COLUMNS)]`` float64 (one :data:`COLUMNS` row per sequence). Everything
    that does not change from step to step is worked out here, on the host, when rows join or leave: the
    step at which each row's explore phase ends and its strict phase starts (exactly where ``step / budget``
    crosses the bounds in float64), the phase values in the dtypes the rules use, and which rules any row
    needs at all. A step then reads these ``[R]`` tensors and does a handful of tensor operations.

    >>> rs = RowSchedule(PhaseScheduleController(2.0).schedule(1), np.array([100]))
    >>> rs.explore_end.tolist(), rs.strict_start.tolist()  # 20 / 100 = 0.2 is no longer "before 0.2"
    ([20], [80])
    """

    NEVER = 2**62  # a phase boundary that no step reaches

    def __init__(self, table: np.ndarray, budget: np.ndarray, device: torch.device | str = "cpu") -> None:
        table = np.asarray(table, dtype=np.float64)
        budget = np.asarray(budget, dtype=np.int64)
        c = {name: table[:, i] for name, i in _COL.items()}
        dev = torch.device(device)

        def put(x: np.ndarray, dtype: torch.dtype) -> torch.Tensor:  # never makes the host wait for the device
            return torch.as_tensor(np.ascontiguousarray(x), dtype=dtype).to(dev, non_blocking=True)

        has_budget = budget > 0
        b = np.maximum(budget, 1).astype(np.float64)
        self.explore_end = put(
            np.where(has_budget, _first_step_at(c["explore_until"], b), c["explore_steps"]), torch.int64
        )
        self.strict_start = put(np.where(has_budget, _first_step_at(c["strict_from"], b), self.NEVER), torch.int64)
        phase = np.stack([c["explore"], c["converge"], c["strict"]], axis=1)
        self.phase64 = put(phase, torch.float64).unbind(1)  # multipliers: base × scale in float64, as Python does
        self.phase32 = put(phase.astype(np.float32), torch.float32).unbind(1)  # thermostat targets
        self.base64 = put(c["base"], torch.float64)
        self.base32 = put(c["base"].astype(np.float32), torch.float32)
        self.thermostat = put(c["thermostat"] > 0, torch.bool)
        decays = (c["decay_after"] >= 0) & (c["half_life"] > 0)  # an empty row's zeros: no decay
        self.decay_after = put(np.where(decays, c["decay_after"], np.inf), torch.float64)
        self.half_life = put(np.where(decays, c["half_life"], 1.0), torch.float64)
        # an empty row's zeros become harmless ones (its λ comes from its zero base, never from here)
        window = np.where(c["drift_window"] > 0, c["drift_window"], 1.0).astype(np.float32)
        self.window = put(window, torch.float32)
        # the window holds min(window, step) generated tokens, or `window` tokens of the text
        self.window_reach = put(np.where(c["drift_text"] > 0, np.inf, 0.0).astype(np.float32), torch.float32)
        share = np.where(c["drift_share"] > 0, c["drift_share"], 1.0).astype(np.float32)
        self.drift_gain = put(c["drift_gain"].astype(np.float32), torch.float32)
        # 1 − (1 − off) / share = off / share + (1 − 1 / share)
        self.drift_scale = put(np.float32(1.0) / share, torch.float32)
        self.drift_shift = put(np.float32(1.0) - np.float32(1.0) / share, torch.float32)
        self.zero = torch.zeros(len(budget), dtype=torch.float32, device=dev)
        self.max_target = put(c["max_target"].astype(np.float32), torch.float32)
        low, high = c["entropy_low"].astype(np.float32), c["entropy_high"].astype(np.float32)
        self._gate = (low, np.where(high > low, high - low, np.float32(1.0)))
        self._gate_by_vocab: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # host-side: which rules run, and the solver's sizes
        thermo = c["thermostat"] > 0
        self.any_thermostat, self.all_thermostat = bool(thermo.any()), bool(thermo.all())
        self.any_decay = bool(decays.any())
        self.iterations = c["iterations"][thermo].astype(np.int64)
        self.candidates = c["candidates"][thermo].astype(np.int64)
        self.row_iterations = put(c["iterations"], torch.int64)
        self.row_candidates = put(c["candidates"], torch.int64)
        budgeted = c["kl_budget"] > 0
        ends = c["kl_budget_steps"] > 0
        late = ends & (c["late_kl_budget"] > 0)
        self.any_kl_budget = bool(((budgeted | late) & thermo).any())
        self.kl_budget = put(np.where(budgeted, c["kl_budget"], np.inf).astype(np.float32), torch.float32)
        self.any_kl_budget_end = bool((ends & thermo).any())
        self.kl_budget_end = put(np.where(ends, c["kl_budget_steps"], self.NEVER).astype(np.int64), torch.int64)
        self.late_kl_budget = put(np.where(late, c["late_kl_budget"], np.inf).astype(np.float32), torch.float32)

    def gate(self, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(shift, scale)`` of the entropy gate for ``vocab``: ``gate = clip(shift + H·scale, 0, 1)``, which is
        ``(H / log V − entropy_low) / (entropy_high − entropy_low)``."""
        pair = self._gate_by_vocab.get(vocab)
        if pair is None:
            low, span = self._gate
            log_v = np.float32(math.log(max(vocab, 2)))
            dev = self.window.device
            pair = (
                torch.as_tensor(-low / span).to(dev, non_blocking=True),
                torch.as_tensor(np.float32(1.0) / (span * log_v)).to(dev, non_blocking=True),
            )
            self._gate_by_vocab[vocab] = pair
        return pair


def _first_step_at(fraction: np.ndarray, budget: np.ndarray) -> np.ndarray:
    """The first whole step ``s`` with ``s / budget >= fraction`` (float64, as the division rounds)."""
    s = np.ceil(fraction * budget)
    s = np.where((s > 0) & ((s - 1) / budget >= fraction), s - 1, s)
    return np.where(s / budget < fraction, s + 1, s)


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
    step: torch.Tensor, rs: RowSchedule, values: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """Each row's phase value at ``step`` from ``values`` (explore, converge, strict; each ``[R]``).

    With a budget, explore lasts while ``step / budget < explore_until`` and strict starts once
    ``step / budget >= strict_from``; without one (budget 0), explore lasts ``explore_steps`` steps and
    strict never starts.
    """
    explore, converge, strict = values
    return torch.where(step >= rs.strict_start, strict, torch.where(step >= rs.explore_end, converge, explore))


def decay_factor(step: torch.Tensor, rs: RowSchedule) -> torch.Tensor:
    """``0.5 ** ((step − decay_after) / half_life)`` once a row is past ``decay_after``, else 1 (float64)."""
    past = (step.to(torch.float64) - rs.decay_after).clamp_min(0.0)
    return 0.5 ** (past / rs.half_life)


def scheduled_strength(step: torch.Tensor, rs: RowSchedule) -> torch.Tensor:
    """λ of the ``constant`` and ``phases`` schedules: ``base × phase multiplier × decay`` (float64 ``[R]``)."""
    scale = phase_value(step, rs, rs.phase64)
    if rs.any_decay:
        scale = scale * decay_factor(step, rs)
    return rs.base64 * scale


_POSITIONS: dict[tuple[int, torch.device], torch.Tensor] = {}


def off_topic_share(on: torch.Tensor, step: torch.Tensor, rs: RowSchedule) -> torch.Tensor:
    """Per row, the share of its ``drift_window`` taken by tokens off the narrative.

    ``on [R, L]`` says whether each of the row's last ``L`` tokens (``L`` ≥ every window; oldest first) is
    on the narrative (no token: False). With ``drift_text`` 0 the window holds generated tokens only, and
    before the window is full the missing tokens count as on the narrative; with ``drift_text`` 1 it is the
    text's last tokens, prompt included, and positions before the text count as off.
    """
    width = on.shape[1]
    key = (width, on.device)
    pos = _POSITIONS.get(key)
    if pos is None:  # each position's distance from the newest token, plus one
        pos = _POSITIONS[key] = torch.arange(width, 0, -1, device=on.device, dtype=torch.float32)
    k = torch.clamp(step.to(torch.float32) + rs.window_reach, max=rs.window)
    on_in = (on & (pos <= k[:, None])).sum(dim=-1)
    return (k - on_in) / rs.window


def kl_budget_at(step: torch.Tensor, rs: RowSchedule) -> torch.Tensor | None:
    """Each row's KL budget (nats) at ``step`` (``[R]``, ``inf`` for no limit): ``kl_budget`` for the first
    ``kl_budget_steps`` generated tokens, ``late_kl_budget`` after them; ``None`` where no row has a budget.

    >>> rs = RowSchedule(ThermostatController(4.0, kl_budget=0.05, kl_budget_steps=64).schedule(1), np.array([256]))
    >>> [kl_budget_at(torch.tensor([s]), rs).item() for s in (0, 63, 64)]  # then no limit
    [0.05000000074505806, 0.05000000074505806, inf]
    """
    if not rs.any_kl_budget:
        return None
    if not rs.any_kl_budget_end:
        return rs.kl_budget
    return torch.where(step >= rs.kl_budget_end, rs.late_kl_budget, rs.kl_budget)


def thermostat_target(
    step: torch.Tensor, rs: RowSchedule, entropy: torch.Tensor, vocab: int, off: torch.Tensor
) -> torch.Tensor:
    """The target narrative mass per row (see :class:`ThermostatController`): phase, drift, decay, entropy gate."""
    base = phase_value(step, rs, rs.phase32)
    drift = rs.drift_gain * torch.addcmul(rs.drift_shift, off, rs.drift_scale).clamp(0.0, 1.0)
    shift, scale = rs.gate(vocab)
    gate = torch.addcmul(shift, entropy, scale).clamp(0.0, 1.0)
    target = base + drift
    if rs.any_decay:
        target = target * decay_factor(step, rs).to(torch.float32)
    return torch.clamp(target * gate, min=rs.zero, max=rs.max_target)


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
        a = field.to(device=probs.device, dtype=torch.float32).expand(b, -1)
        self.mass0 = (probs * (a > 0)).sum(-1)  # NaN for rows without a finite logit (or with a NaN one)
        width = a.shape[1]
        k_max = min(candidates, width)  # a host int: no device read to learn the widest row
        if k_max >= width and columns is None:
            q, a_c = probs, a
        else:
            idx = columns[:, :k_max] if columns is not None else torch.topk(a.abs(), k_max, dim=-1).indices
            q, a_c = probs.gather(1, idx), a.gather(1, idx)
            if row_candidates is not None:  # rows that asked for fewer candidates drop the rest
                q = q * (torch.arange(k_max, device=a.device)[None] < row_candidates.to(a.device)[:, None])
        self.num = torch.where(a_c > 0, q, 0.0)  # [R, K]: the weights of m(λ)'s numerator and denominator
        self.den = q
        self.a = a_c
        # the probability outside the candidates is a constant of the solver (a = 0 there)
        self.outside = not (k_max >= width and complete and columns is None)

    @property
    def alive(self) -> torch.Tensor:
        """``[R]`` bool: the row's softmax is finite (it has a finite logit, and no NaN or ``+inf``)."""
        return ~torch.isnan(self.mass0)

    def _outside(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The numerator's and the denominator's probability outside the candidates (``[R]`` each)."""
        if not self.outside:
            return torch.zeros_like(self.mass0), torch.zeros_like(self.mass0)
        return (self.mass0 - self.num.sum(-1)).clamp_min(0.0), (1.0 - self.den.sum(-1)).clamp_min(0.0)

    def mass(self, lam: torch.Tensor) -> torch.Tensor:
        """``m(λ)`` for one λ per row (``[R]``); 0 for rows without a finite logit."""
        w = torch.exp(lam[:, None] * self.a)  # [R, K]
        out_num, out_den = self._outside()
        num, den = (w * self.num).sum(-1) + out_num, (w * self.den).sum(-1) + out_den
        return torch.nan_to_num(num / den.clamp_min(1e-30), nan=0.0).clamp_max(1.0)

    def solve(
        self,
        target: torch.Tensor,
        max_strength: torch.Tensor,
        iterations: int,
        row_iterations: torch.Tensor | None = None,
        *,
        bits: int | None = None,
        workspace: Workspace | None = None,
        kl_budget: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The smallest λ on the grid ``λ_max · j / 2^iterations`` (``j = 1 … 2^iterations``) per row whose mass
        reaches ``target``: what ``iterations`` steps of bisection on ``[0, λ_max]`` return.

        ``m(λ) ≥ t`` is ``Σ (num − t·den)·e^{λa} ≥ 0``, one weighted sum per λ; ``m`` is non-decreasing, so
        a coarse grid of λ values, all evaluated in one batched product, finds the bracket, and finer grids
        inside it find the grid point. Each level reads a few bits of ``j`` at once: far fewer tensor
        operations than bisection's one bit per pass, with no host synchronisation and no loop over rows.
        Rows already at the target get 0; rows where λ_max falls short get λ_max; rows without a finite
        logit get 0. ``row_iterations`` (``[R]``, each ``≤ iterations``): a row's own, coarser grid.
        ``bits``: grid points per level are ``2^bits`` (default: by the problem's size); the answer does not
        depend on it. ``workspace``: keeps the ``[R, 2^bits, K]`` grid buffer from one step to the next (a fresh
        one of a megabyte each level can cost page faults).

        ``kl_budget`` (``[R]``, ``inf`` for no limit): the search also stops at the first grid λ whose pull costs
        at least this much, ``KL(p_λ ‖ p) = λ·E_{p_λ}[a] − log Z(λ)`` with ``Z(λ) = Σ p·e^{λa}``. KL grows
        with λ (its derivative is ``λ·Var_{p_λ}(a)``), so the bracket search is the same, on two sums more
        of the same products.
        """
        r, k = self.a.shape
        weights = torch.addcmul(self.num, target[:, None], self.den, value=-1.0)  # [R, K]
        # m(λ) ≥ t is Σ_K weights·e^{λa} ≥ −(the same sum outside the candidates, where a = 0), and that
        # is t·(1 − Σ_K den) − (m(0) − Σ_K num) = t − m(0) + Σ_K weights
        floor = (target - self.mass0 + weights.sum(-1)) if self.outside else torch.zeros_like(target)
        floor = floor[:, None]
        if kl_budget is None:
            weights = weights[:, :, None]
        else:  # Z(λ) and Σ p·a·e^{λa} on the candidates, in the same product
            weights = torch.stack([weights, self.den, self.den * self.a], dim=-1)  # [R, K, 3]
            z_outside = self._outside()[1][:, None]
            budget = kl_budget.to(device=self.a.device, dtype=torch.float32)[:, None]
        a = self.a[:, None, :]
        if bits is None:
            bits = grid_bits(r, k, self.a.device)
        dtype = torch.float32 if iterations <= 24 else torch.float64
        lam_max = max_strength.to(dtype)
        lo = torch.zeros(r, dtype=dtype, device=self.a.device)  # the largest grid point known to fall short
        done_bits = 0
        while done_bits < iterations:
            n = min(bits, iterations - done_bits)
            done_bits += n
            unit = lam_max * 0.5**done_bits
            lam = torch.addcmul(lo[:, None], unit[:, None], _steps(2**n, dtype, lo.device))  # [R, g]
            lam_a = lam[:, :, None].float()
            if workspace is None:
                grid = torch.exp(lam_a * a)
            else:  # the same numbers, in a kept buffer
                grid = torch.mul(lam_a, a, out=workspace.shaped("solver", (r, 2**n, k), a.device)).exp_()
            s = torch.bmm(grid, weights)  # [R, g, 1 or 3]
            short = s[..., 0] < floor  # [R, g]
            if kl_budget is not None:
                z = (s[..., 1] + z_outside).clamp_min(1e-30)
                kl = lam.float() * s[..., 2] / z - torch.log(z)
                short = short & (kl < budget)
            # the bracket's top point reaches the target (it did on the level before); where even λ_max
            # falls short, every level stops below the top and λ ends at λ_max
            below = torch.sum(short, dim=1, dtype=dtype).clamp_max(2**n - 1)
            lo = torch.addcmul(lo, unit, below)
        unit = lam_max * 0.5**iterations
        lam = lo + unit
        if row_iterations is not None:  # a coarser grid: round up to a multiple of 2^(iterations − own) units
            d = torch.exp2((iterations - row_iterations.to(dtype)).clamp_min(0)) * unit
            lam = torch.ceil(lam / d) * d
        # rows already at the target, and rows without a finite logit (NaN mass), get 0
        return torch.where(self.mass0 < target, lam.float(), 0.0)


# Off the CPU, the most values a level of the solver's grid may hold (``R × 2^bits × K``; 32 MB in float32).
ACCELERATOR_GRID = 2**23


def grid_bits(rows: int, candidates: int, device: torch.device | str) -> int:
    """How many bits of the answer one level of :meth:`MassProblem.solve` reads: ``2^bits`` λ per level.

    On the CPU a level costs its arithmetic, so few λ per level once the problem is large. On an accelerator a
    level costs its kernel launches, not its arithmetic, so as many λ per level as :data:`ACCELERATOR_GRID`
    values allow (at most 7 bits): the default 14 iterations take 2 levels instead of 5.

    >>> grid_bits(8, 1024, "cpu"), grid_bits(8, 1024, "cuda"), grid_bits(512, 1024, "cuda")
    (3, 7, 4)
    """
    size = max(rows * candidates, 1)
    if torch.device(device).type == "cpu":
        return 7 if size <= 2048 else 3 if size <= 65536 else 2
    if size > ACCELERATOR_GRID // 4:
        return 2
    return min(7, int(math.log2(ACCELERATOR_GRID // size)))


_STEPS: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


def _steps(g: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[1, 2, …, g]`` (cached)."""
    key = (g, dtype, device)
    steps = _STEPS.get(key)
    if steps is None:
        steps = _STEPS[key] = torch.arange(1, g + 1, dtype=dtype, device=device)
    return steps


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
    tokens sink), so a search over the grid ``λ_max · j / 2^iterations`` finds it: a fixed number of batched
    passes, no host synchronisation, no loop over rows (:class:`MassProblem`). Among all distributions with a given
    narrative mass, the exponential tilt with the smallest such λ is the cheapest in ``KL(p'‖p)`` along
    this family: the pull stops as soon as the mass is reached.

    Args:
        logits: ``[B, V]`` next-token scores (``-inf`` allowed).
        field: ``[V]`` or ``[B, V]`` field values.
        target: the mass to reach, a float or ``[B]``.
        max_strength: λ_max, a float or ``[B]``.
        iterations: bits of λ's grid (what as many bisection steps would resolve).
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
        rs = RowSchedule(_row(**self.row(), base=1.0)[None], np.array([max_new_tokens or 0]))
        return float(scheduled_strength(torch.tensor([step]), rs)[0])


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
        kl_budget: float | None = None,
        kl_budget_steps: int | None = None,
        late_kl_budget: float | None = None,
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
        for name, v in (("kl_budget", kl_budget), ("late_kl_budget", late_kl_budget)):
            ok = v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 10)
            if not ok:
                raise ConfigurationError(
                    f"`{name}` has to be None (no limit) or a number in (0, 10] (nats per step), but is {v!r}"
                )
        ok = kl_budget_steps is None or (
            isinstance(kl_budget_steps, int) and not isinstance(kl_budget_steps, bool) and kl_budget_steps >= 1
        )
        if not ok:
            raise ConfigurationError(
                f"`kl_budget_steps` has to be None (the budget holds throughout) or a whole number >= 1, but is "
                f"{kl_budget_steps!r}"
            )
        self.kl_budget, self.kl_budget_steps, self.late_kl_budget = kl_budget, kl_budget_steps, late_kl_budget

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
            "kl_budget": 0.0 if self.kl_budget is None else self.kl_budget,
            "kl_budget_steps": 0.0 if self.kl_budget_steps is None else self.kl_budget_steps,
            "late_kl_budget": 0.0 if self.late_kl_budget is None else self.late_kl_budget,
        }

    def phase_target(self, step: int, max_new_tokens: int | None) -> float:
        """The phase part of the target at ``step`` (:func:`phase_value` of the targets)."""
        rs = RowSchedule(_row(**self.row())[None], np.array([max_new_tokens or 0]))
        return float(phase_value(torch.tensor([step]), rs, rs.phase64)[0])

    def off_topic_share(self, ctx: StepContext) -> torch.Tensor:
        """Per row, the share of the drift window off the narrative (:func:`off_topic_share`)."""
        return self._off_topic_share(ctx, self._rows_at(ctx))

    def _off_topic_share(self, ctx: StepContext, rows: tuple[RowSchedule, torch.Tensor]) -> torch.Tensor:
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
        on = (on & (recent >= 0) & (recent < v)).to(ctx.device)
        rs, step = rows
        return off_topic_share(on, step, rs)

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
        return prob.solve(target, lam_max, self.iterations, kl_budget=budget)
