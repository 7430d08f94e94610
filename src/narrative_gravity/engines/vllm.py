"""Narrative gravity for vLLM: one batch-level logits processor that serves every request in the engine.

Each request brings its own profile in ``SamplingParams.extra_args["gravity"]`` (a mapping, or the same
mapping as JSON text, which is what ``vllm_xargs`` in vLLM's OpenAI server can carry). Requests without
it are left untouched. The processor is a thin adapter: vLLM's bookkeeping (requests added, removed and
moved; each row's newest token) becomes rows of the steering kernel
(:class:`~narrative_gravity.gravity.kernel.GravityKernel`), which owns every row's state (step, budget,
history, what it has said, its stage) and all the math. Every profile the transformers engine runs runs
here: constant, phases and the thermostat, ``repeat_weight``, ``stages``, ``prune_threshold``, lexical and
semantic fields (MiniLM, or the model's own input embeddings read from its checkpoint), and topic memory.

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
import threading
import weakref
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..errors import ConfigurationError, ProfileError
from ..gravity.kernel import GravityKernel, Program
from ..gravity.thermo import METRICS
from ..profiles.build import program_from_profile
from ..profiles.schema import Profile

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

__all__ = [
    "GRAVITY_KEY",
    "TRACE_KEY",
    "NarrativeGravityVLLMLogitsProcessor",
    "forget_trace",
    "pop_trace",
    "profile_from_extra_args",
]

logger = logging.getLogger(__name__)

GRAVITY_KEY = "gravity"
TRACE_KEY = "gravity_trace"
"""``extra_args[TRACE_KEY]``: an id under which the processor keeps the request's per-step measurements
(:func:`pop_trace`), for a caller in the engine's process (``ngrav serve --engine vllm`` streams them)."""

# id -> one row of METRICS (entropy, mass, mass_after, kl, strength) per generated token, until popped
_TRACES: dict[str, list[list[float]]] = {}
_TRACES_LOCK = threading.Lock()


def pop_trace(trace_id: str) -> list[dict[str, float]]:
    """The measurements kept for ``trace_id`` since the last call, one per generated token, oldest first."""
    with _TRACES_LOCK:
        rows = _TRACES.pop(trace_id, [])
    return [dict(zip(METRICS, row)) for row in rows]


def forget_trace(trace_id: str) -> None:
    """Drop what is kept for ``trace_id`` (a request that ended or was aborted)."""
    with _TRACES_LOCK:
        _TRACES.pop(trace_id, None)


_SOURCE = f"extra_args[{GRAVITY_KEY!r}]"

# --------------------------------------------------------------------------------------------------
# Per-request profiles


