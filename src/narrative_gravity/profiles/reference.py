"""The profile reference, generated from the schema: each key's meaning is written once, as the
``Field(description=...)`` of its pydantic model (:mod:`.schema`, :mod:`.blocks`), and both
``docs/profiles.md`` (:func:`profile_reference`, ``ngrav profile docs``) and ``profiles/profile.schema.json``
(:func:`profile_json_schema`, ``ngrav profile schema``) are made from it. A test fails when either is stale.

>>> schema = profile_json_schema()
>>> schema["required"], schema["additionalProperties"]
(['core_semantics'], False)
>>> "| `core_semantics` |" in profile_reference()
True
"""

from __future__ import annotations

import json
import re
import types
import typing
from typing import Any, Literal

import yaml
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from .schema import TOPIC_DEFAULTS, Profile

__all__ = ["SCHEMA_FILE", "profile_json_schema", "profile_reference", "profile_schema_text"]

#: Where the published JSON Schema lives in the repository; the example profiles point at it.
SCHEMA_FILE = "profiles/profile.schema.json"

_GENERATED = (
    "<!-- Generated from src/narrative_gravity/profiles/schema.py and blocks.py by "
    "`ngrav profile docs > docs/profiles.md`; edit the Field descriptions there, not this file. -->"
)


def profile_json_schema() -> dict[str, Any]:
    """The JSON Schema of a profile (draft 2020-12), for editors that validate and complete profile files.

    It is pydantic's schema of :class:`~.schema.Profile` plus what the validator accepts beyond it: ``require``
    as a bare list of words, and a ``$schema`` key that names this schema (the profile ignores it).
    """
    schema = Profile.model_json_schema()
    out: dict[str, Any] = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "narrative-gravity profile",
        "description": "What the narrative is and how hard to pull toward it (docs/profiles.md).",
    }
    out.update({k: v for k, v in schema.items() if k not in ("title", "description")})
    props = dict(out["properties"])
    props["require"] = dict(props["require"])
    props["require"]["anyOf"] = [
        {"type": "array", "items": {"type": "string"}, "minItems": 1},
        *props["require"]["anyOf"],
    ]
    out["properties"] = {
        "$schema": {"type": "string", "description": "the JSON Schema this file follows; the profile ignores it"},
        **props,
    }
    return out


def profile_schema_text() -> str:
    """:func:`profile_json_schema` as the text of ``profiles/profile.schema.json`` (indented, one final newline)."""
    return json.dumps(profile_json_schema(), indent=2, ensure_ascii=False) + "\n"


def _rst_to_md(text: str) -> str:
    text = re.sub(r":\w+:`~?(?:[\w.]+\.)?([\w]+)`", r"`\1`", text)  # :class:`~a.b.C` -> `C`
    text = text.replace("``", "`")
    return text


def _doc(model: type[BaseModel]) -> str:
    doc = (model.__doc__ or "").strip()
    paras = [" ".join(line.strip() for line in p.splitlines()) for p in re.split(r"\n\s*\n", doc)]
    return "\n\n".join(_rst_to_md(p) for p in paras if p and not p.startswith(">>>"))


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def _blocks_of(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in typing.get_args(annotation) for m in _blocks_of(a)]


