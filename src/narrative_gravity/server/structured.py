"""Structured output: OpenAI's ``response_format``, checked before a request joins a batch.

A request may ask for a reply that is one JSON value matching a JSON Schema (``{"type": "json_schema",
"json_schema": {"name": ..., "schema": {...}}}``) or any JSON object (``{"type": "json_object"}``); ``gravity``
still pulls inside the grammar, among the tokens it allows. :func:`parse_response_format` checks the shape and
the schema (against its JSON Schema meta-schema) and :func:`check_response_format` lets the engine compile it
(``Backend.prepare_format``), so a bad schema is a ``400`` naming ``response_format`` and never fails a batch.
Each engine builds its own grammar from the :class:`ResponseFormat`: llguidance on the transformers engine
(:mod:`.grammar`), vLLM's own structured outputs on vLLM (:mod:`.vllm`).

>>> fmt = parse_response_format({"type": "json_schema", "json_schema": {"name": "card", "schema": {"type": "object"}}})
>>> fmt.kind, fmt.name, fmt.schema
('json_schema', 'card', {'type': 'object'})
>>> parse_response_format({"type": "text"}) is None
True
>>> parse_response_format({"type": "json_schema", "json_schema": {"name": "card", "schema": {"type": "strin"}}})
Traceback (most recent call last):
...
narrative_gravity.server.protocol.APIError: `response_format.json_schema.schema` is not a valid JSON Schema: at `type`: 'strin' is not valid under any of the given schemas; fix the schema
>>> reply_errors(fmt, '{"a": 1}') is None, reply_errors(fmt, '[1]')
(True, "the reply does not match the schema: [1] is not of type 'object'")
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigurationError, NarrativeGravityError
from .protocol import APIError

try:  # the `structured` extra; without it a request with `response_format` gets a 400 naming the install
    from jsonschema import Draft202012Validator, SchemaError, validators
except ImportError:  # pragma: no cover - depends on the environment
    validators = None  # type: ignore[assignment]

__all__ = [
    "GRAMMAR_OPTIONS",
    "JSON_OBJECT_SCHEMA",
    "MAX_SCHEMA_DEPTH",
    "ResponseFormat",
    "check_response_format",
    "parse_response_format",
    "reply_errors",
]

PARAM = "response_format"
GRAMMAR_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "json_allowed_escapes": '"\\bfnrt',
}
"""How both engines' grammars write JSON (llguidance's ``x-guidance`` options; a schema's own take precedence):
one line, with one space after each ``,`` and ``:`` of the structure (``{"a": 1, "b": 2}``, as models
mostly saw JSON written) and no other whitespace between its tokens, and no ``\\u`` escapes (text is written as
itself; only the escapes ``\\" \\\\ \\b \\f \\n \\r \\t``). A small model given either freedom can spend its
budget on newlines or write ``\\u0000``."""
JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}
MAX_SCHEMA_DEPTH = 32  # nesting of objects and arrays in a schema; deeper ones are refused
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for `json_schema.name`
_INSTALL = "pip install 'narrative-gravity[structured]'"


@dataclass(frozen=True)
class ResponseFormat:
    """A request's structured-output constraint: the reply is one JSON value matching ``schema``.

    ``kind`` is ``"json_schema"`` or ``"json_object"`` (whose schema is ``{"type": "object"}``); ``key`` is the
    schema as compact JSON, equal for equal schemas (engines cache their compiled grammars by it).
    """

    kind: str
    schema: dict[str, Any]
    key: str
    name: str | None = None
    strict: bool | None = None

    def grammar_schema(self) -> dict[str, Any]:
        """The schema with :data:`GRAMMAR_OPTIONS` under ``x-guidance`` (what both engines compile).

        >>> ResponseFormat.of("json_object", {"type": "object"}).grammar_schema()["x-guidance"]["whitespace_flexible"]
        False
        """
        own = self.schema.get("x-guidance")
        return {**self.schema, "x-guidance": {**GRAMMAR_OPTIONS, **(own if isinstance(own, dict) else {})}}

    @classmethod
    def of(
        cls, kind: str, schema: dict[str, Any], name: str | None = None, strict: bool | None = None
    ) -> ResponseFormat:
        """Build one from a schema (its ``key`` computed here)."""
        key = json.dumps(schema, ensure_ascii=False, separators=(",", ":"))  # key order kept: it orders the reply
        return cls(kind=kind, schema=schema, key=key, name=name, strict=strict)


def _bad(message: str, code: str = "invalid_response_format") -> APIError:
    return APIError(400, message, param=PARAM, code=code)


def parse_response_format(value: Any) -> ResponseFormat | None:
    """The constraint of a request's ``response_format``, or ``None`` for plain text (absent or ``{"type": "text"}``).

    Raises a ``400`` :class:`~narrative_gravity.server.protocol.APIError` with ``param="response_format"``
    that says what is wrong and how to fix it.
    """
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _bad('`response_format` must be an object such as {"type": "json_schema", "json_schema": {...}}')
    kind = value.get("type")
    allowed = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}
    if kind not in allowed:
        raise _bad(f"`response_format.type` is {kind!r}; use one of 'text', 'json_object', 'json_schema'")
    unknown = sorted(set(value) - allowed[kind])
    if unknown:
        raise _bad(f"`response_format` of type {kind!r} takes no `{unknown[0]}`; leave it out")
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat.of("json_object", dict(JSON_OBJECT_SCHEMA))
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise _bad('`response_format.json_schema` is required: send {"name": "...", "schema": {...JSON Schema...}}')
    unknown = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if unknown:
        raise _bad(
            f"`response_format.json_schema` has an unknown key `{unknown[0]}`; "
            "it takes `name`, `schema`, `strict` and `description`"
        )
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise _bad(
            f"`response_format.json_schema.name` is {json.dumps(name)[:80]}; give a name of 1 to 64 letters, digits, "
            "`_` or `-`"
        )
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _bad(f"`response_format.json_schema.strict` must be true or false, but is {json.dumps(strict)[:40]}")
    description = spec.get("description")
    if description is not None and not isinstance(description, str):
        raise _bad("`response_format.json_schema.description` must be a string")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        got = "missing" if schema is None else f"a JSON {type(schema).__name__}"
        raise _bad(
            f"`response_format.json_schema.schema` is {got}; send the JSON Schema object the reply must match "
            '(or use {"type": "json_object"} for any JSON object)'
        )
    check_schema(schema)
    return ResponseFormat.of("json_schema", schema, name=name, strict=strict)


def _depth(value: Any) -> int:
    """How deeply objects and arrays nest in ``value`` (iteratively: no recursion limit to hit).

    >>> _depth({"a": [{"b": 1}]}), _depth(3)
    (3, 0)
    """
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict):
            children = list(node.values())
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in children)
    return deepest


def check_schema(schema: dict[str, Any]) -> None:
    """Raise a ``400`` unless ``schema`` is a valid JSON Schema (by the meta-schema of its ``$schema``, else
    draft 2020-12) that nests at most :data:`MAX_SCHEMA_DEPTH` levels."""
    depth = _depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise _bad(
            f"`response_format.json_schema.schema` nests {depth} levels deep, above this server's limit of "
            f"{MAX_SCHEMA_DEPTH}; flatten it"
        )
    if validators is None:
        raise _bad(f"`response_format` needs jsonschema on this server: {_INSTALL}", code="unsupported")
    try:
        validators.validator_for(schema, default=Draft202012Validator).check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        at = f"at `{where}`: " if where else ""
        raise _bad(
            f"`response_format.json_schema.schema` is not a valid JSON Schema: {at}{exc.message}; fix the schema"
        ) from None


def check_response_format(fmt: ResponseFormat | None, backend: Any) -> None:
    """Let ``backend`` compile ``fmt`` (``prepare_format``) before the request's rows are queued (blocking: call it
    in a worker thread). A schema the engine cannot compile, or an engine without structured output, is a ``400``."""
    if fmt is None:
        return
    prepare = getattr(backend, "prepare_format", None)
    if prepare is None:
        raise _bad(
            f"the {getattr(backend, 'name', '?')} engine cannot constrain replies; leave `response_format` out",
            code="unsupported",
        )
    try:
        prepare(fmt)
    except ConfigurationError as exc:  # the server lacks what structured output needs
        raise _bad(f"`response_format` is not available on this server: {exc}", code="unsupported") from None
    except (NarrativeGravityError, ValueError, TypeError) as exc:
        raise _bad(f"`response_format`: this schema cannot be used: {exc}") from None


def reply_errors(fmt: ResponseFormat | dict[str, Any], text: str) -> str | None:
    """Why ``text`` is not a valid reply for ``fmt`` (a format or a bare schema), or ``None`` when it is."""
    schema = fmt.schema if isinstance(fmt, ResponseFormat) else fmt
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"the reply is not JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})"
    validator = validators.validator_for(schema, default=Draft202012Validator)(schema)
    error = next(iter(validator.iter_errors(value)), None)
    return None if error is None else f"the reply does not match the schema: {error.message}"
