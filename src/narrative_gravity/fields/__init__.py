"""Narrative fields: a value in [-1, 1] per vocabulary token, built once per (profile, tokenizer)."""

from ..gravity.field import NarrativeField, WordReport
from ..text import expand_keywords
from .lexical import build_lexical_field, reach, surface_forms
from .semantic import SemanticSettings, build_semantic_field, combine_fields, semantic_scores

__all__ = [
    "NarrativeField",
    "SemanticSettings",
    "WordReport",
    "build_lexical_field",
    "build_semantic_field",
    "combine_fields",
    "expand_keywords",
    "reach",
    "semantic_scores",
    "surface_forms",
]
