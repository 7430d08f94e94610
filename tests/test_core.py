"""Tests for narrative_gravity.gravity.tilt: apply_gravity (logits + λ·a) and prune_mask."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from narrative_gravity.gravity.tilt import apply_gravity, prune_mask

NEG_INF = float("-inf")


def _logits(b: int = 3, v: int = 7, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, v, generator=g)


def _field(v: int = 7, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(v, generator=g) * 2 - 1


# ------------------------------------------------------------------------------------------------
# apply_gravity: the formula


def test_per_row_strength_matches_formula() -> None:
    logits, field = _logits(), _field()
    lam = torch.tensor([0.0, 1.5, -2.0])
    out = apply_gravity(logits, field, lam)
    assert out.shape == logits.shape
    for b in range(3):
        torch.testing.assert_close(out[b], logits[b] + lam[b] * field)
    # row 0 has λ = 0: unchanged
    assert torch.equal(out[0], logits[0])


@pytest.mark.parametrize("strength", [2.5, 0, torch.tensor(2.5), torch.tensor(2.5, dtype=torch.float64)])
def test_scalar_and_zero_dim_strength(strength: float | torch.Tensor) -> None:
    logits, field = _logits(), _field()
    out = apply_gravity(logits, field, strength)
    expected = logits + float(strength) * field
    torch.testing.assert_close(out, expected)
    assert out.dtype == logits.dtype


def test_batch_field_per_row() -> None:
    logits = _logits(2, 5)
    field = torch.tensor([[1.0, 0.0, 0.0, 0.0, -1.0], [0.0, 0.0, 1.0, 0.0, 0.0]])
    out = apply_gravity(logits, field, torch.tensor([2.0, 3.0]))
    torch.testing.assert_close(out[0], logits[0] + 2.0 * field[0])
    torch.testing.assert_close(out[1], logits[1] + 3.0 * field[1])
    # the rows see different fields: token 0 moved in row 0 only, token 2 in row 1 only
    assert out[0, 0] == logits[0, 0] + 2.0 and out[1, 0] == logits[1, 0]
    assert out[1, 2] == logits[1, 2] + 3.0 and out[0, 2] == logits[0, 2]


def test_batch_field_with_scalar_strength() -> None:
    logits = _logits(2, 4)
    field = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, -1.0, 0.0, 0.0]])
    torch.testing.assert_close(apply_gravity(logits, field, 0.5), logits + 0.5 * field)


def test_field_dtype_follows_logits() -> None:
    logits = _logits(2, 4).to(torch.float16)
    field = torch.tensor([1.0, 0.0, -1.0, 0.5], dtype=torch.float64)
    out = apply_gravity(logits, field, torch.tensor([1.0, 2.0]))
    assert out.dtype == torch.float16
    torch.testing.assert_close(
        out.float(), logits.float() + torch.tensor([[1.0], [2.0]]) * field.float(), atol=1e-2, rtol=1e-2
    )


def test_input_is_not_modified_in_place() -> None:
    logits, field = _logits(), _field()
    logits[0, 2] = NEG_INF
    before, field_before = logits.clone(), field.clone()
    lam = torch.tensor([1.0, 2.0, 3.0])
    lam_before = lam.clone()
    out = apply_gravity(logits, field, lam, mask=prune_mask(field, 0.0))
    assert out.data_ptr() != logits.data_ptr()
    assert torch.equal(logits, before)
    assert torch.equal(field, field_before)
    assert torch.equal(lam, lam_before)
    # and the output really differs, so the comparison above means something
    assert not torch.equal(out, before)


def test_zero_strength_returns_equal_values_but_new_tensor() -> None:
    logits, field = _logits(), _field()
    out = apply_gravity(logits, field, 0.0)
    assert torch.equal(out, logits)
    out[0, 0] = 123.0
    assert logits[0, 0] != 123.0


def test_neg_inf_entries_stay_neg_inf() -> None:
    logits = _logits(2, 5)
    logits[0, 1] = NEG_INF
    logits[1, 4] = NEG_INF
    field = torch.tensor([1.0, 1.0, -1.0, 0.0, 1.0])
    out = apply_gravity(logits, field, torch.tensor([10.0, 10.0]))
    assert out[0, 1] == NEG_INF and out[1, 4] == NEG_INF
    assert torch.isfinite(out).sum() == 8
    assert not torch.isnan(out).any()


def test_all_neg_inf_row_passes_through_without_nan() -> None:
    logits = _logits(2, 4)
    logits[1] = NEG_INF
    field = torch.tensor([1.0, -1.0, 0.0, 0.5])
    for mask in (None, prune_mask(field, 0.0), torch.ones(4, dtype=torch.bool)):
        out = apply_gravity(logits, field, torch.tensor([1.0, 5.0]), mask=mask)
        assert not torch.isnan(out).any()
        assert torch.all(out[1] == NEG_INF)
        assert torch.isfinite(out[0]).any()


# ------------------------------------------------------------------------------------------------
# pruning


def test_mask_sets_pruned_tokens_to_neg_inf() -> None:
    logits = torch.zeros(2, 5)
    field = torch.tensor([1.0, 0.0, -0.5, -1.0, 0.2])
    mask = prune_mask(field, -0.5)
    assert mask.tolist() == [False, False, True, True, False]
    out = apply_gravity(logits, field, torch.tensor([1.0, 2.0]), mask=mask)
    assert torch.all(out[:, 2:4] == NEG_INF)
    torch.testing.assert_close(out[:, [0, 1, 4]], torch.tensor([[1.0, 0.0, 0.2], [2.0, 0.0, 0.4]]))


def test_batch_mask_per_row() -> None:
    logits = torch.zeros(2, 3)
    mask = torch.tensor([[True, False, False], [False, False, True]])
    out = apply_gravity(logits, torch.zeros(3), 1.0, mask=mask)
    assert out.tolist() == [[NEG_INF, 0.0, 0.0], [0.0, 0.0, NEG_INF]]


def test_mask_never_prunes_a_row_to_nothing() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0], [0.0, NEG_INF, NEG_INF], [0.0, 1.0, NEG_INF]])
    field = torch.tensor([-1.0, -1.0, 1.0])
    # mask covers token 0 and 1: row 0 keeps token 2; row 1 only had token 0 finite -> mask ignored;
    mask = torch.tensor([True, True, False])
    out = apply_gravity(logits, field, 1.0, mask=mask)
    assert out[0].tolist() == [NEG_INF, NEG_INF, 3.0]
    assert out[1].tolist() == [-1.0, NEG_INF, NEG_INF]  # would have been empty: kept as pulled
    assert out[2].tolist() == [-1.0, 0.0, NEG_INF]  # tokens 0 and 1 were all that was finite
    for row in out:
        assert torch.isfinite(row).any()


def test_mask_covering_everything_is_ignored() -> None:
    logits = torch.tensor([[0.5, 1.0, 2.0]])
    field = torch.tensor([-1.0, -1.0, -1.0])
    out = apply_gravity(logits, field, 1.0, mask=prune_mask(field, -1.0))
    torch.testing.assert_close(out, logits - 1.0)


def test_prune_mask_none_threshold() -> None:
    assert prune_mask(torch.tensor([1.0, -1.0]), None) is None


def test_prune_mask_is_at_or_below() -> None:
    field = torch.tensor([-1.0, -0.3, -0.2999, 0.0, 1.0])
    assert prune_mask(field, -0.3).tolist() == [True, True, False, False, False]
    assert prune_mask(field, -1.0).tolist() == [True, False, False, False, False]
    assert prune_mask(torch.tensor([[0.0, -1.0], [-1.0, 0.5]]), 0.0).tolist() == [[True, True], [True, False]]


# ------------------------------------------------------------------------------------------------
# property: the exponential tilt


@st.composite
def _tilt_case(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b = draw(st.integers(1, 4))
    v = draw(st.integers(2, 12))
    logits = draw(hnp.arrays("float64", (b, v), elements=st.floats(-20, 20, allow_nan=False)))
    field = draw(hnp.arrays("float64", (v,), elements=st.floats(-1, 1, allow_nan=False)))
    lam = draw(hnp.arrays("float64", (b,), elements=st.floats(0, 8, allow_nan=False)))
    return torch.from_numpy(logits), torch.from_numpy(field), torch.from_numpy(lam)


@settings(max_examples=60, deadline=None)
@given(_tilt_case())
def test_softmax_is_exponential_tilt(case: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    logits, field, lam = case
    out = apply_gravity(logits, field, lam)
    got = torch.softmax(out, dim=-1)
    p = torch.softmax(logits, dim=-1)
    unnorm = p * torch.exp(lam[:, None] * field[None, :])
    expected = unnorm / unnorm.sum(dim=-1, keepdim=True)
    assert torch.allclose(got, expected, rtol=1e-6, atol=1e-9)


@settings(max_examples=40, deadline=None)
@given(_tilt_case(), st.floats(-1, 0.99))
def test_pruned_softmax_is_renormalised_tilt(case: tuple[torch.Tensor, torch.Tensor, torch.Tensor], thr: float) -> None:
    logits, field, lam = case
    mask = prune_mask(field, thr)
    out = apply_gravity(logits, field, lam, mask=mask)
    assert not torch.isnan(out).any()
    got = torch.softmax(out, dim=-1)
    p = torch.softmax(logits, dim=-1)
    keep = ~mask if bool((~mask).any()) else torch.ones_like(mask)
    unnorm = p * torch.exp(lam[:, None] * field[None, :]) * keep
    expected = unnorm / unnorm.sum(dim=-1, keepdim=True)
    assert torch.allclose(got, expected, rtol=1e-6, atol=1e-9)
    assert math.isclose(float(got.sum()), logits.shape[0], rel_tol=1e-9)
