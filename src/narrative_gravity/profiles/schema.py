"""Profiles: what the narrative is and how hard to pull, as JSON or YAML.

The classic keys are accepted exactly as users write them::

    {"task_type": "code_generation", "core_semantics": ["binary_search", "algorithm", "array", "target"],
     "gravity_strength": 1.2, "penalize": ["restaurant", "movie", "recipe"], "decay_after_steps": 50}

A profile that leaves out ``schedule`` gets the measured topic default (:data:`TOPIC_DEFAULTS`): a semantic
field (embedding neighbours of the words; the generator's own embeddings for words in scripts without
spaces, such as Chinese), a word stops pulling once written (``repeat_weight`` 0), and the thermostat with
targets 0.4 / 0.6 / 0.8 and ``λ_max = gravity_strength × 4.25 / 1.5``. The article's keys keep their
meaning: ``gravity_strength`` sets how hard the pull may get, ``penalize`` pushes words away and
``decay_after_steps`` fades the pull. The classic constant lexical pull is asked for by name,
``"schedule": "constant"`` (or ``"phases"``), and its field then defaults to the lexical one.

Our extensions: ``schedule`` (``constant``, ``phases`` or ``thermostat``), ``phases`` (explore/converge/strict),
``thermostat`` (target narrative mass per phase, drift and entropy feedback), ``decay_half_life``,
``prune_threshold`` and ``field`` (lexical, semantic or hybrid; how surface forms are weighted). Errors name
the key, the value and the fix, and suggest the intended key for typos.

>>> p = Profile.from_mapping({"core_semantics": ["binary_search"], "gravity_strength": 1.2})
>>> p.keywords()
['binary', 'search', 'binary search']
>>> p.schedule, p.field.mode, p.field.repeat_weight
('thermostat', 'semantic', 0.0)
>>> classic = Profile.from_mapping({"core_semantics": ["binary_search"], "schedule": "constant"})
>>> classic.field.mode, classic.field.repeat_weight
('lexical', 1.0)
>>> Profile.from_mapping({"core_semantics": ["x"], "gravity_strenght": 2})
Traceback (most recent call last):
...
narrative_gravity.errors.ProfileError: profile: unknown key `gravity_strenght`; did you mean `gravity_strength`?
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from ..errors import ProfileError
from ..text import expand_keywords, has_unspaced_script
from .blocks import (
    NUMERIC_KEYS,
    ChatLead,
    ContextLevel,
    ConversationLevel,
    FieldOptions,
    HeadShortlist,
    Lead,
    Phases,
    PlanLevel,
    Prune,
    Require,
    StageSpec,
    StrictModel,
    Thermostat,
    clean_words,
    numeric_fields,
)

__all__ = [
    "THERMOSTAT_MAX_PER_STRENGTH",
    "TOPIC_DEFAULTS",
    "ChatLead",
    "ContextLevel",
    "ConversationLevel",
    "FieldOptions",
    "HeadShortlist",
    "Lead",
    "Phases",
    "PlanLevel",
    "Profile",
    "Prune",
    "Require",
    "StageSpec",
    "Thermostat",
    "load_profile",
    "profile_problems",
]

# The default topic pull, for a narrative given by nothing but topic words: what a profile without `schedule`
# gets (the model defaults below are these values), spelled out. `ngrav eval --profile auto` starts from it
# (replacing `core_semantics` by each topic's words), `profiles/topic.yaml` writes it down, and
# `plan_then_write` writes with it. A semantic field (MiniLM neighbours of the words) under the thermostat; a
# word once written stops pulling (`repeat_weight` 0), so the pull moves on through the topic; a firm
# thermostat (λ_max 4.25 at the default gravity_strength 1.5, targets 0.4 / 0.6 / 0.8). In plain continuation
# the model first reads a sentence naming the topic's central word, and while it is near the pull stops at
# 0.05 nats a step; past 128 generated tokens, where the sentence has faded, at 0.30. Chosen on the
# `topics-tune` split, the Empath tuning topics and the named tuning prompts, never on held-out words
# (docs/benchmarks.md). In chat the model reads a system message naming the three central words ("Write about
# planet, orbit and galaxy.") under the same budgets (0.05 nats a step, chosen on the chat tuning splits:
# docs/chat.md), and the 300 whole words that message itself makes likeliest join the field (`field.contrast`,
# read once per topic with the model: narrative_gravity.fields.contrast).
TOPIC_DEFAULTS: dict[str, Any] = {
    "schedule": "thermostat",
    "field": {"mode": "semantic", "repeat_weight": 0.0},
    "thermostat": {"max_strength": 4.25, "explore_target": 0.4, "converge_target": 0.6, "strict_target": 0.8},
    "lead": {
        "words": 1,
        "kl_budget": 0.05,
        "kl_budget_steps": 128,
        "late_kl_budget": 0.30,
        "chat": {"words": 3, "contrast": 300},
    },
}


# λ_max per unit of gravity_strength when `thermostat.max_strength` is left out: the topic default's 4.25 at
# the default strength 1.5.
THERMOSTAT_MAX_PER_STRENGTH = 4.25 / 1.5


class Profile(StrictModel):
    """A narrative profile. Only ``core_semantics`` is required."""

    name: str | None = Field(None, description="a label for traces, reports and the store; None = the file's stem")
    description: str | None = Field(None, description="free text for people; never read by the pull")
    task_type: str | None = Field(
        None, description="free text, e.g. code_generation or storytelling (the article's key); never read by the pull"
    )
    core_semantics: list[str] = Field(
        min_length=1,
        description="the words of the narrative; binary_search is read as binary, search and the phrase "
        "'binary search'",
    )
    gravity_strength: float = Field(
        1.5,
        ge=0.0,
        le=20.0,
        description="how hard the pull may get: the thermostat's λ_max is gravity_strength × 4.25 / 1.5 unless "
        "thermostat.max_strength is set; the λ of constant, the base of phases",
    )
    penalize: list[str] = Field(default_factory=list, description="words pushed away: they get a negative field value")
    decay_after_steps: int | None = Field(
        None, ge=0, description="after this many generated tokens the pull fades with decay_half_life; None = never"
    )
    decay_half_life: float = Field(
        25.0, gt=0.0, description="tokens over which a fading pull halves (after decay_after_steps)"
    )
    schedule: Literal["constant", "phases", "thermostat"] = Field(
        "thermostat",
        description="how λ is chosen each step: thermostat (the smallest λ that reaches a target narrative "
        "mass), constant (λ = gravity_strength, the classic pull) or phases (explore, converge, strict)",
    )
    phases: Phases = Field(default_factory=Phases, description="the phases schedule's budget split and multipliers")
    thermostat: Thermostat = Field(
        default_factory=Thermostat, description="the thermostat schedule's targets, drift and entropy feedback"
    )
    prune_threshold: float | None = Field(
        None,
        ge=-1.0,
        lt=1.0,
        description="mask the tokens whose field value is at or below this (true pruning; -0.5 drops penalized "
        "words); None = no pruning",
    )
    prune: Prune | None = Field(
        None,
        description="pruning that saves compute: {head: {shortlist: 32768}} computes logits only for a shortlist "
        "of tokens (transformers engine; see docs/shortlist.md)",
    )
    field: FieldOptions = Field(
        default_factory=FieldOptions, description="how the field over the vocabulary is built from the words"
    )
    stages: list[StageSpec] | None = Field(
        None,
        min_length=1,
        description="hand-written plan stages; the pull follows the current stage (see narrative_gravity.levels.plan)",
    )
    memory: dict[str, float] | None = Field(
        None,
        description="remembered topic words and their weights in (0, 1] (TopicMemory.words()); a lexical "
        "field of these weights joins the profile's field",
    )
    require: Require | None = Field(
        None, description="words the text must contain before it ends: a list, or {words, strength, force, ...}"
    )
    context: ContextLevel | None = Field(
        None, description="prune a request's passages to a token budget before decoding ({} for the defaults)"
    )
    conversation: ConversationLevel | None = Field(
        None, description="remember the topic of a conversation's earlier turns ({} for the defaults)"
    )
    plan: PlanLevel | None = Field(None, description="draft outlines and write stage by stage ({} for the defaults)")
    lead: Lead | Literal[False] | None = Field(
        None,
        description="a topic sentence read before the prompt, never shown in the output ({} for the defaults); "
        "left out, a thermostat profile gets the topic default's (one word, KL budget 0.05, plain continuation "
        "only); false = none",
    )

    @model_validator(mode="before")
    @classmethod
    def _schema_key(cls, data: Any) -> Any:
        # `"$schema": "profile.schema.json"` tells an editor which JSON Schema a file follows; not a setting
        if isinstance(data, dict) and isinstance(data.get("$schema"), str):
            return {k: v for k, v in data.items() if k != "$schema"}
        return data

    @field_validator("require", mode="before")
    @classmethod
    def _require_list(cls, v: Any) -> Any:
        return {"words": v} if isinstance(v, (list, tuple)) else v

    @field_validator("core_semantics", "penalize")
    @classmethod
    def _words(cls, v: list[str]) -> list[str]:
        return clean_words(v)

    @field_validator("memory")
    @classmethod
    def _memory(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is None:
            return v
        bad = {w: x for w, x in v.items() if not w.strip() or not 0.0 < x <= 1.0}
        if bad:
            raise ValueError(f"memory weights have to be in (0, 1] for non-empty words, but got {bad!r}")
        return {w.strip(): float(x) for w, x in v.items()}

    @model_validator(mode="after")
    def _fill_field(self) -> Profile:
        # The field's open choices follow the schedule (see FieldOptions); a filled-in profile dumps and
        # reloads to itself.
        fill: dict[str, Any] = {}
        topic = self.schedule == "thermostat"
        if self.field.mode is None:
            fill["mode"] = "semantic" if topic else "lexical"
        if self.field.repeat_weight is None:
            fill["repeat_weight"] = 0.0 if topic else 1.0
        if self.field.semantic_source is None:
            words = [*self.core_semantics, *(self.field.semantic_topic or "").split()]
            words += [w for s in self.stages or () for w in s.core_semantics]
            fill["semantic_source"] = "lm" if any(has_unspaced_script(w) for w in words) else "minilm"
        if fill:
            object.__setattr__(self, "field", self.field.model_copy(update=fill))
        if self.lead is None and topic and not any(has_unspaced_script(w) for w in self.core_semantics):
            # the topic default reads a topic sentence (measured in English only: none for other scripts)
            object.__setattr__(self, "lead", Lead(**TOPIC_DEFAULTS["lead"]))
        return self

    @model_validator(mode="after")
    def _lead_names_required(self) -> Profile:
        if not self.lead or self.require is not None:
            return self
        chat = self.lead.chat if not isinstance(self.lead.chat, bool) else None
        for key, text in (("lead.text", self.lead.text), ("lead.chat.text", chat.text if chat else None)):
            if "{required}" in (text or ""):
                raise ValueError(
                    f"{key} names {{required}}, but the profile has no `require` words; add `require: [...]` "
                    "or take {required} out of the sentence"
                )
        return self

    @model_validator(mode="after")
    def _stage_shares(self) -> Profile:
        if self.stages:
            given = [s.share for s in self.stages if s.share is not None]
            left_out = len(self.stages) - len(given)
            if sum(given) > 1 + 1e-9:
                raise ValueError(f"stage shares add up to {sum(given):g}, more than 1; lower them or leave some out")
            if left_out and sum(given) >= 1 - 1e-9:
                raise ValueError(
                    f"the given stage shares use the whole budget and leave nothing for the {left_out} stage(s) "
                    "without a share; lower them"
                )
        return self

    def keywords(self) -> list[str]:
        """Core words with compounds split (``binary_search`` → ``binary``, ``search``, ``binary search``)."""
        return expand_keywords(self.core_semantics)

    def penalized(self) -> list[str]:
        return expand_keywords(self.penalize)

    @classmethod
    def from_mapping(cls, data: Any, *, source: str = "profile") -> Profile:
        """Validate a mapping; every error names the key, the value and the fix."""
        if not isinstance(data, dict):
            raise ProfileError(
                f"{source}: the root must be a mapping of keys to values, but is {type(data).__name__}; "
                'write e.g. {"core_semantics": ["orbit", "planet"]}'
            )
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ProfileError(_explain(exc, source)) from None


NUMERIC_KEYS.update(
    {
        m.__name__: numeric_fields(m)
        for m in (
            Phases,
            Thermostat,
            FieldOptions,
            StageSpec,
            Require,
            Lead,
            ChatLead,
            ContextLevel,
            ConversationLevel,
            PlanLevel,
            HeadShortlist,
            Prune,
            Profile,
        )
    }
)

_FIXES = {
    "missing": "add it",
    "list_type": 'write a list, e.g. ["orbit", "planet"]',
    "float_parsing": "write a number",
    "int_parsing": "write a whole number",
    "literal_error": "use one of the allowed values",
    "greater_than_equal": "raise the value",
    "greater_than": "raise the value",
    "less_than_equal": "lower the value",
    "less_than": "lower the value",
    "too_short": "add at least one entry",
}


def _is_literal(a: Any) -> bool:
    return getattr(a, "__origin__", None) is Literal


def _allowed_keys(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    cur: Any = model
    for part in loc[:-1]:
        info = cur.model_fields.get(part) if isinstance(part, str) else None
        if info is None:
            return []
        args = getattr(info.annotation, "__args__", ()) or (info.annotation,)
        # `Lead | Literal[False] | None`, `bool | ChatLead`
        inner = [a for a in args if a not in (type(None), bool) and not _is_literal(a)]
        if len(inner) != 1 or not isinstance(inner[0], type) or not issubclass(inner[0], BaseModel):
            return []
        cur = inner[0]
    return list(cur.model_fields)


def _problems(exc: ValidationError) -> list[tuple[str, str]]:
    out = []
    for err in exc.errors():
        if "literal[False]" in err["loc"]:  # `lead: false`: the other branch (the mapping) tells what is wrong
            continue
        if err["loc"][-1:] == ("bool",) and isinstance(err.get("input"), dict):  # `lead.chat: {...}`: the mapping
            continue  # branch tells what is wrong
        loc = tuple(p for p in err["loc"] if p not in ("Lead", "ChatLead"))  # the mapping branches
        if loc == ("lead",) and err["type"] == "model_type":
            out.append(
                (
                    "lead",
                    f"`lead` (got {err.get('input')!r}): write {{}} for the defaults, a mapping of its "
                    "settings, or false for none",
                )
            )
            continue
        key = ".".join(str(p) for p in loc)
        shown = key or "(root)"
        if err["type"] == "extra_forbidden":
            allowed = _allowed_keys(Profile, loc)
            guess = difflib.get_close_matches(str(loc[-1]), allowed, n=1, cutoff=0.6)
            hint = f"did you mean `{guess[0]}`?" if guess else f"allowed keys are: {', '.join(allowed)}"
            out.append((key, f"unknown key `{shown}`; {hint}"))
            continue
        msg = err["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        fix = _FIXES.get(err["type"], "")
        value = "" if err["type"] == "missing" else f" (got {err.get('input')!r})"
        out.append((key, f"`{shown}`{value}: {msg}" + (f"; {fix}" if fix and fix not in msg else "")))
    return out


def profile_problems(data: Any) -> list[tuple[str, str]]:
    """Every problem of a profile mapping as ``(key path, message)``; empty when it is valid.

    The key path is dotted (``"thermostat.max_strength"``, ``"stages.0.share"``), ``""`` for the whole profile.

    >>> profile_problems({"core_semantics": ["orbit"], "thermostat": {"max_strength": 99}})
    [('thermostat.max_strength', '`thermostat.max_strength` (got 99): Input should be less than or equal to 50; lower the value')]
    >>> profile_problems({"core_semantics": ["orbit"]})
    []
    """
    if not isinstance(data, dict):
        return [("", f"the profile must be a mapping of keys to values, but is {type(data).__name__}")]
    try:
        Profile.model_validate(data)
    except ValidationError as exc:
        return _problems(exc)
    return []


def _explain(exc: ValidationError, source: str) -> str:
    lines = [line for _, line in _problems(exc)]
    head = f"{source}: " if len(lines) == 1 else f"{source}: {len(lines)} problems:\n  - "
    return head + "\n  - ".join(lines)


def load_profile(path: str | Path) -> Profile:
    """Load a profile from a ``.json``, ``.yaml`` or ``.yml`` file."""
    p = Path(path)
    if not p.exists():
        raise ProfileError(f"profile file {str(p)!r} does not exist; check the path (see profiles/ for examples)")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ProfileError(f"profile file {str(p)!r} cannot be read as UTF-8 text: {exc}") from None
    try:
        if p.suffix.lower() in (".yaml", ".yml"):
            data = yaml.safe_load(text)
        elif p.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            raise ProfileError(f"profile file {str(p)!r} must end in .json, .yaml or .yml")
    except (json.JSONDecodeError, Exception) as exc:
        if isinstance(exc, ProfileError):
            raise
        raise ProfileError(f"{p}: not valid {p.suffix[1:].upper()}: {exc}") from None
    profile = Profile.from_mapping(data, source=str(p))
    if profile.name is None:
        profile = profile.model_copy(update={"name": p.stem})
    return profile
