"""Hand each request's rows to an engine that admits rows into its running batch at any step (vLLM).

Each request's rows go to the engine as soon as they arrive and join its running batch
at its next step; rows leave it one by one as they finish. The engine's thread reports each step's events once,
and one ``loop.call_soon_threadsafe`` per step puts them on the requests' queues, as above. A row the engine
refuses or fails gets its own ``error``; too many rows in flight answer ``429``.

:func:`make_scheduler` picks :class:`ContinuousScheduler` for a
:class:`~narrative_gravity.server.backends.base.ContinuousBackend` and
:class:`~narrative_gravity.server.scheduler.BatchScheduler` otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from .backends.base import Backend, ContinuousBackend, GenerationRow
from .config import ServerConfig
from .protocol import APIError
from .scheduler import BatchScheduler, Row, not_accepting, run_on, shutting_down, side_executor
from .telemetry import Metrics

__all__ = ["ContinuousScheduler", "make_scheduler"]

T = TypeVar("T")
log = logging.getLogger("narrative_gravity.server")


class ContinuousScheduler:
    """Hands rows to a continuous backend as they arrive (see the module doc); the same surface as
    :class:`BatchScheduler`.

    Args:
        backend: the engine; it admits rows at any step.
        max_rows: the most rows in flight (waiting in the engine or decoding); more get ``429``.
        metrics: where engine steps, gravity rows and the engine's own collectors go.
    """

    def __init__(self, backend: ContinuousBackend, *, max_rows: int = 128, metrics: Metrics | None = None) -> None:
        if max_rows < 1:
            raise ValueError(f"`max_rows` has to be >= 1, but is {max_rows}")
        self.backend = backend
        self.max_rows = max_rows
        self.metrics = metrics if metrics is not None else Metrics()
        self._live: set[Row] = set()
        self._side: ThreadPoolExecutor | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._registered = False

    @property
    def queued(self) -> int:
        return self.backend.in_flight()[0]

    @property
    def running(self) -> int:
        return self.backend.in_flight()[1]

    async def run_side(self, fn: Callable[..., T], /, *args: Any) -> T:
        """``fn(*args)`` off the event loop, on a side thread with one intra-op thread (the engine's own thread
        decodes; see the module doc)."""
        return await run_on(self._side, fn, args)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._side = side_executor()
        if not self._registered:
            self.metrics.register(self.backend.collectors())
            self._registered = True

    async def stop(self) -> None:
        """Refuse new rows, fail the rows in flight with ``503``, abort them in the engine and stop its thread."""
        self._closed = True
        gone = shutting_down()
        for row in list(self._live):  # their readers must not wait for the engine
            row.cancelled = True
            row.job.deliver(row.index, "error", gone)
        self._live.clear()
        await asyncio.get_running_loop().run_in_executor(None, self.backend.close)
        if self._side is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._side.shutdown)

    def submit(self, rows: Sequence[Row], *, background: bool = False) -> None:
        """Hand a request's rows to the engine, all or none; ``429`` when they would pass ``max_rows``.

        ``background`` rows join the running batch like any other (a row costs the batch little per step); the
        caller decides whether there is room for them."""
        for row in rows:
            row.background = background
        if self._closed or self._loop is None:
            raise not_accepting()
        if len(self._live) + len(rows) > self.max_rows:
            raise APIError(
                429,
                f"the server is busy: {len(self._live)} rows are in flight (limit {self.max_rows}); retry shortly",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        self._live.update(rows)
        self.backend.submit(rows, self._on_events)

    def _on_events(self, events: list[tuple[GenerationRow, str, Any]]) -> None:  # runs in the engine's thread
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the event loop has closed: nobody is listening any more
            self._loop.call_soon_threadsafe(self._deliver, events)

    def _deliver(self, events: list[tuple[GenerationRow, str, Any]]) -> None:
        advanced: set[int] = set()
        for row, kind, payload in events:
            assert isinstance(row, Row)
            if kind == "token":
                advanced.add(id(row))
                if row.cancelled:
                    continue
                row.sent.append(payload)
            elif kind == "stats":  # the measurements of the token that follows
                if row.cancelled:
                    continue
            elif row not in self._live:  # already failed by stop()
                continue
            else:
                self._live.discard(row)
                if kind == "end" and row.gravity is not None and payload.narrative_mass is not None:
                    self.metrics.gravity_row(row.gravity.label, payload.narrative_mass, payload.kl or 0.0)
            row.job.deliver(row.index, kind, payload)
        if advanced:
            self.metrics.engine_step(len(advanced))


def make_scheduler(
    backend: Backend, config: ServerConfig, metrics: Metrics | None = None
) -> BatchScheduler | ContinuousScheduler:
    """The scheduler for ``backend``: rows admitted at any step on a :class:`ContinuousBackend`, batches otherwise.

    A continuous engine decodes up to ``config.max_batch_size`` rows per step (the engine's own limit) and keeps
    up to ``config.max_queue`` more waiting.
    """
    if isinstance(backend, ContinuousBackend):
        return ContinuousScheduler(backend, max_rows=config.max_batch_size + config.max_queue, metrics=metrics)
    return BatchScheduler(
        backend,
        max_batch_size=config.max_batch_size,
        window_s=config.batch_window_ms / 1000.0,
        max_queue=config.max_queue,
        metrics=metrics,
    )
