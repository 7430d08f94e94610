"""Generation on an in-process vLLM engine: what ``ngrav generate --engine vllm`` and ``ngrav eval --engine vllm`` run.

:class:`VLLMGenerator` holds one ``vllm.LLM`` with
:class:`~narrative_gravity.engines.vllm.NarrativeGravityVLLMLogitsProcessor` and the model's Hugging Face
tokenizer. Prompts are encoded by the caller exactly as for the transformers engine (chat template or raw
text, :func:`~narrative_gravity.engines.prompts.encode_prompts`) and sent as token ids, each request with its
sampling settings and its profile in ``SamplingParams(extra_args={"gravity": ...})`` (or none, for plain
decoding). vLLM batches the requests itself.

Traces come from the processor's ``on_measure`` hook: while a call records, every gravity step's measurement
(entropy, narrative mass before and after, KL, λ) is kept per live output list, and each list is matched to
its request by its tokens when the call ends. Requests without gravity keep no trace. The hook runs in this
process only, so the engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the default here).

vLLM lives in its own venv (``bash scripts/setup_vllm.sh``). Without it this module still imports (for docs
and doctests), with :data:`VLLM_IMPORT_ERROR` set; :func:`require_vllm` turns that into an error naming the
setup. It imports vLLM itself, so it is imported only when the vLLM engine is chosen.
"""

from __future__ import annotations

import gc
import itertools
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoConfig, AutoTokenizer

from ..errors import ConfigurationError
from ..gravity.thermo import METRICS
from ..lead import lead_sentence, reading_profile
from ..models import hf_folder
from ..profiles.schema import Profile
from .options import GenerationOptions
from .prompts import encode_prompts
from .results import GenerationResult
from .vllm import GRAVITY_KEY, NarrativeGravityVLLMLogitsProcessor, field_model

try:  # the optional extra; see the module doc
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    VLLM_IMPORT_ERROR: ImportError | None = None
except ImportError as _exc:  # pragma: no cover - exercised where vLLM is not installed
    VLLM_IMPORT_ERROR = _exc

__all__ = [
    "PROCESSOR",
    "VLLM_IMPORT_ERROR",
    "VLLM_SETUP",
    "VLLMGenerator",
    "VLLMOutput",
    "gravity_args",
    "release_shared",
    "require_vllm",
]

VLLM_SETUP = "run `bash scripts/setup_vllm.sh` and use .venv-vllm/bin/ngrav, or use --engine hf"
PROCESSOR = "narrative_gravity.engines.vllm:NarrativeGravityVLLMLogitsProcessor"
_MULTIPROCESSING = "VLLM_ENABLE_V1_MULTIPROCESSING"
_IDS = itertools.count()
_LEN_STEP = 512  # max_model_len is rounded up to a multiple of this, so similar runs share one engine
_SHARED: dict[tuple[Any, ...], VLLMGenerator] = {}


def require_vllm() -> None:
    """A :class:`~narrative_gravity.errors.ConfigurationError` naming the setup when vLLM cannot be imported here."""
    exc = VLLM_IMPORT_ERROR
    if exc is not None:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigurationError(f"--engine vllm needs vLLM, which is not importable here ({reason}); {VLLM_SETUP}")


def gravity_args(profile: Profile | None) -> dict[str, Any] | None:
    """The ``extra_args`` that carry ``profile`` to the vLLM processor (``None``: plain decoding).

    >>> gravity_args(Profile.from_mapping({"core_semantics": ["orbit"]}))["gravity"]["core_semantics"]
    ['orbit']
    """
    if profile is None:
        return None
    return {GRAVITY_KEY: profile.model_dump(mode="json", exclude_none=True)}


@dataclass
class VLLMOutput:
    """One request's result. Times are seconds from the call's start; ``trace`` holds one value per
    generated token for each of :data:`~narrative_gravity.gravity.thermo.METRICS` (``None`` without gravity
    or without ``options.trace``)."""

    prompt_ids: list[int]
    token_ids: list[int]
    ttft: float
    latency: float
    trace: dict[str, list[float]] | None = None

    def trace_means(self) -> dict[str, float] | None:
        """The mean of each trace metric over the generated tokens, as the transformers engine reports it."""
        if not self.trace:
            return None
        return {k: float(np.mean(v)) for k, v in self.trace.items() if v}


