"""The wire format: OpenAI-shaped errors and the chat and completions requests (plus ``gravity``).

Errors always have OpenAI's shape, so every OpenAI client reports them well:

>>> APIError(400, "`max_tokens` has to be >= 1, but is -1", param="max_tokens").body()["error"]["param"]
'max_tokens'

Unknown request fields are refused with a did-you-mean, as OpenAI's API does:

>>> parse_request(CompletionRequest, {"model": "m", "prompt": "hi", "gravtiy": {}})
Traceback (most recent call last):
...
narrative_gravity.server.protocol.APIError: unrecognized request argument `gravtiy`; did you mean `gravity`?

Types are strict, as in OpenAI's API: a number in quotes or a boolean for a number is refused, not coerced:

>>> parse_request(CompletionRequest, {"model": "m", "prompt": "hi", "max_tokens": "5"})  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
narrative_gravity.server.protocol.APIError: `max_tokens`: Input should be a valid integer (got "5")

Text that cannot be encoded (a lone surrogate such as ``"\\ud800"`` in JSON) is refused with the field it is in:

>>> parse_json(b'{"messages": [{"role": "user", "content": "hi \\ud800"}]}')  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
narrative_gravity.server.protocol.APIError: `messages.0.content` holds text that cannot be encoded as UTF-8 ...
"""

from __future__ import annotations

import difflib
import json
import math
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..engines.options import GenerationOptions
from ..text import unencodable

__all__ = [
    "APIError",
    "ChatRequest",
    "CompletionRequest",
    "GenerationParams",
    "chat_messages",
    "completion_prompts",
    "generation_params",
    "parse_json",
    "parse_request",
]

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with HTTP ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def parse_json(body: bytes) -> Any:
    """Decode a request body; ``NaN``/``Infinity`` and non-UTF-8 bytes are refused."""

    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not valid JSON; send a finite number")

    def finite(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            raise ValueError(f"{text} is too large for a number; send a finite number")
        return value

    if not body.strip():
        raise APIError(400, "the request body is empty; send a JSON object", code="invalid_json")
    try:
        data = json.loads(body.decode("utf-8"), parse_constant=no_constants, parse_float=finite)
    except UnicodeDecodeError:
        raise APIError(400, "the request body is not UTF-8 text; send UTF-8 JSON", code="invalid_json") from None
    except json.JSONDecodeError as exc:
        raise APIError(
            400,
            f"the request body is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})",
            code="invalid_json",
        ) from None
    except (ValueError, RecursionError) as exc:
        why = "it is nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise APIError(400, f"the request body is not valid JSON: {why}", code="invalid_json") from None
    bad = unencodable(data)
    if bad is not None:
        raise APIError(
            400,
            f"`{bad}` holds text that cannot be encoded as UTF-8 (a lone surrogate such as \\ud800); "
            "send valid Unicode text",
            param=bad,
            code="invalid_text",
        )
    return data


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    model: str
    gravity: Any = None
    max_tokens: int | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, description="an extension (as in vLLM); 0 = off")
    n: int | None = Field(None, ge=1, le=64)
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # accepted and ignored: they change nothing about the text
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    prompt_cache_key: Any = None
    safety_identifier: Any = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    response_format: Any = None
    modalities: Any = None
    reasoning_effort: Any = None
    documents: Any = None  # an extension: retrieved passages for the pipeline (narrative_gravity.levels.pipeline)


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None
    response_format: Any = None  # an extension (as in vLLM): the same JSON constraint as on chat


def parse_request(cls: type[_Request], data: Any) -> Any:
    """Validate a decoded body into ``cls``; the first problem becomes a ``400`` naming the field."""
    if not isinstance(data, dict):
        raise APIError(
            400, f"the request body must be a JSON object, but is a JSON {_json_type(data)}", code="invalid_json"
        )
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = [str(p) for p in err["loc"]]
        param = ".".join(loc) or None
        if err["type"] == "extra_forbidden":
            guess = difflib.get_close_matches(loc[-1], list(cls.model_fields), n=1, cutoff=0.6)
            hint = f"; did you mean `{guess[0]}`?" if guess else ""
            raise APIError(400, f"unrecognized request argument `{param}`{hint}", param=param) from None
        if err["type"] == "missing":
            raise APIError(400, f"missing required argument `{param}`", param=param) from None
        got = json.dumps(err.get("input"), default=str)
        got = got if len(got) <= 80 else got[:77] + "..."
        raise APIError(400, f"`{param}`: {err['msg']} (got {got})", param=param) from None


def _json_type(value: Any) -> str:
    return {list: "array", str: "string", int: "number", float: "number", bool: "boolean"}.get(
        type(value), "null" if value is None else type(value).__name__
    )


# ------------------------------------------------------------------------------------------- generation params


