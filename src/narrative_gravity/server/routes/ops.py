"""The operator's routes: ``GET /health`` (open, for load balancers), ``GET /metrics`` (Prometheus text) and the
OpenAI model list, ``GET /v1/models`` and ``GET /v1/models/{id}``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse

from ..schemas import Health, ModelCard, ModelList
from ..state import ServerState, server_state
from ..telemetry import CONTENT_TYPE

__all__ = ["router"]

router = APIRouter(tags=["operations"])


@router.get("/health", response_model=Health)
async def health(state: ServerState = Depends(server_state)) -> dict[str, Any]:
    """Whether the server runs, what it serves and how busy it is."""
    return {
        "status": "ok",
        "model": state.backend.model_id,
        "engine": state.backend.name,
        "queued_rows": state.scheduler.queued,
        "running_rows": state.scheduler.running,
        "generate_calls": state.metrics.batches,
    }


@router.get("/metrics", response_class=PlainTextResponse, responses={200: {"content": {CONTENT_TYPE: {}}}})
async def metrics(state: ServerState = Depends(server_state)) -> PlainTextResponse:
    """Prometheus metrics: requests, tokens, latency, batches, errors and the queue."""
    gauges = {
        "ngrav_queued_rows": ("Rows waiting for a batch.", state.scheduler.queued),
        "ngrav_running_rows": ("Rows in the running batch.", state.scheduler.running),
    }
    return PlainTextResponse(state.metrics.render(gauges), media_type=CONTENT_TYPE)


@router.get("/v1/models", response_model=ModelList)
async def list_models(state: ServerState = Depends(server_state)) -> dict[str, Any]:
    """The one model this server serves."""
    return {"object": "list", "data": [state.model_card()]}


@router.get("/v1/models/{model_id:path}", response_model=ModelCard)
async def get_model(model_id: str, state: ServerState = Depends(server_state)) -> dict[str, Any]:
    """The served model, or ``404``."""
    state.check_model(model_id, param="model_id")
    return state.model_card()
