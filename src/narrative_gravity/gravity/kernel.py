"""The steering kernel: every engine's rows, their state, and one step of gravity over a batch.

The kernel owns all per-step math and all per-row state, and knows no engine. An engine adapter only
translates its bookkeeping into kernel rows:

- :meth:`GravityKernel.add` when a sequence joins (its :class:`Program`, budget, prompt and any output so
  far), :meth:`~GravityKernel.remove` when it leaves, :meth:`~GravityKernel.swap`/:meth:`~GravityKernel.move`
  when the engine reorders its batch;
- :meth:`~GravityKernel.advance` with each row's newest token;
- :meth:`~GravityKernel.apply` with the step's logits.

Rows at different steps, with different budgets and programs (or none), are the normal case: the
transformers engine is the special case where every row shares a step. Per-row settings live in host
arrays, copied to the device only when they change; per-row history lives on the device.

>>> import torch
>>> from narrative_gravity.gravity.field import NarrativeField
>>> from narrative_gravity.gravity.controllers import ConstantController
>>> prog = Program(field=NarrativeField(values=torch.tensor([1.0, 0.0, -1.0])),
...                schedule=ConstantController(2.0).schedule(1)[0])
>>> k = GravityKernel(capacity=2)
>>> k.add(1, prog, budget=8, prompt=[0])          # row 0 has no gravity
>>> k.apply(torch.zeros(2, 3))[0].tolist()
[[0.0, 0.0, 0.0], [2.0, 0.0, -2.0]]
"""

from __future__ import annotations

import dataclasses
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from ..errors import ConfigurationError
from .field import NO_TOKEN, NarrativeField, last_tokens, match_suffixes
from .require import Requirement, RequireTables, advance_required, pull_required
from .schedule import _COL, COLUMNS, RowSchedule, kl_budget_at, off_topic_share, scheduled_strength, thermostat_target
from .solve import MassProblem
from .stages import StagePlan, advance_stages
from .thermo import Measurement, Workspace, measure, measure_from_probs, measure_on_support, probabilities
from .tilt import apply_gravity, check_repeat_weight

__all__ = [
    "COMPILE_ENV",
    "COMPILE_MODES",
    "GravityKernel",
    "Program",
    "StepResult",
    "compile_mode",
    "compiled_step",
    "record_nan",
]

# Above this share of the vocabulary a union of supports is handled as the whole vocabulary.
_DENSE_SHARE = 0.5


@dataclass(frozen=True)
class Program:
    """Everything the kernel needs for one profile, built once and shared by every row that uses it.

    Args:
        field: the narrative field (ignored when ``stages`` is given).
        stages: a :class:`~narrative_gravity.gravity.stages.StagePlan`: the row pulls toward its current
            stage's field.
        schedule: the default schedule row (``[len(COLUMNS)]``, see
            :meth:`~narrative_gravity.gravity.controllers.ScheduleController.schedule`); a row may bring its own.
        repeat_weight: the share of its pull a narrative token keeps once the row has generated it.
        prune_threshold: mask tokens whose field value is at or below this; ``None`` = off.
        requirement: words the text must contain before it ends
            (:class:`~narrative_gravity.gravity.require.Requirement`); ``None`` = none.
        key: identifies equal programs (the kernel shares their tables).
    """

    field: NarrativeField | None = None
    schedule: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(len(COLUMNS)))
    stages: StagePlan | None = None
    repeat_weight: float = 1.0
    prune_threshold: float | None = None
    requirement: Requirement | None = None
    key: str = ""

    def __post_init__(self) -> None:
        if self.stages is None and not isinstance(self.field, NarrativeField):
            raise ConfigurationError(
                f"a Program needs a NarrativeField or stages, but got field={type(self.field).__name__}"
            )
        check_repeat_weight(self.repeat_weight)
        if self.prune_threshold is not None and not -1.0 <= self.prune_threshold < 1.0:
            raise ConfigurationError(
                f"`prune_threshold` has to be in [-1, 1), but is {self.prune_threshold!r}; field values lie in [-1, 1]"
            )
        if np.shape(self.schedule) != (len(COLUMNS),):
            raise ConfigurationError(f"`schedule` has to be one row of {len(COLUMNS)} numbers (schedule.COLUMNS)")
        if self.requirement is not None and not isinstance(self.requirement, Requirement):
            raise ConfigurationError(
                f"`requirement` has to be a Requirement, but is {type(self.requirement).__name__}; build one with "
                "narrative_gravity.fields.required.build_requirement(tokenizer, words)"
            )

    @property
    def fields(self) -> tuple[NarrativeField, ...]:
        return self.stages.fields if self.stages is not None else (self.field,)

    @property
    def history(self) -> int:
        """How many of a row's last tokens this program reads (continuations, stage words, drift window)."""
        width = max((f.max_prefix_len for f in self.fields), default=0)
        if self.stages is not None and self.stages.words:
            width = max([width, *(len(f) for ws in self.stages.words for fs in ws for f in fs)])
        if self.schedule[_COL["thermostat"]]:
            width = max(width, int(self.schedule[_COL["drift_window"]]))
        if self.requirement is not None:
            width = max(width, self.requirement.history)
        return max(width, 1)


@dataclass
class StepResult:
    """What :meth:`GravityKernel.apply` did besides the logits: ``strength`` ``[B]``, when asked the step's
    :class:`~narrative_gravity.gravity.thermo.Measurement`, and ``finite``."""

    strength: torch.Tensor
    measurement: Measurement | None = None
    finite: torch.Tensor | None = None
    """``[B]`` bool where the thermostat ran: whether the row's softmax was finite (``False`` for a row with
    a NaN or ``+inf`` logit, or without a finite one), so an engine can check its logits at no extra pass."""


