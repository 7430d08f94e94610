"""narrative-gravity: keep LLM generation on its narrative while it decodes.

Adding ``λ·a`` to the logits, where ``a`` is a field over the vocabulary that says how close each token is
to the narrative, is the exponential tilt ``p'(v) ∝ p(v)·exp(λ·a(v))``.

The public API, with one import::

    import narrative_gravity as ng

    model, tok = ng.load_model()                       # SmolLM2-135M-Instruct, offline
    profile = ng.Profile(core_semantics=["orbit", "planet"])
    print(ng.generate(model, tok, "Tell me about the night sky.", profile).text)
    proc = ng.processor(profile, tok, max_new_tokens=80)   # for a model.generate call of your own

``import narrative_gravity`` is light: the names that need torch (:func:`processor`, :func:`generate`, the kernel's
classes) load on first use.

>>> import narrative_gravity as ng
>>> ng.__version__, ng.GenerationOptions(temperature=0).greedy
('0.1.0', True)
"""

from __future__ import annotations

from typing import Any

from .engines.options import GenerationOptions
from .errors import (
    ConfigurationError,
    FieldError,
    ModelNotFoundError,
    NarrativeGravityError,
    NonFiniteLogitsError,
    ProfileError,
    StoreError,
    VocabularyError,
)
from .models import load_model, load_tokenizer
from .profiles.schema import Profile, load_profile

__version__ = "0.1.0"

_API = frozenset(
    {
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
        "generate",
        "measure",
        "processor",
        "prune_mask",
    }
)

__all__ = [
    "ConfigurationError",
    "FieldError",
    "GenerationOptions",
    "ModelNotFoundError",
    "NarrativeGravityError",
    "NonFiniteLogitsError",
    "Profile",
    "ProfileError",
    "StoreError",
    "VocabularyError",
    "__version__",
    "load_model",
    "load_profile",
    "load_tokenizer",
    *sorted(_API),
]


def __getattr__(name: str) -> Any:
    if name in _API:
        from . import api  # torch and transformers load here, on first use, not on `import narrative_gravity`

        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _API)
