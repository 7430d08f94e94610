"""Narrative fields: a value in [-1, 1] per vocabulary token, built once per (profile, tokenizer)."""

from .field import NarrativeField, WordReport
from .lexical import build_lexical_field, expand_keywords, reach, surface_forms

__all__ = ["NarrativeField", "WordReport", "build_lexical_field", "expand_keywords", "reach", "surface_forms"]
