"""An OpenAI-compatible HTTP server with narrative gravity per request (the ``server`` extra).

Start it with ``ngrav serve`` (see ``docs/server.md``), or build the app yourself::

    from narrative_gravity.server import HFBackend, ServerConfig, create_app

    backend = HFBackend.load("smollm2")
    app = create_app(backend, config=ServerConfig(api_key="secret"))   # any ASGI server runs it

Requests are the OpenAI chat and completions requests plus one field, ``gravity``: an inline profile mapping,
or ``{"profile": "name"}`` (optionally ``"version": N``) from the :class:`~narrative_gravity.profiles.store.ProfileStore`.
Concurrent requests are batched into one ``model.generate`` call (see :mod:`.scheduler`).

The rooms: :mod:`.app` (wiring), :mod:`.routes` (one router per group), :mod:`.backends` (the engines),
:mod:`.scheduler` (batching), :mod:`.protocol` and :mod:`.schemas` (the wire format), :mod:`.limits` (what a
request may ask for), :mod:`.telemetry` (Prometheus).
"""

from __future__ import annotations

from .app import create_app, serve
from .backends import make_backend
from .backends.base import Backend
from .backends.hf import HFBackend
from .config import ServerConfig

__all__ = ["Backend", "HFBackend", "ServerConfig", "create_app", "make_backend", "serve"]
