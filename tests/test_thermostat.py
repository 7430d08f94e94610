"""Tests for the thermostat: ``solve_strength`` (the bisection) and ``ThermostatController`` (the target)."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from narrative_gravity.engines.hf import processor_from_profile
from narrative_gravity.errors import ConfigurationError, ProfileError
from narrative_gravity.gravity import thermo
from narrative_gravity.gravity.controllers import (
    DecayOptions,
    StepContext,
    StrengthController,
    ThermostatController,
    ThermostatOptions,
)
from narrative_gravity.gravity.solve import MAX_THERMOSTAT_STRENGTH, MassProblem, solve_strength
from narrative_gravity.gravity.thermo import Trace, Workspace, measure, probabilities
from narrative_gravity.profiles.build import controller_from_profile, thermostat_args
from narrative_gravity.profiles.schema import Profile

ITERS = 14
LAM_MAX = 8.0
WIDTH = LAM_MAX / 2**ITERS  # the final bisection bracket


def dense_mass(logits: torch.Tensor, field: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """Narrative mass after the pull, measured the slow, obvious way (float64)."""
    pulled = logits.double() + lam.double().reshape(-1, 1) * field.double()
    p = torch.softmax(pulled, dim=-1)
    return torch.nan_to_num((p * (field > 0).double()).sum(-1), nan=0.0)


# -- strategies ------------------------------------------------------------------------------------

FIELD_VALUES = st.sampled_from([-1.0, -0.5, 0.0, 0.0, 0.0, 0.25, 0.5, 1.0])


@st.composite
def problems(draw: Any, max_b: int = 4, max_v: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    b = draw(st.integers(1, max_b))
    v = draw(st.integers(2, max_v))
    logits = torch.tensor(
        draw(st.lists(st.floats(-12, 12, allow_nan=False, width=32), min_size=b * v, max_size=b * v))
    ).reshape(b, v)
    vals = draw(st.lists(FIELD_VALUES, min_size=v, max_size=v))
    vals[draw(st.integers(0, v - 1))] = 1.0  # at least one pulled token
    return logits, torch.tensor(vals)


# -- solve_strength: the bisection -------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(problems(), st.floats(0.0, 0.95))
def test_reached_mass_meets_target_and_lambda_is_smallest(prob: tuple[torch.Tensor, torch.Tensor], t: float) -> None:
    logits, field = prob
    b = logits.shape[0]
    target = torch.full((b,), t)
    lam = solve_strength(logits, field, target, LAM_MAX, iterations=ITERS)
    assert lam.shape == (b,) and torch.isfinite(lam).all()
    assert ((lam >= 0) & (lam <= LAM_MAX)).all()
    m0 = dense_mass(logits, field, torch.zeros(b))
    m_max = dense_mass(logits, field, torch.full((b,), LAM_MAX))
    m = dense_mass(logits, field, lam)
    for r in range(b):
        if m0[r] >= t + 1e-6:
            assert lam[r] == 0.0  # already on the narrative: untouched
        elif m_max[r] < t - 1e-6:
            assert lam[r] == LAM_MAX  # infeasible: the strongest allowed pull
        elif m_max[r] >= t + 1e-6 and m0[r] < t - 1e-6:
            assert m[r] >= t - 1e-5  # the target is reached ...
            below = dense_mass(logits[r : r + 1], field, (lam[r] - 1.01 * WIDTH).clamp_min(0).reshape(1))
            assert below[0] < t + 1e-5  # ... and no clearly smaller λ reaches it


def _bisect(prob: MassProblem, target: torch.Tensor, lam_max: torch.Tensor, iterations: torch.Tensor) -> torch.Tensor:
    """The reference: plain bisection on ``prob.mass``, each row for its own number of iterations."""
    lo, hi = torch.zeros_like(lam_max), lam_max.clone()
    for i in range(int(iterations.max())):
        mid = 0.5 * (lo + hi)
        reached = prob.mass(mid) >= target
        live = iterations > i
        hi = torch.where(reached & live, mid, hi)
        lo = torch.where(~reached & live, mid, lo)
    return torch.where(prob.mass(torch.zeros_like(hi)) >= target, 0.0, hi)


@settings(max_examples=100, deadline=None)
@given(
    problems(max_b=4, max_v=40),
    st.floats(0.0, 0.95),
    st.integers(1, 40),
    st.lists(st.integers(1, 16), min_size=4, max_size=4),
    st.sampled_from([1, 2, 3, 5, 7]),
)
def test_grid_solver_finds_the_point_bisection_finds(
    prob: tuple[torch.Tensor, torch.Tensor], t: float, candidates: int, iterations: list[int], bits: int
) -> None:
    """Several bits of λ per batched evaluation give bisection's answer (on the same candidates, with the mass
    outside them held constant), for any number of bits per level and per-row iteration counts; the two sum in
    different orders, so a λ may differ by one grid step where the mass sits on the target."""
    logits, field = prob
    b = logits.shape[0]
    p, entropy = probabilities(logits)
    problem = MassProblem(p, entropy, field, True, candidates)
    target, lam_max = torch.full((b,), t), torch.full((b,), LAM_MAX)
    rows = torch.tensor(iterations[:b])
    n = int(rows.max())
    got = problem.solve(target, lam_max, n, None if (rows == n).all() else rows, bits=bits)
    want = _bisect(problem, target, lam_max, rows)
    unit = LAM_MAX / 2 ** rows.double()
    assert ((got.double() - want.double()).abs() <= unit * 1.001).all(), (got, want)
    # a kept buffer (the kernel's) gives the same numbers, also when it was left larger by a bigger problem
    work = Workspace()
    work.shaped("solver", (b + 3, 2**bits, 64), logits.device).fill_(float("nan"))
    kept = problem.solve(target, lam_max, n, None if (rows == n).all() else rows, bits=bits, workspace=work)
    assert torch.equal(kept, got)


def dense_kl(logits: torch.Tensor, field: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """KL(pulled ‖ plain) per row, the slow, obvious way (float64)."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    logq = torch.log_softmax(logits.double() + lam.double().reshape(-1, 1) * field.double(), dim=-1)
    return (logq.exp() * (logq - logp)).sum(-1)


