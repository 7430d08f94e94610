"""What happens after a request of a stored profile is answered: its arm is recorded, and, when the rollout drew a
shadow for it, the same request runs again without gravity, in the background.

The shadow has the request's prompt ids (without the profile's topic sentence, ``lead``: plain decoding reads the
prompt as it came) and sampling settings (seed included), and the ``measure_only`` profile of
the version that answered it (:meth:`~narrative_gravity.server.resolver.GravityResolver.shadow_of`), so its narrative
mass, entropy and off-topic rate are measured against the same field while nothing pulls. Its text is never sent.

Why a shadow never fails or slows the request it shadows, and costs at most what it measures:

- it starts only after the answer is complete (after the last streamed chunk), and runs as its own job: an error
  or a skip is counted (``ngrav_shadow_skipped_total{reason}``), never returned;
- each shadow row's ``max_tokens`` is the number of tokens its request's row generated, so a shadow decodes at
  most as many tokens as the request it shadows; and a shadow runs only while the profile's shadows, with this
  one's cap reserved, stay within ``shadow`` × the tokens its requests decoded since the server started (else it is
  skipped, reason ``budget``). So a 5% shadow share adds at most 5% to the profile's decoded tokens at every moment,
  by construction, whatever the draw (``ngrav_shadow_decoded_tokens_total`` counts them, preempted ones too);
- under load it is skipped (reason ``load``): on the batching engine when a full batch is already waiting, on an
  engine that admits rows at any step when the running batch has no room for the waiting rows and the shadow; and
  never more than ``max_batch_size`` shadow rows are in flight. On the batching engine shadow rows only use idle time: they run in
  batches of their own once no request has arrived for the scheduler's ``idle_s`` (0.1 s by default), and a request
  that arrives meanwhile preempts them at the next step (reason ``preempted``; see :mod:`.scheduler`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, replace
from typing import Any

from ..profiles.rollout import SPLIT_A, SPLIT_B
from .arms import ArmRecord, ArmRecorder, mean_stats
from .backends.base import Backend, ResolvedGravity, RowStats
from .config import ServerConfig
from .continuous import ContinuousScheduler
from .limits import check_gravity
from .protocol import APIError
from .resolver import GravityResolver
from .scheduler import BatchScheduler, Job
from .telemetry import Metrics

__all__ = ["Answered", "FollowUps"]

log = logging.getLogger("narrative_gravity.server")

_DRAIN_TIMEOUT_S = 600.0  # a row's end arrives long before; this only keeps a stuck engine from leaking tasks


@dataclass(frozen=True)
class Answered:
    """What answering a request took: its id and endpoint, its tokens, and its times in seconds."""

    request_id: str
    endpoint: str
    prompt_tokens: int
    completion_tokens: int
    seconds: float
    ttft: float | None


class FollowUps:
    """Records finished requests of stored profiles and runs their shadows (see the module doc)."""

    def __init__(
        self,
        *,
        scheduler: BatchScheduler | ContinuousScheduler,
        resolver: GravityResolver,
        recorder: ArmRecorder,
        backend: Backend,
        config: ServerConfig,
        metrics: Metrics,
    ) -> None:
        self.scheduler = scheduler
        self.resolver = resolver
        self.recorder = recorder
        self.backend = backend
        self.config = config
        self.metrics = metrics
        self.shadow_rows = 0  # shadow rows queued or running
        self.decoded: dict[str, int] = {}  # per profile: tokens its requests decoded
        self.shadow_spent: dict[str, int] = {}  # per profile: tokens its shadows decoded, or reserved (caps)
        self._tasks: set[asyncio.Task[None]] = set()

    def finished(
        self, *, job: Job, gravity: ResolvedGravity | None, stats: dict[int, RowStats], answer: Answered
    ) -> None:
        """A request's answer is complete: record it (and run its shadow) in the background. Event loop only."""
        if gravity is None or gravity.name is None or gravity.version is None or gravity.arm is None:
            return
        main = ArmRecord(
            request=answer.request_id,
            profile=gravity.name,
            version=gravity.version,
            arm=gravity.arm,
            completion_tokens=answer.completion_tokens,
            latency_s=answer.seconds,
            prompt_tokens=answer.prompt_tokens,
            ttft_s=answer.ttft,
            endpoint=answer.endpoint,
        )
        task = asyncio.create_task(self._follow(job, gravity, dict(stats), main), name="ngrav-follow-up")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def wants_means(self, gravity: ResolvedGravity | None) -> bool:
        """Whether a request's rows must be traced for their arm's means: on an engine that measures only traced
        rows (vLLM), the rows of a split arm or with a shadow; the transformers engine measures every row anyway."""
        if gravity is None or not isinstance(self.scheduler, ContinuousScheduler):
            return False
        return gravity.shadow or gravity.arm in (SPLIT_A, SPLIT_B)

    @property
    def in_flight(self) -> int:
        """Follow-ups (recordings and shadows) not finished yet."""
        return len(self._tasks)

    async def wait(self) -> None:
        """Wait for the follow-ups in flight (tests, benchmarks)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self) -> None:
        """Cancel the follow-ups in flight (server shutdown)."""
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    # ----------------------------------------------------------------------------------------------- internals

    async def _follow(self, job: Job, gravity: ResolvedGravity, stats: dict[int, RowStats], main: ArmRecord) -> None:
        try:
            stats = await _drain(job, stats)
            name = gravity.name or gravity.label
            self.decoded[name] = self.decoded.get(name, 0) + sum(s.new_tokens for s in stats.values())
            if gravity.measure_only:  # the client's own plain run: decode work, but no arm of the profile
                return
            rows = [(r.prompt_ids, list(r.sent)) for r in job.rows]
            await self.scheduler.run_side(self._record, main, gravity, [stats[i] for i in sorted(stats)], rows)
            if gravity.shadow:
                await self._shadow(job, gravity, stats, main.request)
        except asyncio.CancelledError:
            raise
        except Exception:  # never reaches a client; keep the server serving
            log.exception("recording the arm of request %s failed", main.request)

    def _record(
        self,
        rec: ArmRecord,
        gravity: ResolvedGravity,
        stats: list[RowStats],
        rows: list[tuple[list[int], list[int]]],
    ) -> None:
        means = mean_stats(stats)
        off_topic = self.recorder.off_topic_rate(gravity, rows)
        self.recorder.record(replace(rec, **means, off_topic_rate=off_topic))

    def _room(self, n: int) -> bool:
        if self.shadow_rows + n > self.config.max_batch_size:
            return False
        if isinstance(self.scheduler, BatchScheduler):  # shadows there use idle time only, and give way
            return self.scheduler.queued < self.config.max_batch_size
        # an engine that admits rows at any step: only while the running batch has room for every waiting row too
        return self.scheduler.queued + self.scheduler.running + n <= self.config.max_batch_size

    async def _shadow(self, job: Job, gravity: ResolvedGravity, stats: dict[int, RowStats], of: str) -> None:
        name = gravity.name or gravity.label
        caps = [(row, min(row.max_tokens, stats[row.index].new_tokens)) for row in job.rows if row.index in stats]
        caps = [(row, cap) for row, cap in caps if cap > 0]
        if not caps:
            return
        if not self._room(len(caps)):
            self.metrics.shadow_skip(name, "load")
            return
        reserved = sum(cap for _, cap in caps)
        info = await self.scheduler.run_side(self.resolver.store.route_info, name)  # the share now (stat-cached)
        share = info.rollout.shadow if info.rollout is not None else 0.0
        if self.shadow_spent.get(name, 0) + reserved > share * self.decoded.get(name, 0):
            self.metrics.shadow_skip(name, "budget")
            return
        self.shadow_spent[name] = self.shadow_spent.get(name, 0) + reserved
        settled = False  # the reservation becomes the tokens actually decoded, once they are known
        try:
            settled = await self._run_shadow(gravity, caps, of, name, reserved)
        finally:
            if not settled:
                self.shadow_spent[name] -= reserved

    async def _run_shadow(
        self, gravity: ResolvedGravity, caps: list[tuple[Any, int]], of: str, name: str, reserved: int
    ) -> bool:
        """Run and record one shadow; ``True`` once its reservation has been replaced by what it decoded."""
        shadow = self.resolver.shadow_of(gravity)
        try:
            await self.scheduler.run_side(check_gravity, shadow, self.backend, self.config)
        except Exception as exc:
            log.warning("the shadow of %s version %s cannot be built: %s", name, gravity.version, exc)
            self.metrics.shadow_skip(name, "error")
            return False
        sjob = Job()
        for row, cap in caps:
            same = {"response_format": row.response_format} if getattr(row, "response_format", None) else {}
            trace = isinstance(self.scheduler, ContinuousScheduler)  # see wants_means
            ids = row.plain_prompt_ids if getattr(row, "plain_prompt_ids", None) is not None else row.prompt_ids
            options = row.options.replace(max_new_tokens=cap)
            sjob.add(prompt_ids=ids, options=options, gravity=shadow, trace=trace, **same)
        if not self._room(len(caps)):  # checked again: the build above may have taken a while
            self.metrics.shadow_skip(name, "load")
            return False
        try:
            self.scheduler.submit(sjob.rows, background=True)
        except APIError:
            self.metrics.shadow_skip(name, "load")
            return False
        self.shadow_rows += len(sjob.rows)
        started = time.perf_counter()
        try:
            sstats = await _drain(sjob, {})
        except Exception as exc:
            log.warning("a shadow of %s failed: %s", name, exc)
            self.metrics.shadow_skip(name, "error")
            return True  # what it decoded is unknown: its cap stays counted as spent (an upper bound)
        finally:
            self.shadow_rows -= len(sjob.rows)
            sjob.cancel()
        decoded = sum(s.new_tokens for s in sstats.values())
        self.shadow_spent[name] += decoded - reserved  # the reservation becomes what was decoded
        self.metrics.shadow_decoded(name, decoded)
        if any(r.preempted for r in sjob.rows):
            self.metrics.shadow_skip(name, "preempted")
            return True
        rec = ArmRecord(
            request=of + ":shadow",
            profile=name,
            version=gravity.version or 0,
            arm=shadow.arm or "shadow",
            completion_tokens=sum(s.new_tokens for s in sstats.values()),
            latency_s=time.perf_counter() - started,
            prompt_tokens=sum(len(r.prompt_ids) for r in sjob.rows),
            of=of,
        )
        rows = [(r.prompt_ids, list(r.sent)) for r in sjob.rows]
        await self.scheduler.run_side(self._record, rec, shadow, [sstats[i] for i in sorted(sstats)], rows)
        return True


async def _drain(job: Job, stats: dict[int, RowStats]) -> dict[int, RowStats]:
    """Wait for every row's ``end`` (``stats`` holds those already seen); an ``error`` event raises it."""
    stats = dict(stats)
    deadline = time.monotonic() + _DRAIN_TIMEOUT_S
    while len(stats) < len(job.rows):
        index, kind, payload = await asyncio.wait_for(job.events.get(), max(0.0, deadline - time.monotonic()))
        if kind == "end":
            stats[index] = payload
        elif kind == "error":
            raise payload if isinstance(payload, BaseException) else RuntimeError(str(payload))
    return stats
