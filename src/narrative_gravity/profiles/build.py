"""From a profile to the kernel's :class:`~narrative_gravity.gravity.kernel.Program`: the field (built once per
profile and tokenizer, and cached), the schedule, the stages and the required words. Every engine builds its rows
from :func:`program_from_profile`; nothing here knows an engine.

Stages (hand-written in a profile, or the sections of a drafted outline) compile here too: :func:`parse_stages`
checks them and :func:`stage_plan` gives each a lexical field of its words (:class:`Stage` →
:class:`~narrative_gravity.gravity.stages.StagePlan`).

>>> from narrative_gravity.profiles.schema import Profile
>>> controller_from_profile(Profile(core_semantics=["orbit"], schedule="constant", gravity_strength=2.0))
ConstantController(2.0)
>>> controller_from_profile(Profile(core_semantics=["orbit"], gravity_strength=3.0))  # the topic default
ThermostatController(max_strength=8.5)
>>> [s.share for s in parse_stages([{"name": "a", "core_semantics": ["x"], "share": 0.25},
...                                {"name": "b", "core_semantics": ["y"]}])]
[0.25, 0.75]
"""

from __future__ import annotations

import json
import weakref
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigurationError
from ..fields import NarrativeField, combine_fields
from ..fields.contrast import build_contrast_field
from ..fields.lexical import build_lexical_field, reach, surface_forms, weighted_lexical_field
from ..fields.neighbours import neighbour_words
from ..fields.required import RequirementOptions, build_requirement
from ..fields.semantic import SemanticSettings, build_semantic_field
from ..gravity.controllers import (
    ConstantController,
    DecayOptions,
    PhaseScheduleController,
    ScheduleController,
    ThermostatController,
    ThermostatOptions,
)
from ..gravity.field import merge_fields
from ..gravity.kernel import Program
from ..gravity.require import Requirement
from ..gravity.stages import StagePlan
from .blocks import FieldOptions
from .schema import THERMOSTAT_MAX_PER_STRENGTH, Profile

__all__ = [
    "FIELD_CACHE_SIZE",
    "Stage",
    "build_stage_fields",
    "controller_from_profile",
    "decay_options",
    "field_from_profile",
    "parse_stages",
    "phase_args",
    "program_from_profile",
    "requirement_from_profile",
    "stage_plan",
    "thermostat_args",
]

# Most recently used last. Entries hold the tokenizer (and a weak reference to the model) they were built for: an ``id`` alone can be
# reused by a new object once the old one is gone.
_FIELD_CACHE: OrderedDict[tuple[str, int, int, int], tuple[Any, Any, NarrativeField]] = OrderedDict()
FIELD_CACHE_SIZE = 32


def field_from_profile(profile: Profile, tokenizer: Any, *, model: Any = None) -> NarrativeField:
    """The field of a profile for a tokenizer, built once and cached in memory.

    ``field.mode`` picks it: ``lexical`` (the words' surface forms), ``semantic`` (embedding neighbours of
    the topic, see :func:`~narrative_gravity.fields.build_semantic_field`) or ``hybrid`` (both, combined
    with :func:`~narrative_gravity.fields.combine_fields`; penalized words stay negative). The semantic
    source ``lm`` reads the generator's input embeddings and needs ``model``; ``minilm`` does not.
    """
    opts = profile.field
    semantic = opts.mode in ("semantic", "hybrid")
    if semantic and opts.semantic_source == "lm" and model is None:
        raise ConfigurationError(
            f"field.mode={opts.mode!r} with field.semantic_source='lm' reads the generator's input embeddings; "
            "pass model= (the model you generate with), or set field.semantic_source to 'minilm'"
        )
    words = _Words.of(profile)
    spec = json.dumps(
        {"core": words.core, "penalize": words.avoid, "field": opts.model_dump(), "memory": profile.memory},
        sort_keys=True,
    )
    reads_model = (semantic and opts.semantic_source == "lm") or opts.contrast is not None
    model_key = id(model) if reads_model else 0
    key = (spec, id(tokenizer), len(tokenizer), model_key)
    hit = _FIELD_CACHE.get(key)
    if hit is not None and hit[0] is tokenizer and (model_key == 0 or hit[1]() is model):
        _FIELD_CACHE.move_to_end(key)
        return hit[2]
    built = _build_field(words, opts, tokenizer, model)
    if profile.memory:
        remembered = weighted_lexical_field(tokenizer, profile.memory, name="memory")
        if remembered is not None:
            built = merge_fields([built, remembered], name=built.name)
    # The model is held weakly: the cache must not keep a generator in memory.
    _FIELD_CACHE[key] = (tokenizer, weakref.ref(model) if model_key else None, built)
    while len(_FIELD_CACHE) > FIELD_CACHE_SIZE:
        _FIELD_CACHE.popitem(last=False)
    return built


