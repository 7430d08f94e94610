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
>>> p.schedule, p.field.mode, p.field.repeat_weight, round(p.thermostat_kwargs()["max_strength"], 2)
('thermostat', 'semantic', 0.0, 3.4)
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
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from ..errors import ProfileError
from ..text import expand_keywords, has_unspaced_script

__all__ = [
    "THERMOSTAT_MAX_PER_STRENGTH",
    "TOPIC_DEFAULTS",
    "ContextLevel",
    "ConversationLevel",
    "FieldOptions",
    "Lead",
    "Phases",
    "PlanLevel",
    "Profile",
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
# (docs/benchmarks.md).
TOPIC_DEFAULTS: dict[str, Any] = {
    "schedule": "thermostat",
    "field": {"mode": "semantic", "repeat_weight": 0.0},
    "thermostat": {"max_strength": 4.25, "explore_target": 0.4, "converge_target": 0.6, "strict_target": 0.8},
    "lead": {"words": 1, "kl_budget": 0.05, "chat": False, "kl_budget_steps": 128, "late_kl_budget": 0.30},
}


# λ_max per unit of gravity_strength when `thermostat.max_strength` is left out: the topic default's 4.25 at
# the default strength 1.5.
THERMOSTAT_MAX_PER_STRENGTH = 4.25 / 1.5


# Keys whose `false` means "off" where leaving them out gives a default (the topic default's `lead`).
_OFF_BY_FALSE = frozenset({"lead"})


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans(cls, v: Any, info: ValidationInfo) -> Any:
        # Lax validation reads `true` as 1 and "2" as 2; a boolean belongs only to a key that takes one
        # (`require.force`), and a number in quotes is a slip too (a JSON or YAML profile writes numbers as numbers).
        if isinstance(v, bool) and info.field_name in _OFF_BY_FALSE:  # `lead: false` is off; `true` is no setting
            if v:
                raise ValueError("true is not a setting here; write {} for the defaults, or false for none")
            return v
        if isinstance(v, bool) and cls.model_fields[info.field_name].annotation is not bool:
            raise ValueError(f"{str(v).lower()} is a boolean, but this key does not take one; write a number")
        if isinstance(v, str) and info.field_name in _NUMERIC.get(cls.__name__, ()):
            raise ValueError(f"{v!r} is text, but this key takes a number; write it without quotes")
        return v


def _numeric_fields(model: type[BaseModel]) -> tuple[str, ...]:
    """The keys of ``model`` whose values are numbers (int or float, optional or not)."""
    out = []
    for name, info in model.model_fields.items():
        ann = info.annotation
        args = getattr(ann, "__args__", ()) or (ann,)
        if any(a in (int, float) for a in args):
            out.append(name)
    return tuple(out)


_NUMERIC: dict[str, tuple[str, ...]] = {}  # filled below, once the models exist


def _kl_budget(description: str) -> Any:
    """A KL budget field: nats a step, in (0, 10], None by default."""
    return Field(None, gt=0.0, le=10.0, description=description)


def _kl_budget_steps(description: str) -> Any:
    """A field counting the generated tokens a KL budget holds for, None by default."""
    return Field(None, ge=1, le=1_000_000, description=description)


def _clean_words(v: list[str]) -> list[str]:
    cleaned = [w.strip() for w in v]
    empty = [i for i, w in enumerate(cleaned) if not w]
    if empty:
        raise ValueError(f"entries {empty} are empty; remove them or write the word")
    return cleaned


class Phases(_Strict):
    """Multipliers on ``gravity_strength`` for the phases of the token budget."""

    explore_until: float = Field(0.2, ge=0.0, le=1.0, description="fraction of the budget spent exploring")
    strict_from: float = Field(0.8, ge=0.0, le=1.0, description="fraction of the budget where strict begins")
    explore: float = Field(0.5, ge=0.0, le=10.0)
    converge: float = Field(1.0, ge=0.0, le=10.0)
    strict: float = Field(1.5, ge=0.0, le=10.0)

    @model_validator(mode="after")
    def _ordered(self) -> Phases:
        if self.explore_until > self.strict_from:
            raise ValueError(
                f"phases.explore_until ({self.explore_until}) must not exceed phases.strict_from "
                f"({self.strict_from}); set explore_until below strict_from"
            )
        return self


class Thermostat(_Strict):
    """The thermostat schedule: per row and step, the smallest pull that reaches a target narrative mass.

    See :class:`~narrative_gravity.gravity.controllers.ThermostatController` for the rule. The target defaults were chosen
    on the ``topics-tune`` split of the topic benchmark (docs/benchmarks.md), never on its held-out words.
    """

    max_strength: float | None = Field(
        None,
        gt=0.0,
        le=50.0,
        description="λ_max; None = gravity_strength × 4.25 / 1.5 (4.25 at the default strength; capped at 50)",
    )
    explore_until: float = Field(0.2, ge=0.0, le=1.0, description="fraction of the budget spent exploring")
    strict_from: float = Field(0.8, ge=0.0, le=1.0, description="fraction of the budget where strict begins")
    explore_target: float = Field(0.4, ge=0.0, le=1.0, description="target narrative mass while exploring")
    converge_target: float = Field(0.6, ge=0.0, le=1.0, description="target narrative mass while converging")
    strict_target: float = Field(0.8, ge=0.0, le=1.0, description="target narrative mass near the end")
    drift_window: int = Field(8, ge=1, le=512, description="recent generated tokens checked for drift")
    drift_gain: float = Field(0.15, ge=0.0, le=1.0, description="target added when all recent tokens are off topic")
    drift_share: float = Field(
        0.125, gt=0.0, le=1.0, description="share of narrative tokens in the window that counts as on topic"
    )
    drift_scope: Literal["generated", "text"] = Field(
        "generated", description="drift window: generated tokens only, or the text's last tokens, prompt included"
    )
    max_target: float = Field(0.95, ge=0.0, lt=1.0, description="the target never exceeds this")
    entropy_low: float = Field(
        0.05, ge=0.0, le=1.0, description="normalized entropy at or below which a step is left alone"
    )
    entropy_high: float = Field(
        0.25, ge=0.0, le=1.0, description="normalized entropy at or above which the full target applies"
    )
    iterations: int = Field(14, ge=1, le=64, description="bits of the solver's λ grid (as many bisection steps)")
    candidates: int = Field(1024, ge=1, le=262144, description="field columns (largest |a|) used by the solver")
    kl_budget: float | None = _kl_budget(
        "the most KL (nats) the pull may cost one step: λ stops there even below the target mass; "
        "None = no limit (λ_max alone caps it)"
    )
    kl_budget_steps: int | None = _kl_budget_steps(
        "kl_budget holds for this many generated tokens, late_kl_budget after them; None = throughout"
    )
    late_kl_budget: float | None = _kl_budget(
        "the KL budget (nats a step) after kl_budget_steps tokens; None = no limit"
    )

    @model_validator(mode="after")
    def _ordered(self) -> Thermostat:
        if self.explore_until > self.strict_from:
            raise ValueError(
                f"thermostat.explore_until ({self.explore_until}) must not exceed thermostat.strict_from "
                f"({self.strict_from}); set explore_until below strict_from"
            )
        if self.entropy_low >= self.entropy_high:
            raise ValueError(
                f"thermostat.entropy_low ({self.entropy_low}) must be below thermostat.entropy_high "
                f"({self.entropy_high}); they bound the normalized entropy H/log V where the pull fades in"
            )
        return self


class FieldOptions(_Strict):
    """How the field is built: lexical surface forms, semantic neighbours, or both.

    ``mode``, ``semantic_source`` and ``repeat_weight`` left out (``None``) are filled in by the profile: the
    topic default (``semantic``, ``repeat_weight`` 0) under the thermostat, the classic lexical field with
    ``repeat_weight`` 1 under ``constant`` or ``phases``; the generator's own embeddings (``lm``) for words in
    scripts written without spaces, which MiniLM does not read, else MiniLM.
    """

    glued_weight: float = Field(0.5, ge=0.0, le=1.0, description="weight of forms without a leading space")
    first_piece_weight: float = Field(0.5, ge=0.0, le=1.0, description="weight of a multi-token word's first piece")
    max_pieces: int = Field(8, ge=1, le=32, description="longest word, in tokens, that is used")
    mode: Literal["lexical", "semantic", "hybrid"] | None = Field(
        None,
        description="lexical: the words' surface forms; semantic: embedding neighbours; hybrid: both; "
        "None = semantic under the thermostat, lexical under constant or phases",
    )
    semantic_source: Literal["minilm", "lm"] | None = Field(
        None,
        description="token embeddings: MiniLM (all-MiniLM-L6-v2) or the generator's input embeddings; None = lm "
        "for words in scripts without spaces (Chinese, Japanese, Thai, ...), else minilm",
    )
    semantic_topic: str | None = Field(
        None, min_length=1, description="a sentence describing the topic; None = the core_semantics words"
    )
    repeat_weight: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="share of its pull a narrative token keeps once the text has generated it; None = 0 under "
        "the thermostat, 1 under constant or phases",
    )
    semantic_top_k: int = Field(2000, ge=1, le=20000, description="at most this many related tokens are pulled")
    semantic_z_threshold: float = Field(2.0, ge=0.0, le=50.0, description="keep tokens this many std above the mean")
    semantic_min_value: float = Field(0.2, gt=0.0, le=1.0, description="field value of the weakest kept token")
    semantic_weight: float = Field(0.5, ge=0.0, le=1.0, description="scale of the semantic part in hybrid mode")
    neighbours: int = Field(
        0,
        ge=0,
        le=2000,
        description="semantic and hybrid modes: also pull this many whole English words nearest the topic "
        "through the lexical field, continuation pieces included (reaches words the tokenizer splits); 0 = off",
    )
    neighbours_weight: float = Field(
        0.5, gt=0.0, le=1.0, description="field value of the nearest neighbour word (the others fall to a fifth of it)"
    )
    neighbours_vocabulary: int = Field(
        40000,
        ge=1000,
        le=200000,
        description="the neighbour words are drawn from this many most frequent English words",
    )


