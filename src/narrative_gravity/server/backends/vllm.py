"""The vLLM backend of the server: ``ngrav serve --engine vllm``.

Rows become vLLM requests on one in-process engine (``vllm.LLM`` with
:class:`~narrative_gravity.engines.vllm.NarrativeGravityVLLMLogitsProcessor`), so gravity rides inside vLLM's
own batch with a profile per request (``SamplingParams.extra_args["gravity"]``).

The backend is a :class:`~narrative_gravity.server.backends.base.ContinuousBackend`: one engine thread owns the
engine and loops ``engine.step()``. Between two steps it adds the rows submitted since (they join the running
batch at once, as in vLLM's own server), aborts the rows whose request was cancelled, and reports each step's
new tokens, finished rows and failures in one callback per submission. A request the engine refuses fails alone.

:meth:`VLLMBackend.load` builds the engine on that same thread: vLLM binds its OpenMP threads in the thread that
builds it, and a second thread stepping it starts a second pool, which made 48 steps after a 1 450-token prompt
take 2.9 s instead of 2.15 s on 2 cores (see :mod:`~narrative_gravity.server.scheduler`).

vLLM schedules prefill and decode itself, so rows do not advance in lockstep. A row whose request asked for
per-token stats (``stream_options.include_trace``) carries a trace id in ``extra_args``; the processor keeps
that row's measurements per step (:func:`~narrative_gravity.engines.vllm.pop_trace`), each token is streamed
with them, and the row reports their means (narrative mass, KL) when it ends. The engine keeps its own
statistics (``disable_log_stats=False``); :meth:`VLLMBackend.collectors` puts its ``vllm:*`` metrics (waiting
and running requests, KV-cache usage, token counts, latencies) on the server's ``/metrics``.

A row with a ``response_format`` runs through vLLM's own structured outputs
(``SamplingParams(structured_outputs=...)``) on its ``guidance`` backend: llguidance, the library the
transformers engine uses, so both engines compile a schema to the same grammar and refuse the same schemas (it
runs on the CPU, where vLLM applies the bitmask with xgrammar's CPU kernel). vLLM applies the grammar's bitmask
to the logits before the sampler runs the logits processors, so gravity pulls among the tokens the grammar allows
(``-inf + λ·a`` stays ``-inf``) and its thermostat measures the constrained distribution.
:meth:`VLLMBackend.prepare_format` runs vLLM's own check of the schema before the request is queued. Replies are
one-line JSON without ``\\u`` escapes, as on the transformers engine
(:data:`~narrative_gravity.server.structured.GRAMMAR_OPTIONS`).

vLLM lives in its own environment (``bash scripts/setup_vllm.sh``); this module imports it only in
:meth:`VLLMBackend.load` and the engine thread.
"""

from __future__ import annotations

import copy
import itertools
import logging
import os
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any

from ...engines.vllm import TRACE_KEY, field_model, forget_trace, pop_trace, profile_from_extra_args
from ...errors import ConfigurationError
from ...models import DEFAULT_MODEL, hf_folder
from ...profiles.schema import Profile
from ..structured import ResponseFormat
from .base import EventCallback, GenerationRow, RowStats, TokenCallback, TokenizerText

try:  # the `vllm` extra (its own venv); without it the module imports, and VLLMBackend.load says what to install
    from prometheus_client import REGISTRY  # vLLM's dependency; its collectors register there
    from vllm import LLM, SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.inputs import TokensPrompt
    from vllm.platforms import current_platform
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    VLLM_IMPORT_ERROR: ImportError | None = None
except ImportError as _exc:  # pragma: no cover - exercised where vLLM is not installed
    VLLM_IMPORT_ERROR = _exc

__all__ = ["VLLMBackend"]

log = logging.getLogger("narrative_gravity.server")

PROCESSOR = "narrative_gravity.engines.vllm:NarrativeGravityVLLMLogitsProcessor"
_IDS = itertools.count()


@dataclass(eq=False)
class _Live:
    """A row in the engine: its callback and how many tokens it has produced."""

    row: GenerationRow
    on_events: EventCallback
    tokens: int = 0
    traced: bool = False  # the request asked for per-token stats (the processor keeps them under its id)
    sums: dict[str, float] | None = None  # the stats summed over its tokens, for the row's means


