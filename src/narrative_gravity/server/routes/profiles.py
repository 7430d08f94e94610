"""The profile store over HTTP: ``GET /v1/profiles``; ``GET|PUT /v1/profiles/{name}`` (``?version=N``);
``GET /v1/profiles/{name}/history``; ``GET /v1/profiles/{name}/diff?from=A&to=B``; ``POST
/v1/profiles/{name}/rollback`` with ``{"to": N}``.

Store work runs off the event loop (:func:`store_call`), which also turns the store's errors into answers: an
unknown name or version is a ``404``, an invalid profile a ``400``, a damaged store a ``500`` (logged, never
returned).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Depends, Request

from ...errors import NarrativeGravityError, StoreError
from ...profiles.schema import Profile
from ...profiles.store import StoreDamagedError
from ..guard import request_json
from ..limits import check_profile
from ..protocol import APIError
from ..resolver import public_message
from ..schemas import ProfileUpdate, RollbackRequest, body
from ..state import ServerState, server_state

__all__ = ["int_query", "router", "store_call"]

log = logging.getLogger("narrative_gravity.server")

router = APIRouter(tags=["profiles"])


def _query(name: str, description: str, *, required: bool = False) -> dict[str, Any]:
    """``openapi_extra`` for a whole-number query parameter that the route reads by hand (its errors are ours)."""
    schema = {"type": "integer", "minimum": 1}
    return {
        "parameters": [
            {"name": name, "in": "query", "required": required, "schema": schema, "description": description}
        ]
    }


async def store_call(
    state: ServerState, fn: Callable[[], Any], name: str | None = None, version: int | None = None
) -> Any:
    """``fn()`` off the event loop, after checking that ``name`` (and its ``version``) exists."""
    store = state.store

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
                    raise APIError(404, public_message(exc, store), param="name", code="profile_not_found") from None
            if version is not None and not 1 <= version <= head:
                raise APIError(
                    404, f"profile {name!r} has no version {version}; its newest is {head}", code="version_not_found"
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

    return await state.scheduler.run_side(work)


def int_query(request: Request, key: str, *, required: bool) -> int | None:
    """A whole-number query parameter ``>= 1``, or a ``400`` naming it."""
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


def _snapshot(name: str, snap: Any) -> dict[str, Any]:
    return {
        "name": name,
        "version": snap.version,
        "created": snap.created,
        "message": snap.message,
        "profile": snap.profile.model_dump(mode="json"),
    }


@router.get("/v1/profiles")
async def list_profiles(state: ServerState = Depends(server_state)) -> dict[str, Any]:
    """Every stored profile with its live and newest version; a damaged one is listed and flagged."""
    infos = await store_call(state, state.store.list)
    data = []
    for info in infos:
        row = {k: v for k, v in vars(info).items() if k != "error"}
        if info.error is not None:  # listed and flagged; the details stay in the server log
            log.error("profile %r cannot be read: %s", info.name, info.error)
            row["error"] = "the newest snapshot of this profile is damaged; the server log has the details"
        data.append(row)
    return {"object": "list", "data": data}


@router.get("/v1/profiles/{name}", openapi_extra=_query("version", "a past version (default: the live one)"))
async def get_profile(name: str, request: Request, state: ServerState = Depends(server_state)) -> dict[str, Any]:
    """A profile's live version (or ``?version=N``), and which version is live."""
    store, version = state.store, int_query(request, "version", required=False)
    snap, live = await store_call(
        state, lambda: (store.snapshot(name, version), store.live_version(name)), name, version
    )
    return {**_snapshot(name, snap), "live": live}


@router.put("/v1/profiles/{name}", openapi_extra=body(ProfileUpdate))
@router.post("/v1/profiles/{name}", openapi_extra=body(ProfileUpdate), operation_id="set_profile_post")
async def set_profile(
    name: str, data: Any = Depends(request_json), state: ServerState = Depends(server_state)
) -> dict[str, Any]:
    """Store a profile as the next version of ``name``, live at once."""
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

    def put() -> int:
        profile = Profile.from_mapping(data["profile"], source=f"profile {name!r}")
        check_profile(profile, state.config, param="profile")  # a stored profile must be usable here
        return state.store.set(name, profile, message=data.get("message"))

    return {"name": name, "version": await store_call(state, put)}


@router.get("/v1/profiles/{name}/history")
async def profile_history(name: str, state: ServerState = Depends(server_state)) -> dict[str, Any]:
    """Every version, oldest first, with which one is live and which are staged."""
    store = state.store
    infos, live = await store_call(state, lambda: (store.history(name), store.live_version(name)), name)
    data = [{**vars(i), "live": i.version == live, "staged": i.version > live} for i in infos]
    return {"object": "list", "name": name, "live": live, "data": data}


@router.get(
    "/v1/profiles/{name}/diff",
    openapi_extra={"parameters": [*_query("from", "older version", required=True)["parameters"],
                                  *_query("to", "newer version", required=True)["parameters"]]},
)  # fmt: skip
async def profile_diff(name: str, request: Request, state: ServerState = Depends(server_state)) -> dict[str, Any]:
    """What changed between two versions: a unified diff and the changed keys."""
    store = state.store
    a = int_query(request, "from", required=True)
    b = int_query(request, "to", required=True)
    await store_call(state, lambda: None, name, a)
    diff, changes = await store_call(state, lambda: (store.diff(name, a, b), store.changes(name, a, b)), name, b)
    return {"name": name, "from": a, "to": b, "diff": diff, "changes": [vars(c) for c in changes]}


@router.post("/v1/profiles/{name}/rollback", openapi_extra=body(RollbackRequest))
async def profile_rollback(
    name: str, data: Any = Depends(request_json), state: ServerState = Depends(server_state)
) -> dict[str, Any]:
    """Restore an old version as a new version, and make it live."""
    to = data.get("to") if isinstance(data, dict) else None
    if isinstance(to, bool) or not isinstance(to, int) or to < 1:
        raise APIError(400, 'send {"to": N} with the version to restore (a whole number >= 1)', param="to")
    version = await store_call(state, lambda: state.store.rollback(name, to), name, to)
    return {"name": name, "version": version, "restored": to}