def profile_from_extra_args(extra_args: Mapping[str, Any] | None) -> Profile | None:
    """The profile in ``extra_args["gravity"]`` (a mapping or JSON text), or ``None`` when there is none.

    Raises :class:`~narrative_gravity.errors.ProfileError` (a ``ValueError``) that names the bad key.
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
    return Profile.from_mapping(json.loads(key), source=_SOURCE)


# --------------------------------------------------------------------------------------------------
# The processor


_BASES: tuple[type, ...] = (LogitsProcessor,) if _V2LogitsProcessor is None else (LogitsProcessor, _V2LogitsProcessor)

# One live processor per engine: an entry-point plugin and the same class passed by `logits_processors=`
# would otherwise both be built, and both pull.
_LIVE: dict[int, tuple[weakref.ref, weakref.ref]] = {}


_StepRows = tuple[torch.Tensor | None, np.ndarray | None, torch.Tensor | None, torch.Tensor | None]
"""A step's rows: logits rows to kernel rows (device, host; ``None``: row i is kernel row i), and the newest
tokens with the rows they are new on (``None``: all), where they are advanced with the step."""


class NarrativeGravityVLLMLogitsProcessor(*_BASES):
    """vLLM logits processor: per-request narrative gravity from ``SamplingParams.extra_args["gravity"]``.

    vLLM builds it (``LLM(..., logits_processors=[NarrativeGravityVLLMLogitsProcessor])``, ``vllm serve
    --logits-processors narrative_gravity.engines.vllm:NarrativeGravityVLLMLogitsProcessor``, or the
    ``vllm.logits_processors`` entry point that ``pip install narrative-gravity[vllm]`` registers).

    V1 runner: ``__init__(vllm_config, device, is_pin_memory)``; Model Runner V2:
    ``__init__(vllm_config, req_states)``. ``tokenizer`` (keyword only, for tests) replaces the engine's
    tokenizer, which is otherwise loaded from the model config on the first gravity request.

    Kernel rows are vLLM's persistent batch indices (V1) or request slots (V2). Each step the rows' newest
    tokens go to :meth:`GravityKernel.advance` and the logits to :meth:`GravityKernel.apply`, which pulls
    every row by its own program at its own step (rows without gravity get a zero field and λ = 0).
    ``last_strength`` holds the step's λ per logits row.
    """

    max_programs = 64  # distinct profiles whose built fields are kept
    on_step: Any = None
    """A function ``(processor, logits, pulled, result)``, set on the class, called after every step with
    gravity; ``result`` is the kernel's :class:`~narrative_gravity.gravity.kernel.StepResult` (λ and the step's
    measurement per logits row). For tests and debugging; ``None`` (the default) costs nothing."""
    on_measure: Any = None
    """A function ``(processor, result)``, set on the class, called after every step with gravity with the
    step's :class:`~narrative_gravity.gravity.kernel.StepResult`, measurement included. Unlike ``on_step`` it
    is not handed the unpulled logits, so the kernel still pulls them in place: what recording traces uses
    (``VLLMGenerator(record_trace=True)``, ``ngrav eval --engine vllm``)."""

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
        self.kernel = GravityKernel(max_num_reqs, self.device)
        self._programs: OrderedDict[str, Program] = OrderedDict()
        # V1: each row's live output list and how many of its tokens the kernel has seen. V2: rows whose
        # history is read from the request state on their first step.
        self._outputs: list[list[int] | None] = [None] * max_num_reqs
        self._seen = np.zeros(max_num_reqs, dtype=np.int64)
        self._fresh = np.zeros(max_num_reqs, dtype=bool)
        self._trace_ids: list[str | None] = [None] * max_num_reqs
        self._batch_size = 0
        self._spec_warned = False
        self.last_strength: torch.Tensor | None = None

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
            self.kernel.remove(index)
            self._outputs[index] = self._trace_ids[index] = None
        for index, params, prompt_ids, output_ids in batch_update.added:
            program = self._program(params)
            budget = getattr(params, "max_tokens", None)
            self.kernel.add(index, program, budget=budget, prompt=prompt_ids or (), output=output_ids or ())
            self._outputs[index] = output_ids if program is not None else None
            self._seen[index] = len(output_ids or ())
            self._trace_ids[index] = _trace_id(params) if program is not None else None
        for a, b, direction in batch_update.moved:
            ids = self._trace_ids
            if direction == MoveDirectionality.SWAP:
                self.kernel.swap(a, b)
                self._outputs[a], self._outputs[b] = self._outputs[b], self._outputs[a]
                self._seen[[a, b]] = self._seen[[b, a]]
                ids[a], ids[b] = ids[b], ids[a]
            else:
                self.kernel.move(a, b)
                self._outputs[b], self._outputs[a] = self._outputs[a], None
                self._seen[b] = self._seen[a]
                ids[b], ids[a] = ids[a], None
        self._batch_size = batch_update.batch_size

    def add_request(self, req_idx: int, sampling_params: Any) -> bool:
        """Model Runner V2: (re)initialize the slot ``req_idx`` for a request entering the batch."""
        if self.inert:
            return False
        program = self._program(sampling_params)
        self.kernel.add(req_idx, program, budget=getattr(sampling_params, "max_tokens", None))
        self._fresh[req_idx] = program is not None
        self._trace_ids[req_idx] = _trace_id(sampling_params) if program is not None else None
        return program is not None

    def apply_staged_writes(self) -> None:
        """Model Runner V2: nothing to stage (the kernel copies changed settings on its next step)."""

    def apply(self, logits: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        """Pull the gravity rows of ``logits [B, V]`` (float32); rows without gravity are left as they are."""
        if self.inert:
            return logits
        rows = self._step_v1(logits) if ctx is None else self._step_v2(logits, ctx)
        self.last_strength = None
        if rows is None:
            return logits
        logits_rows, rows_np, tokens, new = rows
        traced = []
        if any(self._trace_ids):
            kernel_rows = range(logits.shape[0]) if rows_np is None else rows_np
            traced = [(i, self._trace_ids[r]) for i, r in enumerate(kernel_rows) if self._trace_ids[r] is not None]
        measure = self.on_step is not None or self.on_measure is not None or bool(traced)
        # vLLM hands its float32 logits over (its own processors write into them too); the kernel copies only
        # where its measurement needs the unpulled logits, and an `on_step` hook is promised them
        if tokens is not None:  # the state update and the step in one call (one graph, compiled)
            out, result = self.kernel.advance_apply(
                tokens, logits, logits_rows, rows_np, new=new, measure_step=measure, inplace=self.on_step is None
            )
        else:
            out, result = self.kernel.apply(
                logits, logits_rows, rows_np, measure_step=measure, inplace=self.on_step is None
            )
        self.last_strength = result.strength
        if traced:  # one read back per step, only while some request asked for its trace
            values = result.measurement.stack()[[i for i, _ in traced]].tolist()
            with _TRACES_LOCK:
                for (_, trace_id), row in zip(traced, values):
                    _TRACES.setdefault(trace_id, []).append(row)
        if self.on_measure is not None:
            self.on_measure(result)
        if self.on_step is not None:
            self.on_step(logits, out, result)
        return out

    # -- per-request programs ------------------------------------------------------------------------

    def _program(self, params: Any) -> Program | None:
        """The kernel program of ``params``' profile, or ``None`` (no gravity, or it cannot run)."""
        extra = getattr(params, "extra_args", None)
        if not extra or extra.get(GRAVITY_KEY) is None:
            return None
        try:
            key = _profile_key(extra[GRAVITY_KEY])
            program = self._programs.get(key)
            if program is None:
                profile = _parse_profile(key)
                tokenizer = self._engine_tokenizer()
                if tokenizer is None:
                    return None
                model = self._engine_model(profile)
                program = program_from_profile(profile, tokenizer, model=model, key=key)
                self._programs[key] = program
                while len(self._programs) > self.max_programs:
                    self._programs.popitem(last=False)
            self._programs.move_to_end(key)
            return program
        except Exception:  # a processor must not take the engine down; validate_params catches the usual errors
            logger.exception("narrative-gravity: request runs without gravity; its profile could not be used")
            return None

    def _engine_tokenizer(self) -> Any:
        if self._tokenizer is None and not self._tokenizer_failed:
            cfg = getattr(self.vllm_config, "model_config", None)
            try:
                self._tokenizer = AutoTokenizer.from_pretrained(
                    cfg.tokenizer,
                    revision=getattr(cfg, "tokenizer_revision", None),
                    trust_remote_code=bool(getattr(cfg, "trust_remote_code", False)),
                )
            except Exception:
                self._tokenizer_failed = True
                logger.exception("narrative-gravity: cannot load the engine's tokenizer; gravity is off")
        return self._tokenizer

    def _engine_model(self, profile: Profile) -> Any:
        """What ``profile``'s field reads of the model (:func:`field_model`), from the checkpoint vLLM serves."""
        cfg = getattr(self.vllm_config, "model_config", None)
        return field_model(profile, getattr(cfg, "model", None))

    # -- one step ------------------------------------------------------------------------------------

    def _step_v1(self, logits: torch.Tensor) -> _StepRows | None:
        """The rows to pull (V1: logits row i is kernel row i) and the newest tokens, where they are advanced
        with the step; other tokens are advanced here."""
        b = min(self._batch_size, logits.shape[0])
        live = np.flatnonzero(self.kernel.prog[:b] >= 0)
        if not live.size:
            return None
        # vLLM v1 hands out output tokens only as live Python lists: one host pass over the gravity rows
        # reads how many each has, and the newest token of those that grew.
        lengths = np.fromiter((len(self._outputs[i]) for i in live), dtype=np.int64, count=live.size)
        grown = lengths - self._seen[live]
        if live.size == b == logits.shape[0] and (grown == 1).all():  # the usual step: all rows, one token each
            newest = [self._outputs[i][-1] for i in range(b)]  # advanced with the step, in `apply`
            tokens = torch.tensor(newest, dtype=torch.long).to(self.device, non_blocking=True)
        else:
            tokens = None
            for k in range(int(grown.max(initial=0))):  # one token a step; more only if a step was skipped
                rows = live[grown > k]
                missed = [self._outputs[i][self._seen[i] + k] for i in rows]
                self.kernel.advance(
                    torch.tensor(missed, dtype=torch.long).to(self.device, non_blocking=True),
                    torch.from_numpy(rows).to(self.device, non_blocking=True),
                )
        self._seen[live] = lengths
        return None, None, tokens, None

    def _step_v2(self, logits: torch.Tensor, ctx: Any) -> _StepRows | None:
        slots_np = np.asarray(ctx.idx_mapping_np).astype(np.int64)
        if logits.shape[0] != slots_np.shape[0]:  # speculative decoding: several rows per request
            if not self._spec_warned and (self.kernel.prog[slots_np] >= 0).any():
                self._spec_warned = True
                logger.warning("narrative-gravity: speculative decoding is not supported; gravity is off")
            return None
        gravity = self.kernel.prog[slots_np] >= 0
        if not gravity.any():
            return None
        slots = ctx.idx_mapping.long().to(self.device)
        rs = self._req_states
        pos = ctx.pos.long()
        fresh = gravity & self._fresh[slots_np]
        for row in np.flatnonzero(fresh):  # once per request: its history so far, from the request state
            slot = int(slots_np[row])
            p = int(pos[row])
            seq = [*rs.all_token_ids.gpu[slot, :p].tolist(), int(ctx.input_ids[row])]
            n_prompt = int(rs.prompt_len.gpu[slot])
            program = self.kernel.program(slot)
            budget = int(self.kernel.budget[slot])
            self.kernel.add(slot, program, budget=budget, prompt=seq[:n_prompt], output=seq[n_prompt:])
            self._fresh[slot] = False
        steps = (pos + 1 - rs.prompt_len.gpu[slots].long()).clamp_min(0)
        known = gravity & ~fresh  # rows whose newest token the kernel may not have yet: advanced with the step
        if not known.any():
            return slots, slots_np, None, None
        known_t = torch.from_numpy(known).to(self.device, non_blocking=True)
        return slots, slots_np, ctx.input_ids.long(), known_t & (steps > self.kernel.step[slots])


