"""Narrative gravity for vLLM: one batch-level logits processor that serves every request in the engine.

Each request brings its own profile in ``SamplingParams.extra_args["gravity"]`` (a mapping, or the same
mapping as JSON text, which is what ``vllm_xargs`` in vLLM's OpenAI server can carry). Requests without
it are left untouched and cost nothing. The processor keeps one field per distinct profile (``[F, V]`` on
the sampler's device), per-row state in ``(max_num_reqs,)`` arrays, and every step it gathers the rows'
fields, computes one λ per row from the profile's schedule and calls
:func:`narrative_gravity.gravity.tilt.apply_gravity` on the gravity rows only.

It implements vLLM's v1 interface (``update_state(batch_update)`` + ``apply(logits)``, the V1 model runner)
and, where vLLM ships it, the Model Runner V2 interface (``add_request`` + ``apply(logits, ctx)``), so the
``vllm.logits_processors`` entry point works under both runners. See ``docs/vllm.md``.

>>> profile_from_extra_args({"gravity": {"core_semantics": ["orbit"], "gravity_strength": 2}}).gravity_strength
2.0
>>> profile_from_extra_args({"gravity": '{"core_semantics": ["orbit"]}'}).core_semantics
['orbit']
>>> profile_from_extra_args({"temperature_hint": 1}) is None
True
>>> profile_from_extra_args({"gravity": {"core_semantics": ["orbit"], "gravity_strenght": 2}})
Traceback (most recent call last):
...
narrative_gravity.errors.ProfileError: extra_args['gravity']: unknown key `gravity_strenght`; did you mean `gravity_strength`?
"""

from __future__ import annotations

import functools
import json
import logging
import weakref
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import ProfileError
from ..fields import NarrativeField
from ..gravity.schedule import ConstantController, PhaseScheduleController
from ..gravity.tilt import apply_gravity, apply_gravity_on_support, prune_mask
from ..profile import Profile

try:  # vLLM is an optional extra: the module imports without it (for docs and doctests) but cannot run.
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

    _VLLM_IMPORT_ERROR: ImportError | None = None
except ImportError as _exc:  # pragma: no cover - exercised where vLLM is not installed
    _VLLM_IMPORT_ERROR = _exc
    BatchUpdate = Any  # type: ignore[misc,assignment]
    MoveDirectionality = None  # type: ignore[assignment]

    class LogitsProcessor:  # type: ignore[no-redef]
        """Stand-in base class; the real one comes from vLLM."""


try:  # Model Runner V2 (vLLM >= 0.3x): a different interface under the same entry-point group.
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as _V2LogitsProcessor
except ImportError:  # pragma: no cover - older vLLM or no vLLM
    _V2LogitsProcessor = None

__all__ = ["GRAVITY_KEY", "NarrativeGravityVLLMLogitsProcessor", "phase_scale", "profile_from_extra_args"]

logger = logging.getLogger(__name__)

GRAVITY_KEY = "gravity"
_SOURCE = f"extra_args[{GRAVITY_KEY!r}]"
_NO_HISTORY = -2  # a token id no continuation prefix uses (prefixes pad with -1): "no token here"

# Columns of the per-row schedule parameters (float64, so the phase boundaries match the controller's
# Python floats exactly).
_BASE, _BUDGET, _EXPLORE_UNTIL, _STRICT_FROM, _EXPLORE, _CONVERGE, _STRICT, _EXPLORE_STEPS, _DECAY_AFTER, _HALF_LIFE = (
    range(10)
)
_N_PARAMS = 10


# --------------------------------------------------------------------------------------------------
# Per-request profiles


