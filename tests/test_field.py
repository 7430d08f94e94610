"""Tests for narrative_gravity.gravity.field.NarrativeField: for_step, continuation, fit_vocab, to."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from narrative_gravity.errors import FieldError, VocabularyError
from narrative_gravity.fields import NarrativeField, WordReport


def cont_field() -> NarrativeField:
    """V = 8. Word A = [2, 3] (value 1), word B = [4, 5, 6] (value 0.8), and 7 has a penalty after 1."""
    values = torch.tensor([0.0, 0.0, 0.5, 0.0, 0.4, 0.0, 0.0, 0.9])
    prefixes = torch.tensor([[-1, 2], [-1, 4], [4, 5], [-1, 1]])
    next_ids = torch.tensor([3, 5, 6, 7])
    next_values = torch.tensor([1.0, 0.8, 0.8, -1.0])
    return NarrativeField(values=values, prefixes=prefixes, next_ids=next_ids, next_values=next_values)


# ------------------------------------------------------------------------------------------------
# construction


def test_plain_field_properties() -> None:
    f = NarrativeField(values=torch.tensor([0.0, 1.0, -1.0]))
    assert f.vocab_size == 3
    assert not f.has_continuations
    assert f.max_prefix_len == 0
    assert isinstance(f.report, WordReport) and f.report.n_used == 0 and f.report.n_unusable == 0
    assert f.name == "field"


def test_continuation_field_properties() -> None:
    f = cont_field()
    assert f.has_continuations and f.max_prefix_len == 2 and f.vocab_size == 8


def test_empty_continuation_table_is_no_continuations() -> None:
    f = NarrativeField(
        values=torch.tensor([0.0, 1.0]),
        prefixes=torch.zeros(0, 2, dtype=torch.long),
        next_ids=torch.zeros(0, dtype=torch.long),
        next_values=torch.zeros(0),
    )
    assert not f.has_continuations
    assert f.for_step(torch.tensor([[1]])).tolist() == [0.0, 1.0]


def test_values_must_be_1d() -> None:
    with pytest.raises(VocabularyError, match=r"1-D.*\(2, 3\)"):
        NarrativeField(values=torch.zeros(2, 3))


def test_table_parts_together() -> None:
    with pytest.raises(VocabularyError, match="together"):
        NarrativeField(values=torch.zeros(3), prefixes=torch.tensor([[1]]))


def test_table_shapes_must_agree() -> None:
    with pytest.raises(VocabularyError, match="shapes disagree"):
        NarrativeField(
            values=torch.zeros(3),
            prefixes=torch.tensor([[1], [2]]),
            next_ids=torch.tensor([1]),
            next_values=torch.ones(1),
        )


@pytest.mark.parametrize("bad", [3, 10, -1])
def test_continuation_ids_out_of_vocab(bad: int) -> None:
    with pytest.raises(VocabularyError, match=rf"continuation token ids \[{bad}\]"):
        NarrativeField(
            values=torch.zeros(3),
            prefixes=torch.tensor([[1], [0]]),
            next_ids=torch.tensor([2, bad]),
            next_values=torch.ones(2),
        )


def test_vocabulary_error_is_field_error() -> None:
    assert issubclass(VocabularyError, FieldError) and issubclass(VocabularyError, ValueError)


# ------------------------------------------------------------------------------------------------
# for_step / continuation


def test_for_step_without_continuations_is_values() -> None:
    values = torch.tensor([0.0, 1.0, -1.0])
    f = NarrativeField(values=values)
    out = f.for_step(torch.tensor([[0, 1], [2, 2]]))
    assert out.shape == (3,)
    assert torch.equal(out, values)


def test_for_step_matches_prefixes() -> None:
    f = cont_field()
    ids = torch.tensor(
        [
            [0, 0, 2],  # after A's first piece -> 3 gets 1.0
            [0, 0, 4],  # after B's first piece -> 5 gets 0.8
            [0, 4, 5],  # after B's first two pieces -> 6 gets 0.8 (5 is not continued by [4, 5])
            [0, 2, 5],  # 5 after 2: not B's prefix -> 6 gets nothing
            [0, 0, 1],  # after 1 -> 7 is penalised: 0.9 - 1.0
            [0, 0, 0],
        ]
    )
    out = f.for_step(ids)
    assert out.shape == (6, 8)
    base = f.values
    exp = base.expand(6, -1).clone()
    exp[0, 3] = 1.0
    exp[1, 5] = 0.8
    exp[2, 6] = 0.8
    exp[4, 7] = 0.9 - 1.0
    torch.testing.assert_close(out, exp)
    # the field itself is not modified by the in-place clamp
    assert torch.equal(f.values, base)


def test_for_step_clamps_to_unit_interval() -> None:
    f = NarrativeField(
        values=torch.tensor([0.0, 0.0, 0.7]),
        prefixes=torch.tensor([[1], [1]]),
        next_ids=torch.tensor([2, 0]),
        next_values=torch.tensor([0.9, -1.0]),
    )
    out = f.for_step(torch.tensor([[1], [0]]))
    assert out[0].tolist() == [-1.0, 0.0, 1.0]  # 0.7 + 0.9 clamped to 1
    assert torch.allclose(out[1], torch.tensor([0.0, 0.0, 0.7]))
    assert out.max() <= 1.0 and out.min() >= -1.0


def test_duplicate_continuations_accumulate() -> None:
    f = NarrativeField(
        values=torch.zeros(3),
        prefixes=torch.tensor([[1], [1]]),
        next_ids=torch.tensor([2, 2]),
        next_values=torch.tensor([0.25, 0.5]),
    )
    assert f.continuation(torch.tensor([[1]])).tolist() == [[0.0, 0.0, 0.75]]


def test_continuation_with_history_shorter_than_prefix() -> None:
    f = cont_field()
    # one token of history: the right-aligned [-1, 2] prefix still matches, [4, 5] cannot
    out = f.continuation(torch.tensor([[2], [5]]))
    assert out.shape == (2, 8)
    assert out[0].tolist() == [0, 0, 0, 1.0, 0, 0, 0, 0]
    assert out[1].abs().sum() == 0
    # empty history: nothing matches
    assert f.continuation(torch.zeros(1, 0, dtype=torch.long)).abs().sum() == 0


def test_continuation_of_plain_field_is_zero() -> None:
    f = NarrativeField(values=torch.tensor([1.0, 0.0]))
    assert f.continuation(torch.tensor([[0], [1]])).tolist() == [[0.0, 0.0], [0.0, 0.0]]


def test_only_the_last_tokens_matter() -> None:
    f = cont_field()
    a = f.for_step(torch.tensor([[4, 5, 0, 0, 2]]))
    b = f.for_step(torch.tensor([[2]]))
    torch.testing.assert_close(a, b)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 7), min_size=1, max_size=6), st.lists(st.integers(0, 7), min_size=1, max_size=6))
def test_continuation_matches_python_reference(hist_a: list[int], hist_b: list[int]) -> None:
    f = cont_field()
    n = max(len(hist_a), len(hist_b))
    rows = [[0] * (n - len(h)) + h for h in (hist_a, hist_b)]  # left pad with token 0 (never in a prefix)
    out = f.continuation(torch.tensor(rows))
    for r, hist in enumerate((hist_a, hist_b)):
        expected = [0.0] * 8
        for pref, nxt, val in zip(f.prefixes.tolist(), f.next_ids.tolist(), f.next_values.tolist()):
            real = [p for p in pref if p >= 0]
            if hist[-len(real) :] == real:
                expected[nxt] += val
        assert torch.allclose(out[r], torch.tensor(expected))


# ------------------------------------------------------------------------------------------------
# fit_vocab


def test_fit_vocab_same_width_is_identity() -> None:
    f = cont_field()
    assert f.fit_vocab(8) is f


def test_fit_vocab_wider_pads_with_zeros() -> None:
    f = cont_field()
    g = f.fit_vocab(11)
    assert g.vocab_size == 11
    assert torch.equal(g.values[:8], f.values) and g.values[8:].tolist() == [0.0, 0.0, 0.0]
    out = g.for_step(torch.tensor([[0, 2]]))
    assert out.shape == (1, 11) and float(out[0, 3]) == 1.0
    assert f.vocab_size == 8  # original untouched


def test_fit_vocab_narrower_drops_zero_tail() -> None:
    f = NarrativeField(values=torch.tensor([1.0, 0.0, -1.0, 0.0, 0.0]))
    g = f.fit_vocab(3)
    assert g.values.tolist() == [1.0, 0.0, -1.0]
    assert g.values.is_contiguous()


def test_fit_vocab_narrower_with_values_beyond_names_ids() -> None:
    f = NarrativeField(values=torch.tensor([1.0, 0.0, 0.0, 0.5, 0.0, -0.2]))
    with pytest.raises(VocabularyError, match=r"logits have 3 columns.*token ids \[3, 5\].*field vocabulary 6"):
        f.fit_vocab(3)


def test_fit_vocab_narrower_with_continuation_beyond_names_ids() -> None:
    f = NarrativeField(
        values=torch.zeros(6),
        prefixes=torch.tensor([[1]]),
        next_ids=torch.tensor([4]),
        next_values=torch.tensor([1.0]),
    )
    with pytest.raises(VocabularyError, match=r"token ids \[4\]"):
        f.fit_vocab(4)
    assert f.fit_vocab(5).vocab_size == 5


def test_fit_vocab_error_truncates_long_id_lists() -> None:
    f = NarrativeField(values=torch.cat([torch.zeros(2), torch.ones(20)]))
    with pytest.raises(VocabularyError, match=r"\[2, 3, 4, 5, 6, 7, 8, 9, 10, 11\] …"):
        f.fit_vocab(2)


# ------------------------------------------------------------------------------------------------
# to


def test_to_dtype_moves_float_parts_only() -> None:
    f = cont_field()
    g = f.to("cpu", torch.float16)
    assert g.values.dtype == torch.float16 and g.next_values.dtype == torch.float16
    assert g.prefixes.dtype == torch.long and g.next_ids.dtype == torch.long
    assert torch.equal(g.prefixes, f.prefixes) and torch.equal(g.next_ids, f.next_ids)
    assert f.values.dtype == torch.float32  # original untouched
    out = g.for_step(torch.tensor([[2]]))
    assert out.dtype == torch.float16 and float(out[0, 3]) == 1.0


def test_to_without_dtype_keeps_dtypes() -> None:
    f = NarrativeField(values=torch.tensor([0.5, 0.0], dtype=torch.float64), name="x")
    g = f.to(torch.device("cpu"))
    assert g.values.dtype == torch.float64 and g.name == "x" and g.prefixes is None
    assert torch.equal(g.values, f.values)