@dataclass
class _Bank:
    """Every live program's field rows on one union support (rebuilt when the set of programs changes)."""

    support: torch.Tensor  # [S] sorted token ids
    dense: bool  # the support is the whole vocabulary
    pos_of: torch.Tensor  # [V] position in the support, -1 outside
    values: torch.Tensor  # [F + 1, S]; the last row is all zero (rows without gravity)
    on_vocab: torch.Tensor  # [F + 1, V + 1] values > 0 over the vocabulary; the last column is False
    share: torch.Tensor  # [F + 1] float64: the field row's share of the budget (1 outside stages)
    need: torch.Tensor  # [F + 1] words that cover the stage
    prefixes: torch.Tensor | None  # [E, L] continuation prefixes, right-aligned, -1 padded
    next_pos: torch.Tensor | None  # [E] position of the continuing piece in the support
    next_values: torch.Tensor | None  # [E]
    entry_frow: torch.Tensor | None  # [E] field row of each entry
    forms: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # stage words (patterns, field row, word)
    columns: torch.Tensor  # [F + 1, K] the thermostat's candidate positions per field row, largest |a| first
    n_words: int
    first: dict[int, int]  # program slot -> its first field row
    zero_row: int
    require: RequireTables | None = None  # every live program's required words
    require_of: dict[int, int] = dataclasses.field(default_factory=dict)  # program slot -> its requirement


@dataclass
class _Plan:
    """What a step over one set of rows needs that changes only when rows join, leave or move: the rows'
    schedules in step-ready form, their field rows, and the host-side choices (which rules run, the solver's
    sizes), so that a step makes no host decisions over per-row arrays."""

    schedule: RowSchedule
    first: torch.Tensor  # [B] each row's first field row
    columns: torch.Tensor | None  # [B, K] candidate columns (rows without stages; else read per step)
    staged: bool  # some row runs stages: its field row moves with its stage
    repeat: torch.Tensor | None  # [B, 1] repeat_weight, when some row has one below 1
    threshold: torch.Tensor | None  # [B, 1] prune threshold (NaN: off), when some row prunes
    prunes_off_support: bool  # some threshold is >= 0, so tokens off the support are pruned too
    candidates: int
    row_candidates: torch.Tensor | None  # [B] when rows ask for different counts
    iterations: int
    row_iterations: torch.Tensor | None  # [B] when rows ask for different counts
    said_index: torch.Tensor | None  # [B·S] the rows' support cells in the flat `said` table, with `repeat`
    require: torch.Tensor | None = None  # [B] each row's requirement, when some row has one


