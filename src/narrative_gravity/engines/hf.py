"""Narrative gravity for Hugging Face transformers: a ``LogitsProcessor`` for ``model.generate``.

A thin adapter: the rows of a ``generate`` call become kernel rows
(:class:`~narrative_gravity.gravity.kernel.GravityKernel`), each step hands the kernel the rows' newest
tokens and the logits, and the kernel does the math. Every row shares a step here.

>>> import torch
>>> from narrative_gravity.fields import NarrativeField
>>> field = NarrativeField(values=torch.tensor([1.0, 0.0, -1.0]))
>>> proc = NarrativeGravityLogitsProcessor(field, strength=2.0)
>>> proc(torch.tensor([[0]]), torch.zeros(1, 3)).tolist()
[[2.0, 0.0, -2.0]]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from transformers import LogitsProcessor

from ..errors import ConfigurationError, NonFiniteLogitsError, VocabularyError
from ..gravity.controllers import ConstantController, ScheduleController, StepContext, StrengthController
from ..gravity.field import NarrativeField
from ..gravity.kernel import GravityKernel, Program, compile_mode, record_nan
from ..gravity.schedule import COLUMNS
from ..gravity.stages import StagePlan
from ..gravity.thermo import Trace
from ..profiles.build import controller_from_profile, program_from_profile
from ..profiles.schema import Profile

__all__ = ["NarrativeGravityLogitsProcessor", "processor_from_profile"]


class NarrativeGravityLogitsProcessor(LogitsProcessor):
    """Add ``λ·a`` to the scores of every row, with λ chosen per row and step by a schedule.

    Args:
        field: the :class:`~narrative_gravity.fields.NarrativeField` (built once, applied every step), or a kernel
            :class:`~narrative_gravity.gravity.kernel.Program` when the pull has more to it than a field: its
            ``stages`` (a :class:`~narrative_gravity.gravity.stages.StagePlan`, see
            :func:`narrative_gravity.profiles.build.stage_plan`: each row pulls toward its current stage's field;
            :attr:`stage` holds each row's stage after a call), ``repeat_weight`` (the share of its pull a
            narrative token keeps once the row has generated it; below 1 the pull moves on to narrative tokens not
            yet written), ``prune_threshold`` (mask tokens whose field value is at or below it) and
            ``requirement`` (words the text must contain before it ends, built by
            :func:`~narrative_gravity.fields.required.build_requirement`; needs ``max_new_tokens`` to force them).
            :func:`~narrative_gravity.profiles.build.program_from_profile` builds one from a profile; the
            controller's schedule replaces the program's.
        controller: a schedule (:class:`~narrative_gravity.gravity.controllers.ConstantController`,
            ``PhaseScheduleController``, ``ThermostatController``) or any callable of a
            :class:`~narrative_gravity.gravity.controllers.StepContext`; defaults to a constant ``strength``.
        strength: λ (one float, or one per prompt) when no controller is given.
        max_new_tokens: the token budget, so schedules know where the end is (needed with ``stages``).
        trace: a :class:`~narrative_gravity.gravity.thermo.Trace` to record entropy, mass, KL and λ; ``None``
            = off and free.
        measure_only: record the trace but return the scores unchanged (the control run).
        nan_check_every: read the NaN flag back every this many steps; defaults to every step on CPU and
            every 16 steps on accelerators, so that no step waits on the device.
        inplace: pull the scores where they are and return them, instead of a new tensor (saves a copy of
            ``[B, V]`` a step). ``model.generate`` hands every processor its own float32 copy of the logits,
            so this is safe there, except that ``output_logits=True`` then records the pulled scores. Off by
            default; ``ngrav`` turns it on (narrative_gravity.engines.hf.processor_from_profile's ``inplace``).
        compile: the kernel's step mode (:data:`~narrative_gravity.gravity.kernel.COMPILE_MODES`): ``"off"``
            (eager), ``"default"`` (``torch.compile``: the state update and the step as one graph) or
            ``"reduce-overhead"`` (the same as CUDA graphs); ``None`` reads ``NARRATIVE_GRAVITY_COMPILE``.

    By default scores are returned as a new tensor and the input is never modified.

    >>> from narrative_gravity.fields import NarrativeField
    >>> from narrative_gravity.gravity.kernel import Program
    >>> field = NarrativeField(values=torch.tensor([1.0, 0.0, -1.0]))
    >>> once = NarrativeGravityLogitsProcessor(Program(field, repeat_weight=0.0), strength=2.0)
    >>> once(torch.tensor([[1]]), torch.zeros(1, 3)).tolist(), once(torch.tensor([[1, 0]]), torch.zeros(1, 3)).tolist()
    ([[2.0, 0.0, -2.0]], [[0.0, 0.0, -2.0]])
    """

    def __init__(
        self,
        field: NarrativeField | Program | None = None,
        controller: StrengthController | None = None,
        *,
        strength: float | Sequence[float] | None = None,
        max_new_tokens: int | None = None,
        trace: Trace | None = None,
        measure_only: bool = False,
        nan_check_every: int | None = None,
        inplace: bool = False,
        compile: str | None = None,
    ) -> None:
        program = field if isinstance(field, Program) else None
        if program is None and not isinstance(field, NarrativeField):
            raise ConfigurationError(
                f"`field` has to be a NarrativeField (or a kernel Program), but is {type(field).__name__}; build one "
                "with narrative_gravity.fields.build_lexical_field(tokenizer, words)"
            )
        if program is not None and program.stages is not None and not isinstance(program.stages, StagePlan):
            raise ConfigurationError(
                f"`stages` has to be a StagePlan, but is {type(program.stages).__name__}; build one with "
                "narrative_gravity.profiles.build.stage_plan(tokenizer, stages)"
            )
        if controller is not None and strength is not None:
            raise ConfigurationError("give either `controller` or `strength`, not both")
        if controller is None:
            controller = ConstantController(1.0 if strength is None else strength)
        if not callable(controller):
            raise ConfigurationError(f"`controller` has to be callable, but is {type(controller).__name__}")
        if max_new_tokens is not None and (
            isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0
        ):
            raise ConfigurationError(f"`max_new_tokens` has to be a positive integer, but is {max_new_tokens!r}")
        if program is not None and program.stages is not None and max_new_tokens is None:
            raise ConfigurationError("`stages` divide the token budget by their shares; pass max_new_tokens")
        if nan_check_every is not None and nan_check_every < 1:
            raise ConfigurationError(f"`nan_check_every` has to be >= 1, but is {nan_check_every!r}")
        self.controller = controller
        self.max_new_tokens = max_new_tokens
        self.trace = trace
        self.measure_only = measure_only
        self.nan_check_every = nan_check_every
        self.inplace = bool(inplace)
        self.compile = compile_mode(compile)
        self._builtin = isinstance(controller, ScheduleController)
        schedule = controller.schedule(len(controller._rows))[0] if self._builtin else np.zeros(len(COLUMNS))
        if program is None:
            self.program = Program(field=field, schedule=schedule)
        else:
            self.program = dataclasses.replace(program, schedule=schedule)
        self.field = self.program.field
        self.prune_threshold = self.program.prune_threshold
        self.repeat_weight = self.program.repeat_weight
        self.kernel: GravityKernel | None = None
        self.last_strength: torch.Tensor | None = None
        self.reset()

    def reset(self) -> None:
        """Forget per-generation state (called automatically when a new generation starts)."""
        self._prompt_len: int | None = None
        self._last_len: int | None = None
        self._prompt: torch.Tensor | None = None
        self._first_nan_step: torch.Tensor | None = None
        if self.kernel is not None:
            self.kernel.reset()
        if self.trace is not None:
            self.trace.reset()

    @property
    def stage(self) -> torch.Tensor | None:
        """Each row's current stage (``[B]``) after a call; ``None`` before the first."""
        if self.kernel is None or self._prompt is None:
            return None
        return self.kernel.stage[: self._prompt.shape[0]]

    def _continues(self, input_ids: torch.Tensor) -> bool:
        """Whether ``input_ids`` is the previous call's input plus one token (else a new generation starts).

        Length and batch size are free to compare. On the CPU the prompt is compared too (no device to wait
        for), so a reused processor resets even when the new prompt is exactly one token longer. On an
        accelerator, call :meth:`reset` between generations that could look like one continuing.
        """
        prompt = self._prompt
        if prompt is None or input_ids.shape[-1] != self._last_len + 1 or input_ids.shape[0] != prompt.shape[0]:
            return False
        if input_ids.device.type == "cpu":  # the prompt part, which beam search never reorders across prompts
            return bool(torch.equal(input_ids[:, : prompt.shape[-1]], prompt))
        return True

    def _start(self, input_ids: torch.Tensor, vocab: int) -> None:
        self.reset()
        self._prompt_len = input_ids.shape[-1]
        self._prompt = input_ids
        # One check per generation (not per step): prompt ids must index the vocabulary.
        bad = input_ids[(input_ids < 0) | (input_ids >= vocab)]
        if bad.numel():
            ids = sorted(set(bad.tolist()))
            raise VocabularyError(
                f"input_ids contain token ids {ids[:10]} outside the vocabulary [0, {vocab}); the prompt was "
                "encoded with a different tokenizer than the model's"
            )
        b = input_ids.shape[0]
        if self.kernel is None or self.kernel.capacity < b or self.kernel.device != input_ids.device:
            self.kernel = GravityKernel(max(b, 1), input_ids.device, compile=self.compile)
        schedules = self.controller.schedule(b) if self._builtin else None
        self.kernel.add_batch(self.program, input_ids, budget=self.max_new_tokens, schedules=schedules)

    def _nan_every(self, scores: torch.Tensor) -> int:
        """How often the NaN flag is read back: ``nan_check_every``, else every step on the CPU, every 16 off it."""
        return self.nan_check_every or (1 if scores.device.type == "cpu" else 16)

    def _nan_steps(self, scores: torch.Tensor) -> torch.Tensor:
        """Each row's first step with a NaN logit (-1: none yet), kept on the device between read-backs."""
        first = self._first_nan_step
        if first is None or first.shape[0] != scores.shape[0]:
            first = self._first_nan_step = torch.full((scores.shape[0],), -1, dtype=torch.long, device=scores.device)
        return first

    def _check_nan(
        self, scores: torch.Tensor, step: int, finite: torch.Tensor | None, every: int, *, tracked: bool = False
    ) -> None:
        """Raise on NaN logits: every step from the finite flag (one device read), or, with ``every > 1``, from
        each row's first NaN step, kept on the device (``tracked``: the kernel's step wrote it) and read back
        once every ``every`` steps."""
        if every == 1:
            # One read-only reduction per row (or the thermostat's softmax, which has read every logit
            # already); the exact (full-size) check runs only when a row is not finite, which also happens
            # for a row holding +inf, or only -inf.
            suspect = ~finite if finite is not None else torch.isnan(scores.sum(dim=-1))
            if bool(suspect.any()):
                rows_nan = torch.isnan(scores).any(dim=-1)
                if bool(rows_nan.any()):
                    self._raise_nan(rows_nan, torch.full_like(rows_nan, step, dtype=torch.long))
            return
        if not tracked:
            record_nan(self._nan_steps(scores), scores, step)
        if step % every == every - 1 and bool((self._first_nan_step >= 0).any()):
            self._raise_nan(self._first_nan_step >= 0, self._first_nan_step)

    @staticmethod
    def _raise_nan(rows: torch.Tensor, steps: torch.Tensor) -> None:
        where = ", ".join(f"row {r} at step {int(steps[r])}" for r in torch.nonzero(rows).flatten().tolist())
        raise NonFiniteLogitsError(
            f"the model produced NaN logits ({where}); gravity cannot repair NaN. Check the model's dtype "
            "(float16 overflow is the usual cause: load it in float32 or bfloat16) and its inputs"
        )

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if scores.dim() != 2 or input_ids.dim() != 2 or input_ids.shape[0] != scores.shape[0]:
            raise ConfigurationError(
                f"expected input_ids [B, T] and scores [B, V] with the same B, got {tuple(input_ids.shape)} "
                f"and {tuple(scores.shape)}"
            )
        length = input_ids.shape[-1]
        continues = self._continues(input_ids)
        if not continues:
            self._start(input_ids, scores.shape[-1])
        self._last_len = length
        step = length - self._prompt_len
        strength = None
        if not self._builtin:

            def strength(dense: torch.Tensor) -> torch.Tensor:
                ctx = StepContext(
                    step=step,
                    max_new_tokens=self.max_new_tokens,
                    batch_size=scores.shape[0],
                    device=scores.device,
                    logits=scores,
                    field=dense,
                    input_ids=input_ids,
                )
                return self.controller(ctx)

        every = self._nan_every(scores)
        if continues and strength is None and not self.measure_only:
            # the state update and the step in one call: one graph when the kernel is compiled
            nan_step = self._nan_steps(scores) if every > 1 else None
            out, result = self.kernel.advance_apply(
                input_ids[:, -1], scores, measure_step=self.trace is not None, inplace=self.inplace, nan_step=nan_step
            )
        else:
            if continues:
                self.kernel.advance(input_ids[:, -1])
            nan_step = None
            out, result = self.kernel.apply(
                scores,
                measure_step=self.trace is not None,
                measure_only=self.measure_only,
                strength=strength,
                inplace=self.inplace,
            )
        self._check_nan(scores, step, result.finite, every, tracked=nan_step is not None)
        self.last_strength = result.strength
        if self.trace is not None:
            self.trace.record(result.measurement)
        return out


def processor_from_profile(
    profile: Profile,
    tokenizer: Any,
    *,
    max_new_tokens: int | None = None,
    trace: Trace | None = None,
    measure_only: bool = False,
    model: Any = None,
    inplace: bool = False,
    compile: str | None = None,
) -> NarrativeGravityLogitsProcessor:
    """A :class:`NarrativeGravityLogitsProcessor` for ``model.generate`` (``narrative_gravity.processor``).

    The profile's :func:`~narrative_gravity.profiles.build.program_from_profile`: its field, or its ``stages``
    (whose shares divide ``max_new_tokens``). ``measure_only`` always measures against the profile's own field.
    ``model`` is needed only for a semantic field built from the generator's own embeddings. ``inplace``: pull
    the scores where they are, and ``compile`` the kernel's step mode (see :class:`NarrativeGravityLogitsProcessor`).
    """
    controller = controller_from_profile(profile)
    program = program_from_profile(profile, tokenizer, model=model, controller=controller)
    if program.stages is not None and max_new_tokens is None and not measure_only:
        raise ConfigurationError(
            "this profile declares `stages`, whose shares divide the token budget; pass max_new_tokens"
        )
    if measure_only:  # the control run measures against the profile's own field, and pulls nothing
        program = dataclasses.replace(program, stages=None, requirement=None)
    return NarrativeGravityLogitsProcessor(
        program,
        controller,
        max_new_tokens=max_new_tokens,
        trace=trace,
        measure_only=measure_only,
        inplace=inplace,
        compile=compile,
    )
