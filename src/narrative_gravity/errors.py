"""Errors raised by narrative-gravity.

Every error names the bad value and says what to do instead.

>>> issubclass(ProfileError, NarrativeGravityError) and issubclass(ProfileError, ValueError)
True
"""

from __future__ import annotations


class NarrativeGravityError(Exception):
    """Base class for every error this package raises on purpose."""


class ProfileError(NarrativeGravityError, ValueError):
    """A profile file or mapping is invalid (unknown key, wrong type, impossible value)."""


class FieldError(NarrativeGravityError, ValueError):
    """A narrative field cannot be built or does not fit the tokenizer or the logits."""


class VocabularyError(FieldError):
    """Token ids fall outside the vocabulary, or vocabulary sizes disagree."""


class NonFiniteLogitsError(NarrativeGravityError, FloatingPointError):
    """The model produced NaN logits; the message names the rows and the decoding step."""


class ModelNotFoundError(NarrativeGravityError, FileNotFoundError):
    """A model package or path is missing; the message prints the exact install command."""


class ConfigurationError(NarrativeGravityError, ValueError):
    """A processor, controller or CLI argument is out of range."""


class StoreError(NarrativeGravityError, ValueError):
    """The profile store cannot do what was asked (bad name, unknown profile or version, unreadable snapshot)."""