def profile_from_extra_args(extra_args: Mapping[str, Any] | None) -> Profile | None:
    """The profile in ``extra_args["gravity"]`` (a mapping or JSON text), or ``None`` when there is none.

    Raises :class:`~narrative_gravity.errors.ProfileError` (a ``ValueError``) that names the bad key, and
    rejects what this engine cannot run (the thermostat schedule, stages, ``field.repeat_weight``, semantic
    fields from the LM's own embeddings).
    """
    if not extra_args:
        return None
    if not isinstance(extra_args, Mapping):
        raise ProfileError(f"extra_args must be a mapping, but is {type(extra_args).__name__}")
    raw = extra_args.get(GRAVITY_KEY)
    if raw is None:
        return None
    return _parse_profile(_profile_key(raw))


def _profile_key(raw: Any) -> str:
    """Canonical JSON of a per-request profile, so equal profiles share one parse and one field."""
    if isinstance(raw, (str, bytes)):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ProfileError(
                f"{_SOURCE}: not valid JSON ({exc.msg} at character {exc.pos}); send the profile as a JSON object, "
                'e.g. vllm_xargs={"gravity": "{\\"core_semantics\\": [\\"orbit\\"]}"}'
            ) from None
    if not isinstance(raw, Mapping):
        raise ProfileError(
            f"{_SOURCE}: the profile must be a mapping of keys to values (or its JSON text), but is "
            f'{type(raw).__name__}; write e.g. {{"core_semantics": ["orbit", "planet"]}}'
        )
    try:
        return json.dumps(raw, sort_keys=True, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise ProfileError(f"{_SOURCE}: the profile must hold plain JSON values ({exc})") from None


@functools.lru_cache(maxsize=1024)
def _parse_profile(key: str) -> Profile:
    profile = Profile.from_mapping(json.loads(key), source=_SOURCE)
    if profile.schedule == "thermostat":
        raise ProfileError(
            f"{_SOURCE}: `schedule` (got 'thermostat') is not supported by the vLLM processor yet: the thermostat "
            "controller works on one decoding step per batch, and vLLM batches rows at different steps; use "
            "'phases' or 'constant'"
        )
    if profile.stages:
        raise ProfileError(
            f"{_SOURCE}: `stages` is not supported by the vLLM processor yet (stage tracking runs in the "
            "transformers processor); remove `stages`, or generate with transformers"
        )
    if profile.field.repeat_weight != 1.0:
        raise ProfileError(
            f"{_SOURCE}: `field.repeat_weight` (got {profile.field.repeat_weight}) is not supported by the vLLM "
            "processor yet (it reads each row's generated tokens, which runs in the transformers processor); "
            "remove it, or generate with transformers"
        )
    if profile.field.mode in ("semantic", "hybrid") and profile.field.semantic_source == "lm":
        raise ProfileError(
            f"{_SOURCE}: `field.semantic_source` (got 'lm') reads the generator's input embeddings, which live in "
            "vLLM's model workers out of the processor's reach; use 'minilm'"
        )
    return profile


def _row_params(profile: Profile, max_tokens: int | None) -> np.ndarray:
    """The schedule of one request as a row of :data:`_N_PARAMS` floats, read off its controller.

    ``steer.controller_from_profile`` decides which controller a profile gets (constant, or phases with
    the classic ``decay_after_steps``), exactly as for the transformers processor.
    """
    from ..steer import controller_from_profile

    ctrl = controller_from_profile(profile)
    row = np.zeros(_N_PARAMS, dtype=np.float64)
    row[_BASE] = float(ctrl.base(1, "cpu")[0])
    row[_BUDGET] = float(max_tokens or 0)
    if isinstance(ctrl, PhaseScheduleController):
        row[_EXPLORE_UNTIL], row[_STRICT_FROM] = ctrl.explore_until, ctrl.strict_from
        row[_EXPLORE], row[_CONVERGE], row[_STRICT] = ctrl.explore, ctrl.converge, ctrl.strict
        row[_EXPLORE_STEPS] = ctrl.explore_steps
        row[_DECAY_AFTER] = -1.0 if ctrl.decay_after_steps is None else ctrl.decay_after_steps
        row[_HALF_LIFE] = ctrl.decay_half_life
    elif isinstance(ctrl, ConstantController):
        row[_EXPLORE] = row[_CONVERGE] = row[_STRICT] = 1.0
        row[_DECAY_AFTER], row[_HALF_LIFE] = -1.0, 1.0
    else:  # pragma: no cover - _parse_profile rejects the thermostat
        raise ProfileError(f"{_SOURCE}: the vLLM processor cannot run a {type(ctrl).__name__}")
    return row


def phase_scale(step: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """:meth:`PhaseScheduleController.scale` for one step per row (``step [R]``, ``params [R, 10]`` float64).

    The same rule as the controller, in tensor ops so that rows at different steps and with different
    schedules are handled in one pass (``tests/test_vllm.py`` checks it against the controller).

    >>> p = torch.from_numpy(_row_params(Profile(core_semantics=["x"], gravity_strength=2.0), 100)).expand(3, -1)
    >>> phase_scale(torch.tensor([0, 50, 95]), p).tolist()
    [0.5, 1.0, 1.5]
    """
    step = step.to(torch.float64)
    budget = params[:, _BUDGET]
    frac = step / budget.clamp_min(1.0)
    explore, converge, strict = params[:, _EXPLORE], params[:, _CONVERGE], params[:, _STRICT]
    with_budget = torch.where(
        frac < params[:, _EXPLORE_UNTIL], explore, torch.where(frac >= params[:, _STRICT_FROM], strict, converge)
    )
    without = torch.where(step < params[:, _EXPLORE_STEPS], explore, converge)
    s = torch.where(budget > 0, with_budget, without)
    after = params[:, _DECAY_AFTER]
    decays = (after >= 0) & (step > after)
    return torch.where(decays, s * 0.5 ** ((step - after) / params[:, _HALF_LIFE]), s)


# --------------------------------------------------------------------------------------------------
# Distinct fields, shared by every request with the same profile


class _FieldTable:
    """One slot per distinct profile: the field (CPU), a refcount, and ``[F, V]`` value tables per width.

    Idle fields (refcount 0) stay cached until more than ``max_idle`` of them pile up; then the least
    recently used idle one is evicted and its slot reused.
    """

    def __init__(self, device: torch.device, max_idle: int = 32) -> None:
        self.device = device
        self.max_idle = max_idle
        self.fields: list[NarrativeField | None] = []
        self.keys: list[str | None] = []
        self.refs: list[int] = []
        self.by_key: dict[str, int] = {}
        self.idle: OrderedDict[int, None] = OrderedDict()
        self._tables: dict[int, torch.Tensor] = {}  # width -> [capacity, width] float32 on device
        self._fitted: dict[tuple[int, int], NarrativeField] = {}  # (slot, width) -> field on device

    def acquire(self, key: str, build: Any) -> int:
        slot = self.by_key.get(key)
        if slot is None:
            field = build()
            slot = self._free_slot()
            self.fields[slot], self.keys[slot] = field, key
            self.by_key[key] = slot
            for width, table in list(self._tables.items()):
                self._tables[width] = self._write_row(table, slot, field, width)
        self.idle.pop(slot, None)
        self.refs[slot] += 1
        return slot

    def release(self, slot: int) -> None:
        self.refs[slot] -= 1
        if self.refs[slot] == 0:
            self.idle[slot] = None
            self.idle.move_to_end(slot)
            while len(self.idle) > self.max_idle:
                old, _ = self.idle.popitem(last=False)
                self._evict(old)

    def _free_slot(self) -> int:
        for slot, key in enumerate(self.keys):
            if key is None:
                return slot
        self.fields.append(None)
        self.keys.append(None)
        self.refs.append(0)
        return len(self.keys) - 1

    def _evict(self, slot: int) -> None:
        del self.by_key[self.keys[slot]]
        self.fields[slot] = self.keys[slot] = None
        for k in [k for k in self._fitted if k[0] == slot]:
            del self._fitted[k]

    def fitted(self, slot: int, width: int) -> NarrativeField:
        key = (slot, width)
        field = self._fitted.get(key)
        if field is None:
            field = self.fields[slot].fit_vocab(width).to(self.device, torch.float32)
            self._fitted[key] = field
        return field

    def _write_row(self, table: torch.Tensor, slot: int, field: NarrativeField, width: int) -> torch.Tensor:
        if slot >= table.shape[0]:
            grown = torch.zeros(max(2 * table.shape[0], slot + 1), width, dtype=table.dtype, device=table.device)
            grown[: table.shape[0]] = table
            table = grown
        table[slot] = field.fit_vocab(width).values.to(self.device, torch.float32)
        return table

    def values(self, width: int) -> torch.Tensor:
        """``[capacity, width]`` field values, one row per slot (rows of evicted slots are stale, never read)."""
        table = self._tables.get(width)
        if table is None:
            table = torch.zeros(max(len(self.keys), 1), width, dtype=torch.float32, device=self.device)
            for slot, field in enumerate(self.fields):
                if field is not None:
                    table = self._write_row(table, slot, field, width)
            self._tables[width] = table
        return table

    def has_continuations(self, slot: int) -> bool:
        return self.fields[slot].has_continuations

    def max_prefix_len(self, slot: int) -> int:
        return self.fields[slot].max_prefix_len


# --------------------------------------------------------------------------------------------------
# The processor


@dataclass
class _Step:
    """What one ``apply`` needs about the gravity rows (all on the sampler's device unless noted)."""

    rows: torch.Tensor  # [R] int64: rows of `logits`
    slots: torch.Tensor  # [R] int64: index into the per-row state arrays
    steps: torch.Tensor  # [R] int64: tokens generated so far
    tails: torch.Tensor | None  # [R, L] int64: last L tokens (prompt + output), -2 where there are none
    layout: _Layout  # which field each gravity row uses
    full: bool  # the rows are exactly 0..B-1 (no gather/scatter needed)


@dataclass
class _Layout:
    """How the gravity rows split over distinct fields (host side; changes only when the batch does)."""

    single: int | None  # the one field slot when every gravity row uses the same field
    groups: list[tuple[int, torch.Tensor]]  # (field slot, positions in 0..R-1) for fields with continuations
    width: int  # longest continuation prefix among the rows' fields (0: no continuations)
    prune: bool  # some row has a prune threshold


_BASES: tuple[type, ...] = (LogitsProcessor,) if _V2LogitsProcessor is None else (LogitsProcessor, _V2LogitsProcessor)

# One live processor per engine: an entry-point plugin and the same class passed by `logits_processors=`
# would otherwise both be built, and both pull.
_LIVE: dict[int, tuple[weakref.ref, weakref.ref]] = {}


class NarrativeGravityVLLMLogitsProcessor(*_BASES):
    """vLLM logits processor: per-request narrative gravity from ``SamplingParams.extra_args["gravity"]``.

    vLLM builds it (``LLM(..., logits_processors=[NarrativeGravityVLLMLogitsProcessor])``, ``vllm serve
    --logits-processors narrative_gravity.engines.vllm:NarrativeGravityVLLMLogitsProcessor``, or the
    ``vllm.logits_processors`` entry point that ``pip install narrative-gravity[vllm]`` registers).

    V1 runner: ``__init__(vllm_config, device, is_pin_memory)``; Model Runner V2:
    ``__init__(vllm_config, req_states)``. ``tokenizer`` (keyword only, for tests) replaces the engine's
    tokenizer, which is otherwise loaded from the model config on the first gravity request.

    Rows are pulled with :func:`~narrative_gravity.gravity.tilt.apply_gravity`; λ per row is the profile's base
    strength times its phase schedule at the row's step (:func:`phase_scale`); the field per row includes
    the multi-token continuations of the row's last tokens. ``strategy`` picks how gravity rows are applied
    in a batch that also has other rows: ``"index"`` (gather the gravity rows, pull, scatter back),
    ``"mask"`` (pull every row, zero strength elsewhere) or ``"auto"`` (``mask`` on the CPU, ``index`` on
    accelerators). When every row has gravity there is neither gather nor scatter.
    """

    strategy = "auto"

    def __init__(self, vllm_config: Any, *args: Any, tokenizer: Any = None) -> None:
        if _VLLM_IMPORT_ERROR is not None:
            raise ImportError(
                "NarrativeGravityVLLMLogitsProcessor needs vLLM: pip install 'narrative-gravity[vllm]' "
                "(see docs/vllm.md)"
            ) from _VLLM_IMPORT_ERROR
        self._v2 = len(args) == 1
        if self._v2:
            (req_states,) = args
            self._req_states = req_states
            self.device = torch.device(req_states.device)
            max_num_reqs = int(req_states.max_num_reqs)
        elif len(args) == 2:
            device, _is_pin_memory = args
            self._req_states = None
            self.device = torch.device(device)
            max_num_reqs = int(vllm_config.scheduler_config.max_num_seqs)
        else:
            raise TypeError(
                "NarrativeGravityVLLMLogitsProcessor(vllm_config, device, is_pin_memory) (V1 runner) or "
                f"(vllm_config, req_states) (Model Runner V2); got {1 + len(args)} positional arguments"
            )
        self.vllm_config = vllm_config
        self.max_num_reqs = max_num_reqs
        self._tokenizer = tokenizer
        self._tokenizer_failed = False
        self.inert = not _claim(vllm_config, self)
        if self.inert:
            logger.warning(
                "narrative-gravity: a second NarrativeGravityVLLMLogitsProcessor was built for the same engine "
                "(entry point and logits_processors=[...]); only the first one pulls"
            )
        self.fields = _FieldTable(self.device)
        # Per-row state, indexed by the persistent batch index (V1) or the request slot (V2).
        self._fslot = np.full(max_num_reqs, -1, dtype=np.int64)
        self._params = np.zeros((max_num_reqs, _N_PARAMS), dtype=np.float64)
        self._thr = np.full(max_num_reqs, np.nan, dtype=np.float32)
        self._params_dev = torch.zeros((max_num_reqs, _N_PARAMS), dtype=torch.float64, device=self.device)
        self._thr_dev = torch.full((max_num_reqs,), float("nan"), dtype=torch.float32, device=self.device)
        self._fslot_dev = torch.full((max_num_reqs,), -1, dtype=torch.int64, device=self.device)
        self._dirty = False
        self._spec_warned = False
        # V1 only: the request's prompt and (live) output token lists, and the cached active-row view.
        self._prompts: list[Sequence[int] | None] = [None] * max_num_reqs
        self._outputs: list[list[int] | None] = [None] * max_num_reqs
        self._batch_size = 0
        self._view: tuple[np.ndarray, torch.Tensor, list[list[int]], list[Sequence[int]], _Layout | None] | None = None

    # -- vLLM interface ------------------------------------------------------------------------------

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        """Reject a bad per-request profile before the request enters the batch (vLLM turns the
        ``ValueError`` into a 400 response); other requests are not touched."""
        profile_from_extra_args(getattr(sampling_params, "extra_args", None))

    def is_argmax_invariant(self) -> bool:
        """Gravity moves the argmax: it must run for greedy requests too."""
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """V1 runner: follow requests as they are added, removed and moved (bookkeeping only)."""
        if batch_update is None or self.inert:
            return
        for index in batch_update.removed:
            self._clear(index)
        for index, params, prompt_ids, output_ids in batch_update.added:
            self._clear(index)
            if self._admit(index, params):
                self._prompts[index], self._outputs[index] = prompt_ids or (), output_ids
        for a, b, direction in batch_update.moved:
            if direction == MoveDirectionality.SWAP:
                self._swap(a, b)
            else:
                self._clear(b)
                self._swap(a, b)
        self._batch_size = batch_update.batch_size
        self._view = None
        self._dirty = True

    def add_request(self, req_idx: int, sampling_params: Any) -> bool:
        """Model Runner V2: (re)initialize the slot ``req_idx`` for a request entering the batch."""
        if self.inert:
            return False
        self._clear(req_idx)
        self._dirty = True
        return self._admit(req_idx, sampling_params)

    def apply_staged_writes(self) -> None:
        """Model Runner V2: copy the per-slot state to the device once per step, if it changed."""
        self._upload()

    def apply(self, logits: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        """Pull the gravity rows of ``logits [B, V]`` (float32); rows without gravity are left as they are."""
        if self.inert:
            return logits
        step = self._step_v1(logits) if ctx is None else self._step_v2(logits, ctx)
        if step is None:
            return logits
        return self._pull(logits, step)

    # -- per-row state -------------------------------------------------------------------------------

    def _admit(self, index: int, params: Any) -> bool:
        """Set up row ``index`` for ``params``; ``False`` when the request has no gravity (or it cannot run)."""
        extra = getattr(params, "extra_args", None)
        if not extra or extra.get(GRAVITY_KEY) is None:
            return False
        try:
            key = _profile_key(extra[GRAVITY_KEY])
            profile = _parse_profile(key)
            row = _row_params(profile, getattr(params, "max_tokens", None))
            tokenizer = self._engine_tokenizer()
            if tokenizer is None:
                return False
            from ..steer import field_from_profile

            slot = self.fields.acquire(key, lambda: field_from_profile(profile, tokenizer))
        except Exception:  # a processor must not take the engine down; validate_params catches the usual errors
            logger.exception("narrative-gravity: request runs without gravity; its profile could not be used")
            return False
        self._fslot[index] = slot
        self._params[index] = row
        self._thr[index] = np.nan if profile.prune_threshold is None else profile.prune_threshold
        return True

    def _clear(self, index: int) -> None:
        slot = int(self._fslot[index])
        if slot >= 0:
            self.fields.release(slot)
            self._fslot[index] = -1
        self._prompts[index] = self._outputs[index] = None

    def _swap(self, a: int, b: int) -> None:
        for arr in (self._fslot, self._params, self._thr):
            arr[[a, b]] = arr[[b, a]]
        self._prompts[a], self._prompts[b] = self._prompts[b], self._prompts[a]
        self._outputs[a], self._outputs[b] = self._outputs[b], self._outputs[a]

    def _upload(self) -> None:
        if self._dirty:
            self._params_dev.copy_(torch.from_numpy(self._params), non_blocking=True)
            self._thr_dev.copy_(torch.from_numpy(self._thr), non_blocking=True)
            self._fslot_dev.copy_(torch.from_numpy(self._fslot), non_blocking=True)
            self._dirty = False

    def _engine_tokenizer(self) -> Any:
        if self._tokenizer is None and not self._tokenizer_failed:
            cfg = getattr(self.vllm_config, "model_config", None)
            try:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(
                    cfg.tokenizer,
                    revision=getattr(cfg, "tokenizer_revision", None),
                    trust_remote_code=bool(getattr(cfg, "trust_remote_code", False)),
                )
            except Exception:
                self._tokenizer_failed = True
                logger.exception("narrative-gravity: cannot load the engine's tokenizer; gravity is off")
        return self._tokenizer

    # -- one step ------------------------------------------------------------------------------------

    def _step_v1(self, logits: torch.Tensor) -> _Step | None:
        view = self._view
        if view is None:
            n = min(self._batch_size, logits.shape[0])
            rows_np = np.flatnonzero(self._fslot[:n] >= 0)
            view = (
                rows_np,
                torch.from_numpy(rows_np).to(self.device),
                [self._outputs[i] for i in rows_np],
                [self._prompts[i] for i in rows_np],
                self._layout(rows_np, rows_np) if rows_np.size else None,
            )
            self._view = view
        rows_np, rows, outputs, prompts, layout = view
        if layout is None:
            return None
        self._upload()
        # vLLM v1 hands out output tokens only as live Python lists: one host pass over the gravity rows
        # reads how many each has (and, for fields with continuations, the last few tokens).
        steps = torch.from_numpy(np.fromiter(map(len, outputs), dtype=np.int64, count=len(outputs)))
        width = layout.width
        tails = None
        if width:
            tails_np = np.full((len(rows_np), width), _NO_HISTORY, dtype=np.int64)
            for i, (out, prompt) in enumerate(zip(outputs, prompts)):
                recent = out[-width:]
                if len(recent) < width and prompt:
                    recent = [*prompt[-(width - len(recent)) :], *recent]
                if recent:
                    tails_np[i, width - len(recent) :] = recent
            tails = torch.from_numpy(tails_np).to(self.device, non_blocking=True)
        return _Step(
            rows=rows,
            slots=rows,
            steps=steps.to(self.device, non_blocking=True),
            tails=tails,
            layout=layout,
            full=len(rows_np) == logits.shape[0],
        )

    def _step_v2(self, logits: torch.Tensor, ctx: Any) -> _Step | None:
        slots_np = np.asarray(ctx.idx_mapping_np)
        if logits.shape[0] != slots_np.shape[0]:  # speculative decoding: several rows per request
            if not self._spec_warned and (self._fslot[slots_np] >= 0).any():
                self._spec_warned = True
                logger.warning("narrative-gravity: speculative decoding is not supported; gravity is off")
            return None
        fslot = self._fslot[slots_np]
        rows_np = np.flatnonzero(fslot >= 0)
        if not rows_np.size:
            return None
        self._upload()
        rows = torch.from_numpy(rows_np).to(self.device, non_blocking=True)
        slots = ctx.idx_mapping[rows].long()
        rs = self._req_states
        pos = ctx.pos[rows].long()
        steps = (pos + 1 - rs.prompt_len.gpu[slots].long()).clamp_min(0)
        layout = self._layout(slots_np[rows_np], rows_np)
        width = layout.width
        tails = None
        if width:
            # Committed tokens before the row's position, then the token fed at it.
            back = torch.arange(width - 1, -1, -1, device=self.device)
            idx = pos[:, None] - back[None, :]
            tokens = rs.all_token_ids.gpu[slots[:, None], idx.clamp_min(0)].long()
            tokens[:, -1] = ctx.input_ids[rows].long()
            tails = torch.where(idx >= 0, tokens, torch.full_like(tokens, _NO_HISTORY))
        return _Step(
            rows=rows, slots=slots, steps=steps, tails=tails, layout=layout, full=len(rows_np) == logits.shape[0]
        )

    def _layout(self, slots_np: np.ndarray, rows_np: np.ndarray) -> _Layout:
        """Group the gravity rows (their state indices ``slots_np``) by field."""
        fslots = self._fslot[slots_np]
        distinct = np.unique(fslots).tolist()
        groups: list[tuple[int, torch.Tensor]] = []
        width = 0
        for slot in distinct:
            if self.fields.has_continuations(slot):
                pos = torch.from_numpy(np.flatnonzero(fslots == slot)).to(self.device, non_blocking=True)
                groups.append((slot, pos))
                width = max(width, self.fields.max_prefix_len(slot))
        return _Layout(
            single=distinct[0] if len(distinct) == 1 else None,
            groups=groups,
            width=width,
            prune=bool(np.isfinite(self._thr[slots_np]).any()),
        )

    def _pull(self, logits: torch.Tensor, s: _Step) -> torch.Tensor:
        # Row gathers use advanced indexing (one pass over the output), not `index_select`/`index_add_`: on
        # CPUs those run one parallel region per row and stall for whole time slices on a busy machine.
        width = logits.shape[-1]
        lay = s.layout
        if lay.single is not None and not lay.prune:  # one profile, no pruning: touch the field's support only
            return self._pull_on_support(logits, s, self.fields.fitted(lay.single, width))
        if lay.single is not None:  # one profile for every gravity row: the field as the HF processor uses it
            field = self.fields.fitted(lay.single, width)
            a = field.for_step(s.tails[:, -field.max_prefix_len :]) if lay.width else field.values  # [R, V] or [V]
        else:
            a = self.fields.values(width)[self._fslot_dev[s.slots]]  # [R, V]
            for slot, pos in lay.groups:  # one pass per distinct field, never per row
                field = self.fields.fitted(slot, width)
                cont = field.continuation(s.tails[pos][:, -field.max_prefix_len :])
                a.index_put_((pos,), cont, accumulate=True)
            if lay.groups:
                a.clamp_(-1.0, 1.0)
        params = self._params_dev[s.slots]
        lam = (params[:, _BASE] * phase_scale(s.steps, params)).to(logits.dtype)
        mask = prune_mask(a, self._thr_dev[s.slots][:, None]) if lay.prune else None
        if s.full:
            return apply_gravity(logits, a, lam, mask)
        if self._masks(logits):
            a_all = torch.zeros_like(logits).index_copy_(0, s.rows, a.expand(len(s.rows), -1))
            lam_all = torch.zeros(logits.shape[0], dtype=logits.dtype, device=logits.device).index_copy_(0, s.rows, lam)
            m_all = None
            if mask is not None:
                m_all = torch.zeros_like(logits, dtype=torch.bool).index_copy_(0, s.rows, mask)
            return apply_gravity(logits, a_all, lam_all, m_all)
        pulled = apply_gravity(logits[s.rows], a, lam, mask)
        return logits.index_copy_(0, s.rows, pulled)

    def _masks(self, logits: torch.Tensor) -> bool:
        """Whether a batch with rows of no gravity is pulled whole (λ = 0 on those rows) rather than gathered.

        ``auto`` masks on the CPU, where row gathers and scatters cost more than the pull itself
        (``bench/vllm_throughput.py --micro``: 2.0 ms against 6.2 ms at 32 rows, half of them pulled).
        """
        return self.strategy == "mask" or (self.strategy == "auto" and logits.device.type == "cpu")

    def _pull_on_support(self, logits: torch.Tensor, s: _Step, field: NarrativeField) -> torch.Tensor:
        """:meth:`_pull` for one profile without pruning: the field gathered on its support, ``[R, S]``."""
        tails = s.tails[:, -field.max_prefix_len :] if field.has_continuations else s.tails  # None: no table
        support, a_s = field.on_support(tails)  # [S], and [R, S] with continuations else [S]
        params = self._params_dev[s.slots]
        lam = (params[:, _BASE] * phase_scale(s.steps, params)).to(logits.dtype)
        if s.full:
            return apply_gravity_on_support(logits, support, a_s, lam)
        if self._masks(logits):
            a_all = torch.zeros(logits.shape[0], support.shape[0], dtype=a_s.dtype, device=a_s.device)
            a_all.index_copy_(0, s.rows, a_s.expand(len(s.rows), -1))
            lam_all = torch.zeros(logits.shape[0], dtype=logits.dtype, device=logits.device).index_copy_(0, s.rows, lam)
            return apply_gravity_on_support(logits, support, a_all, lam_all)
        pulled = apply_gravity_on_support(logits[s.rows], support, a_s, lam)
        return logits.index_copy_(0, s.rows, pulled)


def _claim(vllm_config: Any, proc: NarrativeGravityVLLMLogitsProcessor) -> bool:
    """``True`` for the first processor built for this engine config; later ones stay inert."""
    for key, (cfg_ref, proc_ref) in list(_LIVE.items()):
        if cfg_ref() is None or proc_ref() is None:
            del _LIVE[key]
    try:
        cfg_ref = weakref.ref(vllm_config)
    except TypeError:  # not weak-referenceable: cannot tell engines apart, so never go inert
        return True
    live = _LIVE.get(id(vllm_config))
    if live is not None and live[0]() is vllm_config and live[1]() is not None:
        return False
    _LIVE[id(vllm_config)] = (cfg_ref, weakref.ref(proc))
    return True
