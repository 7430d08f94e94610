"""The profile reference and JSON Schema are generated from the schema, and the files in the repository match."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from narrative_gravity.cli.main import app
from narrative_gravity.profiles import blocks
from narrative_gravity.profiles.reference import profile_json_schema, profile_reference, profile_schema_text
from narrative_gravity.profiles.schema import Profile, load_profile

ROOT = Path(__file__).resolve().parents[1]
REGENERATE = "regenerate it: ngrav profile docs > docs/profiles.md; ngrav profile schema > profiles/profile.schema.json"


def test_docs_profiles_md_is_generated_from_the_schema():
    assert (ROOT / "docs" / "profiles.md").read_text(encoding="utf-8") == profile_reference(), REGENERATE


def test_profile_schema_json_is_the_published_schema():
    assert (ROOT / "profiles" / "profile.schema.json").read_text(encoding="utf-8") == profile_schema_text(), REGENERATE


def test_every_key_has_its_meaning_written_once():
    models = [Profile, *(getattr(blocks, n) for n in blocks.__all__)]
    missing = [f"{m.__name__}.{k}" for m in models for k, info in m.model_fields.items() if not info.description]
    assert not missing, f"give these keys a Field(description=...): {missing}"
    reference = profile_reference()
    for m in models:
        for k in m.model_fields:
            assert f"| `{k}` |" in reference


def test_the_cli_prints_both():
    runner = CliRunner()
    assert runner.invoke(app, ["profile", "schema"]).stdout == profile_schema_text()
    assert runner.invoke(app, ["profile", "docs"]).stdout == profile_reference()


@pytest.mark.parametrize("path", sorted(p for p in (ROOT / "profiles").iterdir() if p.suffix in (".json", ".yaml")))
def test_example_profiles_name_the_schema_and_follow_it(path):
    if path.name == "profile.schema.json":
        return
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".yaml":
        assert text.startswith("# yaml-language-server: $schema=profile.schema.json\n")
        data = yaml.safe_load(text)
    else:
        data = json.loads(text)
        assert data["$schema"] == "profile.schema.json"
    load_profile(path)  # the validator ignores the $schema key
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(data, profile_json_schema())


def test_the_schema_accepts_what_the_validator_accepts_beyond_pydantic():
    jsonschema = pytest.importorskip("jsonschema")
    schema = profile_json_schema()
    jsonschema.validate({"core_semantics": ["orbit"], "require": ["planet"], "lead": False}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"core_semantics": ["orbit"], "gravity_strenght": 2}, schema)
    assert Profile.from_mapping({"$schema": "profile.schema.json", "core_semantics": ["orbit"]}).core_semantics == [
        "orbit"
    ]
