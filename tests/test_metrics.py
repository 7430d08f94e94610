"""Tests for narrative_gravity.eval.text_metrics: distinct_n, penalized_hits, token rates, mean_ci."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from narrative_gravity.eval.text_metrics import (
    distinct_n,
    mean_ci,
    narrative_token_rate,
    penalized_hits,
    token_field_values,
)
from narrative_gravity.fields import NarrativeField


def cont_field() -> NarrativeField:
    """V = 6: token 1 is narrative on its own (0.5); 3 continues 2 (1.0); 5 after [2, 3] is narrative (1.0)."""
    return NarrativeField(
        values=torch.tensor([0.0, 0.5, 0.0, 0.0, -0.5, 0.0]),
        prefixes=torch.tensor([[-1, 2], [2, 3]]),
        next_ids=torch.tensor([3, 5]),
        next_values=torch.tensor([1.0, 1.0]),
    )


# ------------------------------------------------------------------------------------------------
# distinct_n


def test_distinct_1_known_value() -> None:
    # 6 words, 5 distinct ("the" twice)
    assert distinct_n(["the cat sat on the mat"], 1) == 5 / 6


def test_distinct_2_known_value() -> None:
    # bigrams: (a b) (b a) (a b) (b c) -> 3 distinct of 4
    assert distinct_n(["a b a b c"], 2) == 3 / 4


def test_distinct_pools_over_texts() -> None:
    # "x y" twice: 2 bigrams, 1 distinct; unigrams 4, 2 distinct
    assert distinct_n(["x y", "x y"], 2) == 0.5
    assert distinct_n(["x y", "x y"], 1) == 0.5
    # n-grams never cross text boundaries: "a b" + "c d" has bigrams (a b), (c d) only
    assert distinct_n(["a b", "c d"], 2) == 1.0
    assert distinct_n(["a", "b"], 2) == 0.0


def test_distinct_is_case_sensitive_and_whitespace_split() -> None:
    assert distinct_n(["The the  THE\nthe\tthe"], 1) == 3 / 5


def test_distinct_empty_and_too_short() -> None:
    assert distinct_n([], 1) == 0.0
    assert distinct_n(["", "   "], 1) == 0.0
    assert distinct_n(["one two"], 3) == 0.0


def test_distinct_all_repeated() -> None:
    assert distinct_n(["go go go go"], 1) == 0.25
    assert distinct_n(["go go go go"], 3) == 0.5


@settings(max_examples=50, deadline=None)
@given(st.lists(st.text(alphabet="abc ", max_size=30), max_size=4), st.integers(1, 3))
def test_distinct_is_a_fraction(texts: list[str], n: int) -> None:
    d = distinct_n(texts, n)
    assert 0.0 <= d <= 1.0
    if any(len(t.split()) >= n for t in texts):
        assert d > 0


# ------------------------------------------------------------------------------------------------
# penalized_hits


def test_distinct_reads_text_without_spaces_per_character() -> None:
    # the same as plain decoding's Chinese output in `ngrav compare`: no spaces, so one "word" per line before
    varied = "二分查找每一步都把搜索范围减半，直到找到目标。"
    looping = "减半减半减半减半减半减半"
    assert distinct_n([varied], 2) > 0.9
    assert distinct_n([looping], 2) == pytest.approx(2 / 11)
    assert distinct_n(["binary 二分 search"], 1) == 1.0  # mixed: words and characters


def test_eval_metrics_read_chinese() -> None:
    from narrative_gravity.eval.metrics import repetition

    assert repetition("减半减半减半", 2) == pytest.approx(1 - 2 / 5)
    assert repetition("二分查找每一步", 2) == 0.0


@settings(max_examples=100, deadline=None)
@given(st.lists(st.text(alphabet="abc xyz.,\n", max_size=30), min_size=1, max_size=4), st.integers(1, 3))
def test_spaced_text_keeps_its_word_ngrams(texts: list[str], n: int) -> None:
    """Text in scripts written with spaces is split exactly as before: on whitespace."""
    grams = [tuple(t.split()[i : i + n]) for t in texts for i in range(len(t.split()) - n + 1)]
    want = len(set(grams)) / len(grams) if grams else 0.0
    assert distinct_n(texts, n) == want


def test_penalized_hits_whole_words_case_insensitive() -> None:
    text = "A movie, then a Restaurant; movies too. MOVIE! moviegoer, film-movie"
    assert penalized_hits(text, ["movie"]) == 3  # "movie", "MOVIE", "film-movie"; not movies/moviegoer
    assert penalized_hits(text, ["restaurant"]) == 1
    assert penalized_hits(text, ["movie", "restaurant"]) == 4
    assert penalized_hits(text, ["movies"]) == 1


def test_penalized_hits_word_boundaries_with_underscores_and_digits() -> None:
    assert penalized_hits("recipe_book recipe2 recipe", ["recipe"]) == 1
    assert penalized_hits("2recipe recipe.", ["recipe"]) == 1


def test_penalized_hits_phrases_and_regex_characters() -> None:
    assert penalized_hits("I like fast food and Fast  Food.", ["fast food"]) == 1
    assert penalized_hits("c++ is not c", ["c++"]) == 1
    assert penalized_hits("a.b axb", ["a.b"]) == 1


def test_penalized_hits_ignores_empty_words_and_strips() -> None:
    assert penalized_hits("movie", ["", "   ", " movie "]) == 1
    assert penalized_hits("", ["movie"]) == 0
    assert penalized_hits("movie", []) == 0


def test_penalized_hits_cjk_substrings() -> None:
    text = "我喜欢电影。这部电影院很好，电影!"
    assert penalized_hits(text, ["电影"]) == 3  # substrings: no word boundaries in CJK
    assert penalized_hits("映画を見た。映画館", ["映画"]) == 2
    assert penalized_hits("레스토랑에서 레스토랑", ["레스토랑"]) == 2


def test_penalized_hits_counts_each_listed_word() -> None:
    assert penalized_hits("movie movie", ["movie", "movie"]) == 4


# ------------------------------------------------------------------------------------------------
# token_field_values / narrative_token_rate


def test_token_values_without_continuations() -> None:
    f = NarrativeField(values=torch.tensor([0.0, 1.0, -1.0, 0.5]))
    vals = token_field_values(f, [0, 0], [1, 2, 3, 0])
    assert vals.tolist() == [1.0, -1.0, 0.5, 0.0]
    assert narrative_token_rate(f, [0], [1, 2, 3, 0]) == 0.5


def test_token_values_with_continuation_table() -> None:
    f = cont_field()
    # generated: 2 3 5 3 1 -> 3 after 2 (1.0), 5 after [2, 3] (1.0), 3 after 5 (0), 1 (0.5)
    vals = token_field_values(f, [0], [2, 3, 5, 3, 1])
    assert vals.tolist() == [0.0, 1.0, 1.0, 0.0, 0.5]
    assert math.isclose(narrative_token_rate(f, [0], [2, 3, 5, 3, 1]), 3 / 5, rel_tol=1e-6)


def test_continuation_may_start_in_the_prompt() -> None:
    f = cont_field()
    assert token_field_values(f, [0, 2], [3]).tolist() == [1.0]
    assert token_field_values(f, [2, 3], [5]).tolist() == [1.0]
    assert token_field_values(f, [], [3]).tolist() == [0.0]  # no history at all
    assert narrative_token_rate(f, [0, 2], [3]) == 1.0
    assert narrative_token_rate(f, [0, 4], [3]) == 0.0


def test_token_values_clamped() -> None:
    f = NarrativeField(
        values=torch.tensor([0.0, 0.0, 0.8]),
        prefixes=torch.tensor([[1]]),
        next_ids=torch.tensor([2]),
        next_values=torch.tensor([0.8]),
    )
    assert token_field_values(f, [1], [2]).tolist() == [1.0]


def test_tokens_outside_the_field_vocab_count_as_zero() -> None:
    # a model may pad its output layer beyond the tokenizer; such ids have no field value (nor a continuation)
    f = cont_field()
    assert token_field_values(f, [2, 3], [5]).tolist() == [1.0]  # id 5 = vocab - 1 continues [2, 3]
    assert token_field_values(f, [2, 3], [9]).tolist() == [0.0]  # 9 is not 5, even though ids are clamped
    assert token_field_values(f, [2], [9, 7]).tolist() == [0.0, 0.0]
    g = NarrativeField(values=torch.tensor([0.0, 1.0]))
    assert token_field_values(g, [], [1, 5]).tolist() == [1.0, 0.0]


def test_empty_generation() -> None:
    f = cont_field()
    assert token_field_values(f, [1, 2], []).shape == (0,)
    assert narrative_token_rate(f, [1, 2], []) == 0.0


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 5), max_size=4), st.lists(st.integers(0, 5), min_size=1, max_size=8))
def test_token_values_agree_with_for_step(prompt: list[int], gen: list[int]) -> None:
    """What the metric reports equals the field the processor saw at each step."""
    f = cont_field()
    vals = token_field_values(f, prompt, gen)
    seq = prompt + gen
    for j, tok in enumerate(gen):
        hist = seq[: len(prompt) + j]
        expected = float(f.for_step(torch.tensor([hist]))[0, tok]) if hist else float(f.values[tok])
        assert math.isclose(float(vals[j]), expected, abs_tol=1e-6)


# ------------------------------------------------------------------------------------------------
# mean_ci


@pytest.mark.parametrize("values", [[1.0, 2.0, 3.0, 10.0], [0.2, 0.4, 0.3, 0.5, 0.1], [0, 1, 0, 1, 1, 0, 1]])
def test_mean_ci_contains_mean(values: list[float]) -> None:
    m, lo, hi = mean_ci(values)
    assert math.isclose(m, sum(values) / len(values))
    assert lo <= m <= hi
    assert lo < hi
    assert min(values) <= lo and hi <= max(values)


def test_mean_ci_is_deterministic_for_a_seed() -> None:
    values = [math.sin(i) * 3 + i / 7 for i in range(25)]
    assert mean_ci(values) == mean_ci(values)
    assert mean_ci(values, seed=7) == mean_ci(values, seed=7)
    assert mean_ci(values, seed=1)[1:] != mean_ci(values, seed=2)[1:]


def test_mean_ci_level_widens() -> None:
    values = [float(i % 7) for i in range(30)]
    _, lo90, hi90 = mean_ci(values, level=0.90)
    _, lo99, hi99 = mean_ci(values, level=0.99)
    assert lo99 <= lo90 and hi90 <= hi99 and (hi99 - lo99) > (hi90 - lo90)


def test_mean_ci_constant_and_single() -> None:
    assert mean_ci([1.0, 1.0, 1.0]) == (1.0, 1.0, 1.0)
    assert mean_ci([4.5]) == (4.5, 4.5, 4.5)


def test_mean_ci_empty_is_nan() -> None:
    assert all(math.isnan(x) for x in mean_ci([]))
