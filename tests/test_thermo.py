"""Tests for narrative_gravity.gravity.thermo: measure() and Trace."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from narrative_gravity.engines.hf import NarrativeGravityLogitsProcessor
from narrative_gravity.fields import NarrativeField
from narrative_gravity.gravity.thermo import METRICS, Measurement, Trace, measure, narrative_mass
from narrative_gravity.gravity.tilt import apply_gravity, prune_mask

NEG_INF = float("-inf")


def _kl_direct(logits: torch.Tensor, pulled: torch.Tensor) -> torch.Tensor:
    """KL(q‖p) = Σ q (log q − log p), computed the plain way in float64."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    logq = torch.log_softmax(pulled.double(), dim=-1)
    q = logq.exp()
    terms = torch.where(q > 0, q * (logq - logp), torch.zeros_like(q))
    return terms.sum(-1)


# ------------------------------------------------------------------------------------------------
# entropy, mass, KL


@pytest.mark.parametrize("v", [2, 5, 50, 1000])
def test_entropy_of_uniform_is_log_v(v: int) -> None:
    m = measure(torch.zeros(2, v), torch.zeros(v), torch.tensor([0.0, 0.0]))
    torch.testing.assert_close(m.entropy, torch.full((2,), math.log(v)))


def test_entropy_of_one_hot_is_zero() -> None:
    logits = torch.tensor([[0.0, NEG_INF, NEG_INF]])
    m = measure(logits, torch.zeros(3), torch.tensor([0.0]))
    assert float(m.entropy[0]) == 0.0


def test_kl_is_zero_without_pull() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 9, generator=g)
    field = torch.rand(9, generator=g) * 2 - 1
    m = measure(logits, field, torch.zeros(3))
    torch.testing.assert_close(m.kl, torch.zeros(3), atol=1e-6, rtol=0)
    torch.testing.assert_close(m.mass, m.mass_after)
    assert m.strength.tolist() == [0.0, 0.0, 0.0]


def test_positive_pull_costs_kl_and_raises_mass() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 12, generator=g)
    field = torch.zeros(12)
    field[[1, 5, 7]] = 1.0
    lam = torch.tensor([0.5, 1.0, 2.0, 4.0])
    m = measure(logits, field, lam)
    assert torch.all(m.kl > 0)
    assert torch.all(m.mass_after > m.mass)
    # more pull, more cost and more mass (same logits in every row)
    m2 = measure(logits[:1].expand(4, -1), field, lam)
    assert torch.all(m2.kl.diff() > 0)
    assert torch.all(m2.mass_after.diff() > 0)
    torch.testing.assert_close(m2.mass, m2.mass[:1].expand(4))


def test_mass_is_probability_on_positive_tokens() -> None:
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]]))
    field = torch.tensor([1.0, -1.0, 0.5, 0.0])
    m = measure(logits, field, torch.tensor([0.0]))
    assert math.isclose(float(m.mass[0]), 0.4, rel_tol=1e-6)
    assert math.isclose(float(narrative_mass(torch.log_softmax(logits, -1), field)[0]), 0.4, rel_tol=1e-6)


def test_narrative_mass_all_neg_inf_row_is_zero() -> None:
    logp = torch.log_softmax(torch.tensor([[NEG_INF, NEG_INF], [0.0, 0.0]]), -1)
    assert narrative_mass(logp, torch.tensor([1.0, 0.0])).tolist() == [0.0, 0.5]


def test_mass_after_matches_pulled_softmax() -> None:
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 6, generator=g)
    field = torch.tensor([1.0, 0.3, 0.0, -0.4, -1.0, 0.9])
    lam = torch.tensor([1.0, 3.0])
    m = measure(logits, field, lam)
    q = torch.softmax(apply_gravity(logits, field, lam), -1)
    torch.testing.assert_close(m.mass_after, q[:, [0, 1, 5]].sum(-1))


