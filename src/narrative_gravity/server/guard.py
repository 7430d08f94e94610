"""The server's doors: the API key and the body size, checked before any route runs or any body byte is read, and
the body itself, read with a size limit and a timeout (chunked uploads have no ``Content-Length``).

Every route but ``/health``, the playground page (``/``) and its files needs ``Authorization: Bearer KEY`` when
the server has an API key; ``/openapi.json`` and ``/docs`` are behind it too.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from typing import Any

from fastapi import Depends, Request
from fastapi.responses import JSONResponse

from .protocol import APIError, parse_json
from .state import ServerState, server_state
from .telemetry import Metrics

__all__ = [
    "OPEN_PATHS",
    "OPEN_PREFIX",
    "GuardMiddleware",
    "WriteTimeout",
    "read_body",
    "request_body",
    "request_json",
    "too_large",
]

log = logging.getLogger("narrative_gravity.server")

OPEN_PATHS = frozenset({"/health", "/"})
OPEN_PREFIX = "/playground/"  # the page's static files; everything they call needs the key


class GuardMiddleware:
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
                    error = too_large(self.max_body_bytes)
        if error is None:
            await self._guarded(scope, receive, send)
            return
        self.metrics.error(error.status, error.code)
        await JSONResponse(error.body(), status_code=error.status, headers=error.headers)(scope, receive, send)

    async def _guarded(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Run the app with a write timeout: a client that reads nothing for ``write_timeout_s`` is dropped."""

        async def timed_send(message: dict[str, Any]) -> None:
            try:
                await asyncio.wait_for(send(message), self.write_timeout_s)
            except asyncio.TimeoutError:
                raise WriteTimeout from None

        try:
            await self.app(scope, receive, timed_send)
        except WriteTimeout:
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


class WriteTimeout(Exception):
    """The client did not read a response piece in time; uvicorn closes the connection."""


def too_large(limit: int) -> APIError:
    return APIError(
        413, f"the request body is larger than this server's limit of {limit} bytes; send less", code="body_too_large"
    )


async def read_body(request: Request, limit: int, timeout_s: float = 30.0) -> bytes:
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
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def request_body(request: Request, state: ServerState = Depends(server_state)) -> bytes:
    """The FastAPI dependency of routes that read their body by hand: the bytes, within the server's limits."""
    return await read_body(request, state.config.max_body_bytes, state.config.read_timeout_s)


async def request_json(body: bytes = Depends(request_body)) -> Any:
    """The body decoded as JSON (:func:`~narrative_gravity.server.protocol.parse_json`)."""
    return parse_json(body)