class GravityKernel:
    """Per-row state and one step of gravity for up to ``capacity`` rows (see the module doc).

    Args:
        capacity: the most rows at once (vLLM's ``max_num_seqs``; the batch size for transformers).
        device: where the per-row history and the field tables live (the logits' device).
        max_idle: programs no row uses are kept for reuse until more than this many pile up.
    """

    def __init__(
        self, capacity: int, device: torch.device | str = "cpu", *, max_idle: int = 32, compile: str | None = None
    ) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ConfigurationError(f"`capacity` has to be a positive integer, but is {capacity!r}")
        self.capacity = capacity
        self.device = torch.device(device)
        self.max_idle = max_idle
        self.compile = compile_mode(compile)
        self._compiled: Callable[..., tuple[torch.Tensor, StepResult]] | None = None
        self._compiled_advance: Callable[..., tuple[torch.Tensor, StepResult]] | None = None
        self._row_range: torch.Tensor | None = None
        self._bits = compiled_bits(self.device)
        # programs: slot -> Program, with reference counts and an LRU of idle slots
        self._programs: dict[int, Program] = {}
        self._by_key: dict[str, int] = {}
        self._refs: dict[int, int] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()
        self._next_slot = 0
        self._version = 0
        self._bank: tuple[tuple[int, int, torch.dtype], _Bank] | None = None
        # per-row settings on the host (copied to the device when they change)
        n = capacity
        self.prog = np.full(n, -1, dtype=np.int64)
        self.budget = np.zeros(n, dtype=np.int64)
        self.sched = np.zeros((n, len(COLUMNS)), dtype=np.float64)
        self.repeat = np.ones(n, dtype=np.float32)
        self.threshold = np.full(n, np.nan, dtype=np.float32)
        self.last_stage = np.zeros(n, dtype=np.int64)
        self.requires = np.zeros(n, dtype=bool)
        self._dev: dict[str, torch.Tensor] = {}
        self._plans: dict[bytes, _Plan] = {}
        self._work = Workspace()
        self._dirty = True
        # per-row history on the device
        self.width = 1
        self.recent = torch.full((n, 1), NO_TOKEN, dtype=torch.long, device=self.device)
        self.step = torch.zeros(n, dtype=torch.long, device=self.device)
        self.stage = torch.zeros(n, dtype=torch.long, device=self.device)
        self.start = torch.zeros(n, dtype=torch.long, device=self.device)
        self.seen = torch.zeros(n, 1, dtype=torch.bool, device=self.device)
        self.written = torch.zeros(n, 1, dtype=torch.bool, device=self.device)  # required words written
        self.said: torch.Tensor | None = None  # [n, V] bool, made when a program needs it
        self._vocab: int | None = None

    # -- programs -------------------------------------------------------------------------------------

    @staticmethod
    def _key(program: Program) -> str:
        """Equal keys share a slot; a program without a key is shared only with itself (it is held while
        registered, so its ``id`` cannot be reused meanwhile)."""
        return program.key or f"object {id(program)}"

    def _acquire(self, program: Program) -> int:
        key = self._key(program)
        slot = self._by_key.get(key)
        if slot is None:
            slot = self._next_slot
            self._next_slot += 1
            self._programs[slot] = program
            self._refs[slot] = 0
            self._by_key[key] = slot
            self._version += 1
            self._grow_history(program.history)
            if program.stages is not None:
                self._grow_words(program.stages.n_words)
            if program.requirement is not None:
                self._grow_written(program.requirement.n_words)
        self._idle.pop(slot, None)
        self._refs[slot] += 1
        return slot

    def _release(self, slot: int) -> None:
        self._refs[slot] -= 1
        if self._refs[slot] == 0:
            self._idle[slot] = None
            while len(self._idle) > self.max_idle:
                old, _ = self._idle.popitem(last=False)
                prog = self._programs.pop(old)
                self._refs.pop(old)
                self._by_key.pop(self._key(prog), None)
                self._version += 1

    def _grow_history(self, width: int) -> None:
        if width > self.width:
            pad = torch.full((self.capacity, width - self.width), NO_TOKEN, dtype=torch.long, device=self.device)
            self.recent = torch.cat([pad, self.recent], dim=1)
            self.width = width

    def _grow_words(self, n_words: int) -> None:
        if n_words > self.seen.shape[1]:
            extra = torch.zeros(self.capacity, n_words - self.seen.shape[1], dtype=torch.bool, device=self.device)
            self.seen = torch.cat([self.seen, extra], dim=1)

    def _grow_written(self, n_words: int) -> None:
        if n_words > self.written.shape[1]:
            extra = torch.zeros(self.capacity, n_words - self.written.shape[1], dtype=torch.bool, device=self.device)
            self.written = torch.cat([self.written, extra], dim=1)

    # -- rows -----------------------------------------------------------------------------------------

    def add(
        self,
        row: int,
        program: Program | None,
        *,
        budget: int | None,
        prompt: Sequence[int] | torch.Tensor = (),
        output: Sequence[int] = (),
        schedule: np.ndarray | None = None,
    ) -> None:
        """Start ``row`` on ``program`` (``None``: the row has no gravity and costs nothing but a zero row).

        ``prompt`` and ``output`` are the row's tokens so far: the history reads their tail, and ``output``
        sets the row's step and what it has already said. ``schedule`` overrides the program's schedule row.
        """
        self.remove(row)
        if program is None:
            return
        slot = self._acquire(program)
        self.prog[row] = slot
        self.budget[row] = int(budget or 0)
        self.sched[row] = program.schedule if schedule is None else schedule
        self.repeat[row] = program.repeat_weight
        self.threshold[row] = np.nan if program.prune_threshold is None else program.prune_threshold
        self.last_stage[row] = len(program.fields) - 1
        self.requires[row] = program.requirement is not None
        self._dirty = True
        # Nothing here makes the host wait on the device: host data goes over with non-blocking copies, and
        # a row's state is reset with fills (assigning a Python number to one row is a blocking copy on CUDA).
        ids = _to_device(prompt, self.device)
        self.recent[row] = last_tokens(ids[None], self.width)[0]
        for t in (self.step, self.stage, self.start, self.seen, self.written):
            t[row].zero_()
        if program.repeat_weight < 1.0:
            self._said(self._width())
        if self.said is not None:
            self.said[row].zero_()
        if len(output):  # a request that comes back with output (vLLM preemption): replay it, token by token
            where = _to_device([row], self.device)
            tokens = _to_device(output, self.device)
            for i in range(tokens.shape[0]):
                self.advance(tokens[i : i + 1], where)

    def add_batch(
        self,
        program: Program,
        input_ids: torch.Tensor,
        *,
        budget: int | None,
        schedules: np.ndarray | None = None,
    ) -> None:
        """Rows ``0..B-1`` start on ``program`` with the prompts ``input_ids [B, T]`` (the transformers case)."""
        b = input_ids.shape[0]
        if b > self.capacity:
            raise ConfigurationError(f"the batch has {b} rows but the kernel holds {self.capacity}")
        for row in range(b):
            self.remove(row)
        slot = self._acquire(program)
        self._refs[slot] += b - 1
        self.prog[:b] = slot
        self.budget[:b] = int(budget or 0)
        self.sched[:b] = program.schedule if schedules is None else schedules
        self.repeat[:b] = program.repeat_weight
        self.threshold[:b] = np.nan if program.prune_threshold is None else program.prune_threshold
        self.last_stage[:b] = len(program.fields) - 1
        self.requires[:b] = program.requirement is not None
        self._dirty = True
        self.recent[:b] = last_tokens(input_ids.to(self.device).long(), self.width)
        self.step[:b] = 0
        self.stage[:b] = 0
        self.start[:b] = 0
        self.seen[:b] = False
        self.written[:b] = False
        if self.said is not None:
            self.said[:b] = False

    def program(self, row: int) -> Program | None:
        """The program ``row`` runs, or ``None``."""
        slot = int(self.prog[row])
        return self._programs.get(slot) if slot >= 0 else None

    def remove(self, row: int) -> None:
        """``row`` leaves; its program is released."""
        slot = int(self.prog[row])
        if slot >= 0:
            self._release(slot)
            self.prog[row] = -1
            self.sched[row] = 0.0
            self.threshold[row] = np.nan
            self.repeat[row] = 1.0
            self.last_stage[row] = 0
            self.requires[row] = False
            self.stage[row].zero_()  # an empty row reads the zero field row, with no stage on top
            self._dirty = True

    def swap(self, a: int, b: int) -> None:
        """Rows ``a`` and ``b`` trade places (settings and history)."""
        for arr in (self.prog, self.budget, self.sched, self.repeat, self.threshold, self.last_stage, self.requires):
            arr[[a, b]] = arr[[b, a]]
        idx, rev = _to_device([a, b], self.device), _to_device([b, a], self.device)
        for t in (self.recent, self.step, self.stage, self.start, self.seen, self.written, self.said):
            if t is not None:
                t[idx] = t[rev]
        self._dirty = True

    def move(self, src: int, dst: int) -> None:
        """Row ``src`` moves to ``dst`` (whatever was at ``dst`` leaves); ``src`` is empty afterwards."""
        self.remove(dst)
        self.swap(src, dst)

    def reset(self) -> None:
        """Every row leaves."""
        for row in np.flatnonzero(self.prog >= 0):
            self.remove(int(row))

    # -- one step -------------------------------------------------------------------------------------

    def _upload(self, bank: _Bank) -> dict[str, torch.Tensor]:
        """The per-row settings on the device, copied again only after a change (rows or programs)."""
        if self._dirty or self._dev.get("bank") is not bank.values:
            lookup = np.full(self._next_slot + 1, bank.zero_row, dtype=np.int64)
            for slot, first in bank.first.items():
                lookup[slot] = first
            first = lookup[np.where(self.prog >= 0, self.prog, self._next_slot)]
            req = np.full(self._next_slot + 1, len(bank.require_of), dtype=np.int64)
            for slot, q in bank.require_of.items():
                req[slot] = q
            req = req[np.where(self.prog >= 0, self.prog, self._next_slot)]
            self._dev = {
                "bank": bank.values,
                "first": torch.from_numpy(first).to(self.device, non_blocking=True),
                "budget": torch.from_numpy(self.budget).to(self.device, non_blocking=True),
                "repeat": torch.from_numpy(self.repeat).to(self.device, non_blocking=True),
                "threshold": torch.from_numpy(self.threshold).to(self.device, non_blocking=True),
                "last": torch.from_numpy(self.last_stage).to(self.device, non_blocking=True),
                "require": torch.from_numpy(req).to(self.device, non_blocking=True),
            }
            self._plans = {}
            self._dirty = False
        return self._dev

    def _said(self, vocab: int) -> torch.Tensor:
        """What each row has said, ``[capacity, vocab]`` bool, made (or widened) on first need."""
        if self.said is None or self.said.shape[1] != vocab:
            said = torch.zeros(self.capacity, vocab, dtype=torch.bool, device=self.device)
            if self.said is not None:
                keep = min(vocab, self.said.shape[1])
                said[:, :keep] = self.said[:, :keep]
            self.said = said
        return self.said

    def _width(self) -> int:
        """The vocabulary width: the logits' once seen, else the widest field."""
        if self._vocab is not None:
            return self._vocab
        return max([1, *(f.vocab_size for p in self._programs.values() for f in p.fields)])

    def advance(self, tokens: torch.Tensor, rows: torch.Tensor | None = None, new: torch.Tensor | None = None) -> None:
        """Each of ``rows`` (default ``0..len(tokens)-1``) generated ``tokens``; with ``new`` (bool, per row)
        only where it is true. Updates the history, the step, what the row has said, its stage and the required
        words it has written."""
        tokens = tokens.to(self.device).long()
        staged, requires = bool(self.last_stage.any()), bool(self.requires.any())
        if rows is not None or new is not None:  # rows by index (vLLM): the compiled step's update, run eager
            bank, dev = self._tables()
            state = _State(self.recent, self.step, self.stage, self.said, self.written, dev["budget"])
            adv = self._advance_tables(dev)
            rows_t = torch.arange(tokens.shape[0], device=self.device) if rows is None else rows
            _advance_tensors(bank, state, adv, rows_t, tokens, new, staged, requires)
            return
        # the transformers case: rows 0..B-1 all step, in place on views with no gathers
        b = tokens.shape[0]
        history = self.recent[:b]
        history[:, :-1] = history[:, 1:].clone()
        history[:, -1] = tokens
        self.step[:b] += 1
        step = self.step[:b]
        if self.said is not None:
            self.said[:b].scatter_(1, tokens.clamp(0, self.said.shape[1] - 1)[:, None], True)
        if not (staged or requires):
            return
        bank, dev = self._tables()
        if staged:
            self.stage[:b], self.start[:b], self.seen[:b] = advance_stages(
                self.stage[:b],
                self.start[:b],
                self.seen[:b],
                step,
                dev["budget"][:b],
                history,
                dev["first"][:b],
                dev["last"][:b],
                bank.share,
                bank.need,
                bank.forms,
            )
        if requires and bank.require is not None:
            written = self.written[:b, : bank.require.n_words]
            written.copy_(advance_required(written, bank.require, dev["require"][:b], history, step))

    def _advance_tables(self, dev: dict[str, torch.Tensor]) -> _Advance:
        """The tables only the state update reads: stage starts, words seen, each row's stages and requirement."""
        return _Advance(self.start, self.seen, dev["first"], dev["last"], dev["require"])

    def _tables(self) -> tuple[_Bank, dict[str, torch.Tensor]]:
        """The field bank (in the dtype of the logits last seen) and the per-row settings on the device."""
        dtype = self._bank[0][2] if self._bank is not None else torch.float32
        bank = self._bank_for(self._width(), dtype)
        return bank, self._upload(bank)

    def apply(
        self,
        logits: torch.Tensor,
        rows: torch.Tensor | None = None,
        rows_np: np.ndarray | None = None,
        *,
        measure_step: bool = False,
        measure_only: bool = False,
        strength: Callable[[torch.Tensor], torch.Tensor] | None = None,
        inplace: bool = False,
    ) -> tuple[torch.Tensor, StepResult]:
        """One step of gravity on ``logits [B, V]`` (not modified); returns the new logits and a :class:`StepResult`.

        ``rows`` (device) and ``rows_np`` (the same on the host) map logits rows to kernel rows (default
        ``0..B-1``). ``measure_step`` also measures entropy, narrative mass and KL; ``measure_only`` measures
        and leaves the logits as they are. ``strength`` replaces the schedules: a function of the dense
        ``[B, V]`` field of the step that returns ``[B]`` λ (a controller of the user's own). ``inplace``: the
        engine hands its logits over, and they are pulled where they are (with ``measure_step``, only where
        the measurement does not need the unpulled logits: the thermostat's steps without pruning).
        """
        bank, plan, state, rows, _ = self._prepare(logits, rows, rows_np)
        compiled = self._compiled_step(strength, measure_only)
        if compiled is not None:
            if isinstance(rows, slice):
                rows = self._row_ids(logits.shape[0])
            return compiled(bank, plan, logits, rows, state, measure_step, inplace, self._bits)
        return _result(
            *_step_tensors(
                bank, plan, logits, rows, state, measure_step, inplace, None, self._work, measure_only, strength
            )
        )

    def advance_apply(
        self,
        tokens: torch.Tensor,
        logits: torch.Tensor,
        rows: torch.Tensor | None = None,
        rows_np: np.ndarray | None = None,
        *,
        new: torch.Tensor | None = None,
        measure_step: bool = False,
        inplace: bool = False,
        nan_step: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, StepResult]:
        """One decoding step: the rows of ``logits [B, V]`` generated ``tokens [B]`` (:meth:`advance`; with
        ``new``, bool per row, only where it is true), then gravity on ``logits`` (:meth:`apply`; ``rows`` and
        ``rows_np`` as there). Compiled, the state update and the step run as one graph, so the update
        launches no eager operations of its own.

        ``nan_step`` (``[B]`` long, -1 where none yet) receives each row's first step whose logits held a NaN,
        on the device, for the caller to read back when it chooses.

        >>> from narrative_gravity.gravity.field import NarrativeField
        >>> from narrative_gravity.gravity.controllers import ConstantController
        >>> field = NarrativeField(values=torch.tensor([0.0, 1.0, 0.0, -1.0]))
        >>> program = Program(field=field, schedule=ConstantController(2.0).schedule(1)[0])
        >>> kernel = GravityKernel(1)
        >>> kernel.add_batch(program, torch.tensor([[2]]), budget=8)
        >>> out, result = kernel.advance_apply(torch.tensor([1]), torch.zeros(1, 4))
        >>> out.tolist(), kernel.step.tolist(), kernel.recent[0, -1].item()
        ([[0.0, 2.0, 0.0, -2.0]], [1], 1)
        """
        if self.compile == "off":
            self.advance(tokens, rows, new)
            if nan_step is not None:  # before the pull, which may write into the logits
                record_nan(nan_step, logits, self.step[: logits.shape[0]] if rows is None else self.step[rows])
            return self.apply(logits, rows, rows_np, measure_step=measure_step, inplace=inplace)
        bank, plan, state, rows, dev = self._prepare(logits, rows, rows_np)
        if isinstance(rows, slice):
            rows = self._row_ids(logits.shape[0])
        adv = self._advance_tables(dev)
        if self._compiled_advance is None:
            self._compiled_advance = compiled_advance_step(self.compile)
        return self._compiled_advance(
            bank,
            plan,
            logits,
            rows,
            state,
            adv,
            tokens.to(self.device).long(),
            new,
            bool(self.last_stage.any()),
            bool(self.requires.any()),
            measure_step,
            inplace,
            self._bits,
            nan_step,
        )

    def _prepare(
        self, logits: torch.Tensor, rows: torch.Tensor | None, rows_np: np.ndarray | None
    ) -> tuple[_Bank, _Plan, _State, torch.Tensor | slice, dict[str, torch.Tensor]]:
        """What a step over ``logits [B, V]`` reads: the field bank, the rows' plan, the state tables (``said``
        made where the plan needs it), the rows (``0..B-1`` as a slice, views with no gathers, where none are
        given) and the per-row settings on the device."""
        b, vocab = logits.shape
        if rows is None:
            rows, rows_np = slice(0, b), np.arange(b)
        elif rows_np is None:
            rows_np = rows.cpu().numpy()
        self._vocab = vocab
        bank = self._bank_for(vocab, logits.dtype)
        plan = self._plan(bank, rows, rows_np)
        dev = self._upload(bank)
        said = self._said(vocab) if plan.repeat is not None and plan.said_index is not None else self.said
        return bank, plan, _State(self.recent, self.step, self.stage, said, self.written, dev["budget"]), rows, dev

    def _compiled_step(
        self, strength: Callable[[torch.Tensor], torch.Tensor] | None, measure_only: bool
    ) -> Callable[..., tuple[torch.Tensor, StepResult]] | None:
        """The compiled step, or ``None`` where the step runs eager (compile off; a controller of the user's
        own, which is Python code; the measure-only control run)."""
        if self.compile == "off" or strength is not None or measure_only:
            return None
        if self._compiled is None:
            self._compiled = compiled_step(self.compile)
        return self._compiled

    def _row_ids(self, b: int) -> torch.Tensor:
        """``0..b-1`` on the device (cached): the transformers case's rows, as the compiled step takes them."""
        if self._row_range is None or self._row_range.shape[0] < b:
            self._row_range = torch.arange(self.capacity, device=self.device)
        return self._row_range[:b]

    def _plan(self, bank: _Bank, rows: torch.Tensor | slice, rows_np: np.ndarray) -> _Plan:
        """The step plan of ``rows`` (cached until rows or programs change)."""
        dev = self._upload(bank)
        key = rows_np.tobytes()
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        rs = RowSchedule(self.sched[rows_np], self.budget[rows_np], self.device)
        rs.gate(bank.pos_of.numel())  # made here, on the host: a step only reads it
        first = dev["first"][rows]
        staged = bool(self.last_stage[rows_np].any())
        repeat = self.repeat[rows_np]
        thr = self.threshold[rows_np]
        k = min(int(rs.candidates.max(initial=1)), bank.columns.shape[1])
        n_iter = int(rs.iterations.max(initial=1))
        row_k = rs.candidates.clip(max=k)
        said_index = None
        if (repeat < 1.0).any():  # flat positions: one `index_select` a step instead of a 2-D fancy index
            row_ids = _to_device(rows_np, self.device)
            said_index = (row_ids[:, None] * bank.pos_of.numel() + bank.support[None, :]).reshape(-1)
        plan = _Plan(
            schedule=rs,
            first=first,
            columns=None if staged else bank.columns[first],
            staged=staged,
            repeat=dev["repeat"][rows][:, None] if (repeat < 1.0).any() else None,
            threshold=dev["threshold"][rows][:, None] if np.isfinite(thr).any() else None,
            prunes_off_support=bool((thr >= 0).any()),
            candidates=k,
            row_candidates=None if (row_k == k).all() else rs.row_candidates.clamp_max(k),
            iterations=n_iter,
            row_iterations=None if (rs.iterations == n_iter).all() else rs.row_iterations,
            said_index=said_index,
            require=dev["require"][rows] if bank.require is not None and self.requires[rows_np].any() else None,
        )
        if len(self._plans) >= 8:
            self._plans.clear()
        self._plans[key] = plan
        return plan

    @staticmethod
    def _measure(
        logits: torch.Tensor,
        out: torch.Tensor,
        a: torch.Tensor,
        lam: torch.Tensor,
        mask: torch.Tensor | None,
        bank: _Bank,
        probs: torch.Tensor | None,
        entropy: torch.Tensor | None,
        plan: _Plan,
    ) -> Measurement:
        if bank.dense:
            return measure(logits, a, lam, pulled=out)
        if mask is not None and plan.prunes_off_support:  # pruning reaches tokens off the support: measure densely
            return measure(logits, GravityKernel._dense(a, bank.support, False, logits.shape[1]), lam, pulled=out)
        pruned = None
        if mask is not None:
            idx = bank.support[None].expand(logits.shape[0], -1)
            pruned = torch.isneginf(out.gather(1, idx)) & torch.isfinite(logits.gather(1, idx))
        if probs is not None:
            return measure_from_probs(probs, entropy, None, a, lam, pruned=pruned)
        return measure_on_support(logits, bank.support, a, lam, pruned=pruned)

    @staticmethod
    def _dense(a: torch.Tensor, support: torch.Tensor, dense: bool, vocab: int) -> torch.Tensor:
        if dense:
            return a
        return torch.zeros(a.shape[0], vocab, dtype=a.dtype, device=a.device).index_copy_(1, support, a)

    @staticmethod
    def _field_rows(bank: _Bank, frow: torch.Tensor, recent: torch.Tensor) -> torch.Tensor:
        """Each row's field on the support, ``[B, S]``: its field row, plus the continuations of its last tokens."""
        a = bank.values.index_select(0, frow)
        if bank.prefixes is not None:
            match = match_suffixes(recent, bank.prefixes) & (bank.entry_frow[None] == frow[:, None])  # [B, E]
            pieces = bank.next_pos[None].expand(a.shape[0], -1)
            a = a.scatter_add(1, pieces, match.to(a.dtype) * bank.next_values[None]).clamp(-1.0, 1.0)
        return a

    # -- the field bank -------------------------------------------------------------------------------

    def _bank_for(self, vocab: int, dtype: torch.dtype) -> _Bank:
        key = (self._version, vocab, dtype)
        if self._bank is None or self._bank[0] != key:
            self._bank = (key, self._build_bank(vocab, dtype))
        return self._bank[1]

    def _build_bank(self, vocab: int, dtype: torch.dtype) -> _Bank:
        dev = self.device
        first: dict[int, int] = {}
        frows: list[NarrativeField] = []
        shares: list[float] = []
        needs: list[int] = []
        forms: list[tuple[int, int, tuple[int, ...]]] = []
        for slot, prog in self._programs.items():
            first[slot] = len(frows)
            fitted = [f.fit_vocab(vocab).to(dev, dtype) for f in prog.fields]
            if prog.stages is not None:
                shares += list(prog.stages.shares)
                needs += prog.stages.need
                forms += [(first[slot] + s, j, form) for s, j, form in prog.stages.forms(vocab)]
            else:
                shares.append(1.0)
                needs.append(10**9)
            frows += fitted
        zero = len(frows)
        parts = [f.support() for f in frows]
        support = torch.unique(torch.cat(parts)) if parts else torch.zeros(0, dtype=torch.long, device=dev)
        dense = support.numel() > _DENSE_SHARE * vocab
        if dense:
            support = torch.arange(vocab, device=dev)
        pos_of = torch.full((vocab,), -1, dtype=torch.long, device=dev)
        pos_of[support] = torch.arange(support.numel(), device=dev)
        values = torch.zeros(zero + 1, support.numel(), dtype=dtype, device=dev)
        for i, f in enumerate(frows):
            values[i] = f.values[support]
        on_vocab = torch.zeros(zero + 1, vocab + 1, dtype=torch.bool, device=dev)
        on_vocab[:, support] = values > 0
        tables = [(i, f) for i, f in enumerate(frows) if f.has_continuations]
        prefixes = next_pos = next_values = entry_frow = None
        if tables:
            width = max(f.max_prefix_len for _, f in tables)
            prefixes = torch.cat(
                [torch.nn.functional.pad(f.prefixes, (width - f.max_prefix_len, 0), value=-1) for _, f in tables]
            )
            next_pos = torch.cat([pos_of[f.next_ids] for _, f in tables])
            next_values = torch.cat([f.next_values for _, f in tables]).to(dtype)
            entry_frow = torch.cat([torch.full((f.next_ids.shape[0],), i, device=dev) for i, f in tables])
        # The thermostat's candidates, once per field row: the largest |a| first (continuation pieces count
        # with their own value), so that no step sorts.
        score = values.abs().float()
        if tables:
            cont = torch.zeros_like(score).index_put_(
                (entry_frow, next_pos), next_values.abs().float(), accumulate=False
            )
            score = torch.maximum(score, cont)
        k = min(support.numel(), max([1, *(int(p.schedule[_COL["candidates"]]) for p in self._programs.values())]))
        columns = torch.argsort(score, dim=-1, descending=True, stable=True)[:, :k].contiguous()
        form_tables = None
        n_words = max([1, *(p.stages.n_words for p in self._programs.values() if p.stages is not None)])
        if forms:
            lf = max(len(f) for *_, f in forms)
            patterns = torch.tensor([[-1] * (lf - len(f)) + list(f) for *_, f in forms], dtype=torch.long, device=dev)
            form_tables = (
                patterns,
                torch.tensor([s for s, _, _ in forms], dtype=torch.long, device=dev),
                torch.tensor([j for _, j, _ in forms], dtype=torch.long, device=dev),
            )
        reqs = [(slot, p.requirement) for slot, p in self._programs.items() if p.requirement is not None]
        require = RequireTables.build([r for _, r in reqs], vocab, dev) if reqs else None
        return _Bank(
            require=require,
            require_of={slot: q for q, (slot, _) in enumerate(reqs)},
            support=support,
            dense=dense,
            pos_of=pos_of,
            values=values,
            on_vocab=on_vocab,
            share=torch.tensor([*shares, 1.0], dtype=torch.float64, device=dev),
            need=torch.tensor([*needs, 10**9], dtype=torch.long, device=dev),
            prefixes=prefixes,
            next_pos=next_pos,
            next_values=next_values,
            entry_frow=entry_frow,
            forms=form_tables,
            columns=columns,
            n_words=n_words,
            first=first,
            zero_row=zero,
        )