def test_kl_matches_direct_computation() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 10, generator=g) * 3
    field = torch.rand(10, generator=g) * 2 - 1
    lam = torch.tensor([0.7, 2.0, 5.0])
    m = measure(logits, field, lam)
    torch.testing.assert_close(
        m.kl.double(), _kl_direct(logits, apply_gravity(logits, field, lam)), atol=1e-5, rtol=1e-4
    )


def test_kl_with_pruning_matches_direct_computation() -> None:
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 8, generator=g)
    field = torch.tensor([1.0, -1.0, 0.0, -0.8, 0.5, -0.2, 0.0, 1.0])
    lam = torch.tensor([1.0, 2.0])
    pulled = apply_gravity(logits, field, lam, mask=prune_mask(field, -0.5))
    m = measure(logits, field, lam, pulled=pulled)
    torch.testing.assert_close(m.kl.double(), _kl_direct(logits, pulled), atol=1e-5, rtol=1e-4)
    # pruning removes probability: the pull costs more than without pruning
    assert torch.all(m.kl > measure(logits, field, lam).kl)


def test_batch_field_and_scalar_strength() -> None:
    logits = torch.zeros(2, 3)
    field = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    m = measure(logits, field, torch.tensor(1.0))
    assert m.strength.tolist() == [1.0, 1.0]
    torch.testing.assert_close(m.mass, torch.full((2,), 1 / 3))
    torch.testing.assert_close(m.kl.double(), _kl_direct(logits, logits + field))