@dataclass(frozen=True)
class _Words:
    """A profile's words, expanded once: the narrative's, those pushed away, and the topic a semantic field reads."""

    core: list[str]
    avoid: list[str]
    topic: list[str] | str
    name: str

    @classmethod
    def of(cls, profile: Profile) -> _Words:
        core = profile.keywords()
        topic = profile.field.semantic_topic
        return cls(core, profile.penalized(), topic if topic is not None else core, profile.name or "profile")


def _build_field(words: _Words, opts: FieldOptions, tokenizer: Any, model: Any) -> NarrativeField:
    built = _words_field(words, opts, tokenizer, model)
    if opts.contrast is None:
        return built
    c = opts.contrast  # the sentence's own contrast: max of the two
    contrast = build_contrast_field(model, tokenizer, c.sentence, raw=c.raw, top=c.top, positions=c.positions)
    return merge_fields([built, contrast], name=built.name)


def _words_field(words: _Words, opts: FieldOptions, tokenizer: Any, model: Any) -> NarrativeField:
    lexical = None
    if opts.mode in ("lexical", "hybrid") or words.avoid:
        lexical = build_lexical_field(
            tokenizer,
            words.core,
            words.avoid,
            glued_weight=opts.glued_weight,
            first_piece_weight=opts.first_piece_weight,
            max_pieces=opts.max_pieces,
            name=words.name,
        )
    if opts.mode == "lexical":
        return lexical
    semantic = build_semantic_field(
        tokenizer,
        words.topic,
        source=opts.semantic_source,
        model=model,
        settings=SemanticSettings.of(opts),
        name=words.name,
    )
    if lexical is None:
        built = semantic
    elif opts.mode == "hybrid":
        built = combine_fields(lexical, semantic, weight=opts.semantic_weight)
    else:  # semantic mode: the semantic pull plus only the penalties of the lexical field
        built = combine_fields(lexical, semantic, weight=1.0, lexical_positive=False)
    if opts.neighbours:
        built = _with_neighbours(words, opts, tokenizer, built)
    return built


def _with_neighbours(words: _Words, opts: FieldOptions, tokenizer: Any, built: NarrativeField) -> NarrativeField:
    """``built`` with the ``field.neighbours`` whole words nearest the topic pulled lexically (max of the two)."""
    near_words = neighbour_words(
        words.topic, count=opts.neighbours, vocabulary=opts.neighbours_vocabulary, exclude=words.avoid, progress=False
    )
    near = weighted_lexical_field(
        tokenizer,
        {w: x * opts.neighbours_weight for w, x in near_words.items()},
        name="neighbours",
        glued_weight=opts.glued_weight,
        first_piece_weight=opts.first_piece_weight,
        max_pieces=opts.max_pieces,
    )
    return built if near is None else merge_fields([built, near], name=built.name)


_REQUIRE_CACHE: OrderedDict[tuple[str, int, int], tuple[Any, Requirement]] = OrderedDict()


def requirement_from_profile(profile: Profile, tokenizer: Any) -> Requirement | None:
    """The profile's ``require`` for a tokenizer (:func:`~narrative_gravity.fields.required.build_requirement`),
    built once and cached in memory; ``None`` without ``require``. Raises a
    :class:`~narrative_gravity.errors.FieldError` naming a word the tokenizer cannot write."""
    if profile.require is None:
        return None
    spec = profile.require.model_dump_json()
    key = (spec, id(tokenizer), len(tokenizer))
    hit = _REQUIRE_CACHE.get(key)
    if hit is not None and hit[0] is tokenizer:
        _REQUIRE_CACHE.move_to_end(key)
        return hit[1]
    opts = profile.require
    built = build_requirement(tokenizer, opts.words, RequirementOptions(**opts.model_dump(exclude={"words"})))
    _REQUIRE_CACHE[key] = (tokenizer, built)
    while len(_REQUIRE_CACHE) > FIELD_CACHE_SIZE:
        _REQUIRE_CACHE.popitem(last=False)
    return built


