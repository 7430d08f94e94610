"""The library in two calls: a logits processor from a profile, or a whole generation with one.

``narrative_gravity`` hands these names on (``ng.processor``, ``ng.generate``); this module imports torch and
transformers, which ``import narrative_gravity`` alone does not.

>>> from narrative_gravity.api import as_profile
>>> as_profile({"core_semantics": ["orbit"], "schedule": "constant"}).schedule
'constant'
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .engines.hf import NarrativeGravityLogitsProcessor, processor_from_profile
from .engines.hf_generate import generate_with_profile
from .engines.options import GenerationOptions
from .engines.results import GenerationResult
from .errors import ConfigurationError
from .fields import NarrativeField, WordReport
from .gravity.controllers import ConstantController, PhaseScheduleController, StepContext, StrengthController
from .gravity.thermo import Measurement, Trace, measure
from .gravity.tilt import apply_gravity, prune_mask
from .profiles.schema import Profile, load_profile

__all__ = [
    "ConstantController",
    "GenerationResult",
    "Measurement",
    "NarrativeField",
    "NarrativeGravityLogitsProcessor",
    "PhaseScheduleController",
    "StepContext",
    "StrengthController",
    "Trace",
    "WordReport",
    "apply_gravity",
    "as_profile",
    "generate",
    "measure",
    "processor",
    "prune_mask",
]

ProfileLike = Profile | Mapping[str, Any] | str | os.PathLike[str]


def as_profile(profile: ProfileLike) -> Profile:
    """A :class:`~narrative_gravity.profiles.schema.Profile` from itself, a mapping of profile keys, or a file path."""
    if isinstance(profile, Profile):
        return profile
    if isinstance(profile, Mapping):
        return Profile.from_mapping(profile)
    if isinstance(profile, (str, os.PathLike)):
        return load_profile(profile)
    raise ConfigurationError(
        f"a profile has to be a Profile, a mapping of profile keys or a path to a .json/.yaml file, but is "
        f"{type(profile).__name__}"
    )


def processor(
    profile: ProfileLike,
    tokenizer: Any,
    *,
    max_new_tokens: int | None = None,
    trace: Trace | None = None,
    model: Any = None,
) -> NarrativeGravityLogitsProcessor:
    """A logits processor for your own ``model.generate(..., logits_processor=[proc])`` call.

    ``max_new_tokens``: the budget of that call (the schedule reads it; profiles with ``stages`` need it).
    ``trace``: a :class:`~narrative_gravity.gravity.thermo.Trace` to record entropy, narrative mass, KL and λ.
    ``model``: only for a semantic field built from the generator's own embeddings (``semantic_source: lm``).
    A processor in a call of your own reads no topic sentence (``lead``); :func:`generate` reads it.
    """
    return processor_from_profile(
        as_profile(profile), tokenizer, max_new_tokens=max_new_tokens, trace=trace, model=model
    )


def generate(
    model: Any,
    tokenizer: Any,
    prompt: str,
    profile: ProfileLike | None = None,
    options: GenerationOptions = GenerationOptions(),
) -> GenerationResult:
    """Continue ``prompt`` with ``profile``'s pull exactly as ``ngrav generate`` does (``None``: plain decoding).

    The prompt goes through the chat template (``options.raw=True``: plain continuation), after the profile's topic
    sentence where it has one; ``options`` sets the budget and the sampling (``options.trace``: the result carries
    the per-token measurements).
    """
    if options.engine != "hf":
        raise ConfigurationError(
            "narrative_gravity.generate runs on the transformers model it is given; for vLLM use "
            "narrative_gravity.engines.vllm_generate.VLLMGenerator"
        )
    prof = None if profile is None else as_profile(profile)
    return generate_with_profile(model, tokenizer, [prompt], prof, options)[0]
