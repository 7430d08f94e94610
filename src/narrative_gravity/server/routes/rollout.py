"""The rollout routes of the profile store: stage, promote, rollout config, report.

- ``POST /v1/profiles/{name}/stage`` with ``{"profile": {...}, "message": "..."}``: store a version that is not
  live; answers ``{"name", "version", "live"}``.
- ``POST /v1/profiles/{name}/promote`` with ``{"version": V}`` (default: the newest staged) and ``message``: move
  the live pointer. This route does not evaluate anything; ``ngrav profile promote --prompts SET --limit ...``
  is the promotion that runs an eval first and refuses a regression.
- ``GET /v1/profiles/{name}/rollout``, ``PUT`` with ``{"rollout": {"shadow": 0.05, "split": {"version": 4,
  "share": 0.1}}, "message": "..."}`` (``{"rollout": {}}`` turns it off), ``GET .../rollout/history``.
- ``GET /v1/profiles/{name}/report``: the arms compared (:func:`~narrative_gravity.profiles.report.build_report`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from ...profiles.rollout import RolloutError
from ...profiles.store import ProfileStore, RolloutState
from ..config import ServerConfig
from ..limits import check_profile
from ..protocol import APIError, parse_json

try:  # the `server` extra; create_app says what to install without it
    from fastapi import Request
except ModuleNotFoundError:  # pragma: no cover - depends on the environment
    Request = Any  # type: ignore[assignment,misc]

__all__ = ["add_rollout_routes", "rollout_json"]


def rollout_json(name: str, state: RolloutState) -> dict[str, Any]:
    return {
        "name": name,
        "revision": state.revision,
        "updated": state.updated or None,
        "message": state.message,
        "rollout": state.config.model_dump(mode="json", exclude_defaults=True),
    }


def add_rollout_routes(
    app: Any,
    *,
    store: ProfileStore,
    config: ServerConfig,
    store_call: Callable[..., Awaitable[Any]],
    read_body: Callable[[Any], Awaitable[bytes]],
) -> None:
    """Add the routes of the module doc to ``app``; ``store_call`` and ``read_body`` are the app's own."""
    from ...profiles.schema import Profile

    async def body(request: Request, allowed: set[str]) -> dict[str, Any]:
        data = parse_json(await read_body(request))
        if not isinstance(data, dict):
            raise APIError(400, f"send a JSON object with {', '.join(sorted(allowed))}")
        unknown = set(data) - allowed
        if unknown:
            raise APIError(
                400,
                f"unknown keys {sorted(unknown)}; send only {', '.join(f'`{k}`' for k in sorted(allowed))}",
                param=sorted(unknown)[0],
            )
        message = data.get("message")
        if message is not None and not isinstance(message, str):
            raise APIError(400, "`message` must be text", param="message")
        return data

    @app.post("/v1/profiles/{name}/stage")
    async def stage(name: str, request: Request) -> dict[str, Any]:
        data = await body(request, {"profile", "message"})
        if not isinstance(data.get("profile"), dict):
            raise APIError(400, 'send {"profile": {...profile keys...}, "message": "why"}', param="profile")

        def work() -> dict[str, Any]:
            profile = Profile.from_mapping(data["profile"], source=f"profile {name!r}")
            check_profile(profile, config, param="profile")
            version = store.stage(name, profile, message=data.get("message"))
            return {"name": name, "version": version, "live": store.live_version(name)}

        return await store_call(work, name)

    @app.post("/v1/profiles/{name}/promote")
    async def promote(name: str, request: Request) -> dict[str, Any]:
        data = await body(request, {"version", "message"})
        version = data.get("version")
        if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 1):
            raise APIError(
                400, "`version` must be a whole number >= 1 (or left out: the newest staged)", param="version"
            )

        def work() -> dict[str, Any]:
            if version is None and not store.staged(name):
                raise APIError(
                    409,
                    f"nothing is staged for {name!r}: its live version {store.live_version(name)} is the newest; "
                    "stage one first, or send the version to promote",
                    param="version",
                    code="nothing_staged",
                )
            previous = store.live_version(name)
            live = store.promote(name, version, message=data.get("message"))
            return {"name": name, "live": live, "previous": previous}

        return await store_call(work, name, version)

    @app.get("/v1/profiles/{name}/rollout")
    async def get_rollout(name: str) -> dict[str, Any]:
        def work() -> dict[str, Any]:
            out = rollout_json(name, store.rollout(name))
            out.update(live=store.live_version(name), staged=store.staged(name))
            return out

        return await store_call(work, name)

    @app.put("/v1/profiles/{name}/rollout")
    async def put_rollout(name: str, request: Request) -> dict[str, Any]:
        data = await body(request, {"rollout", "message"})
        if "rollout" not in data:
            raise APIError(
                400,
                'send {"rollout": {"shadow": 0.05, "split": {"version": 4, "share": 0.1}}, "message": "why"}; '
                '{"rollout": {}} turns it off',
                param="rollout",
            )

        def work() -> dict[str, Any]:
            try:
                state = store.set_rollout(name, data["rollout"], message=data.get("message"))
            except RolloutError as exc:
                raise APIError(400, str(exc), param="rollout", code="invalid_rollout") from None
            return rollout_json(name, state)

        return await store_call(work, name)

    @app.get("/v1/profiles/{name}/rollout/history")
    async def rollout_history(name: str) -> dict[str, Any]:
        states = await store_call(lambda: store.rollout_history(name), name)
        return {"object": "list", "name": name, "data": [rollout_json(name, s) for s in states]}

    @app.get("/v1/profiles/{name}/report")
    async def report(name: str) -> dict[str, Any]:
        from ...profiles.report import build_report

        def work() -> dict[str, Any]:
            out = build_report(name, store.arms_log(name).read())
            out.update(live=store.live_version(name), rollout=rollout_json(name, store.rollout(name))["rollout"])
            return out

        return await store_call(work, name)
