"""OpenAI's generation routes with a ``gravity`` field: ``POST /v1/chat/completions`` and ``POST /v1/completions``.

``stream: true`` answers with server-sent events (``data: {...}``, then ``data: [DONE]``). A chat request may
carry retrieved passages (``documents``), and a profile may switch on the pipeline's levels: they run first
(:mod:`..prepare`). Before the rows are queued, everything they could fail on is checked; a failure that still
happens inside a batch fails only its own row (:mod:`..scheduler`).
"""

from __future__ import annotations

import functools
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import StreamingResponse

from ...profiles.rollout import route_key
from ..backends.base import ResolvedGravity
from ..guard import request_json
from ..prepare import PipelineRun, plan_request, request_passages
from ..protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    GenerationParams,
    chat_messages,
    completion_prompts,
    generation_params,
    parse_request,
)
from ..resolver import request_lead, with_lead
from ..responses import Completion, Reader, error_event, stream
from ..scheduler import Job
from ..schemas import ChatCompletion, ErrorResponse, TextCompletion, body
from ..shadow import Answered
from ..state import ServerState, server_state
from ..structured import check_response_format, parse_response_format

__all__ = ["COMPLETIONS_DEFAULT_MAX_TOKENS", "router"]

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

router = APIRouter(tags=["completions"])
_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse} for code in (400, 403, 404, 413, 429)}


@router.post(
    "/v1/chat/completions",
    openapi_extra=body(ChatRequest, stream=True),
    responses={200: {"model": ChatCompletion}, **_ERRORS},
)
async def chat_completions(data: Any = Depends(request_json), state: ServerState = Depends(server_state)) -> Any:
    """A chat completion, with ``gravity`` (an inline profile, or ``{"profile": "NAME"}`` from the store)."""
    return await _complete(state, data, chat=True)


@router.post(
    "/v1/completions",
    openapi_extra=body(CompletionRequest, stream=True),
    responses={200: {"model": TextCompletion}, **_ERRORS},
)
async def completions(data: Any = Depends(request_json), state: ServerState = Depends(server_state)) -> Any:
    """A plain continuation of each prompt (text or token ids), with ``gravity``."""
    return await _complete(state, data, chat=False)


@dataclass
class _Parsed:
    """A request after its body: what it asks, how to sample, and how to answer."""

    req: Any
    prompts: list[Any]
    params: GenerationParams
    fmt: Any
    chat: bool
    seed: int

    @property
    def param(self) -> str:
        return "messages" if self.chat else "prompt"


def _parse(state: ServerState, data: Any, *, chat: bool) -> _Parsed:
    """The request's fields, checked against the server's limits."""
    config = state.config
    req = parse_request(ChatRequest if chat else CompletionRequest, data)
    prompts: list[Any] = [chat_messages(req)] if chat else completion_prompts(req)
    state.check_model(req.model)
    default = config.default_max_tokens if chat else COMPLETIONS_DEFAULT_MAX_TOKENS
    params = generation_params(req, default_max_tokens=default, max_tokens_limit=config.max_tokens_limit)
    fmt = parse_response_format(req.response_format)
    rows = len(prompts) * params.n
    if rows > config.max_choices:
        raise APIError(
            400,
            f"this request asks for {rows} completions (prompts × n), above this server's limit of {config.max_choices}",
            param="n",
        )
    seed = params.seed if params.seed is not None else secrets.randbits(62)
    return _Parsed(req, prompts, params, fmt, chat, seed)


async def _gravity(state: ServerState, p: _Parsed) -> tuple[ResolvedGravity | None, PipelineRun | None]:
    """The request's gravity, after the pipeline's levels where a chat request has passages or a profile (they may
    change its messages and its profile)."""
    req = p.req
    key = route_key(user=req.user, seed=p.params.seed)
    if not p.chat:
        return await state.resolve_gravity(req.gravity, key=key, chat=False), None
    messages, passages = request_passages(p.prompts[0], req.documents)
    p.prompts = [messages]
    if not passages and req.gravity is None:
        return None, None
    gravity = await state.resolve_gravity(req.gravity, key=key, chat=True)
    run = await plan_request(
        messages, passages, gravity, backend=state.backend, scheduler=state.scheduler, config=state.config, seed=p.seed
    )
    if run is None:
        return gravity, None
    p.prompts = [run.messages]
    return run.gravity, run


async def _job(state: ServerState, p: _Parsed, gravity: ResolvedGravity | None) -> tuple[Job, str | None, int]:
    """The request's rows (prompts × ``n``), encoded after the profile's topic sentence, checked and queued; the
    sentence; the prompt tokens."""
    lead = await state.scheduler.run_side(functools.partial(request_lead, gravity, chat=p.chat))
    plain = [state.encode(x, chat=p.chat) for x in p.prompts]  # without the topic sentence: what a shadow reads
    encoded = plain if lead is None else [state.encode(with_lead(x, lead, chat=p.chat), chat=p.chat) for x in p.prompts]
    for ids in encoded:
        state.check_length(ids, p.params.max_tokens, p.param)
    if p.fmt is not None:  # the engine compiles the schema now: a bad one is this request's 400, not a batch's
        await state.scheduler.run_side(check_response_format, p.fmt, state.backend)
    params, job = p.params, Job()
    trace = params.include_trace or state.followups.wants_means(gravity)
    for ids, plain_ids in zip(encoded, plain, strict=True):
        for _ in range(params.n):
            options = params.options(seed=(p.seed + len(job.rows)) % 2**63)
            job.add(prompt_ids=ids, plain_prompt_ids=plain_ids, options=options, gravity=gravity, trace=trace,
                    response_format=p.fmt)  # fmt: skip
    state.scheduler.submit(job.rows)
    return job, lead, sum(len(ids) for ids in encoded)


async def _complete(state: ServerState, data: Any, *, chat: bool) -> Any:
    started = time.perf_counter()
    p = _parse(state, data, chat=chat)
    gravity, run = await _gravity(state, p)
    job, lead, prompt_tokens = await _job(state, p, gravity)
    reader = Reader(job, state.backend, p.params, started)
    ctx = Completion(
        chat=chat,
        id=("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
        created=int(time.time()),
        model=state.backend.model_id,
        gravity=gravity,
        prompt_tokens=prompt_tokens,
        pipeline=run,
        lead=lead,
    )
    done = functools.partial(_done, state, ctx, reader, started)
    if p.params.stream:
        return StreamingResponse(
            stream(ctx, reader, p.params, done, state.metrics),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    try:
        async for _ in reader.events(wait_for_stats=True):
            pass
    except BaseException as exc:
        job.cancel()
        if isinstance(exc, Exception):
            raise error_event(exc) from None
        raise
    done()
    return ctx.response(reader)


def _done(state: ServerState, ctx: Completion, reader: Reader, started: float) -> None:
    """Count the finished request, record its arm and start its shadow (after the answer, in the background)."""
    seconds = time.perf_counter() - started
    endpoint = "chat" if ctx.chat else "completions"
    label = ctx.gravity.label if ctx.gravity is not None else "none"
    answer = Answered(ctx.id, endpoint, ctx.prompt_tokens, reader.completion_tokens, seconds, reader.ttft)
    state.metrics.request_done(
        endpoint, label, prompt_tokens=answer.prompt_tokens, completion_tokens=answer.completion_tokens,
        seconds=seconds, ttft=answer.ttft,
    )  # fmt: skip
    state.followups.finished(job=reader.job, gravity=ctx.gravity, stats=reader.stats, answer=answer)