@settings(max_examples=120, deadline=None)
@given(problems(max_b=4, max_v=30), st.floats(0.0, 0.95), st.floats(0.01, 2.0), st.sampled_from([1, 3, 7]))
def test_kl_budget_stops_the_pull_at_the_first_lambda_that_costs_it(
    prob: tuple[torch.Tensor, torch.Tensor], t: float, budget: float, bits: int
) -> None:
    """With a KL budget, λ is the smallest grid point whose mass reaches the target or whose KL reaches the
    budget (exact KL over the whole vocabulary), and never more than without the budget."""
    logits, field = prob
    b = logits.shape[0]
    p, entropy = probabilities(logits)
    problem = MassProblem(p, entropy, field, True, 64)
    target, lam_max = torch.full((b,), t), torch.full((b,), LAM_MAX)
    free = problem.solve(target, lam_max, ITERS, bits=bits)
    got = problem.solve(target, lam_max, ITERS, bits=bits, kl_budget=torch.full((b,), budget))
    assert (got <= free + 1e-6).all()
    for r in range(b):
        if got[r] == 0.0 or got[r] == LAM_MAX:
            continue
        lam = got[r : r + 1]
        reached = dense_mass(logits[r : r + 1], field, lam)[0] >= t - 1e-4
        spent = dense_kl(logits[r : r + 1], field, lam)[0] >= budget - 1e-4
        assert reached or spent, (lam, t, budget)
        before = (lam - 1.01 * WIDTH).clamp_min(0)
        if float(before) > 0:  # one grid step below, neither has happened (up to float32 sums)
            assert dense_mass(logits[r : r + 1], field, before)[0] < t + 1e-4
            assert dense_kl(logits[r : r + 1], field, before)[0] < budget + 1e-4


def test_kl_budget_through_the_profile_and_both_solvers(tiny_model: tuple[Any, Any]) -> None:
    """A profile's ``thermostat.kl_budget`` reaches the controller, the kernel's schedule row and the solver: a
    tight budget lowers the mean pull and the KL each step costs, on a real model's logits."""
    model, tokenizer = tiny_model
    words = ["the", "and", "of"]

    def run(budget: float | None) -> tuple[float, float]:
        spec: dict[str, Any] = {"core_semantics": words, "field": {"mode": "lexical"}, "schedule": "thermostat"}
        spec["thermostat"] = {"max_strength": 8.0, "strict_target": 0.9, "converge_target": 0.9}
        if budget is not None:
            spec["thermostat"]["kl_budget"] = budget
        trace = Trace()
        proc = processor_from_profile(Profile.from_mapping(spec), tokenizer, max_new_tokens=12, trace=trace)
        enc = tokenizer(["The crew", "A small moon moves"], return_tensors="pt", padding=True)
        torch.manual_seed(0)
        _greedy(model, tokenizer, enc, proc, 12)
        t = trace.to_numpy()
        return float(t["strength"].mean()), float(t["kl"].max())

    free_lam, free_kl = run(None)
    tight_lam, tight_kl = run(0.02)
    assert tight_lam < free_lam and tight_kl < free_kl
    assert tight_kl <= 0.02 * 1.5  # the budget holds (the solver's grid point is the first one over it)
    assert controller_from_profile(
        Profile.from_mapping({"core_semantics": words, "thermostat": {"kl_budget": 0.1}})
    ).row()["kl_budget"] == pytest.approx(0.1)


def test_feasible_exact_value() -> None:
    # two tokens of 100 pulled with a = 1, flat logits: mass(λ) = 2e^λ / (2e^λ + 98) = 0.5 at λ = ln 49
    logits = torch.zeros(1, 100)
    field = torch.zeros(100)
    field[:2] = 1.0
    lam = solve_strength(logits, field, 0.5, LAM_MAX, iterations=ITERS)
    assert math.log(49) <= lam.item() <= math.log(49) + WIDTH
    assert dense_mass(logits, field, lam).item() >= 0.5