def _to_device(ids: Sequence[int] | np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Token or row ids as a long tensor on ``device``, copied without making the host wait for the device.

    >>> _to_device([3, 1], torch.device("cpu")).tolist()
    [3, 1]
    """
    if isinstance(ids, torch.Tensor):
        return ids.to(device=device, dtype=torch.long, non_blocking=True)
    return torch.as_tensor(np.asarray(ids, dtype=np.int64)).to(device, non_blocking=True)


class _State(NamedTuple):
    """The kernel's per-row device state a step reads (whole tables; the step picks its rows)."""

    recent: torch.Tensor  # [capacity, L]
    step: torch.Tensor  # [capacity]
    stage: torch.Tensor  # [capacity]
    said: torch.Tensor | None  # [capacity, V], when some row's repeat_weight is below 1
    written: torch.Tensor  # [capacity, W]
    budget: torch.Tensor  # [capacity]


class _Advance(NamedTuple):
    """The per-row device state the state update reads and writes besides :class:`_State` (whole tables)."""

    start: torch.Tensor  # [capacity] the step each row's stage began
    seen: torch.Tensor  # [capacity, W] the words of its current stage generated so far
    first: torch.Tensor  # [capacity] the field row of its first stage
    last: torch.Tensor  # [capacity] its last stage
    require: torch.Tensor  # [capacity] its requirement (``len(requirements)``: none)


def _advance_tensors(
    bank: _Bank,
    state: _State,
    adv: _Advance,
    rows: torch.Tensor,
    tokens: torch.Tensor,
    new: torch.Tensor | None,
    staged: bool,
    requires: bool,
) -> None:
    """``rows`` generated ``tokens`` (with ``new``, bool per row, only where it is true): each row's history,
    step, what it has said, its stage and the required words it has written, updated in place on the whole
    tables by row index. What :meth:`GravityKernel.advance` does, as tensors with no host decision, so that it
    compiles into the same graph as the step."""
    before = state.recent.index_select(0, rows)
    recent = torch.cat([before[:, 1:], tokens[:, None]], dim=1)
    step = state.step.index_select(0, rows)
    if new is None:
        step = step + 1
    else:
        recent = torch.where(new[:, None], recent, before)
        step = step + new.long()
    state.recent.index_copy_(0, rows, recent)
    state.step.index_copy_(0, rows, step)
    if state.said is not None:
        ids = tokens.clamp(0, state.said.shape[1] - 1)
        said = torch.ones_like(ids, dtype=torch.bool) if new is None else state.said[rows, ids] | new
        state.said.index_put_((rows, ids), said)
    if staged:
        stage, start, seen = advance_stages(
            state.stage.index_select(0, rows),
            adv.start.index_select(0, rows),
            adv.seen.index_select(0, rows),
            step,
            state.budget.index_select(0, rows),
            recent,
            adv.first.index_select(0, rows),
            adv.last.index_select(0, rows),
            bank.share,
            bank.need,
            bank.forms,
        )
        if new is not None:
            stage = torch.where(new, stage, state.stage.index_select(0, rows))
            start = torch.where(new, start, adv.start.index_select(0, rows))
            seen = torch.where(new[:, None], seen, adv.seen.index_select(0, rows))
        state.stage.index_copy_(0, rows, stage)
        adv.start.index_copy_(0, rows, start)
        adv.seen.index_copy_(0, rows, seen)
    if requires and bank.require is not None:
        written = state.written[:, : bank.require.n_words]
        done = written.index_select(0, rows)
        now = advance_required(done, bank.require, adv.require.index_select(0, rows), recent, step)
        written.index_copy_(0, rows, now if new is None else torch.where(new[:, None], now, done))


def record_nan(nan_step: torch.Tensor, logits: torch.Tensor, step: torch.Tensor | int) -> None:
    """Write ``step`` (``[B]``, or one step for all rows) into ``nan_step [B]`` (-1: none yet) for the rows whose
    ``logits`` first hold a NaN; on the device, with no read back.

    >>> first = torch.tensor([-1, -1, 2])
    >>> record_nan(first, torch.tensor([[0.0, float("nan")], [0.0, 1.0], [float("nan"), 0.0]]), 5)
    >>> first.tolist()
    [5, -1, 2]
    """
    nan_step.copy_(torch.where((nan_step < 0) & torch.isnan(logits).any(dim=-1), step, nan_step))


def _advance_and_step(
    bank: _Bank,
    plan: _Plan,
    logits: torch.Tensor,
    rows: torch.Tensor,
    state: _State,
    adv: _Advance,
    tokens: torch.Tensor,
    new: torch.Tensor | None,
    staged: bool,
    requires: bool,
    measure_step: bool,
    inplace: bool,
    bits: int | None,
    nan_step: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, ...] | None]:
    """:func:`_advance_tensors`, then :func:`_step_tensors` on the updated state: a whole transformers step as
    one function for ``torch.compile``. ``nan_step`` (``[B]``, by logits row, -1 where none yet) records each
    row's first step whose logits held a NaN, read before the pull (which may cover a NaN with a pruning mask)."""
    _advance_tensors(bank, state, adv, rows, tokens, new, staged, requires)
    if nan_step is not None:
        record_nan(nan_step, logits, state.step.index_select(0, rows))
    return _step_tensors(bank, plan, logits, rows, state, measure_step, inplace, bits, None, False, None)