@settings(max_examples=50, deadline=None)
@given(
    st.integers(1, 3).flatmap(
        lambda b: st.tuples(
            hnp.arrays("float32", (b, 7), elements=st.floats(-15, 15, width=32)),
            hnp.arrays("float32", (7,), elements=st.floats(-1, 1, width=32)),
            hnp.arrays("float32", (b,), elements=st.floats(0, 6, width=32)),
        )
    )
)
def test_kl_property(case: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
    logits, field, lam = (torch.from_numpy(x) for x in case)
    m = measure(logits, field, lam)
    assert torch.all(m.kl >= -1e-5)
    torch.testing.assert_close(m.kl.double(), _kl_direct(logits, logits + lam[:, None] * field), atol=2e-4, rtol=1e-3)
    assert torch.all((m.mass >= 0) & (m.mass <= 1 + 1e-6))
    assert torch.all(m.mass_after >= m.mass - 1e-5)  # a non-negative pull never lowers the mass


# ------------------------------------------------------------------------------------------------
# non-finite inputs


def test_no_nan_with_neg_inf_logits() -> None:
    logits = torch.tensor([[0.0, NEG_INF, 1.0, NEG_INF], [2.0, 0.0, NEG_INF, -1.0]])
    field = torch.tensor([1.0, 1.0, -1.0, 0.0])
    lam = torch.tensor([2.0, 3.0])
    m = measure(logits, field, lam)
    for t in (m.entropy, m.mass, m.mass_after, m.kl, m.strength):
        assert torch.isfinite(t).all()
    torch.testing.assert_close(
        m.kl.double(), _kl_direct(logits, apply_gravity(logits, field, lam)), atol=1e-5, rtol=1e-4
    )
    p0 = torch.softmax(torch.tensor([0.0, 1.0]), -1)
    assert math.isclose(float(m.entropy[0]), float(-(p0 * p0.log()).sum()), rel_tol=1e-5)


def test_all_neg_inf_row_measures_zeros() -> None:
    logits = torch.tensor([[NEG_INF, NEG_INF, NEG_INF], [0.0, 0.0, 0.0]])
    field = torch.tensor([1.0, 0.0, 0.0])
    lam = torch.tensor([1.0, 1.0])
    m = measure(logits, field, lam)
    stacked = m.stack()
    assert not torch.isnan(stacked).any()
    assert stacked[0, :4].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert float(m.strength[0]) == 1.0
    assert float(m.entropy[1]) > 0 and float(m.kl[1]) > 0
    # the same with an explicitly pruned pull
    m2 = measure(logits, field, lam, pulled=apply_gravity(logits, field, lam, mask=prune_mask(field, 0.0)))
    assert not torch.isnan(m2.stack()).any()


def test_measure_does_not_modify_inputs() -> None:
    logits = torch.randn(2, 5, generator=torch.Generator().manual_seed(5))
    field = torch.tensor([1.0, 0.0, -1.0, 0.0, 0.5])
    lam = torch.tensor([1.0, 2.0])
    copies = logits.clone(), field.clone(), lam.clone()
    m = measure(logits, field, lam)
    assert torch.equal(logits, copies[0]) and torch.equal(field, copies[1]) and torch.equal(lam, copies[2])
    m.strength.add_(1.0)  # the measured strength is a copy
    assert torch.equal(lam, copies[2])


def test_measurement_stack_order() -> None:
    t = [torch.tensor([float(i)]) for i in range(5)]
    m = Measurement(*t)
    assert m.stack().tolist() == [[0.0, 1.0, 2.0, 3.0, 4.0]]
    assert METRICS == ("entropy", "mass", "mass_after", "kl", "strength")


# ------------------------------------------------------------------------------------------------
# Trace


def test_empty_trace() -> None:
    t = Trace()
    assert len(t) == 0
    assert t.tensor().shape == (0, 0, 5)
    assert t.means() == []
    assert set(t.to_numpy()) == set(METRICS)


def test_trace_records_b_t_5_and_resets() -> None:
    t = Trace()
    field = torch.tensor([1.0, 0.0, 0.0])
    for step in range(4):
        t.record(measure(torch.zeros(2, 3), field, torch.tensor([float(step), 1.0])))
    assert len(t) == 4
    assert t.tensor().shape == (2, 4, 5)
    arr = t.to_numpy()
    assert arr["strength"].shape == (2, 4)
    assert arr["strength"][0].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert arr["strength"][1].tolist() == [1.0] * 4
    np.testing.assert_allclose(arr["mass"], 1 / 3, rtol=1e-6)
    t.reset()
    assert len(t) == 0 and t.tensor().shape == (0, 0, 5)


def test_trace_means_respects_lengths() -> None:
    t = Trace()
    field = torch.zeros(3)
    for step in range(4):
        t.record(measure(torch.zeros(3, 3), field, torch.tensor([float(step)] * 3)))
    means = t.means([1, 2, 4])
    assert [m["strength"] for m in means] == [0.0, 0.5, 1.5]
    assert [m["strength"] for m in t.means()] == [1.5, 1.5, 1.5]
    # lengths past the trace are clipped, 0 counts as one step
    assert [m["strength"] for m in t.means([10, 0, 3])] == [1.5, 0.0, 1.0]
    assert set(means[0]) == set(METRICS)
    assert math.isclose(means[0]["entropy"], math.log(3), rel_tol=1e-6)


def test_trace_is_off_by_default_in_processor() -> None:
    proc = NarrativeGravityLogitsProcessor(NarrativeField(values=torch.tensor([1.0, 0.0, 0.0])), strength=1.0)
    assert proc.trace is None
    proc(torch.tensor([[0]]), torch.zeros(1, 3))  # runs without a trace


def test_trace_in_processor_records_b_t_5() -> None:
    trace = Trace()
    field = NarrativeField(values=torch.tensor([1.0, 0.0, -1.0, 0.0]))
    proc = NarrativeGravityLogitsProcessor(field, strength=[1.0, 2.0], trace=trace)
    ids = torch.tensor([[0, 1], [2, 3]])
    for _ in range(3):
        proc(ids, torch.zeros(2, 4))
        ids = torch.cat([ids, torch.zeros(2, 1, dtype=torch.long)], dim=1)
    assert trace.tensor().shape == (2, 3, 5)
    assert trace.to_numpy()["strength"].tolist() == [[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]]
    assert np.all(trace.to_numpy()["kl"] > 0)
