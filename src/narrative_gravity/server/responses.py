"""A request's answer as it is generated: token events become text per choice (:class:`Reader`), and the text
becomes OpenAI's response objects, whole or as server-sent events (:class:`Completion`, :func:`stream`).

With ``"stream_options": {"include_trace": true}`` every streamed chunk's choice lists the tokens it carries,
``"tokens": [{"id", "strength", "entropy", "mass", "mass_after", "kl"}, ...]`` (λ and the step's measurements;
only ``id`` where the engine does not measure, or the request has no ``gravity``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from .backends.base import Backend, ResolvedGravity, RowStats
from .detok import ChoiceText
from .prepare import PipelineRun
from .protocol import APIError, GenerationParams
from .scheduler import Job
from .telemetry import Metrics

__all__ = ["Completion", "Reader", "error_event", "stream"]

log = logging.getLogger("narrative_gravity.server")


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


class Reader:
    """Turns a job's token events into text deltas per choice, and keeps the stats of finished rows."""

    def __init__(self, job: Job, backend: Backend, params: GenerationParams, started: float) -> None:
        self.job = job
        self.texts = [
            ChoiceText(backend.decode, eos_ids=backend.eos_ids, max_tokens=row.max_tokens, stop=params.stop)
            for row in job.rows
        ]
        self.stats: dict[int, RowStats] = {}
        self.started = started
        self.first_token_at: float | None = None
        self.trace = params.include_trace
        self._tokens: list[list[dict[str, Any]]] = [[] for _ in job.rows]  # not yet sent, per choice
        self._step: dict[int, dict[str, float]] = {}

    async def events(self, *, wait_for_stats: bool) -> AsyncIterator[tuple[int, str, str | None]]:
        """``(choice index, new text, finish reason or None)``; ends when every choice is finished (and, with
        ``wait_for_stats``, when every row's batch has ended)."""
        n = len(self.texts)
        open_, ended = set(range(n)), 0
        while open_ or (wait_for_stats and ended < n):
            index, kind, payload = await self.job.events.get()
            text = self.texts[index]
            if kind == "stats":
                self._step[index] = payload
                continue
            if kind == "token":
                if self.first_token_at is None:
                    self.first_token_at = time.perf_counter()
                step = self._step.pop(index, None)
                if self.trace and text.finish_reason is None:
                    self._tokens[index].append({"id": payload, **(step or {})})
                delta = text.push(payload)
            elif kind == "end":
                ended += 1
                self.stats[index] = payload
                delta = text.end()
            else:
                raise payload
            if index in open_ and text.finish_reason is not None:
                open_.discard(index)
                self.job.rows[index].cancelled = True  # the batch may drop this row now
                yield index, delta, text.finish_reason
            elif delta:
                yield index, delta, None

    def take_tokens(self, index: int) -> list[dict[str, Any]] | None:
        """The token records of choice ``index`` since the last call (``None`` unless the request asked)."""
        if not self.trace:
            return None
        out, self._tokens[index] = self._tokens[index], []
        return out

    @property
    def completion_tokens(self) -> int:
        return sum(t.n_tokens for t in self.texts)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.started

    def gravity_stats(self) -> dict[str, float]:
        """Means of the rows' trace means (the request's narrative mass and KL)."""
        rows = [s.gravity_json() for s in self.stats.values() if s.narrative_mass is not None]
        out = {k: round(sum(r[k] for r in rows) / len(rows), 5) for k in rows[0]} if rows else {}
        heads = [s.shortlist for s in self.stats.values() if s.shortlist]
        if heads:  # prune.head: the shortlist's size, and with its audit the mass it cut
            out["shortlist"] = {
                "size": max(h["size"] for h in heads),
                **cut_summary([c for h in heads for c in h.get("cut_masses", ())]),
            }
        return out


def cut_summary(masses: list[float]) -> dict[str, float]:
    """Mean and 99th percentile (linear, as numpy's) of the audited masses outside a shortlist; ``{}`` without any.

    >>> cut_summary([0.0, 0.01, 0.02])
    {'cut_mass_mean': 0.01, 'cut_mass_p99': 0.0198, 'audited_steps': 3}
    """
    if not masses:
        return {}
    xs = sorted(masses)
    pos = 0.99 * (len(xs) - 1)
    lo = int(pos)
    p99 = xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (pos - lo)
    return {"cut_mass_mean": round(sum(xs) / len(xs), 6), "cut_mass_p99": round(p99, 6), "audited_steps": len(xs)}


def error_event(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    log.error("generation failed", exc_info=exc)
    return APIError(500, "generation failed; the server log has the details", code="internal_error")


@dataclass
class Completion:
    """What every chunk or response of one request repeats."""

    chat: bool
    id: str
    created: int
    model: str
    gravity: ResolvedGravity | None
    prompt_tokens: int
    pipeline: PipelineRun | None = None
    lead: str | None = None

    def usage(self, completion_tokens: int) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        }

    def gravity_json(self, reader: Reader | None = None) -> dict[str, Any] | None:
        if self.gravity is None:
            return None
        out = self.gravity.describe()
        if self.lead is not None:
            out["lead"] = self.lead
        if reader is not None:
            out.update(reader.gravity_stats())
        return out

    def response(self, reader: Reader) -> dict[str, Any]:
        choices = []
        for i, text in enumerate(reader.texts):
            if self.chat:
                choice = {"index": i, "message": {"role": "assistant", "content": text.text}}
            else:
                choice = {"index": i, "text": text.text}
            choice.update({"logprobs": None, "finish_reason": text.finish_reason})
            choices.append(choice)
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(reader.completion_tokens),
        }
        gravity = self.gravity_json(reader)
        if gravity is not None:
            body["gravity"] = gravity
        if self.pipeline is not None:  # what each level did, and the stages each choice reached
            body["pipeline"] = self.pipeline.finish([t.text for t in reader.texts])
        return body

    def chunk(
        self,
        index: int,
        text: str | None,
        finish: str | None,
        *,
        first: bool = False,
        tokens: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            choice: dict[str, Any] = {"index": index, "delta": delta}
        else:
            choice = {"index": index, "text": text or ""}
        choice.update({"logprobs": None, "finish_reason": finish})
        if tokens is not None:
            choice["tokens"] = tokens
        out = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        if first and self.gravity is not None:
            out["gravity"] = self.gravity_json()
        if first and self.pipeline is not None:
            out["pipeline"] = self.pipeline.report
        return out


async def stream(
    ctx: Completion, reader: Reader, params: GenerationParams, done: Any, metrics: Metrics
) -> AsyncIterator[str]:
    try:
        if ctx.chat:
            for i in range(len(reader.texts)):
                yield f"data: {_dumps(ctx.chunk(i, None, None, first=True))}\n\n"
        first = not ctx.chat
        async for index, text, finish in reader.events(wait_for_stats=False):
            chunk = ctx.chunk(index, text, finish, first=first, tokens=reader.take_tokens(index))
            yield f"data: {_dumps(chunk)}\n\n"
            first = False
        if params.include_usage:
            usage = {
                "id": ctx.id,
                "object": "chat.completion.chunk" if ctx.chat else "text_completion",
                "created": ctx.created,
                "model": ctx.model,
                "choices": [],
                "usage": ctx.usage(reader.completion_tokens),
            }
            yield f"data: {_dumps(usage)}\n\n"
        yield "data: [DONE]\n\n"
        done()
    except Exception as exc:
        err = error_event(exc)
        metrics.error(err.status, err.code)
        yield f"data: {_dumps(err.body())}\n\n"
    finally:
        reader.job.cancel()