def controller_from_profile(profile: Profile) -> ScheduleController:
    """``constant`` gives a :class:`ConstantController` (a :class:`PhaseScheduleController` with flat phases when
    the pull decays), ``phases`` a :class:`PhaseScheduleController`, ``thermostat`` a :class:`ThermostatController`.
    In the kernel the thermostat reads drift through the base values of each row's field (its current stage's,
    with ``stages``)."""
    if profile.schedule == "thermostat":
        return ThermostatController(**thermostat_args(profile))
    if profile.schedule == "constant" and profile.decay_after_steps is None:
        return ConstantController(profile.gravity_strength)
    return PhaseScheduleController(profile.gravity_strength, **phase_args(profile))


def decay_options(profile: Profile) -> DecayOptions:
    """The profile's fade (``decay_after_steps``, ``decay_half_life``)."""
    return DecayOptions(after_steps=profile.decay_after_steps, half_life=profile.decay_half_life)


def phase_args(profile: Profile) -> dict[str, Any]:
    """The keyword arguments of :class:`~narrative_gravity.gravity.controllers.PhaseScheduleController` for a profile
    (``constant``: one flat phase, for a pull that decays)."""
    flat = {"explore": 1.0, "converge": 1.0, "strict": 1.0}
    phases = flat if profile.schedule == "constant" else profile.phases.model_dump()
    return {**phases, "decay": decay_options(profile)}


def thermostat_args(profile: Profile) -> dict[str, Any]:
    """The arguments of :class:`~narrative_gravity.gravity.controllers.ThermostatController` for a profile:
    ``max_strength``, ``options`` (a :class:`~narrative_gravity.gravity.controllers.ThermostatOptions` of the
    ``thermostat`` block) and ``decay``.

    ``max_strength`` defaults to ``gravity_strength × 4.25 / 1.5`` (capped at 50): the topic default's λ_max 4.25
    at the default strength 1.5, and proportional to the strength a user asks for.

    >>> round(thermostat_args(Profile.from_mapping({"core_semantics": ["x"], "gravity_strength": 1.2}))["max_strength"], 2)
    3.4
    """
    opts = profile.thermostat.model_dump()
    lam_max = opts.pop("max_strength")
    if lam_max is None:
        lam_max = min(profile.gravity_strength * THERMOSTAT_MAX_PER_STRENGTH, 50.0)
    return {"max_strength": lam_max, "options": ThermostatOptions(**opts), "decay": decay_options(profile)}


# --------------------------------------------------------------------------------------------------
# stages


@dataclass(frozen=True)
class Stage:
    """One section of a plan: a name, the words it should cover, and its share of the token budget."""

    name: str
    core_semantics: list[str]
    share: float

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "core_semantics": list(self.core_semantics), "share": round(self.share, 4)}


def parse_stages(stages: Sequence[Mapping[str, Any] | Stage]) -> list[Stage]:
    """Validate hand-written stages; shares left out split what the given shares leave, equally.

    Each entry needs ``core_semantics`` (a non-empty list of words); ``name`` defaults to ``stage N``;
    ``share`` is a fraction in ``(0, 1]``. Shares that add up to more than 1 are an error.
    """
    if isinstance(stages, (str, bytes)) or not isinstance(stages, Sequence) or not stages:
        raise ConfigurationError(
            f"`stages` has to be a non-empty list of {{name, core_semantics, share}} mappings, but is {stages!r}"
        )
    names, words, shares = [], [], []
    for i, s in enumerate(stages):
        if isinstance(s, Stage):
            s = s.to_json()
        if not isinstance(s, Mapping):
            raise ConfigurationError(f"stages[{i}] has to be a mapping, but is {type(s).__name__}")
        extra = set(s) - {"name", "core_semantics", "share"}
        if extra:
            raise ConfigurationError(
                f"stages[{i}] has unknown keys {sorted(extra)}; allowed are name, core_semantics, share"
            )
        ws = s.get("core_semantics")
        if isinstance(ws, str) or not isinstance(ws, Sequence) or not [w for w in ws if str(w).strip()]:
            raise ConfigurationError(f"stages[{i}].core_semantics has to be a non-empty list of words, but is {ws!r}")
        share = s.get("share")
        if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1):
            raise ConfigurationError(f"stages[{i}].share has to be a number in (0, 1], but is {share!r}")
        names.append(str(s.get("name") or f"stage {i + 1}"))
        words.append([str(w).strip() for w in ws if str(w).strip()])
        shares.append(None if share is None else float(share))
    given = sum(x for x in shares if x is not None)
    if given > 1 + 1e-9:
        raise ConfigurationError(f"stage shares add up to {given:g}, more than 1; lower them or leave some out")
    missing = [i for i, x in enumerate(shares) if x is None]
    rest = (1.0 - given) / len(missing) if missing else 0.0
    if missing and rest <= 0:
        raise ConfigurationError(
            "the given stage shares use the whole budget and leave nothing for stages without a share"
        )
    return [Stage(n, w, x if x is not None else rest) for n, w, x in zip(names, words, shares)]