def _log_failure(loop: Future[None]) -> None:
    """The engine loop ended with an exception it did not hand to its rows (a bug): log it."""
    if not loop.cancelled() and loop.exception() is not None:
        log.error("the vLLM engine thread stopped", exc_info=loop.exception())


def _row_stats(live: _Live) -> RowStats:
    """A finished row's token count and, when it was traced, the means of its measurements."""
    if not live.sums or not live.tokens:
        return RowStats(new_tokens=live.tokens)
    mean = {k: v / live.tokens for k, v in live.sums.items()}
    return RowStats(
        new_tokens=live.tokens,
        narrative_mass=mean["mass_after"],
        narrative_mass_before=mean["mass"],
        kl=mean["kl"],
        strength=mean["strength"],
        entropy=mean["entropy"],
    )


class _EngineMetrics:
    """A ``prometheus_client`` collector that yields vLLM's own ``vllm:*`` metrics from its global registry."""

    def collect(self) -> Iterator[Any]:
        for metric in REGISTRY.collect():
            if metric.name.startswith("vllm:"):
                yield metric

    def describe(self) -> list[Any]:
        return []  # names are vLLM's and change with its version; none clash with ``ngrav_*``


class _EngineThread:
    """One daemon thread that runs what it is given in order: the engine's construction, then its loop.

    >>> t = _EngineThread()
    >>> t.submit(sum, [1, 2]).result(), t.submit(threading.current_thread).result().name
    (3, 'ngrav-vllm-engine')
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]]
        self._jobs = queue.SimpleQueue()
        threading.Thread(target=self._work, name="ngrav-vllm-engine", daemon=True).start()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        self._jobs.put((future, fn, args, kwargs))
        return future

    def _work(self) -> None:
        while True:
            future, fn, args, kwargs = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # handed to whoever waits on the future
                future.set_exception(exc)


class VLLMBackend(TokenizerText):
    """The server's engine on vLLM (see the module doc).

    Args:
        llm: a ``vllm.LLM`` built with :data:`PROCESSOR` among its ``logits_processors``; build it with
            ``disable_log_stats=False`` for vLLM's engine metrics.
        model_id: the name clients send as ``model``.
        engine_thread: the thread that built ``llm`` (:meth:`load` passes it); without it the engine runs on
            a thread of its own, with a second OpenMP pool.
    """

    name = "vllm"
    token_stats = True  # streams per-token λ, entropy, mass and KL for rows that ask (the processor's trace)

    def __init__(
        self, llm: Any, *, model_id: str, prefill_tokens: int = 0, engine_thread: _EngineThread | None = None
    ) -> None:
        if not model_id:
            raise ConfigurationError("`model_id` is empty; give the name clients send as `model`")
        self.llm = llm
        self.engine = llm.llm_engine
        self.tokenizer = llm.get_tokenizer()
        self.model_id = model_id
        cfg = llm.llm_engine.model_config
        self.max_context = int(cfg.max_model_len)
        self.vocab_size = int(cfg.get_vocab_size())
        self.eos_ids = frozenset(i for i in (self.tokenizer.eos_token_id,) if i is not None)
        self._cv = threading.Condition()
        self._inbox: deque[tuple[GenerationRow, EventCallback]] = deque()
        self.prefill_tokens = prefill_tokens  # new prompt tokens admitted per step (0: all that arrived)
        self._live: dict[str, _Live] = {}
        self._waiting = 0  # submitted rows without a token yet (in the inbox or the engine)
        self._engine_thread = engine_thread if engine_thread is not None else _EngineThread()
        self._loop: Future[None] | None = None  # the engine loop on the engine thread, while it runs
        self._closing = False
        self._flush = False  # aborted rows leave the engine's batch (and its stats) at its next step

    @classmethod
    def load(
        cls,
        name: str | os.PathLike[str] | None = None,
        *,
        device: str = "cpu",
        max_num_seqs: int = 32,
        max_model_len: int = 2048,
        kv_cache_mb: int = 1024,
        prefill_tokens: int = 512,
    ) -> VLLMBackend:
        """Start an in-process vLLM engine on a model (a name, a HF folder or a ``.gguf`` file, as ``--model``).

        ``max_num_seqs`` is the most rows decoding together in one step; more wait in the engine's queue.
        ``prefill_tokens``: the most new prompt tokens admitted per engine step (0: no limit); see
        :class:`~narrative_gravity.server.config.ServerConfig`.

        On the CPU, vLLM cannot split a prompt's prefill over steps for a seeded request (its CPU random
        generators have no offset to rewind; the engine fails with every row in it), and every sampled
        request here is seeded. So on the CPU chunked prefill is off and one step can take the longest
        prompt whole; the server paces bursts itself with ``prefill_tokens``.
        """
        if VLLM_IMPORT_ERROR is not None:
            raise ConfigurationError(
                f"engine 'vllm' needs vLLM, which is not importable here ({VLLM_IMPORT_ERROR}); run "
                "`bash scripts/setup_vllm.sh` and start the server with .venv-vllm/bin/ngrav serve --engine vllm, "
                "or use --engine hf"
            ) from None
        if device not in ("cpu", "auto", "cuda"):
            raise ConfigurationError(f"engine 'vllm' picks its own device; got --device {device!r}, use cpu or cuda")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # keep the engine in this process
        folder = hf_folder(name)
        model_id = str(name) if name is not None else DEFAULT_MODEL
        if isinstance(prefill_tokens, bool) or not isinstance(prefill_tokens, int) or prefill_tokens < 0:
            raise ConfigurationError(f"`prefill_tokens` has to be >= 0 (0: no limit), but is {prefill_tokens!r}")
        scheduling: dict[str, Any] = {}
        if _on_cpu():
            scheduling = {
                "enable_chunked_prefill": False,
                "max_num_batched_tokens": max(max_model_len, max_num_seqs),
            }
        engine_thread = _EngineThread()
        llm = engine_thread.submit(
            LLM,
            model=str(folder),
            dtype="float32",
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            kv_cache_memory_bytes=kv_cache_mb * 2**20,
            enforce_eager=True,
            logits_processors=[PROCESSOR],
            seed=0,
            disable_log_stats=False,  # vLLM's engine metrics for /metrics
            served_model_name=model_id,  # their `model_name` label
            # `response_format`: llguidance (as on the transformers engine), JSON on one line
            structured_outputs_config={"backend": "guidance", "disable_any_whitespace": True},
            **scheduling,
        ).result()
        return cls(llm, model_id=model_id, prefill_tokens=prefill_tokens, engine_thread=engine_thread)

    # ------------------------------------------------------------------------------------------- gravity

    def prepare(self, profile: Profile) -> None:
        """Parse the profile as the vLLM processor will, so a bad one fails its request before the engine."""
        if profile.prune is not None and profile.prune.head is not None:
            raise ConfigurationError(
                "prune.head (the shortlist head) runs on the transformers engine only; take it out of the "
                "profile for vLLM"
            )
        profile_from_extra_args({"gravity": profile.model_dump(exclude_none=True)})

    def model_for(self, profile: Profile) -> Any:
        """What ``profile``'s field reads of the served model (:func:`~narrative_gravity.engines.vllm.field_model`):
        ``None`` for most profiles; a CPU copy from the checkpoint for ``field.contrast``."""
        return field_model(profile, self.engine.model_config.model)

    def prepare_format(self, fmt: ResponseFormat) -> None:
        """Check ``fmt`` as vLLM will when the row is added (its backend compiles the schema), so that a schema
        vLLM refuses fails its request here instead of in the engine thread."""

        params = SamplingParams(max_tokens=1, structured_outputs=_structured_outputs(fmt))
        ip = self.engine.input_processor
        try:
            params.verify(ip.model_config, ip.speculative_config, ip.structured_outputs_config, ip.tokenizer)
        except (VLLMValidationError, ValueError) as exc:
            raise ValueError(str(exc)) from None

    # ------------------------------------------------------------------------------------------- admission

    def submit(self, rows: Sequence[GenerationRow], on_events: EventCallback) -> None:
        """Queue rows for the engine thread; they join the running batch before its next step."""
        with self._cv:
            if self._closing:
                raise ConfigurationError("the vLLM backend is closed; build a new one to generate")
            self._inbox.extend((row, on_events) for row in rows)
            self._waiting += len(rows)
            if self._loop is None:
                self._loop = self._engine_thread.submit(self._run)
                self._loop.add_done_callback(_log_failure)
            self._cv.notify()

    def in_flight(self) -> tuple[int, int]:
        with self._cv:
            return self._waiting, len(self._live) + len(self._inbox) - self._waiting

    def collectors(self) -> list[Any]:
        return [_EngineMetrics()] if getattr(self.engine, "log_stats", False) else []

    def close(self) -> None:
        """Abort every row and stop the engine thread; a later :meth:`submit` starts a new one."""
        with self._cv:
            self._closing = True
            loop = self._loop
            self._cv.notify()
        if loop is not None:
            wait([loop])
        with self._cv:
            self._closing = False
            self._loop = None

    def generate(self, rows: Sequence[GenerationRow], on_tokens: TokenCallback) -> list[RowStats]:
        """Run rows through the engine thread and wait for all of them (the blocking :class:`Backend` call)."""
        if not rows:
            return []
        index = {id(row): i for i, row in enumerate(rows)}
        stats: list[RowStats | None] = [None] * len(rows)
        errors: list[BaseException] = []
        done = threading.Event()

        def on_events(events: list[tuple[GenerationRow, str, Any]]) -> None:
            fresh: list[list[int]] = [[] for _ in rows]
            for row, kind, payload in events:
                i = index[id(row)]
                if kind == "token":
                    fresh[i].append(payload)
                else:
                    stats[i] = payload if kind == "end" else RowStats(new_tokens=0)
                    if kind == "error":
                        errors.append(payload)
            for j in range(max(map(len, fresh))):
                on_tokens([f[j] if j < len(f) else None for f in fresh])
            if all(s is not None for s in stats):
                done.set()

        self.submit(rows, on_events)
        done.wait()
        if errors:
            raise errors[0]
        return [s for s in stats if s is not None]

    # ------------------------------------------------------------------------------------------- engine thread

    def _params(self, row: GenerationRow, rid: str | None = None) -> Any:
        s = row.options
        extra = None
        if row.gravity is not None:
            extra = {"gravity": row.gravity.profile.model_dump(exclude_none=True)}
            if rid is not None and getattr(row, "trace", False):
                extra[TRACE_KEY] = rid
        fmt = getattr(row, "response_format", None)
        return SamplingParams(
            max_tokens=row.max_tokens,
            structured_outputs=None if fmt is None else _structured_outputs(fmt),
            temperature=0.0 if s.greedy else s.temperature,
            top_p=s.top_p,
            top_k=s.top_k if s.top_k > 0 else 0,
            seed=None if s.greedy else s.seed,
            extra_args=extra,
            output_kind=RequestOutputKind.DELTA,  # each step's new tokens only
            detokenize=False,  # the server detokenizes per choice itself
        )

    def _run(self) -> None:
        """The engine thread: admit, abort, step, report; until :meth:`close`."""
        while True:
            with self._cv:
                while not (self._inbox or self._live or self._closing or self._flush):
                    self._cv.wait()
                if self._closing:
                    break
                arrived = self._arrivals()
            events: dict[EventCallback, list[tuple[GenerationRow, str, Any]]] = {}
            try:
                self._admit(arrived, events)
                self._abort([rid for rid, live in self._live.items() if live.row.cancelled], events)
                if self._live or self._flush:
                    self._flush = False
                    self._step(events)
            except Exception as exc:  # the engine failed: every row in it fails, later requests start afresh
                log.exception("the vLLM engine failed with %d rows in flight", len(self._live))
                self._fail_all(exc, events)
            self._report(events)
        events = {}
        with self._cv:
            pending = list(self._inbox)
            self._inbox.clear()
        for row, on_events in pending:
            events.setdefault(on_events, []).append((row, "end", RowStats(new_tokens=0)))
            self._stop_waiting()
        self._abort(list(self._live), events)
        self._report(events)

    def _arrivals(self) -> list[tuple[GenerationRow, EventCallback]]:
        """The rows that join at this step (the caller holds the lock): all that arrived, or with
        ``prefill_tokens`` the oldest ones up to that many prompt tokens (at least one); the rest wait."""
        if not self.prefill_tokens:
            arrived = list(self._inbox)
            self._inbox.clear()
            return arrived
        arrived, tokens = [], 0
        while self._inbox:
            n = len(self._inbox[0][0].prompt_ids)
            if arrived and tokens + n > self.prefill_tokens:
                break
            arrived.append(self._inbox.popleft())
            tokens += n
        return arrived

    def _admit(self, arrived: list[tuple[GenerationRow, EventCallback]], events: dict[EventCallback, list]) -> None:
        for row, on_events in arrived:
            rid = f"ngrav-{next(_IDS)}"
            if row.cancelled:
                events.setdefault(on_events, []).append((row, "end", RowStats(new_tokens=0)))
                self._stop_waiting()
                continue
            try:
                params = self._params(row, rid)
                self.engine.add_request(rid, TokensPrompt(prompt_token_ids=list(row.prompt_ids)), params)
            except Exception as exc:  # this request only: a bad profile, a prompt the engine refuses
                log.warning("vLLM refused a request: %s", exc)
                events.setdefault(on_events, []).append((row, "error", exc))
                self._stop_waiting()
                continue
            with self._cv:
                self._live[rid] = _Live(row, on_events, traced=TRACE_KEY in (params.extra_args or {}))

    def _abort(self, rids: list[str], events: dict[EventCallback, list]) -> None:
        if not rids:
            return
        self.engine.abort_request(rids)
        self._flush = True
        for rid in rids:
            self._finish(rid, "end", None, events)

    def _fail_all(self, exc: BaseException, events: dict[EventCallback, list]) -> None:
        rids = list(self._live)
        try:
            self.engine.abort_request(rids)
            self._flush = True
        except Exception:  # pragma: no cover - the engine is already broken
            log.exception("aborting the failed rows failed too")
        for rid in rids:
            self._finish(rid, "error", exc, events)

    def _step(self, events: dict[EventCallback, list]) -> None:
        outputs = self.engine.step()
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:
                continue
            tokens = list(out.outputs[0].token_ids)
            if tokens:
                if live.tokens == 0:
                    self._stop_waiting()
                live.tokens += len(tokens)
                batch = events.setdefault(live.on_events, [])
                stats = pop_trace(out.request_id) if live.traced else []
                for j, t in enumerate(tokens):
                    if j < len(stats):  # the step's measurements go just before its token
                        batch.append((live.row, "stats", stats[j]))
                        live.sums = {k: (live.sums or {}).get(k, 0.0) + v for k, v in stats[j].items()}
                    batch.append((live.row, "token", t))
            if out.finished:
                self._finish(out.request_id, "end", None, events)
        if self._live and not self.engine.has_unfinished_requests():  # finished without a final output
            for rid in list(self._live):
                self._finish(rid, "end", None, events)

    def _finish(self, rid: str, kind: str, error: BaseException | None, events: dict[EventCallback, list]) -> None:
        with self._cv:
            live = self._live.pop(rid, None)
        if live is None:
            return
        if live.tokens == 0:
            self._stop_waiting()
        if live.traced:
            forget_trace(rid)
        payload: Any = error if kind == "error" else _row_stats(live)
        events.setdefault(live.on_events, []).append((live.row, kind, payload))

    def _stop_waiting(self) -> None:
        """One row got its first token or left before it (the ``waiting`` count of :meth:`in_flight`)."""
        with self._cv:
            self._waiting -= 1

    @staticmethod
    def _report(events: dict[EventCallback, list]) -> None:
        for on_events, batch in events.items():
            try:
                on_events(batch)
            except Exception:  # a listener's bug must not stop the engine for everyone
                log.exception("a token callback failed")


def _structured_outputs(fmt: ResponseFormat) -> Any:
    """vLLM's ``StructuredOutputsParams`` for a response format (``json_object`` is the schema ``{"type": "object"}``)."""

    # the schema carries GRAMMAR_OPTIONS (x-guidance), which vLLM's guidance backend reads as the other engine does
    return StructuredOutputsParams(json=copy.deepcopy(fmt.grammar_schema()), disable_any_whitespace=True)


def _on_cpu() -> bool:
    """Whether this vLLM build runs its engine on the CPU (vLLM picks its device itself)."""

    return bool(current_platform.is_cpu())
