"""The blocks of a profile: ``phases``, ``thermostat``, ``field``, ``require``, ``lead``, the levels (``context``,
``conversation``, ``plan``) and hand-written ``stages``; :class:`~narrative_gravity.profiles.schema.Profile` holds
them. Every block is strict (unknown keys, booleans for numbers and numbers in quotes are errors) and frozen.

>>> Thermostat(explore_until=0.9, strict_from=0.5)  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
pydantic_core._pydantic_core.ValidationError: 1 validation error for Thermostat
...
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

__all__ = [
    "ChatLead",
    "ContextLevel",
    "ConversationLevel",
    "FieldOptions",
    "Lead",
    "Phases",
    "PlanLevel",
    "Require",
    "StageSpec",
    "Thermostat",
]


# Keys whose `false` means "off" where leaving them out gives a default (the topic default's `lead`).
_OFF_BY_FALSE = frozenset({"lead"})


class StrictModel(BaseModel):
    """A profile block: unknown keys, booleans for numbers and numbers in quotes are errors; frozen."""

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
        if isinstance(v, bool) and not _takes_bool(cls.model_fields[info.field_name].annotation):
            raise ValueError(f"{str(v).lower()} is a boolean, but this key does not take one; write a number")
        if isinstance(v, str) and info.field_name in NUMERIC_KEYS.get(cls.__name__, ()):
            raise ValueError(f"{v!r} is text, but this key takes a number; write it without quotes")
        return v


def _takes_bool(annotation: Any) -> bool:
    """Whether a field annotated ``annotation`` takes a boolean: ``bool`` itself or a union with it
    (``lead.chat: bool | ChatLead``)."""
    return annotation is bool or bool in getattr(annotation, "__args__", ())


def numeric_fields(model: type[BaseModel]) -> tuple[str, ...]:
    """The keys of ``model`` whose values are numbers (int or float, optional or not)."""
    out = []
    for name, info in model.model_fields.items():
        ann = info.annotation
        args = getattr(ann, "__args__", ()) or (ann,)
        if any(a in (int, float) for a in args):
            out.append(name)
    return tuple(out)


NUMERIC_KEYS: dict[str, tuple[str, ...]] = {}  # filled below, once the models exist


def _kl_budget(description: str) -> Any:
    """A KL budget field: nats a step, in (0, 10], None by default."""
    return Field(None, gt=0.0, le=10.0, description=description)


def _kl_budget_steps(description: str) -> Any:
    """A field counting the generated tokens a KL budget holds for, None by default."""
    return Field(None, ge=1, le=1_000_000, description=description)


def clean_words(v: list[str]) -> list[str]:
    cleaned = [w.strip() for w in v]
    empty = [i for i, w in enumerate(cleaned) if not w]
    if empty:
        raise ValueError(f"entries {empty} are empty; remove them or write the word")
    return cleaned


class Phases(StrictModel):
    """Multipliers on ``gravity_strength`` for the phases of the token budget."""

    explore_until: float = Field(0.2, ge=0.0, le=1.0, description="fraction of the budget spent exploring")
    strict_from: float = Field(0.8, ge=0.0, le=1.0, description="fraction of the budget where strict begins")
    explore: float = Field(0.5, ge=0.0, le=10.0, description="λ = gravity_strength × this while exploring")
    converge: float = Field(1.0, ge=0.0, le=10.0, description="λ = gravity_strength × this while converging")
    strict: float = Field(1.5, ge=0.0, le=10.0, description="λ = gravity_strength × this near the end")

    @model_validator(mode="after")
    def _ordered(self) -> Phases:
        if self.explore_until > self.strict_from:
            raise ValueError(
                f"phases.explore_until ({self.explore_until}) must not exceed phases.strict_from "
                f"({self.strict_from}); set explore_until below strict_from"
            )
        return self


class Thermostat(StrictModel):
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


class ContrastOptions(StrictModel):
    """A field from a sentence's own effect on the model (:mod:`narrative_gravity.fields.contrast`): the ``top``
    whole words whose log-probability the sentence raises most, over ``positions`` tokens of neutral answers.
    A profile's ``lead.contrast`` sets it from the lead's sentence. It reads the generator (on vLLM, a CPU copy of
    the served checkpoint).
    """

    sentence: str = Field(min_length=1, max_length=1000, description="the sentence whose contrast is read")
    raw: bool = Field(False, description="read it before plain text (true) or as a system message (false)")
    top: int = Field(100, ge=1, le=5000, description="how many whole-word tokens of largest contrast are pulled")
    positions: int = Field(24, ge=1, le=256, description="answer tokens the contrast is averaged over")


class FieldOptions(StrictModel):
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
    contrast: ContrastOptions | None = Field(
        None, description="also pull toward a sentence's own contrast (max of the two; needs the model); None = off"
    )


class Require(StrictModel):
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
        return clean_words(v)

    @model_validator(mode="after")
    def _ordered(self) -> Require:
        if self.slack > self.window:
            raise ValueError(
                f"require.slack ({self.slack}) must not exceed require.window ({self.window}); "
                "forcing after a clause starts earlier than forcing at any new word"
            )
        return self


class ChatLead(StrictModel):
    """The lead's settings in chat (``lead.chat``), where they differ from plain continuation: a system message
    is read differently from a sentence before a text's opening. Keys left out (None) are the lead's own.

    >>> ChatLead(words=3, kl_budget=0.12).text is None
    True
    """

    text: str | None = Field(
        None,
        min_length=1,
        max_length=1000,
        description="the system message ('{words}', '{required}'); None = the lead's",
    )
    words: int | None = Field(
        None, ge=1, le=16, description="how many core_semantics words it names; None = the lead's"
    )
    kl_budget: float | None = _kl_budget("the pull's KL budget (nats a step) in chat; None = the lead's")
    kl_budget_steps: int | None = _kl_budget_steps("tokens the chat kl_budget holds for; None = the lead's")
    late_kl_budget: float | None = _kl_budget("the KL budget after kl_budget_steps in chat; None = the lead's")
    contrast: int | None = Field(None, ge=0, le=5000, description="the contrast's words in chat; None = the lead's")

    @field_validator("text")
    @classmethod
    def _text(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("lead.chat.text is blank; give a sentence, or leave it out for the lead's")
        return v


class Lead(StrictModel):
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

    ``chat``: ``true`` reads the same sentence in chat, as a system message; ``false`` reads none there; a
    :class:`ChatLead` reads one with its own settings (keys it leaves out are the lead's). :meth:`in_mode`
    gives the settings that hold in one mode.

    >>> lead = Lead(words=1, kl_budget=0.05, chat={"words": 3, "kl_budget": 0.12})
    >>> chat = lead.in_mode(raw=False)
    >>> (chat.words, chat.kl_budget), (lead.in_mode(raw=True).words, lead.in_mode(raw=True).kl_budget)
    ((3, 0.12), (1, 0.05))
    >>> Lead(chat=False).in_mode(raw=False) is None
    True
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
    contrast: int = Field(
        0,
        ge=0,
        le=5000,
        description="this many whole words the sentence itself makes likelier join the field (field.contrast, "
        "read with the model); 0 = off",
    )
    chat: bool | ChatLead = Field(
        True,
        description="in chat, as a system message: true = the same sentence and settings; false = no sentence in "
        "chat; an object = its own settings there (text, words, kl_budget, kl_budget_steps, late_kl_budget; "
        "keys left out are the lead's)",
    )

    @field_validator("chat", mode="before")
    @classmethod
    def _chat(cls, v: Any) -> Any:
        if not isinstance(v, (bool, dict, ChatLead)):
            raise ValueError(
                'lead.chat takes true, false or a mapping of its chat settings; e.g. {"words": 3, "kl_budget": 0.12}'
            )
        return v

    def in_mode(self, *, raw: bool) -> Lead | None:
        """The lead as read in plain continuation (``raw``) or in chat, or ``None`` where none is read."""
        if raw or self.chat is True:
            return self
        if self.chat is False:
            return None
        update = {k: v for k, v in self.chat.model_dump().items() if v is not None}
        return self.model_copy(update={**update, "chat": True})

    @field_validator("text")
    @classmethod
    def _text(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("lead.text is blank; give a sentence, or leave it out for the default")
        return v


class ContextLevel(StrictModel):
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


class ConversationLevel(StrictModel):
    """The memory level: the topic of the conversation's earlier turns joins the field
    (:class:`~narrative_gravity.levels.memory.TopicMemory`; its words become the profile's ``memory``)."""

    decay: float = Field(0.5, ge=0.0, lt=1.0, description="how much of the memory survives a turn")
    max_words: int = Field(12, ge=1, le=64, description="the most words remembered")
    answer_weight: float = Field(0.5, ge=0.0, le=1.0, description="weight of the assistant's words against the user's")


class PlanLevel(StrictModel):
    """The plan level: draft outlines first, keep the best, and write stage by stage
    (:mod:`narrative_gravity.levels.plan`). Ignored when the profile writes its own ``stages``."""

    drafts: int = Field(2, ge=1, le=8, description="outline drafts sampled in one batch")
    sections: int = Field(3, ge=1, le=8, description="sections per outline (one stage each)")
    outline_tokens: int = Field(28, ge=4, le=256, description="the token budget of one draft")
    words_per_stage: int = Field(6, ge=1, le=32, description="a section's words that its stage pulls toward")


class StageSpec(StrictModel):
    """One hand-written stage of a plan: the words it should cover and its share of the token budget."""

    name: str | None = Field(None, min_length=1, description="shown in traces; None = 'stage N'")
    core_semantics: list[str] = Field(min_length=1, description="the words this stage pulls toward")
    share: float | None = Field(
        None, gt=0.0, le=1.0, description="fraction of max_new_tokens; None = an equal part of what is left"
    )

    @field_validator("core_semantics")
    @classmethod
    def _words(cls, v: list[str]) -> list[str]:
        return clean_words(v)


class HeadShortlist(StrictModel):
    """Compute the output head only for a shortlist of tokens (:mod:`narrative_gravity.engines.shortlist`).

    The shortlist is the ``shortlist`` most frequent tokens of the model's own frequency list (packaged for the
    shipped models, or built with ``ngrav shortlist build``), plus the request's narrative support (field
    tokens, required words, stage words) and the special and stop tokens. Every other logit is ``-inf``: those
    tokens are never written. Transformers engine only.
    """

    shortlist: int = Field(ge=256, le=1_048_576, description="how many of the most frequent tokens to keep")
    audit: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="the share of steps on which the full head runs too, to measure the probability mass the "
        "shortlist cut (0 = off)",
    )
    file: str | None = Field(
        None, description="a frequency list from `ngrav shortlist build`; left out, the model's packaged list"
    )


class Prune(StrictModel):
    """Pruning that saves compute: ``head`` computes logits only for a shortlist of tokens."""

    head: HeadShortlist | None = Field(None, description="the shortlist head: {shortlist: 32768}")
