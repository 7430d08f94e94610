"""narrative-gravity: keep LLM generation on its narrative while it decodes.

Adding ``λ·a`` to the logits, where ``a`` is a field over the vocabulary that says how close each token is
to the narrative, is the exponential tilt ``p'(v) ∝ p(v)·exp(λ·a(v))``.

>>> import narrative_gravity as ng
>>> ng.__version__
'0.1.0'
"""

from __future__ import annotations

__version__ = "0.1.0"

from .errors import (
    ConfigurationError,
    FieldError,
    ModelNotFoundError,
    NarrativeGravityError,
    NonFiniteLogitsError,
    ProfileError,
    VocabularyError,
)
from .fields import NarrativeField, WordReport
from .gravity.controllers import ConstantController, PhaseScheduleController, StepContext, StrengthController
from .gravity.thermo import Measurement, Trace, measure
from .gravity.tilt import apply_gravity, prune_mask

__all__ = [
    "ConfigurationError",
    "ConstantController",
    "FieldError",
    "Measurement",
    "ModelNotFoundError",
    "NarrativeField",
    "NarrativeGravityError",
    "NonFiniteLogitsError",
    "PhaseScheduleController",
    "ProfileError",
    "StepContext",
    "StrengthController",
    "Trace",
    "VocabularyError",
    "WordReport",
    "__version__",
    "apply_gravity",
    "measure",
    "prune_mask",
]