def test_zero_when_mass_already_reached_and_max_when_infeasible() -> None:
    logits = torch.tensor([[5.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 30.0]])
    field = torch.tensor([1.0, 0.0, 0.0, 0.0])
    lam = solve_strength(logits, field, torch.tensor([0.9, 0.9]), LAM_MAX)
    assert lam[0].item() == 0.0  # p(token 0) ≈ 0.98 >= 0.9
    assert lam[1].item() == LAM_MAX  # e^{8} cannot beat e^{30}


@settings(max_examples=80, deadline=None)
@given(problems(max_b=2), st.lists(st.floats(0.0, 0.99), min_size=2, max_size=6))
def test_lambda_is_monotone_in_the_target(prob: tuple[torch.Tensor, torch.Tensor], targets: list[float]) -> None:
    logits, field = prob
    targets = sorted(targets)
    lams = [solve_strength(logits, field, t, LAM_MAX) for t in targets]
    for lo, hi in itertools.pairwise(lams):
        assert (hi >= lo).all()


@settings(max_examples=60, deadline=None)
@given(problems(max_b=4), st.lists(st.floats(0.0, 0.95), min_size=4, max_size=4))
def test_rows_are_independent(prob: tuple[torch.Tensor, torch.Tensor], ts: list[float]) -> None:
    logits, field = prob
    b = logits.shape[0]
    target = torch.tensor(ts[:b])
    lam_max = torch.tensor([2.0, 4.0, 8.0, 16.0])[:b]
    together = solve_strength(logits, field, target, lam_max)
    for r in range(b):
        alone = solve_strength(logits[r : r + 1], field, target[r : r + 1], lam_max[r : r + 1])
        assert torch.allclose(alone, together[r : r + 1], atol=lam_max[r].item() / 2**14 * 1.01)


def test_rows_are_independent_with_a_per_row_field() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 3
    field = torch.zeros(3, 50)
    field[0, :3] = 1.0
    field[1, 10:20] = 0.5
    field[2, 40] = 1.0
    field[:, 30] = -1.0
    together = solve_strength(logits, field, 0.4, LAM_MAX)
    for r in range(3):
        alone = solve_strength(logits[r : r + 1], field[r : r + 1], 0.4, LAM_MAX)
        assert torch.allclose(alone, together[r : r + 1], atol=WIDTH * 1.01)
    # a [B, V] field that is the same on every row gives the [V] answer
    shared = field[0]
    assert torch.allclose(
        solve_strength(logits, shared.expand(3, -1), 0.4, LAM_MAX),
        solve_strength(logits, shared, 0.4, LAM_MAX),
        atol=WIDTH * 1.01,
    )


def test_minus_inf_logits_and_dead_rows_give_no_nan() -> None:
    ninf = float("-inf")
    logits = torch.tensor(
        [
            [0.0, ninf, 0.0, ninf, 1.0],  # some -inf
            [ninf] * 5,  # nothing left to sample
            [ninf, ninf, 0.0, 0.0, 0.0],  # the pulled tokens are masked out: mass stays 0
            [0.0, 0.0, 0.0, 0.0, ninf],
        ]
    )
    field = torch.tensor([1.0, 0.5, 0.0, -1.0, 0.0])
    lam = solve_strength(logits, field, 0.6, LAM_MAX)
    assert torch.isfinite(lam).all()
    assert lam[1].item() == 0.0  # dead row: untouched
    assert lam[2].item() == LAM_MAX  # infeasible
    m = dense_mass(logits, field, lam)
    assert m[0] >= 0.6 - 1e-5 and m[3] >= 0.6 - 1e-5
    # the pulled logits stay NaN-free too
    out = logits + lam[:, None] * field
    assert not torch.isnan(out).any()


def test_few_candidates_err_on_the_strong_side() -> None:
    # more non-zero columns than candidates: the mass outside is frozen, λ can only come out larger
    torch.manual_seed(1)
    logits = torch.randn(4, 300) * 2
    field = torch.zeros(300)
    field[torch.randperm(300)[:60]] = torch.rand(60) * 0.9 + 0.1
    field[:20] = -1.0
    exact = solve_strength(logits, field, 0.5, LAM_MAX, candidates=300)
    few = solve_strength(logits, field, 0.5, LAM_MAX, candidates=16)
    assert (few >= exact - WIDTH).all()
    assert (dense_mass(logits, field, few) >= 0.5 - 1e-5).all()
    # with at least as many candidates as non-zero columns the answer is exact
    enough = solve_strength(logits, field, 0.5, LAM_MAX, candidates=80)
    assert torch.allclose(enough, exact, atol=WIDTH * 1.01)


