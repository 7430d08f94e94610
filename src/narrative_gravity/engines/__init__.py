"""Thin engine adapters around :func:`narrative_gravity.core.apply_gravity`."""
