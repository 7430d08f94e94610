"""The `empath` topic sets (eval.lexicon) and the `rare_success` metric: no model is loaded."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from narrative_gravity.errors import ConfigurationError
from narrative_gravity.eval import EvalSettings, Sample, compute_metrics
from narrative_gravity.eval.lexicon import (
    EMPATH_TOPICS,
    TEST_TOPICS,
    TUNE_TOPICS,
    clean_words,
    empath_categories_path,
    load_empath,
    read_categories,
    split_topics,
)
from narrative_gravity.eval.metrics import RARE_ZIPF, rare_words
from narrative_gravity.eval.prompts import TOPIC_SETS, load_prompts, split_wordlist

# Categories about a feeling, a mood, a trait or a social attitude: none of them may be a topic.
MOODS = {
    "affection", "aggression", "anger", "anticipation", "attractive", "beauty", "cheerfulness", "childish",
    "confusion", "contentment", "disappointment", "disgust", "dominant_personality", "emotional", "envy",
    "exasperation", "fear", "fun", "hate", "heroic", "horror", "irritability", "joy", "love", "lust",
    "negative_emotion", "neglect", "nervousness", "optimism", "pain", "politeness", "positive_emotion", "pride",
    "rage", "sadness", "shame", "suffering", "surprise", "sympathy", "timidity", "torment", "trust", "ugliness",
    "weakness", "zest",
}  # fmt: skip


def _bench(tmp_path: Path, prefixes: str = "In summary\nThis essay discusses\n\nViews on\n") -> Path:
    topics = tmp_path / "bench" / "topics"
    (topics / "wordlists").mkdir(parents=True)
    (topics / "prefixes.txt").write_text(prefixes)
    (topics / "wordlists" / "space.txt").write_text("planet\ngalaxy\n")
    return topics


def test_topic_set_is_large_and_split_into_disjoint_halves():
    assert len(EMPATH_TOPICS) >= 40 and len(set(EMPATH_TOPICS)) == len(EMPATH_TOPICS)
    assert TUNE_TOPICS and TEST_TOPICS and not set(TUNE_TOPICS) & set(TEST_TOPICS)
    assert set(TUNE_TOPICS) | set(TEST_TOPICS) == set(EMPATH_TOPICS)
    assert abs(len(TUNE_TOPICS) - len(TEST_TOPICS)) <= 1


def test_split_is_fixed():
    assert split_topics() == split_topics() == (TUNE_TOPICS, TEST_TOPICS)
    # A changed rule or topic list must fail here: these are the first topics of each half.
    assert TEST_TOPICS[:3] == ("alcohol", "art", "beach")
    assert TUNE_TOPICS[:3] == ("air_travel", "animal", "banking")
    assert split_topics(reversed(EMPATH_TOPICS)) == split_topics(EMPATH_TOPICS)  # input order does not matter


def test_no_mood_category_is_a_topic():
    assert not MOODS & set(EMPATH_TOPICS)
    assert not MOODS - set(read_categories())  # real category names, so the check above means something


def test_every_topic_is_in_the_installed_lexicon():
    lexicon = read_categories()
    assert len(lexicon) == 194  # empath 0.89
    assert set(EMPATH_TOPICS) <= set(lexicon)


def test_every_topic_has_disjoint_non_empty_halves_and_a_rare_held_out_word():
    lexicon = read_categories()
    for name in EMPATH_TOPICS:
        words = clean_words(lexicon[name])
        cond, held = split_wordlist(words)
        assert cond and held, name
        assert not {w.casefold() for w in cond} & {w.casefold() for w in held}, name
        assert all(w.isalpha() and w.islower() and " " not in w for w in cond + held), name
        assert rare_words(held), name  # rare_success is defined for every topic


def test_clean_words_keeps_single_lowercase_words_once():
    assert clean_words(["law", "in-law", "911", "3d", "a.m.", "worst_part", " court ", "law", ""]) == ("law", "court")


@settings(max_examples=50, deadline=None)
@given(st.lists(st.text(alphabet="abc-_ 1", max_size=6), max_size=20))
def test_clean_words_output_is_always_single_distinct_words(words):
    out = clean_words(words)
    assert len(set(out)) == len(out) and all(w.isalpha() and w.isascii() and w.islower() for w in out)


def test_load_empath_builds_prompts_from_a_lexicon_file(tmp_path):
    root = _bench(tmp_path)
    tsv = tmp_path / "categories.tsv"
    tsv.write_text("law\tcourt\tjudge\tin-law\tjury\tcourt\tverdict\nocean\twave\tsea\n")
    ps = load_empath(root, categories=tsv, topics=["law", "ocean"])
    assert [(p.index, p.topic_name, p.text) for p in ps[:4]] == [
        (0, "law", "In summary"), (1, "law", "This essay discusses"), (2, "law", "Views on"), (3, "ocean", "In summary"),
    ]  # fmt: skip
    assert ps[0].topic_words == ("court", "jury") and ps[0].heldout_words == ("judge", "verdict")
    assert ps[0].score_words() == ("judge", "verdict")
    with pytest.raises(ConfigurationError, match=r"no categories \['space'\]"):
        load_empath(root, categories=tsv, topics=["space"])


def test_empath_prompt_sets_cover_every_topic_times_the_topics_prefixes():
    try:
        prefixes = {p.text for p in load_prompts("topics")}
    except ConfigurationError:
        pytest.skip("the shared bench folder is not next to this checkout")
    assert len(prefixes) == 20
    for source, topics in (("empath", TEST_TOPICS), ("empath-tune", TUNE_TOPICS)):
        ps = load_prompts(source)
        assert len(ps) == 20 * len(topics) and [p.index for p in ps] == list(range(len(ps)))
        assert [p.topic_name for p in ps[::20]] == list(topics)
        for name in topics:
            mine = [p for p in ps if p.topic_name == name]
            assert len(mine) == 20 and {p.text for p in mine} == prefixes
            assert mine[0].topic_words and mine[0].heldout_words
        assert source in TOPIC_SETS and EvalSettings(prompts=source, profiles=("auto",)).raw_mode
    assert not EvalSettings(prompts="empath", profiles=("auto",), raw=False).raw_mode


def test_missing_empath_names_the_install_command(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "empath" else real(name, *a))
    monkeypatch.setenv("NARRATIVE_GRAVITY_BENCH", str(_bench(tmp_path).parent))
    with pytest.raises(ConfigurationError, match=r"pip install --no-deps empath==0\.89"):
        empath_categories_path()
    with pytest.raises(ConfigurationError, match=r"not installed.*pip install --no-deps empath==0\.89"):
        load_prompts("empath")


def test_rare_success_counts_only_rare_held_out_words():
    words = ("bourbon", "bar")  # bourbon is rare, bar is common
    assert rare_words(words) == ("bourbon",) and RARE_ZIPF == 4.0

    def rare(text: str, score_words: tuple[str, ...] = words) -> float:
        return compute_metrics([Sample("p", text, score_words=score_words)], ["rare_success"])[0]["rare_success"]

    assert rare("A glass of Bourbon at the bar.") == 1.0
    assert rare("We met at the bar.") == 0.0  # a held-out word, but a common one
    assert rare("bourbonic plague") == 0.0  # whole words only
    assert math.isnan(rare("We met at the bar.", ("bar", "the")))  # no rare scoring word: undefined
    assert math.isnan(rare("anything", ()))
    both = compute_metrics([Sample("p", "at the bar", score_words=words)], ["topic_success", "rare_success"])[0]
    assert both == {"topic_success": 1.0, "rare_success": 0.0}