def test_mass_outside_the_candidates_is_frozen_not_dropped() -> None:
    # 60 of 300 tokens pulled (a = 1), flat logits: mass 0.2. With 16 candidates the other 44 pulled tokens
    # keep their λ = 0 probability: (16 e^λ + 44) / (16 e^λ + 284) = 0.5 at e^λ = 12.25.
    logits = torch.zeros(1, 300)
    field = torch.zeros(300)
    field[:60] = 1.0
    exact = solve_strength(logits, field, 0.5, LAM_MAX, candidates=300).item()
    assert math.log(4) <= exact <= math.log(4) + WIDTH
    few = solve_strength(logits, field, 0.5, LAM_MAX, candidates=16).item()
    assert math.log(12.25) <= few <= math.log(12.25) + WIDTH


def test_solver_rejects_bad_arguments() -> None:
    logits, field = torch.zeros(1, 3), torch.tensor([1.0, 0.0, 0.0])
    with pytest.raises(ConfigurationError, match="iterations"):
        solve_strength(logits, field, 0.5, 4.0, iterations=0)
    with pytest.raises(ConfigurationError, match="max_strength"):
        solve_strength(logits, field, 0.5, 500.0)


@settings(max_examples=80, deadline=None)
@given(
    problems(max_b=7, max_v=40),
    st.integers(1, 600),
    st.sets(st.integers(0, 39), max_size=12),
    st.sampled_from(["none", "-inf", "dead", "nan"]),
)
def test_the_pass_in_row_blocks_gives_the_numbers_of_one_pass(
    prob: tuple[torch.Tensor, torch.Tensor], block_bytes: int, support: set[int], odd: str
) -> None:
    """On the CPU the whole-vocabulary pass runs in blocks of rows that fit the cache: any block size gives
    exactly the numbers of one pass over all rows, with or without a support, a kept workspace, ``-inf``
    logits, a row without a finite logit or a NaN one."""
    logits, _ = prob
    b, v = logits.shape
    if odd == "-inf":
        logits[:, : v // 2] = float("-inf")
    elif odd == "dead":
        logits[-1] = float("-inf")
    elif odd == "nan":
        logits[0, -1] = float("nan")
    sup = torch.tensor(sorted(i for i in support if i < v), dtype=torch.long)
    sup = sup if sup.numel() else None
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(thermo, "CPU_BLOCK_BYTES", 1 << 40)
        assert thermo.block_rows(logits) == b
        whole = probabilities(logits, sup)
        mp.setattr(thermo, "CPU_BLOCK_BYTES", block_bytes)
        rows = thermo.block_rows(logits)
        assert 1 <= rows <= b
        work = Workspace()
        work.get("exp", torch.empty(b + 2, v)).fill_(float("nan"))  # a dirty, larger buffer is fine too
        for got in (probabilities(logits, sup), probabilities(logits, sup, workspace=work)):
            assert torch.equal(got[0].isnan(), whole[0].isnan())
            assert torch.equal(got[0].nan_to_num(-1.0), whole[0].nan_to_num(-1.0))
            assert torch.equal(got[1], whole[1])


def test_input_is_not_modified() -> None:
    logits = torch.randn(2, 10)
    field = torch.zeros(10)
    field[:2] = 1.0
    before = logits.clone(), field.clone()
    solve_strength(logits, field, 0.5, LAM_MAX)
    assert torch.equal(logits, before[0]) and torch.equal(field, before[1])


# -- ThermostatController: the target ---------------------------------------------------------------

V = 64
# the targets the arithmetic in these tests uses (the defaults are checked in test_default_targets)
PIN: dict[str, Any] = {"explore_target": 0.05, "converge_target": 0.2, "strict_target": 0.35}


def flat_ctx(
    batch: int = 1,
    step: int = 50,
    budget: int | None = 100,
    input_ids: torch.Tensor | None = None,
    logits: torch.Tensor | None = None,
    field: torch.Tensor | None = None,
) -> StepContext:
    if field is None:
        field = torch.zeros(V)
        field[:2] = 1.0
    return StepContext(
        step=step,
        max_new_tokens=budget,
        batch_size=batch,
        logits=torch.zeros(batch, V) if logits is None else logits,
        field=field,
        input_ids=input_ids,
    )


def test_is_a_strength_controller() -> None:
    assert isinstance(ThermostatController(), StrengthController)


def test_default_targets() -> None:
    c = ThermostatController(6.0, ThermostatOptions(drift_gain=0.0))
    assert [c.target(flat_ctx(step=s)).item() for s in (0, 50, 90)] == pytest.approx([0.08, 0.25, 0.4])
    d = ThermostatController()
    assert (d.options.drift_gain, d.options.drift_share, d.options.drift_window) == (0.15, 0.125, 8)
    assert (d.options.entropy_low, d.options.entropy_high, d.options.max_target) == (0.05, 0.25, 0.95)
    assert d.base(1, "cpu").item() == 6.0
    # the profile carries the same feedback defaults, and the topic default's targets and λ_max
    kwargs = thermostat_args(Profile(core_semantics=["orbit"]))
    opts = kwargs["options"]
    for name in ("drift_gain", "drift_share", "drift_window", "entropy_low", "entropy_high", "max_target"):
        assert getattr(opts, name) == getattr(d.options, name), name
    targets = [getattr(opts, k) for k in ("explore_target", "converge_target", "strict_target")]
    assert [*targets, kwargs["max_strength"]] == pytest.approx([0.4, 0.6, 0.8, 4.25])


def test_phase_targets_follow_the_budget() -> None:
    c = ThermostatController(6.0, ThermostatOptions(**PIN, drift_gain=0.0))
    targets = [c.target(flat_ctx(step=s)).item() for s in (0, 19, 20, 79, 80, 99)]
    assert targets == pytest.approx([0.05, 0.05, 0.2, 0.2, 0.35, 0.35])
    lams = [c(flat_ctx(step=s)).item() for s in (0, 50, 90)]
    assert lams[0] < lams[1] < lams[2]
    # without a budget: explore for explore_steps, then converge; never strict
    assert c.target(flat_ctx(step=3, budget=None)).item() == pytest.approx(0.05)
    assert c.target(flat_ctx(step=500, budget=None)).item() == pytest.approx(0.2)


def test_pull_reaches_the_target_mass() -> None:
    c = ThermostatController(8.0, ThermostatOptions(**PIN, drift_gain=0.0))
    ctx = flat_ctx(step=90)  # strict: 0.35
    lam = c(ctx)
    m = measure(ctx.logits, ctx.field, lam).mass_after.item()
    assert 0.35 <= m < 0.35 + 1e-3


def test_confident_step_is_left_alone() -> None:
    c = ThermostatController(8.0, ThermostatOptions(**PIN))
    logits = torch.zeros(2, V)
    logits[:, 40] = 30.0  # the model is sure of an off-narrative token
    ctx = flat_ctx(batch=2, step=90, logits=logits)
    assert c.target(ctx).tolist() == [0.0, 0.0]
    assert c(ctx).tolist() == [0.0, 0.0]


def test_entropy_gate_scales_the_target() -> None:
    c = ThermostatController(8.0, ThermostatOptions(**PIN, drift_gain=0.0, entropy_low=0.2, entropy_high=0.6))
    logits = torch.zeros(3, V)
    logits[1, :8] = 50.0  # 8 equally likely tokens: H / log V = log 8 / log 64 = 0.5
    logits[2, 0] = 50.0  # H = 0
    t = c.target(flat_ctx(batch=3, logits=logits)).tolist()
    assert t[0] == pytest.approx(0.2)  # maximal entropy: the full converge target
    assert t[1] == pytest.approx(0.2 * (0.5 - 0.2) / (0.6 - 0.2), rel=1e-4)
    assert t[2] == 0.0


def ids_with(tail: list[int], prompt: int = 5) -> torch.Tensor:
    return torch.tensor([[60] * prompt + tail])


def test_drift_raises_the_target() -> None:
    c = ThermostatController(8.0, ThermostatOptions(**PIN, drift_window=4, drift_gain=0.4, drift_share=1.0))
    on = c.target(flat_ctx(step=4, input_ids=ids_with([0, 1, 0, 1]))).item()
    half = c.target(flat_ctx(step=4, input_ids=ids_with([0, 30, 1, 31]))).item()
    off = c.target(flat_ctx(step=4, input_ids=ids_with([30, 31, 32, 33]))).item()
    assert on == pytest.approx(0.05)
    assert half == pytest.approx(0.05 + 0.2)
    assert off == pytest.approx(0.05 + 0.4)
    lam_on = c(flat_ctx(step=4, input_ids=ids_with([0, 1, 0, 1])))
    lam_off = c(flat_ctx(step=4, input_ids=ids_with([30, 31, 32, 33])))
    assert lam_off.item() > lam_on.item()


def test_drift_share_sets_what_counts_as_on_the_narrative() -> None:
    c = ThermostatController(8.0, ThermostatOptions(**PIN, drift_window=8, drift_gain=0.4))  # default drift_share 1/8
    assert c.options.drift_share == 0.125
    one_in_eight = ids_with([0] + [30] * 7)
    none = ids_with([30] * 8)
    assert c.target(flat_ctx(step=8, input_ids=one_in_eight)).item() == pytest.approx(0.05)
    assert c.target(flat_ctx(step=8, input_ids=none)).item() == pytest.approx(0.05 + 0.4)
    quarter = ThermostatController(8.0, ThermostatOptions(**PIN, drift_window=8, drift_gain=0.4, drift_share=0.25))
    assert quarter.target(flat_ctx(step=8, input_ids=one_in_eight)).item() == pytest.approx(0.05 + 0.2)


def test_drift_reads_only_generated_tokens_and_the_window() -> None:
    c = ThermostatController(8.0, ThermostatOptions(**PIN, drift_window=4, drift_gain=0.4, drift_share=1.0))
    # step 0: the off-narrative prompt is not drift
    t = c.target(flat_ctx(step=0, budget=None, input_ids=torch.tensor([[30, 31, 32]]))).item()
    assert t == pytest.approx(0.05)
    # step 2: only the 2 generated tokens count (one on, one off); the 2 not yet generated count as on
    t = c.target(flat_ctx(step=2, budget=None, input_ids=torch.tensor([[30, 31, 32, 0, 40]]))).item()
    assert t == pytest.approx(0.05 + 0.4 * 1 / 4)
    # older tokens leave the window
    t = c.target(flat_ctx(step=6, budget=None, input_ids=ids_with([30, 31, 0, 1, 0, 1]))).item()
    assert t == pytest.approx(0.05)


def test_drift_over_the_text_reads_the_prompt_too() -> None:
    c = ThermostatController(
        8.0, ThermostatOptions(**PIN, drift_window=4, drift_gain=0.4, drift_share=1.0, drift_scope="text")
    )
    # step 0: an off-narrative prompt is drift
    t = c.target(flat_ctx(step=0, budget=None, input_ids=torch.tensor([[30, 31, 32, 33]]))).item()
    assert t == pytest.approx(0.05 + 0.4)
    # a prompt that ends on the narrative is not
    t = c.target(flat_ctx(step=0, budget=None, input_ids=torch.tensor([[0, 1, 0, 1]]))).item()
    assert t == pytest.approx(0.05)
    # a prompt shorter than the window: the positions before it count as off (2 of 4 on -> half drift)
    t = c.target(flat_ctx(step=0, budget=None, input_ids=torch.tensor([[0, 1]]))).item()
    assert t == pytest.approx(0.05 + 0.2)
    # once generating, the window slides over prompt and generated tokens alike
    t = c.target(flat_ctx(step=2, budget=None, input_ids=torch.tensor([[30, 31, 32, 33, 0, 40]]))).item()
    assert t == pytest.approx(0.05 + 0.4 * 3 / 4)
    # the generated scope ignores the prompt (the default)
    g = ThermostatController(8.0, ThermostatOptions(**PIN, drift_window=4, drift_gain=0.4, drift_share=1.0))
    assert g.options.drift_scope == "generated"
    assert g.target(flat_ctx(step=0, budget=None, input_ids=torch.tensor([[30, 31, 32, 33]]))).item() == (
        pytest.approx(0.05)
    )


def test_drift_uses_the_base_values_when_given() -> None:
    base = torch.zeros(V)
    base[30] = 1.0  # token 30 is on the narrative in the base field, not in the step field
    step_field = torch.zeros(V)
    step_field[:2] = 1.0
    with_base = ThermostatController(
        8.0, ThermostatOptions(**PIN, drift_window=2, drift_gain=0.4, drift_share=1.0), drift_values=base
    )
    without = ThermostatController(8.0, ThermostatOptions(**PIN, drift_window=2, drift_gain=0.4, drift_share=1.0))
    ctx = flat_ctx(step=2, budget=None, input_ids=ids_with([30, 30]), field=step_field)
    assert with_base.target(ctx).item() == pytest.approx(0.05)
    assert without.target(ctx).item() == pytest.approx(0.45)
    # ids beyond the field (a padded output layer) count as off the narrative, without an index error
    ctx = flat_ctx(step=2, budget=None, input_ids=torch.tensor([[0, 500, 700]]), field=step_field)
    assert with_base.target(ctx).item() == pytest.approx(0.45)


def test_drift_per_row_with_a_per_row_field() -> None:
    c = ThermostatController(8.0, ThermostatOptions(**PIN, drift_window=2, drift_gain=0.4, drift_share=1.0))
    field = torch.zeros(2, V)
    field[0, 5] = 1.0
    field[1, 6] = 1.0
    ids = torch.tensor([[9, 5, 5], [9, 5, 5]])
    t = c.target(flat_ctx(batch=2, step=2, budget=None, input_ids=ids, field=field)).tolist()
    assert t == pytest.approx([0.05, 0.45])


def test_target_is_capped_and_decays() -> None:
    c = ThermostatController(
        8.0, ThermostatOptions(**{**PIN, "strict_target": 0.9}, drift_gain=0.5, max_target=0.7, drift_window=2)
    )
    assert c.target(flat_ctx(step=95, input_ids=ids_with([40, 41]))).item() == pytest.approx(0.7)
    d = ThermostatController(
        8.0, ThermostatOptions(**PIN, drift_gain=0.0), decay=DecayOptions(after_steps=10, half_life=5.0)
    )
    assert d.target(flat_ctx(step=15, budget=None)).item() == pytest.approx(0.1)


def test_per_row_max_strength_and_beams() -> None:
    c = ThermostatController([1.0, 8.0], ThermostatOptions(**PIN))
    logits = torch.zeros(4, V)
    lam = c(flat_ctx(batch=4, step=90, logits=logits))  # 2 prompts × 2 beams
    assert lam[0] == lam[1] == 1.0  # infeasible under λ_max = 1
    assert 1.0 < lam[2].item() == lam[3].item() < 8.0


def test_field_edited_in_place_is_seen() -> None:
    c = ThermostatController(8.0, ThermostatOptions(**PIN, drift_gain=0.0, candidates=4))
    field = torch.zeros(V)
    field[:2] = 1.0
    first = c(flat_ctx(step=90, field=field)).item()
    field[:2] = 0.0
    field[10:20] = 1.0  # more pulled tokens: less pull needed
    second = c(flat_ctx(step=90, field=field)).item()
    assert second < first
    assert measure(torch.zeros(1, V), field, torch.tensor([second])).mass_after.item() >= 0.35 - 1e-5


def test_controller_needs_logits_and_field() -> None:
    with pytest.raises(ConfigurationError, match="needs `logits` and `field`"):
        ThermostatController()(StepContext(step=0, max_new_tokens=10, batch_size=1))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_strength": -1.0}, "strength"),
        ({"max_strength": 80.0}, "max_strength"),
        ({"entropy_low": 0.5, "entropy_high": 0.4}, "entropy_low"),
        ({"explore_until": 0.9, "strict_from": 0.1}, "explore_until"),
        ({"strict_target": 1.5}, "strict_target"),
        ({"max_target": 1.0}, "max_target"),
        ({"drift_window": 0}, "drift_window"),
        ({"drift_share": 0.0}, "drift_share"),
        ({"drift_scope": "prompt"}, "drift_scope"),
        ({"iterations": 0}, "iterations"),
        ({"candidates": 0}, "candidates"),
        ({"decay_half_life": 0.0}, "decay_half_life"),
        ({"drift_values": torch.zeros(2, 2)}, "drift_values"),
    ],
)
def test_constructor_validates(kwargs: dict[str, Any], match: str) -> None:
    kwargs = dict(kwargs)
    args = {k: kwargs.pop(k) for k in ("max_strength", "drift_values") if k in kwargs}
    with pytest.raises(ConfigurationError, match=match):
        if "decay_half_life" in kwargs:
            args["decay"] = DecayOptions(half_life=kwargs.pop("decay_half_life"))
        ThermostatController(**args, options=ThermostatOptions(**kwargs))


