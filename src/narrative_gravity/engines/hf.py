"""Narrative gravity for Hugging Face transformers: a ``LogitsProcessor`` for ``model.generate``.

>>> import torch
>>> from narrative_gravity.fields import NarrativeField
>>> field = NarrativeField(values=torch.tensor([1.0, 0.0, -1.0]))
>>> proc = NarrativeGravityLogitsProcessor(field, strength=2.0)
>>> proc(torch.tensor([[0]]), torch.zeros(1, 3)).tolist()
[[2.0, 0.0, -2.0]]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import LogitsProcessor

from ..control import ConstantController, StepContext, StrengthController
from ..core import apply_gravity, apply_gravity_on_support, check_repeat_weight, damp_repeats, prune_mask
from ..errors import ConfigurationError, NonFiniteLogitsError, VocabularyError
from ..fields import NarrativeField
from ..thermo import Measurement, Trace, measure, measure_from_probs, measure_on_support

__all__ = ["NarrativeGravityLogitsProcessor"]


class NarrativeGravityLogitsProcessor(LogitsProcessor):
    """Add ``λ·a`` to the scores of every row, with λ chosen per row and step by a controller.

    Args:
        field: the :class:`~narrative_gravity.fields.NarrativeField` (built once, applied every step).
        controller: a strength controller; defaults to :class:`ConstantController` of ``strength``.
        strength: λ (one float, or one per prompt) when no controller is given.
        max_new_tokens: the token budget, so schedules know where the end is.
        prune_threshold: mask tokens whose field value is at or below this (true pruning); ``None`` = off.
        trace: a :class:`~narrative_gravity.thermo.Trace` to record entropy, mass, KL and λ; ``None`` = off
            and free.
        measure_only: record the trace but return the scores unchanged (the control run).
        nan_check_every: read the NaN flag back every this many steps; defaults to every step on CPU and
            every 16 steps on accelerators, so that no step waits on the device.
        repeat_weight: the share of its pull a narrative token (``a > 0``) keeps once the row has generated
            it (prompt tokens do not count). ``1`` = no change; below 1 the pull moves on to narrative tokens
            not yet written, which spreads the text over its topic instead of repeating one word.

    Scores are returned as a new tensor; the input is never modified.
    """

    def __init__(
        self,
        field: NarrativeField,
        controller: StrengthController | None = None,
        *,
        strength: float | Sequence[float] | None = None,
        max_new_tokens: int | None = None,
        prune_threshold: float | None = None,
        trace: Trace | None = None,
        measure_only: bool = False,
        nan_check_every: int | None = None,
        repeat_weight: float = 1.0,
    ) -> None:
        if not isinstance(field, NarrativeField):
            raise ConfigurationError(
                f"`field` has to be a NarrativeField, but is {type(field).__name__}; build one with "
                "narrative_gravity.fields.build_lexical_field(tokenizer, words)"
            )
        if controller is not None and strength is not None:
            raise ConfigurationError("give either `controller` or `strength`, not both")
        if controller is None:
            controller = ConstantController(1.0 if strength is None else strength)
        if not callable(controller):
            raise ConfigurationError(f"`controller` has to be callable, but is {type(controller).__name__}")
        if max_new_tokens is not None and (not isinstance(max_new_tokens, int) or max_new_tokens <= 0):
            raise ConfigurationError(f"`max_new_tokens` has to be a positive integer, but is {max_new_tokens!r}")
        if prune_threshold is not None and not -1.0 <= prune_threshold < 1.0:
            raise ConfigurationError(
                f"`prune_threshold` has to be in [-1, 1), but is {prune_threshold!r}; field values lie in [-1, 1]"
            )
        if nan_check_every is not None and nan_check_every < 1:
            raise ConfigurationError(f"`nan_check_every` has to be >= 1, but is {nan_check_every!r}")
        self.field = field
        self.controller = controller
        self.max_new_tokens = max_new_tokens
        self.prune_threshold = prune_threshold
        self.trace = trace
        self.measure_only = measure_only
        self.nan_check_every = nan_check_every
        self.repeat_weight = check_repeat_weight(repeat_weight)
        self._fitted: tuple[tuple[int, str, torch.dtype], NarrativeField] | None = None
        self._support: torch.Tensor | None = None
        # Without pruning, and with a controller that does not read the field, gravity touches the field's
        # support only (see NarrativeField.on_support): no [B, V] field is ever built.
        self._sparse = prune_threshold is None and not getattr(controller, "needs_field", True)
        self.reset()

    def reset(self) -> None:
        """Forget per-generation state (called automatically when a new generation starts)."""
        self._prompt_len: int | None = None
        self._last_len: int | None = None
        self._prompt: torch.Tensor | None = None
        self._first_nan_step: torch.Tensor | None = None
        if self.trace is not None:
            self.trace.reset()

    def _field_for(self, scores: torch.Tensor) -> NarrativeField:
        key = (scores.shape[-1], str(scores.device), scores.dtype)
        if self._fitted is None or self._fitted[0] != key:
            fitted = self.field.fit_vocab(scores.shape[-1]).to(scores.device, scores.dtype)
            self._fitted = (key, fitted)
            # The thermometer measures the pull on the field's support only, unless pruning can reach
            # tokens outside it (a threshold >= 0 also masks the field's zeros).
            sparse_ok = self.prune_threshold is None or self.prune_threshold < 0
            self._support = fitted.support() if sparse_ok else None
        return self._fitted[1]

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

    def _check_nan(self, scores: torch.Tensor, step: int) -> None:
        every = self.nan_check_every or (1 if scores.device.type == "cpu" else 16)
        if every == 1:
            # One read-only reduction per row; the exact (full-size) check runs only when a row sum is NaN,
            # which also happens for a row holding both +inf and -inf.
            if bool(torch.isnan(scores.sum(dim=-1)).any()):
                rows_nan = torch.isnan(scores).any(dim=-1)
                if bool(rows_nan.any()):
                    self._raise_nan(rows_nan, torch.full_like(rows_nan, step, dtype=torch.long))
            return
        rows_nan = torch.isnan(scores).any(dim=-1)
        first = self._first_nan_step
        if first is None or first.shape[0] != rows_nan.shape[0]:
            first = torch.full(rows_nan.shape, -1, dtype=torch.long, device=scores.device)
        self._first_nan_step = torch.where((first < 0) & rows_nan, step, first)
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
        if not self._continues(input_ids):
            self._start(input_ids, scores.shape[-1])
        self._last_len = length
        step = length - self._prompt_len
        self._check_nan(scores, step)
        field = self._field_for(scores)
        if self._sparse:
            return self._step_on_support(field, input_ids, scores, step)
        a = damp_repeats(field.for_step(input_ids), input_ids, step, self.repeat_weight, scores.shape[-1])
        ctx = self._context(step, input_ids, scores, a)
        if self.measure_only:
            if self.trace is not None:
                zero = torch.zeros(scores.shape[0], device=scores.device)
                self.trace.record(measure(scores, a, zero, pulled=scores, support=self._support))
            return scores
        lam = self.controller(ctx)
        out = apply_gravity(scores, a, lam, prune_mask(a, self.prune_threshold))
        if self.trace is not None:
            self.trace.record(self._measure(scores, a, lam, out))
        return out

    def _measure(self, scores: torch.Tensor, a: torch.Tensor, lam: torch.Tensor, out: torch.Tensor) -> Measurement:
        # A controller that already took this step's softmax (the thermostat) saves the thermometer its pass.
        prob = getattr(self.controller, "last_problem", None)
        support = self._support
        if prob is not None and prob.logits is scores and support is not None and self.prune_threshold is None:
            a_s = a[support] if a.dim() == 1 else a.gather(1, support[None].expand(a.shape[0], -1))
            return measure_from_probs(prob.p, prob.entropy, support, a_s, lam)
        return measure(scores, a, lam, pulled=out, support=support)

    def _context(
        self, step: int, input_ids: torch.Tensor, scores: torch.Tensor, field: torch.Tensor | None = None
    ) -> StepContext:
        return StepContext(
            step=step,
            max_new_tokens=self.max_new_tokens,
            batch_size=scores.shape[0],
            device=scores.device,
            logits=scores,
            field=field,
            input_ids=input_ids,
        )

    def _step_on_support(
        self, field: NarrativeField, input_ids: torch.Tensor, scores: torch.Tensor, step: int
    ) -> torch.Tensor:
        """The fast path (no pruning, a controller that does not read the field): work on the support only."""
        support, a_s = field.on_support(input_ids)
        a_s = damp_repeats(a_s, input_ids, step, self.repeat_weight, scores.shape[-1], support)
        if self.measure_only:
            if self.trace is not None:
                zero = torch.zeros(scores.shape[0], device=scores.device)
                self.trace.record(measure_on_support(scores, support, a_s, zero))
            return scores
        lam = self.controller(self._context(step, input_ids, scores))
        out = apply_gravity_on_support(scores, support, a_s, lam)
        if self.trace is not None:
            self.trace.record(measure_on_support(scores, support, a_s, lam))
        return out
