"""The schedule table: the pull λ's per-row numbers, and the rules that read them at every step.

A schedule is a row of named numbers (:data:`COLUMNS`), made step-ready per row by :class:`RowSchedule`:
rows at different steps, with different budgets and different schedules, are the normal case and share one
pass of tensor work. Each rule is written once:

- :func:`phase_value`: explore → converge → strict over the budget (multipliers for ``phases``, target
  masses for the thermostat);
- :func:`decay_factor`: the classic ``decay_after_steps`` fade;
- :func:`scheduled_strength`: ``constant`` and ``phases``;
- :func:`thermostat_target`, :func:`off_topic_share` and :func:`kl_budget_at`: what the thermostat aims at
  (the solver that reaches it is :mod:`.solve`).

The user-facing names of schedules (``ConstantController(1.2)``) live in :mod:`.controllers` and turn into
rows of this table.

>>> import torch
>>> from narrative_gravity.gravity.controllers import PhaseScheduleController
>>> rows = RowSchedule(PhaseScheduleController(2.0).schedule(2), np.array([100, 100]))  # one row per sequence
>>> scheduled_strength(torch.tensor([0, 95]), rows).tolist()
[1.0, 3.0]
"""

from __future__ import annotations

import math

import numpy as np
import torch

__all__ = [
    "COLUMNS",
    "DRIFT_SCOPES",
    "RowSchedule",
    "decay_factor",
    "kl_budget_at",
    "off_topic_share",
    "phase_value",
    "schedule_row",
    "scheduled_strength",
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

    >>> from narrative_gravity.gravity.controllers import PhaseScheduleController
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


def schedule_row(**values: float) -> np.ndarray:
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
    pos = None if torch.compiler.is_compiling() else _POSITIONS.get(key)  # compiled: an iota, no cache
    if pos is None:  # each position's distance from the newest token, plus one
        pos = torch.arange(width, 0, -1, device=on.device, dtype=torch.float32)
        if not torch.compiler.is_compiling():
            _POSITIONS[key] = pos
    k = torch.clamp(step.to(torch.float32) + rs.window_reach, max=rs.window)
    on_in = (on & (pos <= k[:, None])).sum(dim=-1)
    return (k - on_in) / rs.window


def kl_budget_at(step: torch.Tensor, rs: RowSchedule) -> torch.Tensor | None:
    """Each row's KL budget (nats) at ``step`` (``[R]``, ``inf`` for no limit): ``kl_budget`` for the first
    ``kl_budget_steps`` generated tokens, ``late_kl_budget`` after them; ``None`` where no row has a budget.

    >>> from narrative_gravity.gravity.controllers import ThermostatController, ThermostatOptions
    >>> budget = ThermostatOptions(kl_budget=0.05, kl_budget_steps=64)
    >>> rs = RowSchedule(ThermostatController(4.0, budget).schedule(1), np.array([256]))
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