class _Recorder:
    """Keeps every gravity step's measurement per live output list (vLLM's per-request token list)."""

    def __init__(self) -> None:
        self.rows: dict[int, tuple[list[int], dict[int, np.ndarray]]] = {}

    def record(self, proc: Any, result: Any) -> None:
        if result.measurement is None:
            return
        stacked = result.measurement.stack()
        live = np.flatnonzero(proc.kernel.prog[: stacked.shape[0]] >= 0)
        values = stacked[torch.from_numpy(live).to(stacked.device)].float().cpu().numpy()
        for k, row in enumerate(live):
            out = proc._outputs[row]
            if out is not None:  # the step measured is the one that samples token len(out)
                self.rows.setdefault(id(out), (out, {}))[1][len(out)] = values[k]

    def traces(self) -> dict[tuple[int, ...], list[dict[str, list[float]]]]:
        """Each recorded request's trace, keyed by its whole output (the lists are complete by now)."""
        by_output: dict[tuple[int, ...], list[dict[str, list[float]]]] = {}
        for out, steps in self.rows.values():
            table = np.stack([steps[s] for s in sorted(steps)])
            trace = {name: [round(float(v), 5) for v in table[:, i]] for i, name in enumerate(METRICS)}
            by_output.setdefault(tuple(out), []).append(trace)
        return by_output