def _result(
    out: torch.Tensor, lam: torch.Tensor, finite: torch.Tensor | None, measured: tuple[torch.Tensor, ...] | None
) -> tuple[torch.Tensor, StepResult]:
    """The new logits and the :class:`StepResult` of :func:`_step_tensors`' tensors."""
    result = StepResult(strength=lam, finite=finite)
    if measured is not None:
        result.measurement = Measurement(*measured)
    return out, result


def _step_tensors(
    bank: _Bank,
    plan: _Plan,
    logits: torch.Tensor,
    rows: torch.Tensor | slice,
    state: _State,
    measure_step: bool,
    inplace: bool,
    bits: int | None,
    workspace: Workspace | None,
    measure_only: bool,
    strength: Callable[[torch.Tensor], torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, ...] | None]:
    """One step of gravity as tensors (what :meth:`GravityKernel.apply` runs, eager or compiled): the new logits,
    λ, the finite flag and the measurement's five columns. No host decision over per-row values and no host read,
    so that ``torch.compile(fullgraph=True)`` takes it whole."""
    b, vocab = logits.shape
    frow = plan.first + state.stage[rows] if plan.staged else plan.first
    support = bank.support
    recent = state.recent[rows]
    a = GravityKernel._field_rows(bank, frow, recent)  # [B, S]
    if plan.repeat is not None and plan.said_index is not None:
        said = state.said.view(-1).index_select(0, plan.said_index).view(b, -1)
        a = torch.where(said & (a > 0), a * plan.repeat.to(a.dtype), a)
    rs = plan.schedule
    step = state.step[rows]
    probs = entropy = finite = None
    if measure_only:
        lam = torch.zeros(b, dtype=torch.float32, device=logits.device)
    elif strength is not None:
        lam = strength(GravityKernel._dense(a, support, bank.dense, vocab)).to(logits.device, torch.float32)
    else:
        lam = None
        if not rs.all_thermostat:
            lam = scheduled_strength(step, rs).to(torch.float32)
        if rs.any_thermostat:
            probs, entropy = probabilities(logits, None if bank.dense else support, workspace=workspace)
            columns = plan.columns if plan.columns is not None else bank.columns[frow]
            prob = MassProblem(probs, entropy, a, bank.dense, plan.candidates, plan.row_candidates, columns)
            on = bank.on_vocab[frow[:, None], recent.clamp(-1, vocab)]  # no token / outside: the False column
            target = thermostat_target(step, rs, entropy, vocab, off_topic_share(on, step, rs))
            budget = kl_budget_at(step, rs)
            solved = prob.solve(
                target,
                rs.base32,
                plan.iterations,
                plan.row_iterations,
                bits=bits,
                workspace=workspace,
                kl_budget=budget,
            )
            finite = prob.alive
            lam = solved if lam is None else torch.where(rs.thermostat, solved, lam)
    mask = None
    if plan.threshold is not None:
        on_support = a <= plan.threshold
        if bank.dense:
            mask = on_support
        else:
            mask = (plan.threshold >= 0).expand(b, vocab).clone()
            mask[:, support] = on_support
    sparse = None if bank.dense else support
    # the measurement reads the unpulled logits, except where the thermostat's softmax already holds
    # everything it needs (a field on a support, no pruning)
    inplace = inplace and (not measure_step or (probs is not None and mask is None and not bank.dense))
    out = logits if measure_only else apply_gravity(logits, a, lam.to(logits.dtype), mask, sparse, inplace=inplace)
    if plan.require is not None and not measure_only:
        tables = bank.require
        written = state.written[rows, : tables.n_words]
        pull_required(out, tables, plan.require, written, recent, step, state.budget[rows])
    measured = None
    if measure_step or measure_only:
        m = GravityKernel._measure(logits, out, a, lam, mask, bank, probs, entropy, plan)
        measured = (m.entropy, m.mass, m.mass_after, m.kl, m.strength)
    return out, lam, finite, measured