def test_max_strength_cap_is_documented_value() -> None:
    assert MAX_THERMOSTAT_STRENGTH == 50.0
    ThermostatController(50.0)


# -- profile and processor ------------------------------------------------------------------------


def test_profile_defaults_and_controller() -> None:
    p = Profile(core_semantics=["orbit"])
    assert p.schedule == "thermostat"  # the topic default
    t = Profile(core_semantics=["orbit"], gravity_strength=3.0)
    c = controller_from_profile(t)
    assert isinstance(c, ThermostatController)
    assert c.base(1, "cpu").item() == pytest.approx(8.5)  # gravity_strength × 4.25 / 1.5
    custom = Profile.from_mapping(
        {
            "core_semantics": ["orbit"],
            "schedule": "thermostat",
            "decay_after_steps": 30,
            "thermostat": {"max_strength": 3.0, "strict_target": 0.5, "drift_window": 4, "entropy_high": 0.4},
        }
    )
    c = controller_from_profile(custom)
    assert c.base(1, "cpu").item() == 3.0
    assert (c.options.strict_target, c.options.drift_window, c.options.entropy_high, c.decay.after_steps) == (
        0.5,
        4,
        0.4,
        30,
    )


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"thermostat": {"max_strength": 60}}, "`thermostat.max_strength` (got 60)"),
        ({"thermostat": {"strict_target": 2}}, "`thermostat.strict_target` (got 2)"),
        ({"thermostat": {"max_target": 1.0}}, "`thermostat.max_target` (got 1.0)"),
        ({"thermostat": {"entropy_low": 0.3, "entropy_high": 0.2}}, "entropy_low (0.3) must be below"),
        ({"thermostat": {"drift_windw": 3}}, "did you mean `drift_window`?"),
        ({"thermostat": {"drift_scope": "all"}}, "`thermostat.drift_scope`"),
        ({"schedule": "thermostats"}, "`schedule` (got 'thermostats')"),
    ],
)
def test_profile_thermostat_errors(data: dict[str, Any], needle: str) -> None:
    with pytest.raises(ProfileError) as exc:
        Profile.from_mapping({"core_semantics": ["orbit"], **data})
    assert needle in str(exc.value)


