"""The FastAPI app: OpenAI-compatible routes, the profile store over HTTP, metrics, and ``serve``.

Routes (all but ``/health`` need ``Authorization: Bearer KEY`` when the server has an API key):

- ``POST /v1/chat/completions``, ``POST /v1/completions``: OpenAI requests plus ``gravity``; ``stream: true``
  answers with server-sent events (``data: {...}``, then ``data: [DONE]``).
- ``GET /v1/models``, ``GET /v1/models/{id}``.
- ``GET /v1/profiles``; ``GET|PUT /v1/profiles/{name}``; ``GET /v1/profiles/{name}/history``;
  ``GET /v1/profiles/{name}/diff?from=A&to=B``; ``POST /v1/profiles/{name}/rollback`` with ``{"to": N}``.
- Rollout (:mod:`.rollout_routes`): ``POST /v1/profiles/{name}/stage`` and ``/promote``,
  ``GET|PUT /v1/profiles/{name}/rollout``, ``GET /v1/profiles/{name}/report``. Requests of stored profiles are
  recorded per arm, and shadows run after the answer (:mod:`.shadow`).
- ``GET /metrics`` (Prometheus text) and ``GET /health``.
- The playground: the page at ``GET /`` (open, like its files under ``/playground/``) and the routes it adds for
  scripts too, ``GET /v1/playground``, ``POST /v1/validate``, ``POST /v1/score`` (see
  :mod:`~narrative_gravity.server.routes.playground`).

With ``"stream_options": {"include_trace": true}`` every streamed chunk's choice lists the tokens it carries,
``"tokens": [{"id", "strength", "entropy", "mass", "mass_after", "kl"}, ...]`` (λ and the step's measurements;
only ``id`` where the engine does not measure, or the request has no ``gravity``; ``"measure_only": true`` in
``gravity`` measures a plain run).

Every error is ``{"error": {"message", "type", "param", "code"}}``; unexpected failures answer a generic ``500``
and are logged with their traceback, never returned.

Before a request's rows are queued, everything it could fail on is checked (:mod:`.limits`); a failure that still
happens inside a batch fails only its own row (:mod:`.scheduler`). Client connections have read and write
timeouts (:func:`uvicorn_config`), so a client that stops sending or reading does not hold a connection forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import os
import secrets
import sys
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from ..errors import ConfigurationError, NarrativeGravityError, StoreError

try:  # the `server` extra; the module still imports without it, and create_app() says what to install
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the environment
    _MISSING: str | None = exc.name
else:
    _MISSING = None

from ..profiles.rollout import route_key
from ..profiles.schema import Profile
from ..profiles.store import ProfileStore, StoreDamagedError
from .arms import ArmRecorder
from .backends.base import Backend, ResolvedGravity, RowStats, Sampling
from .config import ServerConfig
from .detok import ChoiceText
from .levels import PipelineRun, plan_request, request_passages
from .limits import check_gravity, check_profile
from .protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    GenerationParams,
    chat_messages,
    completion_prompts,
    generation_params,
    parse_json,
    parse_request,
)
from .resolver import GravityResolver, public_message, request_lead, with_lead
from .routes.playground import add_playground
from .routes.rollout import add_rollout_routes
from .scheduler import Job, make_scheduler
from .shadow import FollowUps
from .structured import check_response_format, parse_response_format
from .telemetry import CONTENT_TYPE, Metrics

__all__ = ["create_app", "serve", "uvicorn_config"]

log = logging.getLogger("narrative_gravity.server")

OPEN_PATHS = frozenset({"/health", "/"})
OPEN_PREFIX = "/playground/"  # the page's static files; everything they call needs the key
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def _json_response(status: int, body: Any, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(body, status_code=status, headers=headers)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


class _GuardMiddleware:
    """Checks the API key and the declared body size before any route runs or any body byte is read."""

    def __init__(
        self, app: Any, *, api_key: str | None, max_body_bytes: int, metrics: Metrics, write_timeout_s: float = 60.0
    ) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics
        self.write_timeout_s = write_timeout_s

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        error = None
        path = scope.get("path", "")
        if self.key is not None and path not in OPEN_PATHS and not path.startswith(OPEN_PREFIX):
            error = self._auth_error(headers.get(b"authorization"))
        if error is None and b"content-length" in headers:
            try:
                declared = int(headers[b"content-length"])
            except ValueError:
                error = APIError(400, "the Content-Length header is not a number", code="invalid_request")
            else:
                if declared > self.max_body_bytes:
                    error = _too_large(self.max_body_bytes)
        if error is None:
            await self._guarded(scope, receive, send)
            return
        self.metrics.error(error.status, error.code)
        await _json_response(error.status, error.body(), error.headers)(scope, receive, send)

    async def _guarded(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Run the app with a write timeout: a client that reads nothing for ``write_timeout_s`` is dropped."""

        async def timed_send(message: dict[str, Any]) -> None:
            try:
                await asyncio.wait_for(send(message), self.write_timeout_s)
            except asyncio.TimeoutError:
                raise _WriteTimeout from None

        try:
            await self.app(scope, receive, timed_send)
        except _WriteTimeout:
            log.warning(
                "dropped a client on %s that read nothing for %.0f s (write timeout)",
                scope.get("path"),
                self.write_timeout_s,
            )
            raise

    def _auth_error(self, header: bytes | None) -> APIError | None:
        assert self.key is not None
        auth = {"WWW-Authenticate": "Bearer"}
        if not header:
            return APIError(
                401,
                "missing API key: send the header `Authorization: Bearer <key>`",
                code="missing_api_key",
                headers=auth,
            )
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
            return APIError(401, "invalid API key", code="invalid_api_key", headers=auth)
        return None


