"""From a profile to a ready processor: build the field once per (profile, tokenizer) and pick the controller.

>>> from narrative_gravity.profile import Profile
>>> controller_from_profile(Profile(core_semantics=["orbit"], schedule="constant", gravity_strength=2.0))
ConstantController(2.0)
"""

from __future__ import annotations

import json
from typing import Any

from .control import ConstantController, PhaseScheduleController, StrengthController
from .fields import NarrativeField
from .profile import Profile
from .thermo import Trace

__all__ = ["controller_from_profile", "field_from_profile", "processor_from_profile"]

_FIELD_CACHE: dict[tuple[str, int, int], NarrativeField] = {}


def _tokenizer_key(tokenizer: Any) -> int:
    return id(tokenizer)


def field_from_profile(profile: Profile, tokenizer: Any) -> NarrativeField:
    """The lexical field of a profile for a tokenizer, built once and cached in memory."""
    from .fields.lexical import build_lexical_field

    spec = json.dumps(
        {"core": profile.keywords(), "penalize": profile.penalized(), "field": profile.field.model_dump()},
        sort_keys=True,
    )
    key = (spec, _tokenizer_key(tokenizer), len(tokenizer))
    cached = _FIELD_CACHE.get(key)
    if cached is None:
        cached = build_lexical_field(
            tokenizer,
            profile.keywords(),
            profile.penalized(),
            glued_weight=profile.field.glued_weight,
            first_piece_weight=profile.field.first_piece_weight,
            max_pieces=profile.field.max_pieces,
            name=profile.name or "profile",
        )
        _FIELD_CACHE[key] = cached
    return cached


def controller_from_profile(profile: Profile) -> StrengthController:
    """``constant`` gives a :class:`ConstantController`; ``phases`` a :class:`PhaseScheduleController`."""
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


def processor_from_profile(
    profile: Profile,
    tokenizer: Any,
    *,
    max_new_tokens: int | None = None,
    trace: Trace | None = None,
    measure_only: bool = False,
) -> Any:
    """A :class:`~narrative_gravity.engines.hf.NarrativeGravityLogitsProcessor` for ``model.generate``."""
    from .engines.hf import NarrativeGravityLogitsProcessor

    return NarrativeGravityLogitsProcessor(
        field_from_profile(profile, tokenizer),
        controller_from_profile(profile),
        max_new_tokens=max_new_tokens,
        prune_threshold=profile.prune_threshold,
        trace=trace,
        measure_only=measure_only,
    )
