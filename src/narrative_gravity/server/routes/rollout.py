"""The rollout routes of the profile store: stage, promote, rollout config, report.

- ``POST /v1/profiles/{name}/stage`` with ``{"profile": {...}, "message": "..."}``: store a version that is not
  live; answers ``{"name", "version", "live"}``.
- ``POST /v1/profiles/{name}/promote`` with ``{"version": V}`` (default: the newest staged) and ``message``: move
  the live pointer. This route does not evaluate anything; ``ngrav profile promote --prompts SET --limit ...``
  is the promotion that runs an eval first and refuses a regression.
- ``GET /v1/profiles/{name}/rollout``, ``PUT`` with ``{"rollout": {"shadow": 0.05, "split": {"version": 4,
  "share": 0.1}}, "message": "..."}`` (``{"rollout": {}}`` turns it off), ``GET .../rollout/history``.
- ``GET /v1/profiles/{name}/report``: the arms compared (:func:`~narrative_gravity.eval.rollout_report.build_report`).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from ...eval.rollout_report import build_report
from ...profiles.rollout import RolloutError
from ...profiles.schema import Profile
from ...profiles.store import RolloutState
from ..guard import request_json
from ..limits import check_profile
from ..protocol import APIError
from ..schemas import ProfileUpdate, PromoteRequest, RolloutUpdate, body
from ..state import ServerState, server_state
from .profiles import store_call

__all__ = ["rollout_json", "router"]

router = APIRouter(tags=["rollout"])


def rollout_json(name: str, state: RolloutState) -> dict[str, Any]:
    return {
        "name": name,
        "revision": state.revision,
        "updated": state.updated or None,
        "message": state.message,
        "rollout": state.config.model_dump(mode="json", exclude_defaults=True),
    }


def _fields(data: Any, allowed: set[str]) -> dict[str, Any]:
    """The body as a mapping of ``allowed`` keys, with ``message`` text if given; else a ``400``."""
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


@router.post("/v1/profiles/{name}/stage", openapi_extra=body(ProfileUpdate))
async def stage(
    name: str, data: Any = Depends(request_json), state: ServerState = Depends(server_state)
) -> dict[str, Any]:
    """Store a version that is not live yet."""
    data = _fields(data, {"profile", "message"})
    if not isinstance(data.get("profile"), dict):
        raise APIError(400, 'send {"profile": {...profile keys...}, "message": "why"}', param="profile")
    store = state.store

    def work() -> dict[str, Any]:
        profile = Profile.from_mapping(data["profile"], source=f"profile {name!r}")
        check_profile(profile, state.config, param="profile")
        version = store.stage(name, profile, message=data.get("message"))
        return {"name": name, "version": version, "live": store.live_version(name)}

    return await store_call(state, work, name)


@router.post("/v1/profiles/{name}/promote", openapi_extra=body(PromoteRequest))
async def promote(
    name: str, data: Any = Depends(request_json), state: ServerState = Depends(server_state)
) -> dict[str, Any]:
    """Move the live pointer to a staged version (no eval here: ``ngrav profile promote`` runs one)."""
    data = _fields(data, {"version", "message"})
    version = data.get("version")
    if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 1):
        raise APIError(400, "`version` must be a whole number >= 1 (or left out: the newest staged)", param="version")
    store = state.store

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

    return await store_call(state, work, name, version)


@router.get("/v1/profiles/{name}/rollout")
async def get_rollout(name: str, state: ServerState = Depends(server_state)) -> dict[str, Any]:
    """How the profile's traffic is shadowed and split, with the live and the staged versions."""
    store = state.store

    def work() -> dict[str, Any]:
        out = rollout_json(name, store.rollout(name))
        out.update(live=store.live_version(name), staged=store.staged(name))
        return out

    return await store_call(state, work, name)


@router.put("/v1/profiles/{name}/rollout", openapi_extra=body(RolloutUpdate))
async def put_rollout(
    name: str, data: Any = Depends(request_json), state: ServerState = Depends(server_state)
) -> dict[str, Any]:
    """Change the shadow share and the split."""
    data = _fields(data, {"rollout", "message"})
    if "rollout" not in data:
        raise APIError(
            400,
            'send {"rollout": {"shadow": 0.05, "split": {"version": 4, "share": 0.1}}, "message": "why"}; '
            '{"rollout": {}} turns it off',
            param="rollout",
        )

    def work() -> dict[str, Any]:
        try:
            new = state.store.set_rollout(name, data["rollout"], message=data.get("message"))
        except RolloutError as exc:
            raise APIError(400, str(exc), param="rollout", code="invalid_rollout") from None
        return rollout_json(name, new)

    return await store_call(state, work, name)


@router.get("/v1/profiles/{name}/rollout/history")
async def rollout_history(name: str, state: ServerState = Depends(server_state)) -> dict[str, Any]:
    """Every revision of the rollout."""
    states = await store_call(state, lambda: state.store.rollout_history(name), name)
    return {"object": "list", "name": name, "data": [rollout_json(name, s) for s in states]}


@router.get("/v1/profiles/{name}/report")
async def report(name: str, state: ServerState = Depends(server_state)) -> dict[str, Any]:
    """The arms compared, with 95% intervals (:func:`~narrative_gravity.eval.rollout_report.build_report`)."""
    store = state.store

    def work() -> dict[str, Any]:
        out = build_report(name, store.arms_log(name).read())
        out.update(live=store.live_version(name), rollout=rollout_json(name, store.rollout(name))["rollout"])
        return out

    return await store_call(state, work, name)
