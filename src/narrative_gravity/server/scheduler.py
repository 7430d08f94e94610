"""Batch concurrent requests into one ``generate`` call at a time (:class:`BatchScheduler`), and the rows and jobs
every scheduler shares.

**BatchScheduler.**
Each request becomes one or more rows (prompts × ``n``) in a FIFO queue. A single scheduler task takes the
oldest row, waits up to ``window`` seconds (from that row's arrival) for more, then takes up to
``max_batch_size`` rows and runs them as one batch in a dedicated worker thread (``Backend.generate``), so the
event loop keeps accepting requests and streaming tokens meanwhile. Rows that arrive while a batch runs wait for
the next one; a full queue answers ``429``.

Tokens travel back through the backend's per-step callback: the worker thread calls
``loop.call_soon_threadsafe`` once per step, which puts ``(index, "token", id)`` on each request's
:class:`asyncio.Queue`; a backend that measures each step (for rows with ``trace``) puts
``(index, "stats", TokenStats)`` just before that token. When the batch ends every row gets
``(index, "end", RowStats)``.

*Background rows* (``submit(rows, background=True)``: shadow runs, see :mod:`.shadow`) use idle time only: they
run in batches of their own once no other row has arrived for ``idle_s`` (so a burst of requests is not split by
them), and a row that arrives while they run cancels them (``preempted``): their batch ends at its next step, and
the rows that arrived meanwhile get a full batching window from then on.

One row never fails the others: when a batch raises, each of its rows is run again on its own, so only the row
that fails by itself gets ``(index, "error", exc)``. A row that had already streamed tokens must regenerate the
same tokens first (its seed makes it reproducible); those are not sent twice, and a row whose replay differs is
failed rather than sent text that does not join up.

**Threads (BatchScheduler).** PyTorch's OpenMP runtime on Linux (libgomp) keeps a pool of helper threads for each
thread that starts a parallel region, and once the helpers of all pools outnumber the CPUs, every pool stops
spinning between regions and sleeps, so each matrix product pays a wake-up. The server's other tensor work
(fields, context pruning, the topic sentence) used to run in ``asyncio.to_thread`` threads with their own
pools: after one pipeline request, decoding 48 tokens after a 1 450-token prompt took 4.9 s instead of 3.4 s
on 2 cores. So ``generate`` runs on one thread with all intra-op threads, and the rest on :meth:`run_side`:
a few side threads with one intra-op thread each, which start no pools. The ContinuousScheduler's side work
runs the same way, beside the engine's own thread. PyTorch hands its latest setting to threads that start
later, so in a process that embeds the server, a new thread of your own that runs tensor work should call
``torch.set_num_threads`` first.

The scheduler of engines that admit rows at any step is :mod:`.continuous`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from ..engines.options import GenerationOptions
from .backends.base import Backend, ResolvedGravity, RowStats, TokenStats
from .protocol import APIError
from .telemetry import Metrics

__all__ = ["BatchScheduler", "Job", "Row", "not_accepting", "run_on", "shutting_down", "side_executor"]

T = TypeVar("T")
_SIDE_THREADS = 4  # side work that waits on generation (plan drafts) must not hold up the rest


@functools.cache
def _generate_threads() -> int:
    """The intra-op threads ``generate`` gets: the process's setting when the first scheduler started (later
    threads would read what the side threads set, one)."""

    return torch.get_num_threads()


def _set_intra_op_threads(n: int) -> None:
    """Executor initializer: this thread's intra-op threads (OpenMP and MKL settings are per thread)."""

    torch._C.set_num_threads(n)  # not ``torch.set_num_threads``: an in-process vLLM replaces it with a no-op


def side_executor() -> ThreadPoolExecutor:
    """Threads for the work beside decoding: one intra-op thread each, so they start no OpenMP pool."""
    return ThreadPoolExecutor(
        max_workers=_SIDE_THREADS, thread_name_prefix="ngrav-side", initializer=_set_intra_op_threads, initargs=(1,)
    )