def compiled_bits(device: torch.device | str) -> int:
    """The solver's grid bits in a compiled step (:func:`~narrative_gravity.gravity.solve.grid_bits` chooses them
    by the problem's size in an eager one). Fixed, so that the batch size never changes the compiled code, and
    the answer does not depend on them. Off the CPU a level costs its launches: 7 bits, 2 levels for the default
    14 iterations. On the CPU a level costs its arithmetic (``2^bits`` exponentials per candidate): 3 bits.

    >>> compiled_bits("cpu"), compiled_bits("cuda")
    (3, 7)
    """
    return 3 if torch.device(device).type == "cpu" else 7


COMPILE_ENV = "NARRATIVE_GRAVITY_COMPILE"
"""The environment variable that picks the step's mode when ``compile`` is not given (one of :data:`COMPILE_MODES`)."""

COMPILE_MODES = ("off", "default", "reduce-overhead")
"""``off``: the eager step (the default); ``default``: ``torch.compile(fullgraph=True)``, the batch size
dynamic; ``reduce-overhead``: the same, replayed as CUDA graphs on CUDA (on the CPU it is ``default``)."""


def compile_mode(mode: str | bool | None) -> str:
    """The step's mode: ``mode`` (``True`` = ``default``, ``False`` = ``off``), else :data:`COMPILE_ENV`, else ``off``.

    >>> compile_mode(None), compile_mode(True), compile_mode("reduce-overhead")
    ('off', 'default', 'reduce-overhead')
    """
    if mode is None:
        mode = os.environ.get(COMPILE_ENV, "off").strip() or "off"
        source = f"${COMPILE_ENV}"
    else:
        source = "`compile`"
    if mode is True or mode in ("1", "on", "true"):
        return "default"
    if mode is False or mode in ("0", "false"):
        return "off"
    if mode not in COMPILE_MODES:
        raise ConfigurationError(f"{source} has to be one of {', '.join(COMPILE_MODES)}, but is {mode!r}")
    return str(mode)


