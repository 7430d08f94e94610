"""Tests for narrative_gravity.gravity.schedule: ConstantController and PhaseScheduleController."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from narrative_gravity.errors import ConfigurationError
from narrative_gravity.gravity.controllers import (
    ConstantController,
    DecayOptions,
    PhaseScheduleController,
    StepContext,
    StrengthController,
)


def ctx(step: int = 0, batch: int = 2, max_new: int | None = 100) -> StepContext:
    return StepContext(step=step, max_new_tokens=max_new, batch_size=batch)


# ------------------------------------------------------------------------------------------------
# ConstantController


def test_constant_returns_b_tensor() -> None:
    out = ConstantController(1.25)(ctx(batch=3))
    assert isinstance(out, torch.Tensor)
    assert out.shape == (3,)
    assert out.dtype == torch.float32
    assert out.tolist() == [1.25, 1.25, 1.25]


def test_constant_is_the_same_at_every_step() -> None:
    c = ConstantController(2.0)
    assert all(c(ctx(step=s, max_new=10)).tolist() == [2.0, 2.0] for s in (0, 5, 9, 50))
    assert c(ctx(step=3, max_new=None)).tolist() == [2.0, 2.0]


def test_constant_int_and_zero() -> None:
    assert ConstantController(3)(ctx(batch=1)).tolist() == [3.0]
    assert ConstantController(0)(ctx(batch=2)).tolist() == [0.0, 0.0]


def test_per_row_strengths() -> None:
    out = ConstantController([0.0, 0.5, 2.0])(ctx(batch=3))
    assert out.tolist() == [0.0, 0.5, 2.0]


def test_per_row_strengths_expand_for_beams() -> None:
    rows = [0.0, 1.0, 3.0]
    c = ConstantController(rows)
    for k in (2, 4):
        out = c(ctx(batch=3 * k))
        assert out.shape == (3 * k,)
        assert torch.equal(out, torch.tensor(rows).repeat_interleave(k))
    # row-major beams: [r0, r0, r1, r1, r2, r2], not [r0, r1, r2, r0, r1, r2]
    assert c(ctx(batch=6)).tolist() == [0.0, 0.0, 1.0, 1.0, 3.0, 3.0]


@pytest.mark.parametrize("batch", [2, 4, 5])
def test_per_row_strength_batch_mismatch(batch: int) -> None:
    with pytest.raises(ConfigurationError, match=rf"3 per-row strengths .* {batch} rows"):
        ConstantController([1.0, 2.0, 3.0])(ctx(batch=batch))


def test_device_is_respected() -> None:
    out = ConstantController([1.0, 2.0])(StepContext(step=0, max_new_tokens=None, batch_size=2, device="cpu"))
    assert out.device.type == "cpu"


def test_controllers_satisfy_protocol() -> None:
    assert isinstance(ConstantController(1.0), StrengthController)
    assert isinstance(PhaseScheduleController(1.0), StrengthController)


def test_repr_names_strengths() -> None:
    assert repr(ConstantController(1.5)) == "ConstantController(1.5)"
    assert repr(PhaseScheduleController([1.0, 2.0])) == "PhaseScheduleController([1.0, 2.0])"


@pytest.mark.parametrize("cls", [ConstantController, PhaseScheduleController])
@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf"), float("-inf"), True])
def test_invalid_strength_raises(cls: type, bad: object) -> None:
    with pytest.raises(ConfigurationError, match=r"`strength` has to be a finite number >= 0"):
        cls(bad)


@pytest.mark.parametrize("bad", [-1.0, float("nan")])
def test_invalid_scalar_strength_names_argument_and_value(bad: float) -> None:
    with pytest.raises(ConfigurationError, match=r"`strength` has to be a finite number >= 0, but is") as exc:
        ConstantController(bad)
    assert repr(bad) in str(exc.value)


def test_invalid_per_row_strength() -> None:
    with pytest.raises(ConfigurationError, match=r"strength\[i\].*-2\.0"):
        ConstantController([1.0, -2.0])
    with pytest.raises(ConfigurationError, match=r"strength\[i\].*nan"):
        PhaseScheduleController([float("nan")])
    with pytest.raises(ConfigurationError, match="empty"):
        ConstantController([])


# ------------------------------------------------------------------------------------------------
# PhaseScheduleController


def test_phase_boundaries_with_budget() -> None:
    s = PhaseScheduleController(2.0)  # explore < 0.2, strict >= 0.8
    assert s.scale(0, 100) == 0.5
    assert s.scale(19, 100) == 0.5
    assert s.scale(20, 100) == 1.0  # first converge step
    assert s.scale(79, 100) == 1.0
    assert s.scale(80, 100) == 1.5  # first strict step
    assert s.scale(99, 100) == 1.5
    assert s(ctx(step=0, batch=2)).tolist() == [1.0, 1.0]
    assert s(ctx(step=50, batch=2)).tolist() == [2.0, 2.0]
    assert s(ctx(step=80, batch=2)).tolist() == [3.0, 3.0]


def test_custom_phases() -> None:
    s = PhaseScheduleController(1.0, explore_until=0.5, strict_from=0.5, explore=0.0, converge=9.0, strict=3.0)
    assert s.scale(4, 10) == 0.0
    assert s.scale(5, 10) == 3.0  # empty converge phase: straight to strict
    s = PhaseScheduleController(1.0, explore_until=0.0, strict_from=1.0, explore=0.0, converge=2.0, strict=7.0)
    assert [s.scale(t, 10) for t in (0, 9)] == [2.0, 2.0]
    assert s.scale(10, 10) == 7.0


def test_no_budget_uses_explore_steps_and_never_strict() -> None:
    s = PhaseScheduleController(1.0, explore_steps=3)
    assert [s.scale(t, None) for t in range(5)] == [0.5, 0.5, 0.5, 1.0, 1.0]
    assert s.scale(10_000, None) == 1.0
    assert s(ctx(step=0, max_new=None)).tolist() == [0.5, 0.5]


def test_schedule_with_per_row_strengths_and_beams() -> None:
    s = PhaseScheduleController([0.0, 2.0])
    assert s(ctx(step=90, batch=4)).tolist() == [0.0, 0.0, 3.0, 3.0]
    with pytest.raises(ConfigurationError):
        s(ctx(step=0, batch=3))


def test_decay_halves_after_half_life() -> None:
    s = PhaseScheduleController(1.0, explore_steps=0, decay=DecayOptions(10, 5.0))
    assert s.scale(10, None) == 1.0  # at the threshold: no decay yet
    assert math.isclose(s.scale(15, None), 0.5)
    assert math.isclose(s.scale(20, None), 0.25)
    assert math.isclose(s.scale(11, None), 0.5 ** (1 / 5))
    assert 0 < s.scale(1000, None) < 1e-20
    out = s(ctx(step=15, batch=2, max_new=None))
    torch.testing.assert_close(out, torch.tensor([0.5, 0.5]))


def test_decay_combines_with_phase() -> None:
    s = PhaseScheduleController(2.0, decay=DecayOptions(50, 25.0))
    assert s.scale(50, 100) == 1.0
    assert math.isclose(s.scale(75, 100), 0.5)  # converge 1.0 × 0.5
    assert math.isclose(s.scale(90, 100), 1.5 * 0.5 ** (40 / 25))  # strict × decay


def test_decay_after_zero_decays_from_first_step() -> None:
    s = PhaseScheduleController(1.0, explore_steps=0, decay=DecayOptions(0, 1.0))
    assert s.scale(0, None) == 1.0
    assert s.scale(1, None) == 0.5


@settings(max_examples=100, deadline=None)
@given(
    strength=st.floats(0, 20),
    step=st.integers(0, 500),
    budget=st.one_of(st.none(), st.integers(1, 500)),
    decay=st.one_of(st.none(), st.integers(0, 200)),
)
def test_schedule_strength_is_bounded(strength: float, step: int, budget: int | None, decay: int | None) -> None:
    s = PhaseScheduleController(strength, decay=DecayOptions(decay))
    out = s(ctx(step=step, batch=1, max_new=budget))
    assert out.shape == (1,)
    assert 0.0 <= float(out[0]) <= 1.5 * strength * (1 + 1e-6) + 1e-6
    assert math.isclose(float(out[0]), strength * s.scale(step, budget), rel_tol=1e-5, abs_tol=1e-6)


# ------------------------------------------------------------------------------------------------
# PhaseScheduleController validation


def test_explore_until_after_strict_from_raises() -> None:
    with pytest.raises(ConfigurationError, match=r"explore_until=0\.9, strict_from=0\.5"):
        PhaseScheduleController(1.0, explore_until=0.9, strict_from=0.5)


@pytest.mark.parametrize(
    "kwargs",
    [{"explore_until": -0.1}, {"strict_from": 1.5}, {"explore_until": float("nan")}],
)
def test_phase_bounds_out_of_range(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigurationError, match="explore_until"):
        PhaseScheduleController(1.0, **kwargs)


@pytest.mark.parametrize("name", ["explore", "converge", "strict"])
@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_phase_multipliers_validated(name: str, bad: float) -> None:
    with pytest.raises(ConfigurationError, match=rf"`{name}`"):
        PhaseScheduleController(1.0, **{name: bad})


@pytest.mark.parametrize("bad", [-1, -50, 2.5, "10"])
def test_bad_decay_after_steps(bad: object) -> None:
    with pytest.raises(ConfigurationError, match=r"`decay_after_steps`") as exc:
        PhaseScheduleController(1.0, decay=DecayOptions(bad))
    assert repr(bad) in str(exc.value)


@pytest.mark.parametrize("bad", [0.0, -3.0, float("nan")])
def test_bad_decay_half_life(bad: float) -> None:
    with pytest.raises(ConfigurationError, match=r"`decay_half_life`"):
        PhaseScheduleController(1.0, decay=DecayOptions(5, bad))


def test_configuration_error_is_value_error() -> None:
    with pytest.raises(ValueError):
        ConstantController(-1.0)


def test_string_strength_is_named_not_split_into_characters() -> None:
    with pytest.raises(ConfigurationError, match=r"the string '1\.0'.*float\(value\)"):
        ConstantController("1.0")  # type: ignore[arg-type]