@dataclass(frozen=True)
class GenerationParams:
    """The sampling side of a request, checked against the server's limits."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    n: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    include_trace: bool = False  # stream_options.include_trace: each chunk lists its tokens (ids and stats)

    def options(self, *, seed: int) -> GenerationOptions:
        """One row's budget and sampling (each row of a request has its own ``seed``)."""
        return GenerationOptions(
            max_new_tokens=self.max_tokens, top_k=self.top_k, temperature=self.temperature, top_p=self.top_p, seed=seed
        )


def generation_params(req: _Request, *, default_max_tokens: int, max_tokens_limit: int) -> GenerationParams:
    """Check the fields every request shares; unsupported options are refused rather than ignored."""
    max_tokens = req.max_tokens
    param = "max_tokens"
    if isinstance(req, ChatRequest) and req.max_completion_tokens is not None:
        max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
    if max_tokens is None:
        max_tokens = min(default_max_tokens, max_tokens_limit)
    if max_tokens < 1:
        raise APIError(400, f"`{param}` has to be >= 1, but is {max_tokens}", param=param, code="invalid_value")
    if max_tokens > max_tokens_limit:
        raise APIError(
            400,
            f"`{param}` is {max_tokens}, above this server's limit of {max_tokens_limit}; ask for fewer tokens",
            param=param,
            code="invalid_value",
        )
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value:
            raise APIError(400, f"`{name}` is not supported by this server; leave it out or set it to 0", param=name)
    if req.logit_bias:
        raise APIError(400, "`logit_bias` is not supported; use `gravity` to steer tokens", param="logit_bias")
    stop: tuple[str, ...] = ()
    if isinstance(req.stop, str):
        stop = (req.stop,)
    elif req.stop is not None:
        stop = tuple(req.stop)
    if len(stop) > 4 or any(not s for s in stop):
        raise APIError(400, "`stop` takes at most 4 non-empty strings", param="stop")
    include_usage = False
    if req.stream_options is not None:
        if not req.stream:
            raise APIError(400, "`stream_options` is only allowed with `stream: true`", param="stream_options")
        unknown = set(req.stream_options) - {"include_usage", "include_trace"}
        if unknown:
            raise APIError(
                400,
                f"unknown `stream_options` keys {sorted(unknown)}; only `include_usage` and `include_trace` are "
                "supported",
                param="stream_options",
            )
        include_usage = bool(req.stream_options.get("include_usage"))
    include_trace = bool(req.stream_options and req.stream_options.get("include_trace"))
    temperature = 1.0 if req.temperature is None else req.temperature
    top_p = 1.0 if req.top_p is None else req.top_p
    if not (math.isfinite(temperature) and math.isfinite(top_p)):  # pragma: no cover - pydantic refuses them
        raise APIError(400, "`temperature` and `top_p` must be finite numbers", param="temperature")
    return GenerationParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=req.top_k or 0,
        seed=req.seed,
        n=req.n or 1,
        stop=stop,
        stream=bool(req.stream),
        include_usage=include_usage,
        include_trace=include_trace,
    )


_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def chat_messages(req: ChatRequest) -> list[dict[str, str]]:
    """The messages as ``{"role", "content"}`` text for a chat template; tools and images are refused.

    (``response_format`` is read by :func:`~narrative_gravity.server.structured.parse_response_format`.)"""
    for name in ("tools", "functions", "tool_choice", "function_call"):
        if getattr(req, name) not in (None, "none", []):
            raise APIError(400, f"`{name}` is not supported by this server", param=name)
    if req.logprobs or req.top_logprobs:
        raise APIError(400, "`logprobs` is not supported by this server", param="logprobs")
    out = []
    for i, msg in enumerate(req.messages):
        role = _ROLES.get(msg.role)
        if role is None:
            raise APIError(
                400,
                f"`messages[{i}].role` is {msg.role!r}; use one of system, developer, user, assistant",
                param=f"messages.{i}.role",
            )
        content = msg.content
        if content is None:
            content = ""
        elif isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(
                        400,
                        f"`messages[{i}].content[{j}]` is not a text part; this server reads text only",
                        param=f"messages.{i}.content.{j}",
                    )
                parts.append(part["text"])
            content = "".join(parts)
        out.append({"role": role, "content": content})
    return out


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """Each prompt as text or as token ids; ``echo``, ``logprobs``, ``best_of`` and ``suffix`` are refused."""
    if req.echo:
        raise APIError(400, "`echo` is not supported by this server", param="echo")
    if req.logprobs:
        raise APIError(400, "`logprobs` is not supported by this server", param="logprobs")
    if req.best_of not in (None, 1):
        raise APIError(400, "`best_of` is not supported; use `n`", param="best_of")
    if req.suffix:
        raise APIError(400, "`suffix` is not supported by this server", param="suffix")
    prompt = req.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "`prompt` is an empty list; send a string or a list of strings", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]