def _greedy(model: Any, tok: Any, enc: Any, proc: Any, n: int) -> torch.Tensor:
    """``n`` greedy tokens exactly, with ``proc`` as the only processor."""
    return model.generate(
        **enc,
        logits_processor=[proc],
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        pad_token_id=tok.pad_token_id,
    )


def test_thermostat_generation_with_a_tiny_model(tiny_model: tuple[Any, Any]) -> None:
    model, tok = tiny_model
    profile = Profile(
        core_semantics=["planet", "orbit", "galaxy"],
        schedule="thermostat",
        field={"mode": "lexical"},
        thermostat={
            "max_strength": 6.0,
            "entropy_low": 0.0,
            "entropy_high": 0.01,
            "explore_target": 0.5,
            "converge_target": 0.5,
            "strict_target": 0.5,
        },
    )
    trace = Trace()
    proc = processor_from_profile(profile, tok, max_new_tokens=12, trace=trace)
    assert isinstance(proc.controller, ThermostatController)
    enc = tok(["The crew", "A small moon moves"], return_tensors="pt", padding=True)
    torch.manual_seed(0)
    out = _greedy(model, tok, enc, proc, 12)
    assert out.shape == (2, enc.input_ids.shape[1] + 12)
    t = trace.to_numpy()
    assert t["strength"].shape == (2, 12)
    assert (t["strength"] >= 0).all() and (t["strength"] <= 6.0).all()  # λ_max
    # with a random model the steps are disordered: wherever λ < λ_max the target mass was reached
    reached = t["mass_after"][t["strength"] < 6.0 - 1e-3]
    assert reached.size and (reached >= 0.5 - 1e-4).all()