class Require(_Strict):
    """Words the text must contain before it ends (:mod:`narrative_gravity.gravity.require`).

    The pull on a missing word's first piece rises as ``strength · progress^curve`` while the budget runs out;
    the text cannot end while a word is missing; and once the budget only just fits the missing words, they
    are forced: from ``window`` tokens before that point right after a clause ends, from ``slack`` tokens
    before it where the model starts a new word, and at the last moment anyway. ``force: false`` keeps the
    pull alone. A profile may give the words alone: ``require: [planet, orbit]``.
    """

    words: list[str] = Field(min_length=1, description="the words (or phrases) the text must contain")
    strength: float = Field(4.0, ge=0.0, le=20.0, description="λ on a missing word's first piece at the deadline")
    curve: float = Field(2.0, gt=0.0, le=10.0, description="the pull is strength × progress^curve")
    force: bool = Field(True, description="force the missing words when the budget only just fits them")
    slack: int = Field(6, ge=0, le=256, description="tokens before the deadline from which a new word may be forced")
    window: int = Field(
        24, ge=0, le=512, description="tokens before the deadline from which a word may be forced after a clause"
    )
    spread: bool = Field(
        False, description="the k-th of n words is due at (k + 1) / (n + 1) of the budget, not all at its end"
    )

    @field_validator("words")
    @classmethod
    def _words(cls, v: list[str]) -> list[str]:
        return _clean_words(v)

    @model_validator(mode="after")
    def _ordered(self) -> Require:
        if self.slack > self.window:
            raise ValueError(
                f"require.slack ({self.slack}) must not exceed require.window ({self.window}); "
                "forcing after a clause starts earlier than forcing at any new word"
            )
        return self