async def run_on(executor: ThreadPoolExecutor | None, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
    if executor is None:  # not started: a plain worker thread
        return await asyncio.to_thread(fn, *args)
    return await asyncio.get_running_loop().run_in_executor(executor, functools.partial(fn, *args))


log = logging.getLogger("narrative_gravity.server")


@dataclass(eq=False)
class Row:
    """One sequence to generate: a choice of a request (see :class:`~narrative_gravity.server.backends.base.GenerationRow`)."""

    job: Job
    index: int
    prompt_ids: list[int]
    options: GenerationOptions
    """The row's budget (``max_new_tokens``) and sampling."""
    gravity: ResolvedGravity | None
    cancelled: bool = False
    arrived: float = field(default_factory=time.monotonic)
    sent: list[int] = field(default_factory=list)
    """Token ids already delivered (the replay check of a rerun compares against them)."""
    trace: bool = False  # the request asked for per-token stats
    background: bool = False  # a shadow row: idle time only (see the module doc)
    preempted: bool = False  # a background row cancelled to make room for others
    response_format: Any = None  # a structured.ResponseFormat: the reply must be JSON matching its schema
    plain_prompt_ids: list[int] | None = None
    """The prompt without the profile's topic sentence (``lead``), where it has one: what a shadow reads."""

    @property
    def max_tokens(self) -> int:
        return self.options.max_new_tokens


class Job:
    """The rows of one request and the queue their events arrive on (event-loop side only)."""

    def __init__(self) -> None:
        self.rows: list[Row] = []
        self.events: asyncio.Queue[tuple[int, str, Any]] = asyncio.Queue()

    def add(self, **kwargs: Any) -> Row:
        row = Row(job=self, index=len(self.rows), **kwargs)
        self.rows.append(row)
        return row

    def deliver(self, index: int, kind: str, payload: Any) -> None:
        self.events.put_nowait((index, kind, payload))

    def cancel(self) -> None:
        """Stop generating for this request (client gone, or every choice finished)."""
        for row in self.rows:
            row.cancelled = True


class BatchScheduler:
    """Collects rows into batches and runs them one after another on ``backend`` (see the module doc)."""

    def __init__(
        self,
        backend: Backend,
        *,
        max_batch_size: int = 8,
        window_s: float = 0.02,
        max_queue: int = 64,
        metrics: Metrics | None = None,
        idle_s: float | None = None,
    ) -> None:
        self.backend = backend
        self.max_batch_size = max_batch_size
        self.window_s = window_s
        self.idle_s = idle_s if idle_s is not None else max(0.1, 4 * window_s)  # before background rows run
        self._background_ended = 0.0  # when the last background batch ended
        self.max_queue = max_queue
        self.metrics = metrics if metrics is not None else Metrics()
        self._pending: deque[Row] = deque()
        self._background: deque[Row] = deque()
        self._running: list[Row] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._side: ThreadPoolExecutor | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    @property
    def queued(self) -> int:
        return len(self._pending)

    @property
    def running(self) -> int:
        return len(self._running)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        threads = _generate_threads()
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="ngrav-generate", initializer=_set_intra_op_threads, initargs=(threads,)
        )
        self._side = side_executor()
        self._task = asyncio.create_task(self._run(), name="ngrav-scheduler")

    async def run_side(self, fn: Callable[..., T], /, *args: Any) -> T:
        """``fn(*args)`` off the event loop, on a side thread with one intra-op thread (see the module doc).

        >>> async def demo():
        ...     scheduler = BatchScheduler(backend=None)
        ...     await scheduler.start()
        ...     try:
        ...         return await scheduler.run_side(sum, [1, 2])
        ...     finally:
        ...         await scheduler.stop()
        >>> asyncio.run(demo())
        3
        """
        return await run_on(self._side, fn, args)

    async def stop(self) -> None:
        """Refuse new rows, fail the queued ones with ``503``, cancel the running batch and wait for it."""
        self._closed = True
        gone = shutting_down()
        while self._pending or self._background:
            row = (self._pending or self._background).popleft()
            row.job.deliver(row.index, "error", gone)
        for row in self._running:  # their batch stops at its next step; their readers must not wait for it
            row.cancelled = True
            row.job.deliver(row.index, "error", gone)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for executor in (self._executor, self._side):
            if executor is not None:
                await asyncio.get_running_loop().run_in_executor(None, executor.shutdown)

    def submit(self, rows: Sequence[Row], *, background: bool = False) -> None:
        """Queue a request's rows, all or none; ``429`` when they do not fit. ``background`` rows wait for idle
        time and give way to every other row (see the module doc)."""
        if self._closed or self._wake is None:
            raise not_accepting()
        if background:
            if len(self._background) + len(rows) > self.max_queue:
                raise APIError(429, "too many background rows are queued", code="queue_full")
            for row in rows:
                row.background = True
            self._background.extend(rows)
            self._wake.set()
            return
        for row in self._running:  # background rows make room at the next step
            if row.background and not row.cancelled:
                row.cancelled = row.preempted = True
        if len(self._pending) + len(rows) > self.max_queue:
            raise APIError(
                429,
                f"the server is busy: {len(self._pending)} rows are queued (limit {self.max_queue}); retry shortly",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        self._pending.extend(rows)
        self._wake.set()

    # ----------------------------------------------------------------------------------------------- loop

    async def _run(self) -> None:
        while True:
            rows = await self._next_batch()
            await self._run_batch(rows)
            if rows[0].background:
                self._background_ended = time.monotonic()

    def _drop_cancelled(self) -> None:
        if any(r.cancelled for r in self._pending):
            self._pending = deque(r for r in self._pending if not r.cancelled)
        for row in [r for r in self._background if r.cancelled]:  # they still owe their job an end
            self._background.remove(row)
            row.job.deliver(row.index, "end", RowStats(new_tokens=0))

    async def _wait(self, timeout: float | None) -> bool:
        assert self._wake is not None  # set by start()
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    async def _next_batch(self) -> list[Row]:
        assert self._loop is not None
        while True:
            self._drop_cancelled()
            if not self._pending:
                if self._background:  # run background rows, alone, once the engine has been idle a while
                    if await self._wait(self.idle_s):
                        continue
                    n = min(self.max_batch_size, len(self._background))
                    return [self._background.popleft() for _ in range(n)]
                await self._wait(None)
                continue
            # rows that arrived while a (preempted) background batch ran get their whole window from its end
            deadline = max(self._pending[0].arrived, self._background_ended) + self.window_s
            while len(self._pending) < self.max_batch_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not await self._wait(remaining):
                    break
                self._drop_cancelled()
            self._drop_cancelled()
            n = min(self.max_batch_size, len(self._pending))
            rows = [self._pending.popleft() for _ in range(n)]
            if rows:
                return rows

    async def _run_batch(self, rows: list[Row]) -> None:
        self._running = rows
        try:
            try:
                stats = await self._generate(rows)
            except Exception as exc:
                if len(rows) == 1:
                    log.error("a row failed", exc_info=exc)
                    rows[0].job.deliver(rows[0].index, "error", exc)
                    return
                log.warning(
                    "a batch of %d rows failed (%s: %s); running its rows one by one",
                    len(rows),
                    type(exc).__name__,
                    exc,
                )
                for row in rows:
                    await self._run_alone(row)
                return
        finally:
            self._running = []
        self._finish(rows, stats)

    async def _run_alone(self, row: Row) -> None:
        """Rerun one row of a failed batch; it gets its stats, or the error it raises by itself."""
        if row.cancelled:
            row.job.deliver(row.index, "end", RowStats(new_tokens=len(row.sent)))
            return
        self._running = [row]
        replay = _Replay(row)
        try:
            stats = await self._generate([row], replay)
        except Exception as exc:
            log.error("a row failed on its own", exc_info=exc)
            row.job.deliver(row.index, "error", exc)
            return
        if replay.diverged:
            row.job.deliver(
                row.index,
                "error",
                APIError(
                    500,
                    "generation failed in a shared batch and its rerun did not repeat the text already sent; retry",
                    code="internal_error",
                ),
            )
            return
        self._finish([row], stats)

    async def _generate(self, rows: list[Row], replay: _Replay | None = None) -> list[RowStats]:
        loop = self._loop
        assert loop is not None and self._executor is not None

        def on_tokens(tokens: list[int | None], stats: list[TokenStats | None] | None = None) -> None:
            # runs in the worker thread
            if replay is not None:
                tokens = replay.filter(tokens)
            loop.call_soon_threadsafe(self._deliver_tokens, rows, tokens, stats)

        t0 = time.perf_counter()
        try:
            return await loop.run_in_executor(self._executor, self.backend.generate, rows, on_tokens)
        finally:
            self.metrics.batch(len(rows), time.perf_counter() - t0)

    def _finish(self, rows: list[Row], stats: list[RowStats]) -> None:
        for row, s in zip(rows, stats):
            if row.gravity is not None and s.narrative_mass is not None:
                self.metrics.gravity_row(row.gravity.label, s.narrative_mass, s.kl or 0.0)
            row.job.deliver(row.index, "end", s)

    @staticmethod
    def _deliver_tokens(rows: list[Row], tokens: list[int | None], stats: list[TokenStats | None] | None) -> None:
        for i, (row, token) in enumerate(zip(rows, tokens)):
            if token is not None and not row.cancelled:
                row.sent.append(token)
                if stats is not None and stats[i] is not None:
                    row.job.deliver(row.index, "stats", stats[i])
                row.job.deliver(row.index, "token", token)


class _Replay:
    """Drops the tokens a rerun row had already sent, and notes when the rerun takes another path."""

    def __init__(self, row: Row) -> None:
        self.row = row
        self.expected = list(row.sent)  # copied: the event loop appends to row.sent
        self.step = 0
        self.diverged = False

    def filter(self, tokens: list[int | None]) -> list[int | None]:
        token = tokens[0]
        if token is None or self.step >= len(self.expected):
            return tokens
        if token != self.expected[self.step]:
            self.diverged = True
            self.row.cancelled = True  # stop generating: this text can no longer be sent
        self.step += 1
        return [None]


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down; retry on another instance", code="shutting_down")


def not_accepting() -> APIError:
    return APIError(503, "the server is not accepting requests (starting or shutting down)", code="unavailable")
