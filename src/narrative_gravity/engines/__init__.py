"""Thin engine adapters around :func:`narrative_gravity.gravity.tilt.apply_gravity`."""
