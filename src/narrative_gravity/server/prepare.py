"""The pipeline of one chat request in the server: its passages pruned, its earlier turns remembered, its answer
planned, before its rows are queued (:mod:`narrative_gravity.levels.pipeline` does the levels; this module feeds
them from the request and the engine).

The plan level's outline drafts are rows like any request's (sampled, no gravity) on the same scheduler, so
they batch with the rest of the traffic. Everything that can fail (a bad ``documents`` list, a profile that
cannot be built once memory and stages are in it) is the request's own ``400``, before its rows join a batch.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, replace
from typing import Any

from ..engines.prompts import chat_ids
from ..errors import NarrativeGravityError
from ..levels.pipeline import Passage, needs_pipeline, parse_documents, prepare, split_documents, stage_report
from ..levels.plan import DRAFT_OPTIONS
from .backends.base import Backend, ResolvedGravity
from .config import ServerConfig
from .limits import check_gravity
from .protocol import APIError
from .scheduler import Job

__all__ = ["PipelineRun", "plan_request", "profile_key", "request_passages"]

log = logging.getLogger("narrative_gravity.server")


@dataclass
class PipelineRun:
    """A request after its pipeline: the messages the model reads, its gravity, and what each level did."""

    messages: list[dict[str, str]]
    gravity: ResolvedGravity | None
    report: dict[str, Any]
    stages: list[dict[str, Any]] | None = None

    def finish(self, texts: list[str]) -> dict[str, Any]:
        """The report with the stages each choice's text reached."""
        if not self.stages:
            return self.report
        return {**self.report, "stages": [stage_report(self.stages, t) for t in texts]}


def request_passages(messages: list[dict[str, str]], documents: Any) -> tuple[list[dict[str, str]], list[Passage]]:
    """The request's passages (its ``documents`` and its messages' ``<document>`` blocks) and the messages
    without the blocks; a bad ``documents`` list is a ``400`` naming it."""
    try:
        listed = parse_documents(documents)
    except NarrativeGravityError as exc:
        raise APIError(400, str(exc), param="documents") from None
    cleaned, inline = split_documents(messages)
    ids = {p.id for p in listed}
    clash = sorted(p.id for p in inline if p.id in ids)
    if clash:
        raise APIError(
            400, f"passage ids {clash[:5]} are given in `documents` and in the messages; give each its own id",
            param="documents",
        )  # fmt: skip
    return cleaned, [*listed, *inline]


async def plan_request(
    messages: list[dict[str, str]],
    passages: list[Passage],
    gravity: ResolvedGravity | None,
    *,
    backend: Backend,
    scheduler: Any,
    config: ServerConfig,
    seed: int,
) -> PipelineRun | None:
    """Run the request's levels (``None`` when none applies) and check the prepared profile like any other."""
    profile = gravity.profile if gravity is not None else None
    if not needs_pipeline(profile, passages, messages):
        return None
    loop = asyncio.get_running_loop()

    def draft(prompts: list[str], max_tokens: int) -> list[str]:
        future = asyncio.run_coroutine_threadsafe(_drafts(prompts, max_tokens), loop)
        return future.result()

    async def _drafts(prompts: list[str], max_tokens: int) -> list[str]:
        job = Job()
        for i, p in enumerate(prompts):
            job.add(
                prompt_ids=chat_ids(backend.tokenizer, [{"role": "user", "content": p}]),  # type: ignore[attr-defined]
                options=DRAFT_OPTIONS.replace(max_new_tokens=max_tokens, seed=(seed + 7919 * (i + 1)) % 2**63),
                gravity=None,
            )
        scheduler.submit(job.rows)
        tokens: list[list[int]] = [[] for _ in job.rows]
        ended = 0
        try:
            while ended < len(job.rows):
                index, kind, payload = await job.events.get()
                if kind == "token":
                    tokens[index].append(payload)
                elif kind == "end":
                    ended += 1
                elif kind == "error":
                    raise payload
        finally:
            job.cancel()
        return [backend.decode([t for t in ids if t not in backend.eos_ids]) for ids in tokens]

    def work() -> PipelineRun:
        try:
            prepared = prepare(
                messages,
                passages,
                profile,
                tokenizer=backend.tokenizer,  # type: ignore[attr-defined]
                draft=draft,
            )
        except NarrativeGravityError as exc:
            raise APIError(400, f"pipeline: {exc}", param="gravity" if profile is not None else "documents") from None
        new = gravity
        if gravity is not None and prepared.profile is not gravity.profile:
            new = replace(gravity, profile=prepared.profile, key=profile_key(prepared.profile))
            check_gravity(new, backend, config)  # memory and stages: built now, refused now
        return PipelineRun(prepared.messages, new, prepared.report, prepared.stages)

    return await scheduler.run_side(work)


def profile_key(profile: Any) -> str:
    """The grouping key of a prepared profile (as the resolver's)."""
    return json.dumps(profile.model_dump(mode="json"), sort_keys=True)