def _trace_id(params: Any) -> str | None:
    extra = getattr(params, "extra_args", None) or {}
    value = extra.get(TRACE_KEY)
    return None if value is None else str(value)


def _reads_lm_embeddings(profile: Profile) -> bool:
    return profile.field.mode in ("semantic", "hybrid") and profile.field.semantic_source == "lm"


def field_model(profile: Profile, folder: Any) -> Any:
    """What ``profile``'s field reads of the model vLLM serves from ``folder``: the model itself
    (:func:`checkpoint_model`) for ``field.contrast``, its input embeddings (:class:`CheckpointEmbeddings`) for
    ``semantic_source: lm``, else ``None``; each loaded once per folder and process."""
    if profile.field.contrast is not None:
        return checkpoint_model(folder)
    return _checkpoint_embeddings(str(folder) if folder else "") if _reads_lm_embeddings(profile) else None


@functools.lru_cache(maxsize=2)
def _checkpoint_embeddings(folder: str) -> CheckpointEmbeddings:
    """One embedding matrix per folder and process: the field cache knows a model by its identity."""
    return CheckpointEmbeddings.load(folder or None)


def checkpoint_model(folder: Any) -> Any:
    """The model of a checkpoint ``folder``, loaded by transformers on the CPU in float32, once per folder and
    process: a field that reads the model itself (``field.contrast``) reads this copy, as vLLM's own weights are
    out of a processor's reach. It costs the model's size in memory, and each new sentence a few short
    generations on the CPU."""
    return _checkpoint_model(str(folder) if folder else "")