def build_stage_fields(tokenizer: Any, stages: Sequence[Stage], **kwargs: Any) -> list[NarrativeField]:
    """One lexical field per stage, from the stage's reachable words (``kwargs`` go to
    :func:`~narrative_gravity.fields.build_lexical_field`). A stage with no reachable word gets a zero field."""
    out = []
    for s in stages:
        ok, _ = reach(tokenizer, s.core_semantics, max_pieces=kwargs.get("max_pieces", 8))
        if ok:
            out.append(build_lexical_field(tokenizer, ok, name=s.name, **kwargs))
        else:
            out.append(NarrativeField(values=torch.zeros(kwargs.get("vocab_size") or len(tokenizer)), name=s.name))
    return out


def stage_plan(
    tokenizer: Any,
    stages: Sequence[Stage] | Sequence[Mapping[str, Any]],
    *,
    base: NarrativeField | None = None,
    base_weight: float = 1.0,
    cover_fraction: float = 0.5,
) -> StagePlan:
    """The kernel's :class:`~narrative_gravity.gravity.stages.StagePlan` of ``stages`` for ``tokenizer``.

    Each stage gets a lexical field of its reachable words (:func:`build_stage_fields`) and the token ids
    of their surface forms, so that a row moves on once it has written ``cover_fraction`` of them. ``base``
    is a field every stage keeps under its own (for example the semantic field of the whole prompt): each
    stage's positive values become ``max(stage, base_weight × base)``, its penalties win
    (:func:`~narrative_gravity.fields.combine_fields`).
    """
    parsed = parse_stages(stages)
    fields = build_stage_fields(tokenizer, parsed)
    if base is not None:
        fields = [combine_fields(f, base, weight=base_weight) for f in fields]
    words = []
    for s in parsed:
        ok, _ = reach(tokenizer, s.core_semantics, max_pieces=8)
        words.append(tuple(tuple(tuple(f) for f in surface_forms(tokenizer, w)) for w in ok))
    return StagePlan(
        fields=tuple(fields),
        shares=tuple(s.share for s in parsed),
        words=tuple(words),
        cover_fraction=cover_fraction,
        names=tuple(s.name for s in parsed),
    )


def program_from_profile(
    profile: Profile,
    tokenizer: Any,
    *,
    model: Any = None,
    key: str = "",
    controller: ScheduleController | None = None,
) -> Program:
    """The kernel's :class:`~narrative_gravity.gravity.kernel.Program` for a profile: its field (or stages),
    its schedule, ``repeat_weight``, ``prune_threshold`` and ``require``. Every engine builds its rows from this.

    ``controller``: the profile's :func:`controller_from_profile`, when the caller has built it already.
    """
    field = field_from_profile(profile, tokenizer, model=model)
    controller = controller if controller is not None else controller_from_profile(profile)
    stages = None
    if profile.stages:
        stages = stage_plan(tokenizer, [s.model_dump(exclude_none=True) for s in profile.stages])
    return Program(
        field=field,
        stages=stages,
        schedule=controller.schedule(1)[0],  # a profile has one base strength
        repeat_weight=profile.field.repeat_weight,
        prune_threshold=profile.prune_threshold,
        requirement=requirement_from_profile(profile, tokenizer),
        key=key,
    )