@pytest.mark.parametrize("prune", [None, -0.5])
def test_pulling_in_place_changes_nothing_but_the_copy(tiny_model: tuple[Any, Any], prune: float | None) -> None:
    """``inplace=True`` (what ``ngrav`` runs) writes into the scores ``generate`` hands over and returns them: the
    same tokens and the same trace as the copying default, with and without pruning (which measures on the
    unpulled logits, so the kernel copies there)."""
    model, tok = tiny_model
    profile = Profile(
        core_semantics=["planet", "orbit", "galaxy"],
        schedule="thermostat",
        thermostat={"entropy_low": 0.0, "entropy_high": 0.01},
        prune_threshold=prune,
    )
    enc = tok(["The crew", "A small moon moves"], return_tensors="pt", padding=True)
    runs = []
    for inplace in (False, True):
        trace = Trace()
        proc = processor_from_profile(profile, tok, max_new_tokens=10, trace=trace, inplace=inplace)
        out = _greedy(model, tok, enc, proc, 10)
        runs.append((out, trace.tensor()))
        scores = torch.randn(2, len(tok))
        before = scores.clone()
        pulled = processor_from_profile(profile, tok, max_new_tokens=10, inplace=inplace)(enc.input_ids, scores)
        assert (pulled is scores) == inplace
        assert torch.equal(scores, pulled if inplace else before)
        assert not torch.equal(pulled, before)  # it did pull
    assert torch.equal(runs[0][0], runs[1][0])
    assert torch.equal(runs[0][1], runs[1][1])


