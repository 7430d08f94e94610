"""From a profile to a ready processor: build the field once per (profile, tokenizer) and pick the controller.

>>> from narrative_gravity.profiles.schema import Profile
>>> controller_from_profile(Profile(core_semantics=["orbit"], schedule="constant", gravity_strength=2.0))
ConstantController(2.0)
>>> controller_from_profile(Profile(core_semantics=["orbit"], gravity_strength=3.0))  # the topic default
ThermostatController(max_strength=8.5)
"""

from __future__ import annotations

import json
import weakref
from collections import OrderedDict
from typing import Any

from ..engines.hf import NarrativeGravityLogitsProcessor
from ..errors import ConfigurationError
from ..fields import NarrativeField
from ..fields.lexical import weighted_lexical_field
from ..gravity.controllers import ConstantController, PhaseScheduleController, ScheduleController, ThermostatController
from ..gravity.field import merge_fields
from ..gravity.kernel import Program
from ..gravity.require import Requirement
from ..gravity.thermo import Trace
from ..levels.plan import stage_plan
from .schema import Profile

__all__ = [
    "controller_from_profile",
    "field_from_profile",
    "processor_from_profile",
    "program_from_profile",
    "requirement_from_profile",
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
    spec = json.dumps(
        {
            "core": profile.keywords(),
            "penalize": profile.penalized(),
            "field": opts.model_dump(),
            "memory": profile.memory,
        },
        sort_keys=True,
    )
    model_key = id(model) if semantic and opts.semantic_source == "lm" else 0
    key = (spec, id(tokenizer), len(tokenizer), model_key)
    hit = _FIELD_CACHE.get(key)
    if hit is not None and hit[0] is tokenizer and (model_key == 0 or hit[1]() is model):
        _FIELD_CACHE.move_to_end(key)
        return hit[2]
    built = _build_field(profile, tokenizer, model)
    if profile.memory:
        remembered = weighted_lexical_field(tokenizer, profile.memory, name="memory")
        if remembered is not None:
            built = merge_fields([built, remembered], name=built.name)
    # The model is held weakly: the cache must not keep a generator in memory.
    _FIELD_CACHE[key] = (tokenizer, weakref.ref(model) if model_key else None, built)
    while len(_FIELD_CACHE) > FIELD_CACHE_SIZE:
        _FIELD_CACHE.popitem(last=False)
    return built


def _build_field(profile: Profile, tokenizer: Any, model: Any) -> NarrativeField:
    from ..fields.lexical import build_lexical_field

    opts = profile.field
    name = profile.name or "profile"
    lexical = None
    if opts.mode in ("lexical", "hybrid") or profile.penalized():
        lexical = build_lexical_field(
            tokenizer,
            profile.keywords(),
            profile.penalized(),
            glued_weight=opts.glued_weight,
            first_piece_weight=opts.first_piece_weight,
            max_pieces=opts.max_pieces,
            name=name,
        )
    if opts.mode == "lexical":
        return lexical
    from ..fields.semantic import build_semantic_field, combine_fields

    semantic = build_semantic_field(
        tokenizer,
        opts.semantic_topic if opts.semantic_topic is not None else profile.keywords(),
        source=opts.semantic_source,
        model=model,
        top_k=opts.semantic_top_k,
        z_threshold=opts.semantic_z_threshold,
        min_value=opts.semantic_min_value,
        glued_weight=opts.glued_weight,
        name=name,
    )
    if lexical is None:
        built = semantic
    elif opts.mode == "hybrid":
        built = combine_fields(lexical, semantic, weight=opts.semantic_weight)
    else:  # semantic mode: the semantic pull plus only the penalties of the lexical field
        built = combine_fields(lexical, semantic, weight=1.0, lexical_positive=False)
    if opts.neighbours:
        built = _with_neighbours(profile, tokenizer, built)
    return built


def _with_neighbours(profile: Profile, tokenizer: Any, built: NarrativeField) -> NarrativeField:
    """``built`` with the ``field.neighbours`` whole words nearest the topic pulled lexically (max of the two)."""
    from ..fields.neighbours import neighbour_words

    opts = profile.field
    topic = opts.semantic_topic if opts.semantic_topic is not None else profile.keywords()
    words = neighbour_words(
        topic,
        count=opts.neighbours,
        vocabulary=opts.neighbours_vocabulary,
        exclude=profile.penalized(),
        progress=False,
    )
    near = weighted_lexical_field(
        tokenizer,
        {w: x * opts.neighbours_weight for w, x in words.items()},
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
    from ..fields.required import build_requirement

    opts = profile.require
    built = build_requirement(
        tokenizer,
        opts.words,
        strength=opts.strength,
        curve=opts.curve,
        force=opts.force,
        slack=opts.slack,
        window=opts.window,
        spread=opts.spread,
    )
    _REQUIRE_CACHE[key] = (tokenizer, built)
    while len(_REQUIRE_CACHE) > FIELD_CACHE_SIZE:
        _REQUIRE_CACHE.popitem(last=False)
    return built


def controller_from_profile(profile: Profile) -> ScheduleController:
    """``constant`` gives a :class:`ConstantController`, ``phases`` a :class:`PhaseScheduleController`,
    ``thermostat`` a :class:`ThermostatController`. In the kernel the thermostat reads drift through the
    base values of each row's field (its current stage's, with ``stages``)."""
    if profile.schedule == "thermostat":
        return ThermostatController(**profile.thermostat_kwargs())
    if profile.schedule == "constant":
        if profile.decay_after_steps is not None:
            return PhaseScheduleController(
                profile.gravity_strength,
                explore=1.0,
                converge=1.0,
                strict=1.0,
                decay_after_steps=profile.decay_after_steps,
                decay_half_life=profile.decay_half_life,
            )
        return ConstantController(profile.gravity_strength)
    return PhaseScheduleController(profile.gravity_strength, **profile.controller_kwargs())


def program_from_profile(profile: Profile, tokenizer: Any, *, model: Any = None, key: str = "") -> Program:
    """The kernel's :class:`~narrative_gravity.gravity.kernel.Program` for a profile: its field (or stages),
    its schedule, ``repeat_weight``, ``prune_threshold`` and ``require``. Every engine builds its rows from this."""
    field = field_from_profile(profile, tokenizer, model=model)
    controller = controller_from_profile(profile)
    stages = None
    if profile.stages:
        stages = stage_plan(tokenizer, [s.model_dump(exclude_none=True) for s in profile.stages])
    return Program(
        field=field,
        stages=stages,
        schedule=controller.schedule(len(controller._rows))[0],
        repeat_weight=profile.field.repeat_weight,
        prune_threshold=profile.prune_threshold,
        requirement=requirement_from_profile(profile, tokenizer),
        key=key,
    )


def processor_from_profile(
    profile: Profile,
    tokenizer: Any,
    *,
    max_new_tokens: int | None = None,
    trace: Trace | None = None,
    measure_only: bool = False,
    model: Any = None,
    inplace: bool = False,
) -> NarrativeGravityLogitsProcessor:
    """A :class:`~narrative_gravity.engines.hf.NarrativeGravityLogitsProcessor` for ``model.generate``.

    The profile's :func:`program_from_profile`: its field, or its ``stages`` (whose shares divide
    ``max_new_tokens``). ``measure_only`` always measures against the profile's own field. ``model`` is
    needed only for a semantic field built from the generator's own embeddings. ``inplace``: pull the scores
    where they are (see :class:`~narrative_gravity.engines.hf.NarrativeGravityLogitsProcessor`).
    """
    program = program_from_profile(profile, tokenizer, model=model)
    if program.stages is not None and max_new_tokens is None and not measure_only:
        raise ConfigurationError(
            "this profile declares `stages`, whose shares divide the token budget; pass max_new_tokens"
        )
    return NarrativeGravityLogitsProcessor(
        program.field,
        controller_from_profile(profile),
        stages=None if measure_only else program.stages,
        max_new_tokens=max_new_tokens,
        prune_threshold=program.prune_threshold,
        trace=trace,
        measure_only=measure_only,
        repeat_weight=program.repeat_weight,
        requirement=None if measure_only else program.requirement,
        inplace=inplace,
    )
