"""The FastAPI app: its parts wired together (:func:`create_app`), and ``serve``.

The routes live in :mod:`.routes`, one ``APIRouter`` per group: operations (``/health``, ``/metrics``,
``/v1/models``), completions (``/v1/chat/completions``, ``/v1/completions``), the profile store
(``/v1/profiles...``), its rollout (stage, promote, rollout, report) and the playground (``/``, ``/v1/playground``,
``/v1/validate``, ``/v1/score``). They share one :class:`~narrative_gravity.server.state.ServerState` through
``Depends``. ``/openapi.json`` describes every route with its request body, and ``/docs`` shows it; both, like
every route but ``/health`` and the playground page, need ``Authorization: Bearer KEY`` when the server has an
API key (:mod:`.guard`).

Every error is ``{"error": {"message", "type", "param", "code"}}``; unexpected failures answer a generic ``500``
and are logged with their traceback, never returned. Client connections have read and write timeouts
(:func:`~narrative_gravity.server.connections.uvicorn_config`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import AsyncIterator
from typing import Any

from .. import __version__
from ..embeddings import encode as sentence_encoder
from ..errors import ConfigurationError, NarrativeGravityError
from ..fields.cache import set_field_cache_limit
from ..models import resolve_device
from ..profiles.store import ProfileStore
from .backends import make_backend
from .backends.base import Backend
from .config import ServerConfig
from .protocol import APIError
from .telemetry import Metrics

try:  # the `server` extra; the module still imports without it, and create_app() says what to install
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from .connections import uvicorn_config
    from .guard import GuardMiddleware
    from .routes import completions, ops, playground, profiles, rollout
    from .schemas import openapi
    from .state import ServerState
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the environment
    _MISSING: str | None = exc.name
else:
    _MISSING = None

__all__ = ["create_app", "serve"]

log = logging.getLogger("narrative_gravity.server")


def create_app(
    backend: Backend,
    *,
    config: ServerConfig | None = None,
    store: ProfileStore | None = None,
    metrics: Metrics | None = None,
) -> FastAPI:
    """The ASGI app serving ``backend``. ``store`` defaults to :func:`~narrative_gravity.profiles.store.default_store_root`."""
    _require_server_extra()
    state = ServerState.build(backend, config, store, metrics)
    app = FastAPI(
        title="narrative-gravity",
        version=__version__,
        description="OpenAI-compatible generation with a `gravity` profile per request, and the profile store.",
        lifespan=_lifespan,
        redoc_url=None,
    )
    app.state.server = state
    app.openapi = lambda: openapi(app)  # type: ignore[method-assign]
    cfg = state.config
    app.add_middleware(
        GuardMiddleware,
        api_key=cfg.api_key,
        max_body_bytes=cfg.max_body_bytes,
        metrics=state.metrics,
        write_timeout_s=cfg.write_timeout_s,
    )
    app.add_exception_handler(APIError, _api_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _unexpected)
    for group in (ops, completions, profiles, rollout, playground):
        app.include_router(group.router)
    return app


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    state: ServerState = app.state.server
    await state.scheduler.start()
    if state.config.preload_encoder:
        await state.scheduler.run_side(_preload_encoder)
    backend = state.backend
    log.info(
        "serving %s (%s engine) with batches of up to %d rows",
        backend.model_id,
        backend.name,
        state.config.max_batch_size,
    )
    try:
        yield
    finally:
        await state.followups.close()
        await state.scheduler.stop()


def _preload_encoder() -> None:
    """Load the MiniLM sentence encoder (process-wide, once); a missing package is logged, not fatal: the
    requests that need it will say how to install it."""
    try:
        sentence_encoder([])
    except NarrativeGravityError as exc:
        log.warning("the sentence encoder was not preloaded: %s", exc)


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    request.app.state.server.metrics.error(exc.status, exc.code)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 404:
        err = APIError(404, f"no route {request.method} {request.url.path}; see /v1/models", code="not_found")
    elif exc.status_code == 405:
        err = APIError(405, f"{request.url.path} does not accept {request.method}", code="method_not_allowed")
    else:
        err = APIError(exc.status_code, str(exc.detail))
    return await _api_error(request, err)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    param = ".".join(str(p) for p in first["loc"][1:]) or None
    return await _api_error(request, APIError(400, f"`{param}`: {first['msg']}", param=param))


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    request.app.state.server.metrics.error(500, "internal_error")
    body = APIError(500, "internal server error; the server log has the details", code="internal_error").body()
    return JSONResponse(body, status_code=500)


def _require_server_extra() -> None:
    if _MISSING is not None:
        raise ConfigurationError(
            f"the server needs FastAPI and uvicorn ({_MISSING} is missing); install them with:\n"
            "    pip install 'narrative-gravity[server]'"
        )


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
