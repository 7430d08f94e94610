"""Tests for narrative_gravity.profiles.schema: Profile validation and load_profile (JSON / YAML)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from narrative_gravity.errors import ProfileError
from narrative_gravity.fields import expand_keywords
from narrative_gravity.gravity.controllers import DecayOptions, PhaseScheduleController
from narrative_gravity.profiles.build import phase_args, thermostat_args
from narrative_gravity.profiles.schema import TOPIC_DEFAULTS, FieldOptions, Profile, load_profile

CLASSIC = {
    "task_type": "code_generation",
    "core_semantics": ["binary_search", "algorithm", "array", "target"],
    "gravity_strength": 1.2,
    "penalize": ["restaurant", "movie", "recipe"],
    "decay_after_steps": 50,
}
REPO_PROFILES = Path(__file__).resolve().parents[1] / "profiles"


def err(data: Any) -> str:
    with pytest.raises(ProfileError) as exc:
        Profile.from_mapping(data)
    return str(exc.value)


# ------------------------------------------------------------------------------------------------
# the classic example


def test_classic_mapping_loads_exactly() -> None:
    p = Profile.from_mapping(CLASSIC)
    assert p.task_type == "code_generation"
    assert p.core_semantics == ["binary_search", "algorithm", "array", "target"]
    assert p.gravity_strength == 1.2
    assert p.penalize == ["restaurant", "movie", "recipe"]
    assert p.decay_after_steps == 50
    # everything not given: the topic default (TOPIC_DEFAULTS), λ_max proportional to the strength
    assert p.schedule == "thermostat" and p.prune_threshold is None and p.decay_half_life == 25.0
    assert p.field == FieldOptions(mode="semantic", repeat_weight=0.0, semantic_source="minilm")
    assert thermostat_args(p)["max_strength"] == pytest.approx(1.2 * 4.25 / 1.5)
    topic = TOPIC_DEFAULTS["thermostat"]
    assert {k: getattr(p.thermostat, k) for k in topic if k != "max_strength"} == {
        k: v for k, v in topic.items() if k != "max_strength"
    }
    # the default strength gives the topic default's λ_max exactly
    assert thermostat_args(Profile.from_mapping({"core_semantics": ["x"]}))["max_strength"] == pytest.approx(
        topic["max_strength"]
    )


def test_the_classic_pull_is_asked_for_by_name() -> None:
    for schedule in ("constant", "phases"):
        p = Profile.from_mapping({**CLASSIC, "schedule": schedule})
        assert p.field == FieldOptions(mode="lexical", repeat_weight=1.0, semantic_source="minilm")
    # a key given explicitly is kept whatever the schedule
    p = Profile.from_mapping({**CLASSIC, "schedule": "constant", "field": {"mode": "semantic"}})
    assert (p.field.mode, p.field.repeat_weight) == ("semantic", 1.0)
    p = Profile.from_mapping({**CLASSIC, "field": {"repeat_weight": 0.5, "mode": "hybrid"}})
    assert (p.schedule, p.field.mode, p.field.repeat_weight) == ("thermostat", "hybrid", 0.5)


def test_a_filled_in_profile_dumps_and_reloads_to_itself() -> None:
    for data in (CLASSIC, {**CLASSIC, "schedule": "phases"}, {"core_semantics": ["二分查找", "数组"]}):
        p = Profile.from_mapping(data)
        assert Profile.from_mapping(p.model_dump()) == p


def test_words_without_spaces_take_the_generators_embeddings() -> None:
    assert Profile.from_mapping({"core_semantics": ["二分查找", "数组"]}).field.semantic_source == "lm"
    staged = {"core_semantics": ["search"], "stages": [{"core_semantics": ["数组"]}]}
    assert Profile.from_mapping(staged).field.semantic_source == "lm"
    assert Profile.from_mapping({"core_semantics": ["search"]}).field.semantic_source == "minilm"
    given = {"core_semantics": ["数组"], "field": {"semantic_source": "minilm"}}
    assert Profile.from_mapping(given).field.semantic_source == "minilm"  # an explicit choice stands


def test_classic_json_file_loads_exactly(tmp_path: Path) -> None:
    path = tmp_path / "binary_search.json"
    path.write_text(json.dumps(CLASSIC), encoding="utf-8")
    p = load_profile(path)
    assert p.model_dump(include=set(CLASSIC)) == CLASSIC
    assert p.name == "binary_search"  # named after the file when the profile has no name


def test_repo_example_profile_if_present() -> None:
    path = REPO_PROFILES / "binary_search.json"
    if not path.exists():
        pytest.skip("profiles/binary_search.json is not in this checkout")
    data = json.loads(path.read_text(encoding="utf-8"))
    assert data.pop("$schema") == "profile.schema.json"  # for editors; the profile ignores it
    p = load_profile(path)
    assert p.model_dump(include=set(data)) == data


def test_keywords_split_compounds() -> None:
    p = Profile.from_mapping(CLASSIC)
    assert p.keywords() == ["binary", "search", "binary search", "algorithm", "array", "target"]
    assert p.penalized() == ["restaurant", "movie", "recipe"]


def test_keywords_dedupe_and_strip() -> None:
    p = Profile.from_mapping({"core_semantics": [" orbit ", "deep_space", "space", "orbit"], "penalize": ["fast_food"]})
    assert p.core_semantics == ["orbit", "deep_space", "space", "orbit"]
    assert p.keywords() == ["orbit", "deep", "space", "deep space"]
    assert p.penalized() == ["fast", "food", "fast food"]


@pytest.mark.parametrize(
    ("word", "parts"),
    [
        ("binary_search", ["binary", "search", "binary search"]),
        ("a_b_c", ["a", "b", "c", "a b c"]),
        ("orbit", ["orbit"]),
        ("_orbit_", ["orbit"]),
        ("   ", []),
        ("two words", ["two words"]),
    ],
)
def test_compounds_split_like_profiles(word: str, parts: list[str]) -> None:
    assert expand_keywords([word]) == parts
    if word.strip():  # a profile rejects empty entries instead
        assert Profile.from_mapping({"core_semantics": ["x", word]}).keywords() == ["x", *parts]


def test_controller_kwargs_build_a_schedule() -> None:
    p = Profile.from_mapping({**CLASSIC, "phases": {"explore": 0.25}, "decay_half_life": 10})
    kw = phase_args(p)
    assert kw["decay"] == DecayOptions(after_steps=50, half_life=10.0) and kw["explore"] == 0.25
    sched = PhaseScheduleController(p.gravity_strength, **kw)
    assert sched.scale(0, 100) == 0.25
    assert abs(sched.scale(60, 100) - 0.5) < 1e-12  # converge 1.0, decayed by one half-life


def test_profile_is_frozen() -> None:
    p = Profile.from_mapping(CLASSIC)
    with pytest.raises(Exception, match="frozen"):
        p.gravity_strength = 3.0  # type: ignore[misc]


# ------------------------------------------------------------------------------------------------
# files


def test_yaml_file_loads(tmp_path: Path) -> None:
    path = tmp_path / "space.yaml"
    path.write_text(
        "name: astro\n"
        "core_semantics: [orbit, planet, dark_matter]\n"
        "gravity_strength: 2\n"
        "schedule: constant\n"
        "phases:\n  explore: 0.1\n  strict_from: 0.9\n"
        "prune_threshold: -0.5\n"
        "field:\n  glued_weight: 0.25\n",
        encoding="utf-8",
    )
    p = load_profile(path)
    assert p.name == "astro"
    assert p.keywords() == ["orbit", "planet", "dark", "matter", "dark matter"]
    assert p.gravity_strength == 2.0 and p.schedule == "constant" and p.prune_threshold == -0.5
    assert p.phases.explore == 0.1 and p.phases.strict_from == 0.9 and p.phases.converge == 1.0
    assert p.field.glued_weight == 0.25


@pytest.mark.parametrize("suffix", [".yml", ".YAML", ".JSON"])
def test_other_suffixes(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"p{suffix}"
    path.write_text(json.dumps({"core_semantics": ["orbit"]}), encoding="utf-8")  # JSON is valid YAML too
    assert load_profile(str(path)).core_semantics == ["orbit"]


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.json"
    with pytest.raises(ProfileError, match=r"nope\.json.*does not exist"):
        load_profile(path)


def test_wrong_suffix(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text('core_semantics = ["orbit"]\n', encoding="utf-8")
    with pytest.raises(ProfileError, match=r"p\.toml.*must end in \.json, \.yaml or \.yml"):
        load_profile(path)


def test_non_utf8_file(tmp_path: Path) -> None:
    path = tmp_path / "latin1.json"
    path.write_bytes('{"core_semantics": ["café"]}'.encode("latin-1"))
    with pytest.raises(ProfileError, match=r"latin1\.json.*cannot be read as UTF-8 text"):
        load_profile(path)


def test_directory_instead_of_file(tmp_path: Path) -> None:
    folder = tmp_path / "profile.json"
    folder.mkdir()
    with pytest.raises(ProfileError, match=r"profile\.json.*cannot be read"):
        load_profile(folder)


def test_invalid_json(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{"core_semantics": ["orbit",]', encoding="utf-8")
    with pytest.raises(ProfileError, match=r"bad\.json: not valid JSON"):
        load_profile(path)


def test_invalid_yaml(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("core_semantics: [orbit\ngravity_strength: : 2\n", encoding="utf-8")
    with pytest.raises(ProfileError, match=r"bad\.yaml: not valid YAML"):
        load_profile(path)


@pytest.mark.parametrize(("text", "kind"), [("- orbit\n- planet\n", "list"), ("", "NoneType"), ("42\n", "int")])
def test_non_mapping_root_in_file(tmp_path: Path, text: str, kind: str) -> None:
    path = tmp_path / "root.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ProfileError, match=rf"root\.yaml: the root must be a mapping.*but is {kind}"):
        load_profile(path)


def test_file_errors_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "typo.json"
    path.write_text(json.dumps({"core_semantics": ["x"], "gravity_strenght": 2}), encoding="utf-8")
    with pytest.raises(
        ProfileError, match=r"typo\.json: unknown key `gravity_strenght`; did you mean `gravity_strength`\?"
    ):
        load_profile(path)


# ------------------------------------------------------------------------------------------------
# validation messages


@pytest.mark.parametrize("data", [["orbit"], "orbit", 3, None])
def test_non_mapping_root(data: Any) -> None:
    msg = err(data)
    assert msg.startswith("profile: the root must be a mapping")
    assert type(data).__name__ in msg


@pytest.mark.parametrize(
    ("typo", "intended"),
    [
        ("gravity_strenght", "gravity_strength"),
        ("core_semantic", "core_semantics"),
        ("penalise", "penalize"),
        ("decay_after_step", "decay_after_steps"),
        ("prune_treshold", "prune_threshold"),
    ],
)
def test_unknown_key_suggests_intended(typo: str, intended: str) -> None:
    msg = err({"core_semantics": ["x"], typo: 1})
    assert f"unknown key `{typo}`; did you mean `{intended}`?" in msg


def test_unknown_key_without_close_match_lists_allowed() -> None:
    msg = err({"core_semantics": ["x"], "zzzzzz": 1})
    assert "unknown key `zzzzzz`" in msg and "allowed keys are:" in msg and "gravity_strength" in msg


def test_nested_unknown_key() -> None:
    msg = err({"core_semantics": ["x"], "phases": {"explor": 0.3}})
    assert "unknown key `phases.explor`; did you mean `explore`?" in msg
    msg = err({"core_semantics": ["x"], "field": {"glued_weigth": 0.3}})
    assert "unknown key `field.glued_weigth`; did you mean `glued_weight`?" in msg


@pytest.mark.parametrize(
    ("data", "key", "value"),
    [
        ({"gravity_strength": "strong"}, "gravity_strength", "'strong'"),
        ({"core_semantics": "orbit"}, "core_semantics", "'orbit'"),
        ({"penalize": "movie"}, "penalize", "'movie'"),
        ({"decay_after_steps": 2.5}, "decay_after_steps", "2.5"),
        ({"decay_after_steps": "soon"}, "decay_after_steps", "'soon'"),
        ({"schedule": "linear"}, "schedule", "'linear'"),
        ({"phases": [1, 2]}, "phases", "[1, 2]"),
        ({"core_semantics": [1.5]}, "core_semantics.0", "1.5"),
    ],
)
def test_wrong_types_name_key_and_value(data: dict[str, Any], key: str, value: str) -> None:
    msg = err({"core_semantics": ["x"], **data})
    assert f"`{key}` (got {value})" in msg


@pytest.mark.parametrize(
    ("data", "key", "value", "fix"),
    [
        ({"gravity_strength": -1}, "gravity_strength", "-1", "raise the value"),
        ({"gravity_strength": 30}, "gravity_strength", "30", "lower the value"),
        ({"decay_after_steps": -5}, "decay_after_steps", "-5", "raise the value"),
        ({"decay_half_life": 0}, "decay_half_life", "0", "raise the value"),
        ({"prune_threshold": 1.0}, "prune_threshold", "1.0", "lower the value"),
        ({"prune_threshold": -2}, "prune_threshold", "-2", "raise the value"),
        ({"phases": {"explore": -0.5}}, "phases.explore", "-0.5", "raise the value"),
        ({"phases": {"strict_from": 1.2}}, "phases.strict_from", "1.2", "lower the value"),
        ({"field": {"max_pieces": 0}}, "field.max_pieces", "0", "raise the value"),
        ({"core_semantics": []}, "core_semantics", "[]", "add at least one entry"),
    ],
)
def test_impossible_values_name_key_and_value(data: dict[str, Any], key: str, value: str, fix: str) -> None:
    msg = err({"core_semantics": ["x"], **data})
    assert f"`{key}` (got {value})" in msg
    assert fix in msg


def test_phase_order_checked() -> None:
    msg = err({"core_semantics": ["x"], "phases": {"explore_until": 0.9, "strict_from": 0.1}})
    assert "phases.explore_until (0.9) must not exceed phases.strict_from (0.1)" in msg


def test_missing_core_semantics() -> None:
    msg = err({"gravity_strength": 1.0})
    assert "`core_semantics`: Field required; add it" in msg


def test_empty_words_rejected() -> None:
    msg = err({"core_semantics": ["orbit", "  "]})
    assert "`core_semantics`" in msg and "entries [1] are empty" in msg
    msg = err({"core_semantics": ["orbit"], "penalize": [""]})
    assert "`penalize`" in msg and "entries [0] are empty" in msg


def test_several_problems_are_listed() -> None:
    msg = err({"core_semantics": "orbit", "gravity_strength": 99, "gravity_strenght": 1})
    assert msg.startswith("profile: 3 problems:")
    assert "`core_semantics`" in msg and "`gravity_strength` (got 99)" in msg and "did you mean" in msg


def test_profile_error_is_value_error() -> None:
    with pytest.raises(ValueError):
        Profile.from_mapping({})


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"core_semantics": ["orbit"], "gravity_strength": True}, "gravity_strength"),
        ({"core_semantics": ["orbit"], "phases": {"explore": False}}, "phases.explore"),
        ({"core_semantics": ["orbit"], "thermostat": {"drift_window": True}}, "thermostat.drift_window"),
    ],
)
def test_booleans_are_not_read_as_numbers(data: dict[str, Any], key: str) -> None:
    msg = err(data)
    assert f"`{key}`" in msg and "is a boolean" in msg and "write a number" in msg


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"core_semantics": ["x"], "gravity_strength": "2"}, "gravity_strength"),
        ({"core_semantics": ["x"], "thermostat": {"max_strength": "4"}}, "thermostat.max_strength"),
        ({"core_semantics": ["x"], "field": {"semantic_top_k": "5"}}, "field.semantic_top_k"),
        ({"core_semantics": ["x"], "stages": [{"core_semantics": ["y"], "share": "0.5"}]}, "stages.0.share"),
    ],
)
def test_a_number_in_quotes_is_refused_by_key(data: dict, key: str) -> None:
    with pytest.raises(ProfileError, match=rf"`{re.escape(key)}`.*write it without quotes"):
        Profile.from_mapping(data)