class VLLMGenerator:
    """An in-process vLLM engine with the gravity processor, and the model's tokenizer (see the module doc).

    Build one with :meth:`load`; ``tokenizer`` is the Hugging Face tokenizer that encodes prompts and
    decodes outputs, the same one the transformers engine uses.
    """

    def __init__(self, llm: Any, tokenizer: Any, *, folder: Path) -> None:
        self.llm = llm
        self.tokenizer = tokenizer
        self.folder = folder
        self.max_model_len = int(llm.llm_engine.model_config.max_model_len)

    @classmethod
    def load(
        cls,
        model: str | os.PathLike[str] | None = None,
        *,
        max_num_seqs: int = 8,
        longest: int = 2048,
        kv_cache_mb: int | None = None,
        reuse: bool = True,
        tokenizer: Any = None,
    ) -> VLLMGenerator:
        """Start an engine on ``model`` (a name, a HF folder or a ``.gguf`` file, as ``--model``).

        ``max_num_seqs`` requests run at once; ``longest`` is the longest prompt plus its token budget (the
        context is rounded up to a multiple of 512, within the model's own limit). The KV cache is sized to
        hold every running request at full length, unless ``kv_cache_mb`` says otherwise. With ``reuse``,
        an engine already started in this process with the same settings is returned (an engine start
        takes half a minute); an engine with other settings is released first. ``tokenizer`` saves loading
        the model's tokenizer again.
        """
        if max_num_seqs < 1:
            raise ConfigurationError(f"`max_num_seqs` has to be >= 1, but is {max_num_seqs}")
        os.environ.setdefault(_MULTIPROCESSING, "0")  # the trace hook runs in this process
        folder = hf_folder(model)
        config = AutoConfig.from_pretrained(folder).get_text_config()
        limit = int(getattr(config, "max_position_embeddings", 0) or 0)
        if limit and longest > limit:
            raise ConfigurationError(
                f"the longest prompt plus --max-new-tokens is {longest} tokens, more than the model's context "
                f"of {limit}; lower --max-new-tokens or shorten the prompt"
            )
        max_model_len = _LEN_STEP * math.ceil(max(1, longest) / _LEN_STEP)
        max_model_len = min(max_model_len, limit) if limit else max_model_len
        kv_bytes = kv_cache_mb * 2**20 if kv_cache_mb is not None else _kv_bytes(config, max_num_seqs, max_model_len)
        key = (str(folder), max_num_seqs, max_model_len, kv_bytes)
        if reuse and key in _SHARED:
            return _SHARED[key]
        release_shared()
        llm = LLM(
            model=str(folder),
            dtype="float32",  # as the transformers engine: the same numbers, the same greedy tokens
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            kv_cache_memory_bytes=kv_bytes,
            enforce_eager=True,
            logits_processors=[PROCESSOR],
            seed=0,
        )
        gen = cls(llm, tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(folder), folder=folder)
        if reuse:
            _SHARED[key] = gen
        return gen

    @classmethod
    def for_prompts(
        cls,
        model: str | os.PathLike[str] | None,
        prompts: Sequence[str],
        options: GenerationOptions,
        *,
        profile: Profile | None = None,
        tokenizer: Any,
    ) -> VLLMGenerator:
        """:meth:`load` for ``options.batch_size`` requests at once, sized for the longest of ``prompts`` (encoded
        as ``options`` says, after ``profile``'s topic sentence) plus ``options.max_new_tokens``."""
        raw = not options.chat_template(tokenizer)
        encoded = encode_prompts(tokenizer, prompts, raw=raw, lead=lead_sentence(profile, raw=raw))
        longest = max(len(ids) for ids in encoded) + options.max_new_tokens
        return cls.load(model, max_num_seqs=options.batch_size, longest=longest, tokenizer=tokenizer)

    def field_model(self, profile: Profile) -> Any:
        """What ``profile``'s field reads of this engine's model (:func:`~narrative_gravity.engines.vllm.field_model`:
        a CPU copy from the checkpoint for ``field.contrast``, its embeddings for ``semantic_source: lm``)."""
        return field_model(profile, self.folder)

    @staticmethod
    def sampling_params(options: GenerationOptions, gravity: Mapping[str, Any] | None) -> SamplingParams:
        """vLLM's settings for ``options`` (greedy below temperature 1e-5) with ``gravity`` as ``extra_args``."""
        if options.greedy:
            return SamplingParams(temperature=0.0, max_tokens=options.max_new_tokens, extra_args=gravity)
        return SamplingParams(
            temperature=options.temperature,
            top_k=options.top_k,
            top_p=options.top_p,
            seed=options.seed,
            max_tokens=options.max_new_tokens,
            extra_args=gravity,
        )

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        options: GenerationOptions,
        profile: Profile | None = None,
        *,
        on_finish: Callable[[int], None] | None = None,
    ) -> list[VLLMOutput]:
        """Continue every token-id prompt with ``options``, each request carrying ``profile`` in its
        ``extra_args`` (:func:`gravity_args`; ``None``: plain decoding); all are sent at once and vLLM batches
        them.

        ``options.trace`` fills :attr:`VLLMOutput.trace` for gravity requests. ``on_finish(n)`` is called as
        requests finish. The outputs keep the order of ``prompt_ids``.
        """
        if not prompt_ids:
            return []
        record_trace = options.trace
        if record_trace and profile is not None and os.environ.get(_MULTIPROCESSING, "0") != "0":
            raise ConfigurationError(
                f"traces come from the engine running in this process, but {_MULTIPROCESSING}="
                f"{os.environ[_MULTIPROCESSING]!r}; set {_MULTIPROCESSING}=0 or drop the trace"
            )
        params = per_request(self.sampling_params(options, gravity_args(profile)), len(prompt_ids))
        recorder = _Recorder() if record_trace and profile is not None else None
        outputs = self._run(prompt_ids, params, recorder, on_finish)
        if recorder is not None:
            self._attach(outputs, recorder, params)
        return outputs

    def generate_texts(
        self,
        prompts: Sequence[str],
        options: GenerationOptions,
        profile: Profile | None = None,
        *,
        progress: Callable[[int], None] | None = None,
    ) -> list[GenerationResult]:
        """:func:`narrative_gravity.engines.hf_generate.generate` on this engine, for one batch of ``prompts``: the
        same encoding (chat template, or plain text with ``options.raw``), the same result fields, ``profile`` on
        every request (``None``: plain decoding, and no trace), and its topic sentence (``lead``) before every
        prompt. ``seconds`` is each prompt's share of the call."""
        raw = not options.chat_template(self.tokenizer)
        lead = lead_sentence(profile, raw=raw)
        encoded = encode_prompts(self.tokenizer, prompts, raw=raw, lead=lead)
        profile = reading_profile(profile, raw=raw)  # the pull while the sentence is read (its KL budget)
        t0 = time.perf_counter()
        outs = self.generate(encoded, options, profile, on_finish=progress)
        elapsed = time.perf_counter() - t0
        return [
            GenerationResult(
                prompt=prompt,
                text=self.decode(out.token_ids),
                new_tokens=len(out.token_ids),
                seconds=elapsed / len(prompts),
                token_ids=out.token_ids,
                seed=options.seed,
                batch_seconds=elapsed,
                trace=out.trace,
                trace_means=out.trace_means(),
            )
            for prompt, out in zip(prompts, outs, strict=True)
        ]

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of generated tokens, decoded as the transformers engine decodes them."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    # -- internals -------------------------------------------------------------------------------------

    def _run(
        self,
        prompt_ids: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        recorder: _Recorder | None,
        on_finish: Callable[[int], None] | None,
    ) -> list[VLLMOutput]:
        engine = self.llm.llm_engine
        ids = [f"ngrav-{next(_IDS)}" for _ in prompt_ids]
        index = {rid: i for i, rid in enumerate(ids)}
        outputs = [VLLMOutput(list(p), [], math.nan, math.nan) for p in prompt_ids]
        live: set[str] = set()
        cls = NarrativeGravityVLLMLogitsProcessor
        previous = cls.__dict__.get("on_measure")

        def hook(proc: Any, result: Any) -> None:
            if recorder is not None:
                recorder.record(proc, result)
            if previous is not None:
                previous(proc, result)

        if recorder is not None:
            cls.on_measure = hook
        t0 = time.perf_counter()
        try:
            for rid, prompt, request_params in zip(ids, prompt_ids, params, strict=True):
                engine.add_request(rid, TokensPrompt(prompt_token_ids=list(prompt)), request_params)
                live.add(rid)
            while live and engine.has_unfinished_requests():
                for out in engine.step():
                    i = index.get(out.request_id)
                    if i is None:
                        continue
                    now = time.perf_counter() - t0
                    outputs[i].token_ids = list(out.outputs[0].token_ids)
                    if outputs[i].token_ids and math.isnan(outputs[i].ttft):
                        outputs[i].ttft = now
                    if out.finished:
                        outputs[i].latency = now
                        live.discard(out.request_id)
                        if on_finish is not None:
                            on_finish(1)
        finally:
            if recorder is not None:
                cls.on_measure = previous
            if live:  # an interrupt or an error: leave the engine empty for the next call
                engine.abort_request(list(live))
        return outputs

    def _attach(self, outputs: list[VLLMOutput], recorder: _Recorder, params: Sequence[SamplingParams]) -> None:
        """Give each output its trace. Output lists are matched by their tokens; requests whose outputs are
        equal but whose prompts differ (so their traces may differ) are run again one by one for theirs."""
        traces = recorder.traces()
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, out in enumerate(outputs):
            groups.setdefault(tuple(out.token_ids), []).append(i)
        again: list[int] = []
        for tokens, rows in groups.items():
            found = traces.get(tokens, [])
            if len(rows) == 1 or len({tuple(outputs[i].prompt_ids) for i in rows}) == 1:
                for i, trace in zip(rows, found):  # equal prompts and outputs: equal traces
                    outputs[i].trace = trace
            else:
                again.extend(rows)
        for i in again:
            alone = _Recorder()
            self._run([outputs[i].prompt_ids], [params[i]], alone, None)
            found = alone.traces().get(tuple(outputs[i].token_ids), [])
            outputs[i].trace = found[0] if found else None


