"""What the API says it takes and gives, for ``/openapi.json`` and ``/docs``.

Request bodies are read by hand (within the size limit, see :mod:`.guard`) and validated by the models of
:mod:`.protocol` and :mod:`narrative_gravity.profiles`; :func:`body` declares such a model as a route's body in
the schema, and :func:`openapi` puts every declared model into the schema's components. The response models
here describe the JSON the routes return.

>>> body(RollbackRequest)["requestBody"]["content"]["application/json"]["schema"]
{'$ref': '#/components/schemas/RollbackRequest'}
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field

from ..profiles.rollout import RolloutConfig

__all__ = [
    "BODY_MODELS",
    "ChatCompletion",
    "ErrorResponse",
    "Health",
    "ModelCard",
    "ModelList",
    "ProfileUpdate",
    "PromoteRequest",
    "RollbackRequest",
    "RolloutUpdate",
    "TextCompletion",
    "body",
    "openapi",
]

BODY_MODELS: dict[str, type[BaseModel]] = {}
"""Every model declared with :func:`body`, by name (the schema's components)."""


_SKY = {"core_semantics": ["planet", "orbit", "telescope"]}
EXAMPLES: dict[str, dict[str, Any]] = {
    "ChatRequest": {"messages": [{"role": "user", "content": "Tell me about the night sky."}], "gravity": _SKY},
    "CompletionRequest": {"prompt": "The night sky", "gravity": _SKY},
    "ProfileUpdate": {"profile": _SKY, "message": "first cut"},
    "RollbackRequest": {"to": 1},
    "PromoteRequest": {"message": "no regression on the eval"},
    "RolloutUpdate": {"rollout": {"shadow": 0.05}, "message": "measure the pull"},
    "ValidateRequest": {"profile": _SKY},
}
"""One working body per model (``/docs`` shows them); chat and completions requests get the served model and a
budget the server allows."""


def body(model: type[BaseModel], *, stream: bool = False) -> dict[str, Any]:
    """``openapi_extra`` of a route that reads ``model`` by hand: a required JSON body of that schema (``stream``:
    the route can also answer with server-sent events)."""
    BODY_MODELS[model.__name__] = model
    content: dict[str, Any] = {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}
    if model.__name__ in EXAMPLES:
        content["example"] = EXAMPLES[model.__name__]
    extra: dict[str, Any] = {"requestBody": {"required": True, "content": {"application/json": content}}}
    if stream:
        extra["responses"] = {"200": {"content": {"text/event-stream": {"schema": {"type": "string"}}}}}
    return extra


def openapi(app: Any) -> dict[str, Any]:
    """The app's OpenAPI document: FastAPI's, plus the models of :func:`body` and their parts as components."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    for name, model in BODY_MODELS.items():
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for part, sub in schema.pop("$defs", {}).items():
            components.setdefault(part, sub)
        components.setdefault(name, schema)
    state = getattr(app.state, "server", None)
    if state is not None:  # the generation examples name the served model and fit its budget
        served = {"model": state.backend.model_id, "max_tokens": min(16, state.config.max_tokens_limit)}
        for path in ("/v1/chat/completions", "/v1/completions"):
            content = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]
            content["example"] = {**served, **content["example"]}
    app.openapi_schema = doc
    return doc


class _Out(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(_Out):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Out):
    """Every error: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorDetail


class Health(_Out):
    status: Literal["ok"]
    model: str
    engine: str
    queued_rows: int
    running_rows: int
    generate_calls: int


class ModelCard(_Out):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(_Out):
    object: Literal["list"]
    data: list[ModelCard]


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Message(_Out):
    role: Literal["assistant"]
    content: str


class ChatChoice(_Out):
    index: int
    message: Message
    logprobs: None = None
    finish_reason: str | None


class TextChoice(_Out):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None


class _Completion(_Out):
    id: str
    created: int
    model: str
    usage: Usage
    gravity: dict[str, Any] | None = Field(None, description="the profile that pulled, its arm and its measurements")
    pipeline: dict[str, Any] | None = Field(None, description="what each level of the pipeline did")


class ChatCompletion(_Completion):
    object: Literal["chat.completion"]
    choices: list[ChatChoice]


class TextCompletion(_Completion):
    object: Literal["text_completion"]
    choices: list[TextChoice]


class ProfileUpdate(BaseModel):
    """The body of ``PUT /v1/profiles/{name}`` and ``POST /v1/profiles/{name}/stage``."""

    model_config = ConfigDict(extra="forbid")

    profile: dict[str, Any] = Field(description="the profile's keys, as in a profile file")
    message: str | None = Field(None, description="why it changed")


class RollbackRequest(BaseModel):
    """The body of ``POST /v1/profiles/{name}/rollback``."""

    model_config = ConfigDict(extra="forbid")

    to: int = Field(ge=1, description="the version to restore")


class PromoteRequest(BaseModel):
    """The body of ``POST /v1/profiles/{name}/promote``."""

    model_config = ConfigDict(extra="forbid")

    version: int | None = Field(None, ge=1, description="default: the newest staged version")
    message: str | None = None


class RolloutUpdate(BaseModel):
    """The body of ``PUT /v1/profiles/{name}/rollout``; ``{"rollout": {}}`` turns it off."""

    model_config = ConfigDict(extra="forbid")

    rollout: RolloutConfig
    message: str | None = None