def _compile(fn: Callable[..., Any], mode: str) -> Callable[..., Any]:
    """``fn`` under ``torch.compile(fullgraph=True, dynamic=True)``; ``reduce-overhead`` asks for CUDA graphs."""
    _allow_graphs()
    return torch.compile(
        fn, fullgraph=True, dynamic=True, mode="reduce-overhead" if mode == "reduce-overhead" else None
    )


_COMPILED: dict[str, Callable[..., tuple[torch.Tensor, StepResult]]] = {}

GRAPHS = 64
"""The most graphs one compiled function keeps (torch's default is 8). A graph per structure of step: which
rules its rows run (thermostat, pruning, stages, required words, a repeat weight), measured or not. A server that
sees many kinds of profile needs more than 8, and ``fullgraph=True`` fails hard past the limit."""


def _allow_graphs() -> None:
    """Raise torch's recompile limit (a process-wide setting) to at least :data:`GRAPHS`, once, when a step is
    first compiled: a patch around every call would cost more than a small step (about 55 µs on a CPU)."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, GRAPHS)


def compiled_step(mode: str = "default") -> Callable[..., tuple[torch.Tensor, StepResult]]:
    """:func:`_step_tensors` under ``torch.compile(fullgraph=True, dynamic=True)``, one per mode for the process.

    Every size is symbolic (the batch, the support, the history), so rows joining or leaving and programs
    coming and going reuse the compiled code; a batch of one row is compiled once more (torch specializes
    sizes 0 and 1). A profile is data: its fields and schedules are tensors, and only the step's structure
    (which rules run: thermostat or not, pruning, stages, required words, the solver's sizes) selects a graph.
    ``reduce-overhead`` replays the step as CUDA graphs on CUDA devices (inductor's ``mode="reduce-overhead"``).
    """
    fn = _COMPILED.get(mode)
    if fn is None:
        step = _compile(_step_tensors, mode)

        def fn(
            bank: _Bank,
            plan: _Plan,
            logits: torch.Tensor,
            rows: torch.Tensor,
            state: _State,
            measure_step: bool,
            inplace: bool,
            bits: int,
        ) -> tuple[torch.Tensor, StepResult]:
            return _result(*step(bank, plan, logits, rows, state, measure_step, inplace, bits, None, False, None))

        _COMPILED[mode] = fn
    return fn


_COMPILED_ADVANCE: dict[str, Callable[..., tuple[torch.Tensor, StepResult]]] = {}


def compiled_advance_step(mode: str = "default") -> Callable[..., tuple[torch.Tensor, StepResult]]:
    """:func:`_advance_and_step` under ``torch.compile(fullgraph=True, dynamic=True)``, one per mode for the
    process: the state update and the step in one graph (see :func:`compiled_step`)."""
    fn = _COMPILED_ADVANCE.get(mode)
    if fn is None:
        step = _compile(_advance_and_step, mode)

        def fn(*args: Any) -> tuple[torch.Tensor, StepResult]:
            return _result(*step(*args))

        _COMPILED_ADVANCE[mode] = fn
    return fn