def _type(annotation: Any, links: dict[type[BaseModel], str]) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Literal:
        return " \\| ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type(a, links) for a in args if a is not type(None))
    if origin is list:
        return f"list of {_type(args[0], links)}s"
    if origin is dict:
        return f"mapping of {_type(args[0], links)} to {_type(args[1], links)}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"[block](#{links[annotation]})" if annotation in links else "block"
    return {bool: "boolean", int: "integer", float: "number", str: "string"}.get(annotation, str(annotation))


def _range(metadata: list[Any]) -> str:
    parts = []
    for m in metadata:  # pydantic's constraints (annotated_types: Ge, Gt, Le, Lt, MinLen, MaxLen)
        for attr, sign in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
            bound = getattr(m, attr, None)
            if isinstance(bound, int):
                parts.append(f"{sign} {bound:,}")
            elif isinstance(bound, float):
                parts.append(f"{sign} {bound:g}")
        if getattr(m, "min_length", None):
            parts.append(f"at least {m.min_length}")
        if getattr(m, "max_length", None) is not None:
            parts.append(f"at most {m.max_length}")
    return ", ".join(parts)


def _default(info: Any) -> str:
    if info.default_factory is not None:
        value = info.default_factory()
        return "`{}`" if isinstance(value, BaseModel) else f"`{json.dumps(value)}`"
    if info.default is PydanticUndefined:
        return "**required**"
    if info.default is None:
        return "unset"
    return f"`{json.dumps(info.default, ensure_ascii=False)}`"


def _table(model: type[BaseModel], links: dict[type[BaseModel], str]) -> list[str]:
    rows = ["| key | type | default | range | meaning |", "|---|---|---|---|---|"]
    for name, info in model.model_fields.items():
        meaning = (info.description or "").replace("|", "\\|")
        cells = [f"`{name}`", _type(info.annotation, links), _default(info), _range(info.metadata), meaning]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def _sections() -> list[tuple[str, type[BaseModel]]]:
    """``(key path, block)`` for every block a profile holds, in the order of its keys, depth first."""
    out: list[tuple[str, type[BaseModel]]] = []
    seen: set[type[BaseModel]] = set()

    def walk(prefix: str, model: type[BaseModel]) -> None:
        for name, info in model.model_fields.items():
            listed = typing.get_origin(info.annotation) is list or any(
                typing.get_origin(a) is list for a in typing.get_args(info.annotation)
            )
            for block in _blocks_of(info.annotation):
                if block not in seen:
                    seen.add(block)
                    path = f"{prefix}{name}" + ("[]" if listed else "")
                    out.append((path, block))
                    walk(path + ".", block)

    walk("", Profile)
    return out


def profile_reference() -> str:
    """``docs/profiles.md``: every key of a profile, its type, default, range and meaning, from the schema."""
    sections = _sections()
    links = {block: _anchor(f"`{path}`") for path, block in sections}
    lines = [
        _GENERATED,
        "",
        "# Profile reference",
        "",
        "A profile says what the narrative is and how hard to pull toward it. It is a JSON or YAML file (or the "
        "same mapping in a request's `gravity` field); only `core_semantics` is required. Unknown keys, wrong "
        "types and values out of range are errors that name the key, the value and the fix.",
        "",
        f"Editors validate and complete profiles with the JSON Schema [`{SCHEMA_FILE}`](../{SCHEMA_FILE}) "
        "(`ngrav profile schema`). A YAML profile points at it on its first line, "
        '`# yaml-language-server: $schema=profile.schema.json`; a JSON profile with a `"$schema"` key. '
        "Why each default is what it is, with the measurements, is in [defaults.md](defaults.md).",
        "",
        "```yaml",
        "core_semantics: [planet, orbit, galaxy]   # everything else has a default",
        "penalize: [recipe]",
        "```",
        "",
        "## The topic default",
        "",
        "A profile that leaves out `schedule` gets these settings (`TOPIC_DEFAULTS`; `profiles/topic.yaml` writes "
        "them out, and `ngrav eval --profile auto` runs them with each topic's words). `field.semantic_source` "
        "becomes `lm` for words in scripts written without spaces, and such a profile gets no `lead`. "
        "`schedule: constant` or `phases` asks for the classic pull, whose field is then `lexical` with "
        "`repeat_weight` 1.",
        "",
        "```yaml",
        yaml.safe_dump(TOPIC_DEFAULTS, sort_keys=False, allow_unicode=True).rstrip(),
        "```",
        "",
        "## Top-level keys",
        "",
        _doc(Profile),
        "",
        *_table(Profile, links),
    ]
    for path, block in sections:
        lines += ["", f"## `{path}`", "", _doc(block), "", *_table(block, links)]
    return "\n".join(lines) + "\n"
