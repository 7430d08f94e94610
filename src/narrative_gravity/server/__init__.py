"""An OpenAI-compatible HTTP server with narrative gravity per request (the ``server`` extra).

Start it with ``ngrav serve`` (see ``docs/server.md``), or build the app yourself::

    from narrative_gravity.server import HFBackend, ServerConfig, create_app

    backend = HFBackend.load("smollm2")
    app = create_app(backend, config=ServerConfig(api_key="secret"))   # any ASGI server runs it

Requests are the OpenAI chat and completions requests plus one field, ``gravity``: an inline profile mapping,
or ``{"profile": "name"}`` (optionally ``"version": N``) from the :class:`~narrative_gravity.profiles.store.ProfileStore`.
Concurrent requests are batched into one ``model.generate`` call (see :mod:`.scheduler`).

Only :mod:`.app` needs FastAPI and uvicorn; the backend, scheduler and helpers import without them.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Backend", "HFBackend", "ServerConfig", "create_app", "make_backend", "serve"]

_WHERE = {
    "Backend": ".backends.base",
    "make_backend": ".backends",
    "HFBackend": ".backends.hf",
    "ServerConfig": ".config",
    "create_app": ".app",
    "serve": ".app",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