def request_seed(seed: int, index: int) -> int:
    """The seed of the ``index``-th request of a call seeded with ``seed``: well mixed, so that the rows of one
    call sample independently (as the rows of one seeded transformers batch do), and reproducible.

    >>> request_seed(0, 1) == request_seed(0, 1) != request_seed(0, 2)
    True
    """
    return int(np.random.SeedSequence([seed, index]).generate_state(1, np.uint64)[0] >> 1)


def per_request(params: SamplingParams, n: int) -> list[SamplingParams]:
    """``params`` for each of ``n`` requests, each with its own :func:`request_seed` when ``params`` is seeded.
    vLLM seeds each request's sampler with its own seed: one shared seed would give every row of a call the
    same random draws, and rows that are not independent make narrower intervals than the data supports."""
    if params.seed is None:
        return [params] * n
    out = []
    for i in range(n):
        clone = params.clone()
        clone.seed = request_seed(params.seed, i)
        out.append(clone)
    return out


def _kv_bytes(config: Any, max_num_seqs: int, max_model_len: int) -> int:
    """KV-cache bytes for every running request at full length (float32), with room for block rounding."""
    heads = int(getattr(config, "num_attention_heads", 1) or 1)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    layers = int(config.num_hidden_layers)
    per_token = 2 * layers * kv_heads * head_dim * 4
    return int(per_token * max_model_len * max_num_seqs * 1.25) + 32 * 2**20


def release_shared() -> None:
    """Drop the engine kept for reuse (see :meth:`VLLMGenerator.load`), so its memory can be freed."""
    _SHARED.clear()
    gc.collect()