class _WriteTimeout(Exception):
    """The client did not read a response piece in time; uvicorn closes the connection."""


def _too_large(limit: int) -> APIError:
    return APIError(
        413, f"the request body is larger than this server's limit of {limit} bytes; send less", code="body_too_large"
    )


async def _read_body(request: Request, limit: int, timeout_s: float = 30.0) -> bytes:
    """The body, refused as soon as it passes ``limit`` bytes (chunked uploads have no Content-Length), or with
    ``408`` when the client sends nothing for ``timeout_s`` seconds before it is complete."""
    chunks, size = [], 0
    stream = request.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(stream.__anext__(), timeout_s)
        except StopAsyncIteration:
            break
        except asyncio.TimeoutError:
            raise APIError(
                408,
                f"the request body did not arrive: nothing was received for {timeout_s:g} s; send the whole body",
                code="request_timeout",
                headers={"Connection": "close"},
            ) from None
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


# ----------------------------------------------------------------------------------------------- generation


class _Reader:
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
        if not rows:
            return {}
        return {k: round(sum(r[k] for r in rows) / len(rows), 5) for k in rows[0]}


def _error_event(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    log.error("generation failed", exc_info=exc)
    return APIError(500, "generation failed; the server log has the details", code="internal_error")


# ----------------------------------------------------------------------------------------------- app


def _require_server_extra() -> None:
    if _MISSING is not None:
        raise ConfigurationError(
            f"the server needs FastAPI and uvicorn ({_MISSING} is missing); install them with:\n"
            "    pip install 'narrative-gravity[server]'"
        )


def _preload_encoder() -> None:
    """Load the MiniLM sentence encoder (process-wide, once); a missing package is logged, not fatal: the
    requests that need it will say how to install it."""
    from ..embeddings import encode

    try:
        encode([])
    except NarrativeGravityError as exc:
        log.warning("the sentence encoder was not preloaded: %s", exc)


def create_app(
    backend: Backend,
    *,
    config: ServerConfig | None = None,
    store: ProfileStore | None = None,
    metrics: Metrics | None = None,
) -> FastAPI:
    """The ASGI app serving ``backend``. ``store`` defaults to :func:`~narrative_gravity.profiles.store.default_store_root`."""
    _require_server_extra()
    config = config or ServerConfig()
    store = store if store is not None else ProfileStore()
    metrics = metrics if metrics is not None else Metrics()
    resolver = GravityResolver(store)
    scheduler = make_scheduler(backend, config, metrics)
    followups = FollowUps(
        scheduler=scheduler,
        resolver=resolver,
        recorder=ArmRecorder(store, metrics, backend),
        backend=backend,
        config=config,
        metrics=metrics,
    )
    started_at = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await scheduler.start()
        if config.preload_encoder:
            await scheduler.run_side(_preload_encoder)
        log.info(
            "serving %s (%s engine) with batches of up to %d rows",
            backend.model_id,
            backend.name,
            config.max_batch_size,
        )
        try:
            yield
        finally:
            await followups.close()
            await scheduler.stop()

    app = FastAPI(
        title="narrative-gravity",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.scheduler = scheduler
    app.state.metrics = metrics
    app.state.store = store
    app.state.backend = backend
    app.state.followups = followups
    app.add_middleware(
        _GuardMiddleware,
        api_key=config.api_key,
        max_body_bytes=config.max_body_bytes,
        metrics=metrics,
        write_timeout_s=config.write_timeout_s,
    )

    async def read_body(request: Request) -> bytes:
        return await _read_body(request, config.max_body_bytes, config.read_timeout_s)

    # --------------------------------------------------------------------------------------- errors

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        metrics.error(exc.status, exc.code)
        return _json_response(exc.status, exc.body(), exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            err = APIError(404, f"no route {request.method} {request.url.path}; see /v1/models", code="not_found")
        elif exc.status_code == 405:
            err = APIError(405, f"{request.url.path} does not accept {request.method}", code="method_not_allowed")
        else:
            err = APIError(exc.status_code, str(exc.detail))
        return await _api_error(request, err)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        param = ".".join(str(p) for p in first["loc"][1:]) or None
        return await _api_error(request, APIError(400, f"`{param}`: {first['msg']}", param=param))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        metrics.error(500, "internal_error")
        return _json_response(
            500, APIError(500, "internal server error; the server log has the details", code="internal_error").body()
        )

    # --------------------------------------------------------------------------------------- plain routes

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "model": backend.model_id,
            "engine": backend.name,
            "queued_rows": scheduler.queued,
            "running_rows": scheduler.running,
            "generate_calls": metrics.batches,
        }

    @app.get("/metrics")
    async def metrics_route() -> PlainTextResponse:
        gauges = {
            "ngrav_queued_rows": ("Rows waiting for a batch.", scheduler.queued),
            "ngrav_running_rows": ("Rows in the running batch.", scheduler.running),
        }
        return PlainTextResponse(metrics.render(gauges), media_type=CONTENT_TYPE)

    def model_card() -> dict[str, Any]:
        return {"id": backend.model_id, "object": "model", "created": started_at, "owned_by": "narrative-gravity"}

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict[str, Any]:
        check_model(model_id, param="model_id")
        return model_card()

    def check_model(name: str, *, param: str = "model") -> None:
        if name != backend.model_id:
            raise APIError(
                404,
                f"model {name!r} is not served here; this server serves {backend.model_id!r} (see /v1/models)",
                param=param,
                code="model_not_found",
            )

    # --------------------------------------------------------------------------------------- generation

    async def resolve_gravity(
        spec: Any, *, key: str | None = None, routed: bool = True, chat: bool | None = None
    ) -> ResolvedGravity | None:
        if spec is not None and not config.allow_inline_gravity and not (isinstance(spec, dict) and "profile" in spec):
            raise APIError(
                403,
                'this server accepts only stored profiles: send "gravity": {"profile": "NAME"} (see /v1/profiles)',
                param="gravity",
                code="inline_gravity_disabled",
            )

        def work() -> ResolvedGravity | None:
            gravity = resolver.resolve(spec, route_key=key, routed=routed, chat=chat)
            check_gravity(gravity, backend, config)  # everything the rows could fail on, before they are queued
            return gravity

        return await scheduler.run_side(work)

    def encode(prompt: str | list[int] | list[dict[str, str]], *, chat: bool) -> list[int]:
        try:
            if chat:
                ids = backend.encode_chat(prompt)  # type: ignore[arg-type]
            elif isinstance(prompt, list):
                backend.check_ids(prompt)  # type: ignore[arg-type]
                ids = list(prompt)  # type: ignore[arg-type]
            else:
                ids = backend.encode_text(prompt)
        except NarrativeGravityError as exc:
            raise APIError(400, str(exc), param="messages" if chat else "prompt") from None
        except Exception as exc:
            if type(exc).__module__.startswith("jinja2"):
                raise APIError(
                    400, f"the model's chat template refused these messages: {exc}", param="messages"
                ) from None
            raise
        if not ids:
            raise APIError(400, "the prompt is empty; send some text", param="messages" if chat else "prompt")
        return ids

    def check_length(ids: list[int], max_tokens: int, param: str) -> None:
        if len(ids) > config.max_prompt_tokens:
            raise APIError(
                400,
                f"the prompt has {len(ids)} tokens, above this server's limit of {config.max_prompt_tokens}; shorten it",
                param=param,
                code="context_length_exceeded",
            )
        if len(ids) + max_tokens > backend.max_context:
            raise APIError(
                400,
                f"the prompt ({len(ids)} tokens) plus `max_tokens` ({max_tokens}) exceeds the model's context of "
                f"{backend.max_context} tokens; shorten the prompt or ask for fewer tokens",
                param=param,
                code="context_length_exceeded",
            )

    async def run_request(request: Request, *, chat: bool) -> Any:
        started = time.perf_counter()
        data = parse_json(await read_body(request))
        if chat:
            req = parse_request(ChatRequest, data)
            prompts: list[Any] = [chat_messages(req)]
        else:
            req = parse_request(CompletionRequest, data)
            prompts = completion_prompts(req)
        check_model(req.model)
        params = generation_params(
            req,
            default_max_tokens=config.default_max_tokens if chat else COMPLETIONS_DEFAULT_MAX_TOKENS,
            max_tokens_limit=config.max_tokens_limit,
        )
        fmt = parse_response_format(req.response_format)
        rows = len(prompts) * params.n
        if rows > config.max_choices:
            raise APIError(
                400,
                f"this request asks for {rows} completions (prompts × n), above this server's limit of {config.max_choices}",
                param="n",
            )
        param = "messages" if chat else "prompt"
        seed = params.seed if params.seed is not None else secrets.randbits(62)
        run: PipelineRun | None = None
        gravity: ResolvedGravity | None = None
        passages: list[Any] = []
        if chat:  # the pipeline (.pipeline): passages pruned, earlier turns remembered, a plan, before encoding
            messages, passages = request_passages(prompts[0], req.documents)
            prompts = [messages]
            if passages or req.gravity is not None:
                gravity = await resolve_gravity(req.gravity, key=route_key(user=req.user, seed=params.seed), chat=chat)
                run = await plan_request(
                    messages, passages, gravity, backend=backend, scheduler=scheduler, config=config, seed=seed
                )
                if run is not None:
                    prompts, gravity = [run.messages], run.gravity
        if not (chat and (passages or req.gravity is not None)):
            gravity = await resolve_gravity(req.gravity, key=route_key(user=req.user, seed=params.seed), chat=chat)
        lead = await scheduler.run_side(functools.partial(request_lead, gravity, chat=chat))
        encoded = [encode(p, chat=chat) for p in prompts]
        plain = encoded  # without the topic sentence: what a shadow (plain decoding) reads
        if lead is not None:
            encoded = [encode(with_lead(p, lead, chat=chat), chat=chat) for p in prompts]
        for ids in encoded:
            check_length(ids, params.max_tokens, param)
        if fmt is not None:  # the engine compiles the schema now: a bad one is this request's 400, not a batch's
            await scheduler.run_side(check_response_format, fmt, backend)
        job = Job()
        for ids, plain_ids in zip(encoded, plain, strict=True):
            for _ in range(params.n):
                job.add(
                    prompt_ids=ids,
                    plain_prompt_ids=plain_ids,
                    max_tokens=params.max_tokens,
                    sampling=Sampling(params.temperature, params.top_p, params.top_k, (seed + len(job.rows)) % 2**63),
                    gravity=gravity,
                    trace=params.include_trace or followups.wants_means(gravity),
                    response_format=fmt,
                )
        scheduler.submit(job.rows)
        reader = _Reader(job, backend, params, started)
        prompt_tokens = sum(len(ids) for ids in encoded)
        ctx = _Context(
            chat=chat,
            id=("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
            created=int(time.time()),
            model=backend.model_id,
            gravity=gravity,
            prompt_tokens=prompt_tokens,
            pipeline=run,
            lead=lead,
        )
        label = gravity.label if gravity is not None else "none"
        endpoint = "chat" if chat else "completions"

        def done() -> None:
            seconds = time.perf_counter() - started
            metrics.request_done(
                endpoint,
                label,
                prompt_tokens=prompt_tokens,
                completion_tokens=reader.completion_tokens,
                seconds=seconds,
                ttft=reader.ttft,
            )
            followups.finished(  # records the arm and runs a shadow, after the answer and in the background
                job=job,
                gravity=gravity,
                stats=reader.stats,
                request_id=ctx.id,
                endpoint=endpoint,
                prompt_tokens=prompt_tokens,
                completion_tokens=reader.completion_tokens,
                seconds=seconds,
                ttft=reader.ttft,
            )

        if params.stream:
            return StreamingResponse(
                _stream(ctx, reader, params, done, metrics),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        try:
            async for _ in reader.events(wait_for_stats=True):
                pass
        except BaseException as exc:
            job.cancel()
            if isinstance(exc, Exception):
                raise _error_event(exc) from None
            raise
        done()
        return ctx.response(reader)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await run_request(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await run_request(request, chat=False)

    # --------------------------------------------------------------------------------------- profiles

    async def store_call(fn: Any, name: str | None = None, version: int | None = None) -> Any:
        def work() -> Any:
            if name is not None:
                try:
                    head = store.head_version(name)
                except StoreError as exc:
                    raise APIError(400, public_message(exc, store), param="name", code="invalid_name") from None
                if head == 0:
                    try:
                        store.get(name)
                    except StoreError as exc:
                        raise APIError(
                            404, public_message(exc, store), param="name", code="profile_not_found"
                        ) from None
                if version is not None and not 1 <= version <= head:
                    raise APIError(
                        404,
                        f"profile {name!r} has no version {version}; its newest is {head}",
                        code="version_not_found",
                    )
            try:
                return fn()
            except StoreDamagedError as exc:  # our fault, not the client's: logged, and a 500
                log.error("profile store failure: %s", exc)
                raise APIError(
                    500,
                    "the profile store could not be read or written; the server log has the details",
                    code="store_error",
                ) from None
            except NarrativeGravityError as exc:  # invalid profile, bad message
                raise APIError(400, public_message(exc, store), code="invalid_profile") from None

        return await scheduler.run_side(work)

    def int_query(request: Request, key: str, *, required: bool) -> int | None:
        raw = request.query_params.get(key)
        if raw is None:
            if required:
                raise APIError(400, f"missing query parameter `{key}`", param=key)
            return None
        try:
            value = int(raw)
        except ValueError:
            raise APIError(400, f"query parameter `{key}` must be a whole number, but is {raw!r}", param=key) from None
        if value < 1:
            raise APIError(400, f"query parameter `{key}` must be >= 1, but is {value}", param=key)
        return value

    def snapshot_json(name: str, snap: Any) -> dict[str, Any]:
        return {
            "name": name,
            "version": snap.version,
            "created": snap.created,
            "message": snap.message,
            "profile": snap.profile.model_dump(mode="json"),
        }

    @app.get("/v1/profiles")
    async def list_profiles() -> dict[str, Any]:
        infos = await store_call(store.list)
        data = []
        for info in infos:
            row = {k: v for k, v in vars(info).items() if k != "error"}
            if info.error is not None:  # listed and flagged; the details stay in the server log
                log.error("profile %r cannot be read: %s", info.name, info.error)
                row["error"] = "the newest snapshot of this profile is damaged; the server log has the details"
            data.append(row)
        return {"object": "list", "data": data}

    @app.get("/v1/profiles/{name}")
    async def get_profile(name: str, request: Request) -> dict[str, Any]:
        version = int_query(request, "version", required=False)
        snap, live = await store_call(lambda: (store.snapshot(name, version), store.live_version(name)), name, version)
        return {**snapshot_json(name, snap), "live": live}

    @app.api_route("/v1/profiles/{name}", methods=["PUT", "POST"])
    async def set_profile(name: str, request: Request) -> dict[str, Any]:
        data = parse_json(await read_body(request))
        if not isinstance(data, dict) or not isinstance(data.get("profile"), dict):
            raise APIError(
                400,
                'send {"profile": {...profile keys...}, "message": "why it changed"}; `profile` is required',
                param="profile",
            )
        unknown = set(data) - {"profile", "message"}
        if unknown:
            raise APIError(
                400, f"unknown keys {sorted(unknown)}; send only `profile` and `message`", param=sorted(unknown)[0]
            )
        message = data.get("message")

        def put() -> int:
            profile = Profile.from_mapping(data["profile"], source=f"profile {name!r}")
            check_profile(profile, config, param="profile")  # a stored profile must be usable here
            return store.set(name, profile, message=message)

        version = await store_call(put)
        return {"name": name, "version": version}

    @app.get("/v1/profiles/{name}/history")
    async def profile_history(name: str) -> dict[str, Any]:
        infos, live = await store_call(lambda: (store.history(name), store.live_version(name)), name)
        data = [{**vars(i), "live": i.version == live, "staged": i.version > live} for i in infos]
        return {"object": "list", "name": name, "live": live, "data": data}

    @app.get("/v1/profiles/{name}/diff")
    async def profile_diff(name: str, request: Request) -> dict[str, Any]:
        a = int_query(request, "from", required=True)
        b = int_query(request, "to", required=True)
        await store_call(lambda: None, name, a)
        diff, changes = await store_call(lambda: (store.diff(name, a, b), store.changes(name, a, b)), name, b)
        return {"name": name, "from": a, "to": b, "diff": diff, "changes": [vars(c) for c in changes]}

    @app.post("/v1/profiles/{name}/rollback")
    async def profile_rollback(name: str, request: Request) -> dict[str, Any]:
        data = parse_json(await read_body(request))
        to = data.get("to") if isinstance(data, dict) else None
        if isinstance(to, bool) or not isinstance(to, int) or to < 1:
            raise APIError(400, 'send {"to": N} with the version to restore (a whole number >= 1)', param="to")
        version = await store_call(lambda: store.rollback(name, to), name, to)
        return {"name": name, "version": version, "restored": to}

    async def read_json(request: Request) -> Any:
        return parse_json(await _read_body(request, config.max_body_bytes))

    add_rollout_routes(app, store=store, config=config, store_call=store_call, read_body=read_body)
    add_playground(  # the playground shows the live (or a pinned) version: no split, no shadow
        app,
        backend=backend,
        config=config,
        read_json=read_json,
        resolve_gravity=functools.partial(resolve_gravity, routed=False),
        encode=encode,
        run_side=scheduler.run_side,
    )
    return app


# ----------------------------------------------------------------------------------------------- responses


class _Context:
    """What every chunk or response of one request repeats."""

    def __init__(
        self,
        *,
        chat: bool,
        id: str,
        created: int,
        model: str,
        gravity: ResolvedGravity | None,
        prompt_tokens: int,
        pipeline: PipelineRun | None = None,
        lead: str | None = None,
    ) -> None:
        self.chat = chat
        self.lead = lead
        self.id = id
        self.created = created
        self.model = model
        self.gravity = gravity
        self.prompt_tokens = prompt_tokens
        self.pipeline = pipeline

    def usage(self, completion_tokens: int) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        }

    def gravity_json(self, reader: _Reader | None = None) -> dict[str, Any] | None:
        if self.gravity is None:
            return None
        out = self.gravity.describe()
        if self.lead is not None:
            out["lead"] = self.lead
        if reader is not None:
            out.update(reader.gravity_stats())
        return out

    def response(self, reader: _Reader) -> dict[str, Any]:
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


async def _stream(
    ctx: _Context, reader: _Reader, params: GenerationParams, done: Any, metrics: Metrics
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
        err = _error_event(exc)
        metrics.error(err.status, err.code)
        yield f"data: {_dumps(err.body())}\n\n"
    finally:
        reader.job.cancel()


# ----------------------------------------------------------------------------------------------- serve


def uvicorn_config(app: Any, config: ServerConfig, *, log_level: str = "info", **kwargs: Any) -> Any:
    """The ``uvicorn.Config`` that runs ``app`` with ``config``'s connection timeouts.

    - ``read_timeout_s``: a connection must deliver complete request headers within this time (a fresh
      connection, or one that starts a new request on keep-alive); a body that stalls gets ``408``.
    - ``write_timeout_s``: a response piece the client leaves unread this long drops the connection.
    - ``keep_alive_s``: an idle keep-alive connection is closed after this time.

    ``kwargs`` go to ``uvicorn.Config`` (e.g. ``host`` and ``port``).
    """
    import uvicorn

    options: dict[str, Any] = {
        "log_level": log_level,
        "timeout_keep_alive": config.keep_alive_s,
        "limit_concurrency": max(256, 4 * config.max_queue),
        "server_header": False,
        "timeout_graceful_shutdown": 30,
        "h11_max_incomplete_event_size": 16 * 1024,  # request line and headers
        "http": _timed_h11(config.read_timeout_s),
        **kwargs,
    }
    return uvicorn.Config(app, **options)


def _timed_h11(read_timeout_s: float) -> Any:
    """uvicorn's h11 protocol, plus a deadline for request headers (uvicorn has none: a client that opens a
    connection and sends a few bytes, or nothing, would keep it forever)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class TimedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self._arm()  # still waiting for (the rest of) the request headers
            else:
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(read_timeout_s, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                log.info("closed a connection that sent no complete request headers in %g s", read_timeout_s)
                self.transport.close()

    return TimedH11Protocol


def serve(
    config: ServerConfig,
    *,
    model: str | None = None,
    engine: str = "hf",
    device: str = "cpu",
    store: str | os.PathLike[str] | None = None,
    log_level: str = "info",
) -> None:
    """Load the model, build the app and run uvicorn until interrupted (what ``ngrav serve`` does)."""
    _require_server_extra()
    try:
        import uvicorn
    except ModuleNotFoundError:
        raise ConfigurationError(
            "the server needs uvicorn; install it with:\n    pip install 'narrative-gravity[server]'"
        ) from None

    from ..fields.semantic import set_field_cache_limit
    from ..models import resolve_device
    from .backends import make_backend

    if engine == "hf":  # a device this machine lacks fails here, before the store or the model is touched
        device = resolve_device(device)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not config.is_loopback and config.api_key is None:  # ServerConfig allowed it: --insecure-no-auth
        message = (
            f"WARNING: listening on {config.host} without an API key (--insecure-no-auth): anyone who can reach "
            "it can generate and change profiles; set NGRAV_API_KEY to require a key"
        )
        print(message, file=sys.stderr, flush=True)
        log.warning(message)
    profile_store = ProfileStore(store)
    set_field_cache_limit(config.max_semantic_cache_entries)
    options: dict[str, Any] = {}
    if engine == "vllm":  # vLLM decodes up to --max-batch-size rows per step and fits the longest allowed request
        options = {
            "max_num_seqs": config.max_batch_size,
            "max_model_len": config.max_prompt_tokens + config.max_tokens_limit,
            "prefill_tokens": config.prefill_tokens,
        }
    backend = make_backend(engine, model, device=device, **options)
    app = create_app(backend, config=config, store=profile_store)
    log.info("profile store: %s", profile_store.root)
    uvicorn.Server(uvicorn_config(app, config, log_level=log_level, host=config.host, port=config.port)).run()
