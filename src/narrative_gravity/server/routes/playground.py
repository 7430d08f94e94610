"""The playground: a page at ``/`` to write a profile, watch gravity work and keep what works.

The page (``static/``: one HTML file, one script, one style sheet; no build step, no CDN) only calls the
server's own API, so everything it does can be done over HTTP too. It adds three routes for that:

- ``GET /v1/playground``: what the page needs to start: the model, the engine, whether the engine streams
  per-token stats, the server's limits and the topic default profile. No model work.
- ``POST /v1/validate`` with ``{"profile": {...}, "prepare": false}``: ``{"valid": true, "profile": {...}}``
  (with every default filled in), or ``{"valid": false, "errors": [{"param", "message"}, ...]}`` where
  ``param`` is the key path of the bad setting (``"thermostat.max_strength"``, ``"stages.0.share"``; ``""``
  for the profile as a whole). ``"prepare": true`` also builds the profile's field, as a request would.
- ``POST /v1/score``: the metrics of ``ngrav compare`` for completions already generated, per run and, over
  paired runs, the summary with 95% bootstrap intervals (see :func:`~narrative_gravity.compare.summarize`)::

      {"gravity": {...profile...} | {"profile": "NAME"}, "prompt": "text" | "messages": [...],
       "runs": [{"control": SIDE, "gravity": SIDE}, ...]}
      SIDE = {"token_ids": [...], "text": "...", "seconds": 1.2, "entropy": 2.1, "kl": 0.05}

  ``entropy`` and ``kl`` are the run's means (from a stream's per-token stats; ``null`` when not measured).

The page and its files are open like ``/health``; every ``/v1`` route needs the API key when one is set, and
the page asks for it once.
"""

from __future__ import annotations

import math
from importlib import resources
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from ...compare import Scoring, row_metrics, summarize_metrics
from ...errors import NarrativeGravityError
from ...profiles.build import field_from_profile
from ...profiles.schema import TOPIC_DEFAULTS, Profile, profile_problems
from ..backends.base import field_model_of
from ..guard import request_json
from ..protocol import APIError, parse_request
from ..schemas import body
from ..state import ServerState, server_state

__all__ = ["ASSETS", "TOPIC_WORDS", "ScoreRequest", "ValidateRequest", "router", "topic_profile"]

router = APIRouter(tags=["playground"])

# The words of profiles/topic.yaml, the topic default the page starts from (tests check they agree).
TOPIC_WORDS = ("planet", "orbit", "galaxy", "telescope", "astronaut", "rocket")

ASSETS = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "app.css": "text/css; charset=utf-8",
}
MAX_RUNS = 64


def topic_profile() -> dict[str, Any]:
    """The topic default as a profile mapping: profiles/topic.yaml.

    >>> Profile.from_mapping(topic_profile()).schedule
    'thermostat'
    """
    return {"name": "topic", "core_semantics": list(TOPIC_WORDS), **TOPIC_DEFAULTS}


def _asset(name: str) -> bytes:
    return resources.files("narrative_gravity.server").joinpath("static", name).read_bytes()


def _finite(obj: Any) -> Any:
    """JSON has no NaN: metrics that were not measured become ``null``."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


class _Side(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    token_ids: list[int] = Field(max_length=100_000)
    text: str
    seconds: float = Field(0.0, ge=0.0)
    entropy: float | None = None
    kl: float | None = None


class _Run(BaseModel):
    model_config = ConfigDict(extra="forbid")

    control: _Side
    gravity: _Side


class ScoreRequest(BaseModel):
    """The body of ``POST /v1/score``."""

    model_config = ConfigDict(extra="forbid")

    gravity: dict[str, Any]
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    runs: list[_Run] = Field(min_length=1, max_length=MAX_RUNS)
    held_out: list[str] = Field(
        default_factory=list, max_length=256, description="topic words the profile does not name, scored as hits"
    )
    description: str | None = Field(
        None, max_length=2000, description="a sentence describing the topic, scored by MiniLM similarity"
    )


class ValidateRequest(BaseModel):
    """The body of ``POST /v1/validate``."""

    model_config = ConfigDict(extra="forbid")

    profile: Any
    prepare: bool = Field(False, strict=True)


def _file(name: str) -> Response:
    if name not in ASSETS:
        raise APIError(404, f"no playground file {name!r}", code="not_found")
    return Response(_asset(name), media_type=ASSETS[name], headers={"Cache-Control": "no-cache"})


@router.get("/", include_in_schema=False)
async def page() -> Response:
    return _file("index.html")


@router.get("/playground/{name}", include_in_schema=False)
async def playground_file(name: str) -> Response:
    return _file(name)


@router.get("/v1/playground")
async def playground_config(state: ServerState = Depends(server_state)) -> dict[str, Any]:
    """What the page needs to start: the model, the engine, the server's limits and the topic default."""
    backend, config = state.backend, state.config
    tokenizer = getattr(backend, "tokenizer", None)
    return {
        "model": backend.model_id,
        "engine": backend.name,
        "token_stats": bool(getattr(backend, "token_stats", False)),
        "chat": bool(getattr(tokenizer, "chat_template", None)),
        "max_tokens_limit": config.max_tokens_limit,
        "default_max_tokens": min(64, config.max_tokens_limit),
        "inline_gravity": config.allow_inline_gravity,
        "topic_default": topic_profile(),
    }