@functools.lru_cache(maxsize=2)
def _checkpoint_model(folder: str) -> Any:
    path = Path(folder) if folder else None
    if path is None or not (path / "config.json").is_file():
        raise ConfigurationError(
            f"field.contrast reads the model itself, loaded from the checkpoint folder vLLM serves, and {folder!r} "
            "is not one; serve a Hugging Face folder, or leave field.contrast (lead.contrast) out"
        )
    with torch.inference_mode(False):
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


class CheckpointEmbeddings:
    """A model's input embedding matrix read from its checkpoint, standing in for the model where only
    ``get_input_embeddings()`` is needed (semantic fields with ``semantic_source: lm``).

    vLLM holds its weights inside its model runner; the processor reads the same matrix from the files.
    """

    _NAMES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "tok_embeddings.weight")

    def __init__(self, weight: torch.Tensor) -> None:
        with torch.inference_mode(False):
            self._embedding = torch.nn.Embedding.from_pretrained(weight.float(), freeze=True)

    def get_input_embeddings(self) -> torch.nn.Embedding:
        return self._embedding

    @classmethod
    def load(cls, folder: Any) -> CheckpointEmbeddings:
        path = Path(str(folder)) if folder else None
        files = sorted(path.glob("*.safetensors")) if path is not None and path.is_dir() else []
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    if name.endswith(cls._NAMES):
                        # vLLM builds processors in inference mode; the field cache needs a normal tensor
                        with torch.inference_mode(False):
                            return cls(f.get_tensor(name).clone())
        raise ConfigurationError(
            f"semantic_source 'lm' reads the model's input embeddings from its safetensors checkpoint, and none "
            f"was found in {folder!r}; serve a folder with *.safetensors files, or use semantic_source 'minilm'"
        )


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