def test_kl_budget_steps_hold_the_budget_for_the_first_tokens_only(tiny_model: tuple[Any, Any]) -> None:
    """``kl_budget_steps``: the budget holds for that many generated tokens, ``late_kl_budget`` after them. The
    first steps are the budgeted run's to the bit; after them the pull costs more, up to the late budget."""
    model, tokenizer = tiny_model
    words = ["the", "and", "of"]
    steps, n = 5, 12

    def run(**budget: float | int) -> dict[str, Any]:
        spec: dict[str, Any] = {"core_semantics": words, "field": {"mode": "lexical"}, "schedule": "thermostat"}
        spec["thermostat"] = {"max_strength": 8.0, "strict_target": 0.9, "converge_target": 0.9, **budget}
        trace = Trace()
        proc = processor_from_profile(Profile.from_mapping(spec), tokenizer, max_new_tokens=n, trace=trace)
        enc = tokenizer(["The crew", "A small moon moves"], return_tensors="pt", padding=True)
        torch.manual_seed(0)
        _greedy(model, tokenizer, enc, proc, n)
        return trace.to_numpy()

    held = run(kl_budget=0.02)
    lifted = run(kl_budget=0.02, kl_budget_steps=steps)
    late = run(kl_budget=0.02, kl_budget_steps=steps, late_kl_budget=0.1)
    for t in (lifted, late):
        assert (t["strength"][:, :steps] == held["strength"][:, :steps]).all()  # [B, T]
    assert held["kl"].max() <= 0.02 * 1.5
    assert lifted["kl"][:, steps:].max() > 0.1  # no limit after the first tokens
    assert 0.02 * 1.5 < late["kl"][:, steps:].max() <= 0.1 * 1.5
    row = controller_from_profile(
        Profile.from_mapping({"core_semantics": words, "thermostat": {"kl_budget_steps": 64, "late_kl_budget": 0.3}})
    ).row()
    assert (row["kl_budget"], row["kl_budget_steps"], row["late_kl_budget"]) == (0.0, 64, 0.3)
    with pytest.raises(ConfigurationError, match="kl_budget_steps"):
        ThermostatController(4.0, ThermostatOptions(kl_budget=0.1, kl_budget_steps=0))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4096), st.integers(1, 1 << 17))
def test_an_accelerator_takes_more_lambdas_per_level_within_the_grid_cap(rows: int, candidates: int) -> None:
    from narrative_gravity.gravity.solve import ACCELERATOR_GRID, grid_bits

    cpu, gpu = grid_bits(rows, candidates, "cpu"), grid_bits(rows, candidates, "cuda")
    assert 2 <= cpu <= 7 and 2 <= gpu <= 7
    assert gpu >= cpu  # never more levels (kernel launches) than on the CPU
    assert gpu == 2 or rows * candidates * 2**gpu <= ACCELERATOR_GRID  # the grid stays within its cap