@router.post("/v1/validate", openapi_extra=body(ValidateRequest))
async def validate(data: Any = Depends(request_json), state: ServerState = Depends(server_state)) -> dict[str, Any]:
    """A profile with every default filled in, or every problem with the key path of its setting."""
    req = parse_request(ValidateRequest, data)  # type: ignore[arg-type]
    problems = profile_problems(req.profile)
    if problems:
        return {"valid": False, "errors": [{"param": k, "message": m} for k, m in problems]}
    profile = Profile.from_mapping(req.profile)
    if req.prepare:
        try:
            await state.scheduler.run_side(state.backend.prepare, profile)
        except NarrativeGravityError as exc:
            return {"valid": False, "errors": [{"param": "", "message": str(exc)}]}
    return {"valid": True, "profile": profile.model_dump(mode="json", exclude_none=True)}


@router.post("/v1/score", openapi_extra=body(ScoreRequest))
async def score(data: Any = Depends(request_json), state: ServerState = Depends(server_state)) -> dict[str, Any]:
    """The metrics of ``ngrav compare`` for completions already generated, and their paired summary."""
    req = parse_request(ScoreRequest, data)  # type: ignore[arg-type]
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "send either `prompt` (text) or `messages` (a conversation)", param="prompt")
    # the live (or a pinned) version: no split, no shadow
    gravity = await state.resolve_gravity(req.gravity, routed=False)
    if gravity is None:  # pragma: no cover - a mapping always resolves to a profile
        raise APIError(400, "send the profile to score against in `gravity`", param="gravity")
    if gravity.measure_only:
        raise APIError(
            400, "score against the steering profile: leave `measure_only` out", param="gravity.measure_only"
        )
    chat = req.messages is not None
    prompt_ids = state.encode(req.messages if chat else req.prompt, chat=chat)
    vocab = getattr(state.backend, "vocab_size", None)
    for i, run in enumerate(req.runs):
        for side in ("control", "gravity"):
            ids = getattr(run, side).token_ids
            if vocab is not None and any(not 0 <= t < vocab for t in ids):
                raise APIError(400, f"`runs.{i}.{side}.token_ids` has ids outside the vocabulary", param="runs")
    backend, profile = state.backend, gravity.profile
    scoring = Scoring(held_out=tuple(req.held_out), description=req.description)
    try:
        scoring.check(profile)
    except NarrativeGravityError as exc:
        raise APIError(400, str(exc), param="held_out") from None

    def work() -> dict[str, Any]:
        field = field_from_profile(profile, backend.tokenizer, model=field_model_of(backend, profile))  # type: ignore[attr-defined]

        def metrics(side: _Side) -> dict[str, float]:
            means = {k: v for k, v in (("entropy", side.entropy), ("kl", side.kl)) if v is not None}
            own = row_metrics(profile, field, prompt_ids, side.token_ids, side.text, seconds=side.seconds, means=means)
            return scoring.metrics(side.text) | own

        runs = [{"control": metrics(r.control), "gravity": metrics(r.gravity)} for r in req.runs]
        return {"runs": runs, "summary": summarize_metrics(runs)}

    return _finite(await state.scheduler.run_side(work))
