"""What every route shares: the server's parts (:class:`ServerState`, on ``app.state.server``) and the checks a
request passes before its rows are queued (model name, prompt encoding and length, gravity).

Routes reach it through FastAPI's dependency injection: ``state: ServerState = Depends(server_state)``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from ..errors import NarrativeGravityError
from ..profiles.store import ProfileStore
from .arms import ArmRecorder
from .backends.base import Backend, ResolvedGravity
from .config import ServerConfig
from .continuous import ContinuousScheduler, make_scheduler
from .limits import check_gravity
from .protocol import APIError
from .resolver import GravityResolver
from .scheduler import BatchScheduler
from .shadow import FollowUps
from .telemetry import Metrics

__all__ = ["ServerState", "server_state"]


@dataclass
class ServerState:
    """The engine, the settings, the profile store, the scheduler and what runs after a request."""

    backend: Backend
    config: ServerConfig
    store: ProfileStore
    metrics: Metrics
    scheduler: BatchScheduler | ContinuousScheduler
    resolver: GravityResolver
    followups: FollowUps
    started_at: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def build(
        cls,
        backend: Backend,
        config: ServerConfig | None = None,
        store: ProfileStore | None = None,
        metrics: Metrics | None = None,
    ) -> ServerState:
        """The parts for ``backend``; ``store`` defaults to :func:`~narrative_gravity.profiles.store.default_store_root`."""
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
        return cls(backend, config, store, metrics, scheduler, resolver, followups)

    def model_card(self) -> dict[str, Any]:
        return {
            "id": self.backend.model_id,
            "object": "model",
            "created": self.started_at,
            "owned_by": "narrative-gravity",
        }

    def check_model(self, name: str, *, param: str = "model") -> None:
        """A ``404`` unless ``name`` is the served model."""
        if name != self.backend.model_id:
            raise APIError(
                404,
                f"model {name!r} is not served here; this server serves {self.backend.model_id!r} (see /v1/models)",
                param=param,
                code="model_not_found",
            )

    async def resolve_gravity(
        self, spec: Any, *, key: str | None = None, routed: bool = True, chat: bool | None = None
    ) -> ResolvedGravity | None:
        """A request's ``gravity``, resolved and checked against everything its rows could fail on (off the event
        loop: a profile's field may be built here)."""
        if (
            spec is not None
            and not self.config.allow_inline_gravity
            and not (isinstance(spec, dict) and "profile" in spec)
        ):
            raise APIError(
                403,
                'this server accepts only stored profiles: send "gravity": {"profile": "NAME"} (see /v1/profiles)',
                param="gravity",
                code="inline_gravity_disabled",
            )

        def work() -> ResolvedGravity | None:
            gravity = self.resolver.resolve(spec, route_key=key, routed=routed, chat=chat)
            check_gravity(gravity, self.backend, self.config)  # everything the rows could fail on, before they queue
            return gravity

        return await self.scheduler.run_side(work)

    def encode(self, prompt: str | list[int] | list[dict[str, str]], *, chat: bool) -> list[int]:
        """The token ids of a prompt (a conversation with ``chat``, text, or ids checked against the vocabulary)."""
        backend = self.backend
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

    def check_length(self, ids: list[int], max_tokens: int, param: str) -> None:
        """A ``400`` when the prompt is longer than the server allows, or leaves no room for ``max_tokens``."""
        limit, context = self.config.max_prompt_tokens, self.backend.max_context
        if len(ids) > limit:
            raise APIError(
                400,
                f"the prompt has {len(ids)} tokens, above this server's limit of {limit}; shorten it",
                param=param,
                code="context_length_exceeded",
            )
        if len(ids) + max_tokens > context:
            raise APIError(
                400,
                f"the prompt ({len(ids)} tokens) plus `max_tokens` ({max_tokens}) exceeds the model's context of "
                f"{context} tokens; shorten the prompt or ask for fewer tokens",
                param=param,
                code="context_length_exceeded",
            )


def server_state(request: Request) -> ServerState:
    """The FastAPI dependency of every route: the app's :class:`ServerState`."""
    return request.app.state.server