class Lead(_Strict):
    """A topic sentence the model reads before the prompt and the output never shows
    (:mod:`narrative_gravity.lead`): text before the prompt in plain continuation, a system message in chat.

    ``{words}`` in ``text`` becomes ``words`` of the profile's ``core_semantics``: with ``pick: central`` the
    ones nearest the MiniLM centroid of them all (in the profile's order for scripts without spaces, which
    MiniLM does not read), with ``pick: first`` the first ones. ``{required}`` becomes the words of the
    profile's ``require`` (all of them, in their order). ``lead: {}`` switches the defaults on.

    ``kl_budget``: while the sentence is read, the thermostat's pull stops at this many nats a step (the model
    already leans toward the topic, so a capped pull costs more there). Where nothing reads the sentence (a
    logits processor in a ``generate`` call of your own, a vLLM request with the profile in its
    ``extra_args``), the profile pulls as if it had no ``lead``. ``chat: false`` reads it in plain continuation
    only: in chat, the profile pulls as if it had no ``lead`` too.

    ``kl_budget_steps`` and ``late_kl_budget``: the sentence holds the opening of a text best, and is far back
    in a long one; past ``kl_budget_steps`` generated tokens the budget becomes ``late_kl_budget`` (None: no
    limit, the thermostat's full pull).
    """

    text: str | None = Field(
        None,
        min_length=1,
        max_length=1000,
        description="the sentence, '{words}' standing for the chosen words and '{required}' for the required "
        "words; None = 'The following is about {words}.' in plain continuation, 'Write about {words}.' in chat",
    )
    words: int = Field(3, ge=1, le=16, description="how many core_semantics words '{words}' names")
    pick: Literal["central", "first"] = Field(
        "central", description="central: the words nearest their own MiniLM centroid; first: the profile's order"
    )
    kl_budget: float | None = _kl_budget(
        "while the sentence is read, the thermostat's pull stops at this KL (nats a step); None = the "
        "thermostat's own kl_budget"
    )
    kl_budget_steps: int | None = _kl_budget_steps(
        "the sentence's kl_budget holds for this many generated tokens, late_kl_budget after them (the sentence "
        "is far back by then); None = throughout"
    )
    late_kl_budget: float | None = _kl_budget(
        "the thermostat's KL budget (nats a step) after kl_budget_steps tokens; None = no limit"
    )
    chat: bool = Field(True, description="also read in chat, as a system message (false: in plain continuation only)")

    @field_validator("text")
    @classmethod
    def _text(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("lead.text is blank; give a sentence, or leave it out for the default")
        return v


class ContextLevel(_Strict):
    """The context level of a request's pipeline: prune its retrieved passages to a token budget before the
    model reads them (:func:`narrative_gravity.levels.context.prune_context`; see :mod:`narrative_gravity.levels.pipeline`).

    The budget is ``budget_tokens``, or ``budget_share`` of the passages' own tokens, whichever is smaller
    (at least one of them is set; the default keeps 60% of the passages' tokens, the operating point measured
    in docs/pruning.md).
    """

    encoder: Literal["tokens", "minilm"] = Field(
        "tokens",
        description="passage embeddings: tokens (MiniLM's token table, no transformer pass: fast) or minilm "
        "(the sentence encoder: ranks a little better, costs about 2 s a request on two CPU cores)",
    )
    budget_tokens: int | None = Field(None, ge=1, le=1_000_000, description="at most this many passage tokens")
    budget_share: float | None = Field(0.6, gt=0.0, le=1.0, description="at most this share of the passages' tokens")
    lexical_weight: float = Field(0.3, ge=0.0, le=1.0, description="share of BM25 in a passage's score")
    narrative_weight: float = Field(0.3, ge=0.0, le=1.0, description="share of the profile's narrative in the score")
    cluster_threshold: float = Field(0.35, ge=0.0, le=1.0, description="cosine at which passages form one cluster")
    cluster_margin: float = Field(0.2, ge=0.0, le=2.0, description="drop clusters this far below the best one")
    mmr_lambda: float = Field(0.9, ge=0.0, le=1.0, description="relevance against novelty when picking passages")
    duplicate_threshold: float = Field(0.95, ge=0.0, le=1.0, description="cosine at which a passage is a duplicate")

    @model_validator(mode="after")
    def _some_budget(self) -> ContextLevel:
        if self.budget_tokens is None and self.budget_share is None:
            raise ValueError("context needs a budget: set budget_tokens, budget_share, or both")
        return self


class ConversationLevel(_Strict):
    """The memory level: the topic of the conversation's earlier turns joins the field
    (:class:`~narrative_gravity.levels.memory.TopicMemory`; its words become the profile's ``memory``)."""

    decay: float = Field(0.5, ge=0.0, lt=1.0, description="how much of the memory survives a turn")
    max_words: int = Field(12, ge=1, le=64, description="the most words remembered")
    answer_weight: float = Field(0.5, ge=0.0, le=1.0, description="weight of the assistant's words against the user's")


class PlanLevel(_Strict):
    """The plan level: draft outlines first, keep the best, and write stage by stage
    (:mod:`narrative_gravity.levels.plan`). Ignored when the profile writes its own ``stages``."""

    drafts: int = Field(2, ge=1, le=8, description="outline drafts sampled in one batch")
    sections: int = Field(3, ge=1, le=8, description="sections per outline (one stage each)")
    outline_tokens: int = Field(28, ge=4, le=256, description="the token budget of one draft")
    words_per_stage: int = Field(6, ge=1, le=32, description="a section's words that its stage pulls toward")


class StageSpec(_Strict):
    """One hand-written stage of a plan: the words it should cover and its share of the token budget."""

    name: str | None = Field(None, min_length=1, description="shown in traces; None = 'stage N'")
    core_semantics: list[str] = Field(min_length=1, description="the words this stage pulls toward")
    share: float | None = Field(
        None, gt=0.0, le=1.0, description="fraction of max_new_tokens; None = an equal part of what is left"
    )

    @field_validator("core_semantics")
    @classmethod
    def _words(cls, v: list[str]) -> list[str]:
        return _clean_words(v)


class Profile(_Strict):
    """A narrative profile. Only ``core_semantics`` is required."""

    name: str | None = None
    description: str | None = None
    task_type: str | None = None
    core_semantics: list[str] = Field(min_length=1)
    gravity_strength: float = Field(1.5, ge=0.0, le=20.0)
    penalize: list[str] = Field(default_factory=list)
    decay_after_steps: int | None = Field(None, ge=0)
    decay_half_life: float = Field(25.0, gt=0.0)
    schedule: Literal["constant", "phases", "thermostat"] = "thermostat"
    phases: Phases = Field(default_factory=Phases)
    thermostat: Thermostat = Field(default_factory=Thermostat)
    prune_threshold: float | None = Field(None, ge=-1.0, lt=1.0)
    field: FieldOptions = Field(default_factory=FieldOptions)
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

    @field_validator("require", mode="before")
    @classmethod
    def _require_list(cls, v: Any) -> Any:
        return {"words": v} if isinstance(v, (list, tuple)) else v

    @field_validator("core_semantics", "penalize")
    @classmethod
    def _words(cls, v: list[str]) -> list[str]:
        return _clean_words(v)

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
        if self.lead and "{required}" in (self.lead.text or "") and self.require is None:
            raise ValueError(
                "lead.text names {required}, but the profile has no `require` words; add `require: [...]` "
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

    def controller_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :class:`~narrative_gravity.gravity.controllers.PhaseScheduleController`."""
        return {
            **self.phases.model_dump(),
            "decay_after_steps": self.decay_after_steps,
            "decay_half_life": self.decay_half_life,
        }

    def thermostat_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :class:`~narrative_gravity.gravity.controllers.ThermostatController`.

        ``max_strength`` defaults to ``gravity_strength × 4.25 / 1.5`` (capped at 50): the topic default's
        λ_max 4.25 at the default strength 1.5, and proportional to the strength a user asks for.
        """
        opts = self.thermostat.model_dump()
        lam_max = opts.pop("max_strength")
        if lam_max is None:
            lam_max = min(self.gravity_strength * THERMOSTAT_MAX_PER_STRENGTH, 50.0)
        return {
            "max_strength": lam_max,
            **opts,
            "decay_after_steps": self.decay_after_steps,
            "decay_half_life": self.decay_half_life,
        }


_NUMERIC.update(
    {
        m.__name__: _numeric_fields(m)
        for m in (
            Phases,
            Thermostat,
            FieldOptions,
            StageSpec,
            Require,
            ContextLevel,
            ConversationLevel,
            PlanLevel,
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
        inner = [a for a in args if a is not type(None) and not _is_literal(a)]  # `Lead | Literal[False] | None`
        if len(inner) != 1 or not isinstance(inner[0], type) or not issubclass(inner[0], BaseModel):
            return []
        cur = inner[0]
    return list(cur.model_fields)


def _problems(exc: ValidationError) -> list[tuple[str, str]]:
    out = []
    for err in exc.errors():
        if "literal[False]" in err["loc"]:  # `lead: false`: the other branch (the mapping) tells what is wrong
            continue
        loc = tuple(p for p in err["loc"] if p != "Lead")  # the mapping branch of `lead`
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
