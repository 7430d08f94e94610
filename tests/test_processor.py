"""Tests for narrative_gravity.engines.hf.NarrativeGravityLogitsProcessor (unit and a tiny end-to-end model)."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LogitsProcessor, LogitsProcessorList

from narrative_gravity.engines.hf import NarrativeGravityLogitsProcessor
from narrative_gravity.errors import ConfigurationError, NonFiniteLogitsError, VocabularyError
from narrative_gravity.fields import NarrativeField
from narrative_gravity.gravity.controllers import (
    ConstantController,
    PhaseScheduleController,
    StepContext,
    ThermostatController,
)
from narrative_gravity.gravity.kernel import Program
from narrative_gravity.gravity.thermo import Trace, measure
from narrative_gravity.gravity.tilt import apply_gravity

NEG_INF = float("-inf")
V = 6


def plain_field() -> NarrativeField:
    return NarrativeField(values=torch.tensor([1.0, 0.5, 0.0, 0.0, -0.5, -1.0]))


def scores(b: int = 2, v: int = V, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed))


def run_steps(
    proc: NarrativeGravityLogitsProcessor, prompt: torch.Tensor, n: int, v: int = V, token: int = 2
) -> list[torch.Tensor]:
    """Call ``proc`` like ``generate`` does: the input grows by one token per step."""
    outs, ids = [], prompt
    for i in range(n):
        outs.append(proc(ids, scores(prompt.shape[0], v, seed=i)))
        ids = torch.cat([ids, torch.full((ids.shape[0], 1), token, dtype=torch.long)], dim=1)
    return outs


class RecordingController:
    """A controller that remembers every StepContext it is given."""

    def __init__(self, strength: float = 1.0) -> None:
        self.strength = strength
        self.seen: list[StepContext] = []

    def __call__(self, ctx: StepContext) -> torch.Tensor:
        self.seen.append(ctx)
        return torch.full((ctx.batch_size,), self.strength, device=ctx.device)


# ------------------------------------------------------------------------------------------------
# the pull


def test_is_a_logits_processor_and_works_in_list() -> None:
    proc = NarrativeGravityLogitsProcessor(plain_field(), strength=2.0)
    assert isinstance(proc, LogitsProcessor)
    procs = LogitsProcessorList([proc])
    s = scores()
    out = procs(torch.tensor([[1, 2], [3, 4]]), s)
    torch.testing.assert_close(out, s + 2.0 * plain_field().values)


def test_default_strength_is_one() -> None:
    proc = NarrativeGravityLogitsProcessor(plain_field())
    s = scores()
    torch.testing.assert_close(proc(torch.tensor([[0], [0]]), s), s + plain_field().values)
    assert isinstance(proc.controller, ConstantController)


def test_per_row_strengths() -> None:
    proc = NarrativeGravityLogitsProcessor(plain_field(), strength=[0.0, 3.0])
    s = scores()
    out = proc(torch.tensor([[0], [0]]), s)
    assert torch.equal(out[0], s[0])
    torch.testing.assert_close(out[1], s[1] + 3.0 * plain_field().values)


def test_scores_are_not_modified_in_place() -> None:
    proc = NarrativeGravityLogitsProcessor(Program(plain_field(), prune_threshold=-0.5), strength=2.0)
    s = scores()
    before = s.clone()
    out = proc(torch.tensor([[0], [0]]), s)
    assert torch.equal(s, before)
    assert not torch.equal(out, before)


def test_half_precision_scores_keep_dtype() -> None:
    proc = NarrativeGravityLogitsProcessor(plain_field(), strength=[1.0, 2.0])
    s = scores().to(torch.bfloat16)
    out = proc(torch.tensor([[0], [0]]), s)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(
        out.float(), s.float() + torch.tensor([[1.0], [2.0]]) * plain_field().values, atol=0.05, rtol=0.02
    )


def test_continuation_field_uses_input_ids() -> None:
    field = NarrativeField(
        values=torch.zeros(V),
        prefixes=torch.tensor([[3]]),
        next_ids=torch.tensor([4]),
        next_values=torch.tensor([1.0]),
    )
    proc = NarrativeGravityLogitsProcessor(field, strength=5.0)
    out = proc(torch.tensor([[0, 3], [3, 0]]), torch.zeros(2, V))
    assert out[0].tolist() == [0.0, 0.0, 0.0, 0.0, 5.0, 0.0]
    assert out[1].tolist() == [0.0] * V


def test_controller_sees_context() -> None:
    ctl = RecordingController()
    proc = NarrativeGravityLogitsProcessor(plain_field(), ctl, max_new_tokens=7)
    prompt = torch.tensor([[1, 2, 3], [4, 5, 0]])
    run_steps(proc, prompt, 3)
    assert [c.step for c in ctl.seen] == [0, 1, 2]
    c = ctl.seen[-1]
    assert c.max_new_tokens == 7 and c.batch_size == 2 and c.device.type == "cpu"
    assert c.input_ids.shape == (2, 5) and c.logits.shape == (2, V)
    assert torch.equal(c.field, plain_field().values.expand(2, -1))  # the dense field of every row


class DenseConstant:
    """A controller of the user's own (not a built-in schedule): it gets the dense ``[B, V]`` field."""

    def __init__(self, strength: float) -> None:
        self.strength = strength

    def __call__(self, ctx: StepContext) -> torch.Tensor:
        assert ctx.field is not None and ctx.field.shape == (ctx.batch_size, ctx.logits.shape[-1])
        return torch.full((ctx.batch_size,), self.strength)


def random_field(seed: int, v: int = 40, entries: int = 12) -> NarrativeField:
    g = torch.Generator().manual_seed(seed)
    values = torch.zeros(v)
    on = torch.randperm(v, generator=g)[:10]
    values[on] = torch.rand(10, generator=g) * 2 - 1
    prefixes = torch.randint(0, 6, (entries, 3), generator=g)
    prefixes[:, 0] = torch.where(torch.rand(entries, generator=g) < 0.5, -1, prefixes[:, 0])
    return NarrativeField(
        values=values,
        prefixes=prefixes,
        next_ids=torch.randint(0, v, (entries,), generator=g),
        next_values=torch.rand(entries, generator=g) * 2 - 1,
    )


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), batch=st.integers(1, 5), strength=st.floats(0.0, 8.0))
def test_support_path_equals_dense_path(seed: int, batch: int, strength: float) -> None:
    field = random_field(seed)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, 6, (batch, 5), generator=g)
    logits = torch.randn(batch, 40, generator=g) * 3
    logits[0, 7] = NEG_INF
    fast_trace, dense_trace = Trace(), Trace()
    fast = NarrativeGravityLogitsProcessor(field, strength=strength, trace=fast_trace)
    dense = NarrativeGravityLogitsProcessor(field, DenseConstant(strength), trace=dense_trace)
    out_fast, out_dense = fast(ids, logits), dense(ids, logits)
    expected = apply_gravity(logits, field.for_step(ids), strength)
    torch.testing.assert_close(out_fast, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out_dense, expected, rtol=1e-6, atol=1e-6)
    reference = measure(logits, field.for_step(ids), torch.full((batch,), strength)).stack()
    torch.testing.assert_close(fast_trace.tensor()[:, 0], reference, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dense_trace.tensor()[:, 0], reference, rtol=1e-4, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), batch=st.integers(1, 4), weight=st.floats(0.0, 1.0), prompt=st.integers(1, 4))
def test_repeat_weight_scales_generated_narrative_tokens_on_both_paths(
    seed: int, batch: int, weight: float, prompt: int
) -> None:
    field = random_field(seed)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, 40, (batch, prompt + 3), generator=g)
    logits = torch.randn(batch, 40, generator=g)
    outs = []
    for proc in (
        NarrativeGravityLogitsProcessor(Program(field, repeat_weight=weight), strength=2.0),
        NarrativeGravityLogitsProcessor(Program(field, repeat_weight=weight), DenseConstant(2.0)),
    ):
        proc(ids[:, :prompt], logits)  # the prompt: nothing generated yet
        for t in range(prompt + 1, ids.shape[1] + 1):
            out = proc(ids[:, :t], logits)
        outs.append(out)
    a = field.for_step(ids).expand(batch, -1).clone()
    for r in range(batch):
        said = ids[r, prompt:].unique()
        a[r, said] = torch.where(a[r, said] > 0, a[r, said] * weight, a[r, said])
    expected = apply_gravity(logits, a, 2.0)
    torch.testing.assert_close(outs[0], expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(outs[1], expected, rtol=1e-6, atol=1e-6)


def test_repeat_weight_leaves_prompt_tokens_and_penalties_alone() -> None:
    proc = NarrativeGravityLogitsProcessor(Program(plain_field(), repeat_weight=0.0), strength=2.0)
    first = proc(torch.tensor([[0, 4]]), torch.zeros(1, V))  # 0 and 4 are in the prompt only
    assert first[0].tolist() == [2.0, 1.0, 0.0, 0.0, -1.0, -2.0]
    out = proc(torch.tensor([[0, 4, 1]]), torch.zeros(1, V))  # token 1 was generated; then 5, a penalty
    assert out[0].tolist() == [2.0, 0.0, 0.0, 0.0, -1.0, -2.0]
    out = proc(torch.tensor([[0, 4, 1, 5]]), torch.zeros(1, V))
    assert out[0].tolist() == [2.0, 0.0, 0.0, 0.0, -1.0, -2.0]


@pytest.mark.parametrize("bad", [-0.1, 1.5, True, "0.5"])
def test_bad_repeat_weight(bad: Any) -> None:
    with pytest.raises(ConfigurationError, match=r"`repeat_weight`"):
        NarrativeGravityLogitsProcessor(Program(plain_field(), repeat_weight=bad), strength=1.0)


def test_controller_without_needs_field_gets_the_dense_field() -> None:
    field = random_field(3)
    ctl = RecordingController()
    proc = NarrativeGravityLogitsProcessor(field, ctl)
    ids = torch.randint(0, 6, (2, 5), generator=torch.Generator().manual_seed(0))
    proc(ids, torch.zeros(2, 40))
    assert torch.equal(ctl.seen[0].field, field.for_step(ids))


# ------------------------------------------------------------------------------------------------
# steps and generations


def test_step_is_derived_from_input_length() -> None:
    trace = Trace()
    sched = PhaseScheduleController(2.0)  # explore < 20 %, strict >= 80 %
    proc = NarrativeGravityLogitsProcessor(plain_field(), sched, max_new_tokens=10, trace=trace)
    run_steps(proc, torch.tensor([[1, 2, 3, 4], [4, 3, 2, 1]]), 10)
    strengths = trace.to_numpy()["strength"]
    assert strengths.shape == (2, 10)
    expected = [1.0, 1.0] + [2.0] * 6 + [3.0, 3.0]
    assert strengths[0].tolist() == expected
    assert strengths[1].tolist() == expected


def test_new_generation_resets_state() -> None:
    trace = Trace()
    ctl = RecordingController()
    proc = NarrativeGravityLogitsProcessor(plain_field(), ctl, trace=trace)
    run_steps(proc, torch.tensor([[1, 2, 3]]), 4)
    assert [c.step for c in ctl.seen] == [0, 1, 2, 3] and len(trace) == 4
    # the same prompt again (length 3, not 7): a new generation
    run_steps(proc, torch.tensor([[1, 2, 3]]), 2)
    assert [c.step for c in ctl.seen[4:]] == [0, 1]
    assert len(trace) == 2 and trace.tensor().shape == (1, 2, 5)
    # skipping a length (7 after 4) also starts over
    proc(torch.zeros(1, 7, dtype=torch.long), torch.zeros(1, V))
    assert ctl.seen[-1].step == 0 and len(trace) == 1


def test_new_prompt_one_token_longer_is_a_new_generation() -> None:
    ctl = RecordingController()
    proc = NarrativeGravityLogitsProcessor(plain_field(), ctl)
    run_steps(proc, torch.tensor([[1, 2, 3]]), 2)  # lengths 3, 4
    proc(torch.tensor([[5, 4, 3, 2, 1]]), torch.zeros(1, V))  # length 5, but a different prompt
    assert [c.step for c in ctl.seen] == [0, 1, 0]
    proc(torch.tensor([[0, 0, 0], [0, 0, 0]]), torch.zeros(2, V))  # another batch size
    proc(torch.tensor([[0, 0, 0, 1], [0, 0, 0, 1], [0, 0, 0, 1]]), torch.zeros(3, V))
    assert [c.step for c in ctl.seen[3:]] == [0, 0]


def test_beam_reordering_keeps_the_generation() -> None:
    ctl = RecordingController()
    proc = NarrativeGravityLogitsProcessor(plain_field(), ctl)
    proc(torch.tensor([[1, 2], [1, 2]]), torch.zeros(2, V))
    proc(torch.tensor([[1, 2, 4], [1, 2, 3]]), torch.zeros(2, V))
    proc(torch.tensor([[1, 2, 3, 0], [1, 2, 4, 5]]), torch.zeros(2, V))  # beams swapped rows
    assert [c.step for c in ctl.seen] == [0, 1, 2]


def test_reset_clears_trace() -> None:
    trace = Trace()
    proc = NarrativeGravityLogitsProcessor(plain_field(), strength=1.0, trace=trace)
    run_steps(proc, torch.tensor([[1]]), 3)
    assert len(trace) == 3
    proc.reset()
    assert len(trace) == 0


# ------------------------------------------------------------------------------------------------
# errors during decoding


def test_nan_logits_raise_with_row_and_step() -> None:
    proc = NarrativeGravityLogitsProcessor(plain_field(), strength=1.0)
    ids = torch.tensor([[1, 2], [3, 4], [5, 0]])
    run_steps(proc, ids, 2)  # steps 0 and 1
    bad = scores(3)
    bad[1, 3] = float("nan")
    ids = torch.cat([ids, torch.zeros(3, 2, dtype=torch.long)], dim=1)  # length 4 = step 2
    with pytest.raises(NonFiniteLogitsError, match=r"row 1 at step 2") as exc:
        proc(ids, bad)
    assert "row 0" not in str(exc.value) and "row 2" not in str(exc.value)
    assert isinstance(exc.value, FloatingPointError)


@pytest.mark.parametrize("controller", [None, ThermostatController(4.0)], ids=["constant", "thermostat"])
def test_nan_in_several_rows_names_them_all(controller: Any) -> None:
    # the thermostat reads NaN rows from its own softmax; the other schedules from one sum per row
    proc = NarrativeGravityLogitsProcessor(plain_field(), controller=controller)
    bad = torch.zeros(3, V)
    bad[0, 0] = float("nan")
    bad[2] = float("nan")
    with pytest.raises(NonFiniteLogitsError, match=r"row 0 at step 0, row 2 at step 0"):
        proc(torch.tensor([[1], [2], [3]]), bad)


@pytest.mark.parametrize("controller", [None, ThermostatController(4.0)], ids=["constant", "thermostat"])
def test_neg_inf_logits_are_not_an_error(controller: Any) -> None:
    proc = NarrativeGravityLogitsProcessor(plain_field(), controller=controller)
    s = torch.zeros(2, V)
    s[0, :] = NEG_INF
    s[1, 2] = NEG_INF
    out = proc(torch.tensor([[1], [2]]), s)
    assert not torch.isnan(out).any()
    assert torch.all(out[0] == NEG_INF) and out[1, 2] == NEG_INF


def test_deferred_nan_check_reports_first_step() -> None:
    proc = NarrativeGravityLogitsProcessor(plain_field(), strength=1.0, nan_check_every=4)
    ids = torch.tensor([[1]])
    proc(ids, torch.zeros(1, V))  # step 0
    nan = torch.full((1, V), float("nan"))
    ids = torch.cat([ids, ids], 1)
    proc(ids, nan)  # step 1: recorded, not yet read back
    ids = torch.cat([ids, ids[:, :1]], 1)
    proc(ids, torch.zeros(1, V))  # step 2
    ids = torch.cat([ids, ids[:, :1]], 1)
    with pytest.raises(NonFiniteLogitsError, match=r"row 0 at step 1"):
        proc(ids, torch.zeros(1, V))  # step 3: read back


@pytest.mark.parametrize(("bad_ids", "named"), [([[1, 6]], "[6]"), ([[-1, 2], [2, 99]], "[-1, 99]")])
def test_prompt_ids_outside_vocab(bad_ids: list[list[int]], named: str) -> None:
    proc = NarrativeGravityLogitsProcessor(plain_field(), strength=1.0)
    ids = torch.tensor(bad_ids)
    with pytest.raises(VocabularyError, match=re.escape(f"token ids {named} outside the vocabulary [0, {V})")):
        proc(ids, torch.zeros(ids.shape[0], V))


def test_field_wider_than_logits_with_values_beyond() -> None:
    field = NarrativeField(values=torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.0, -1.0]))
    proc = NarrativeGravityLogitsProcessor(field, strength=1.0)
    with pytest.raises(
        VocabularyError, match=r"logits have 6 columns but the field gives values to token ids \[6, 8\]"
    ):
        proc(torch.tensor([[1]]), torch.zeros(1, V))


def test_field_wider_than_logits_with_zero_tail_is_fine() -> None:
    field = NarrativeField(values=torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]))
    proc = NarrativeGravityLogitsProcessor(field, strength=2.0)
    out = proc(torch.tensor([[1]]), torch.zeros(1, V))
    assert out.tolist() == [[0.0, 2.0, 0.0, 0.0, 0.0, 0.0]]


def test_logits_wider_than_field_are_padded_with_zeros() -> None:
    proc = NarrativeGravityLogitsProcessor(plain_field(), strength=2.0)
    s = scores(2, V + 3)
    out = proc(torch.tensor([[1], [2]]), s)
    assert out.shape == (2, V + 3)
    torch.testing.assert_close(out[:, :V], s[:, :V] + 2.0 * plain_field().values)
    assert torch.equal(out[:, V:], s[:, V:])
    # and a later step with the same width still works (fitted field is cached)
    out2 = proc(torch.tensor([[1, 2], [2, 3]]), s)
    torch.testing.assert_close(out2, out)


def test_shape_mismatch_is_configuration_error() -> None:
    proc = NarrativeGravityLogitsProcessor(plain_field(), strength=1.0)
    with pytest.raises(ConfigurationError, match=r"\(3, 1\) and \(2, 6\)"):
        proc(torch.zeros(3, 1, dtype=torch.long), torch.zeros(2, V))
    with pytest.raises(ConfigurationError):
        proc(torch.zeros(2, 1, dtype=torch.long), torch.zeros(V))


# ------------------------------------------------------------------------------------------------
# measure_only, pruning


def test_measure_only_returns_scores_unchanged_and_records() -> None:
    trace = Trace()
    proc = NarrativeGravityLogitsProcessor(plain_field(), strength=5.0, measure_only=True, trace=trace)
    prompt = torch.tensor([[1, 2], [3, 4]])
    outs = run_steps(proc, prompt, 3)
    for i, out in enumerate(outs):
        assert torch.equal(out, scores(2, V, seed=i))
    t = trace.to_numpy()
    assert trace.tensor().shape == (2, 3, 5)
    assert (t["strength"] == 0).all() and (abs(t["kl"]) < 1e-6).all()
    assert (t["entropy"] > 0).all()
    assert (abs(t["mass"] - t["mass_after"]) < 1e-6).all()


def test_measure_only_without_trace() -> None:
    proc = NarrativeGravityLogitsProcessor(plain_field(), strength=5.0, measure_only=True)
    s = scores()
    assert torch.equal(proc(torch.tensor([[1], [2]]), s), s)


def test_trace_on_records_pull() -> None:
    trace = Trace()
    proc = NarrativeGravityLogitsProcessor(plain_field(), strength=[1.0, 4.0], trace=trace)
    run_steps(proc, torch.tensor([[1], [2]]), 2)
    t = trace.to_numpy()
    assert t["strength"].tolist() == [[1.0, 1.0], [4.0, 4.0]]
    assert (t["kl"] > 0).all() and (t["mass_after"] > t["mass"]).all()
    assert (t["kl"][1] > t["kl"][0]).all()


@pytest.mark.parametrize(
    ("threshold", "pruned"), [(-1.0, [5]), (-0.5, [4, 5]), (0.0, [2, 3, 4, 5]), (0.5, [1, 2, 3, 4, 5])]
)
def test_prune_threshold_masks_at_or_below(threshold: float, pruned: list[int]) -> None:
    proc = NarrativeGravityLogitsProcessor(Program(plain_field(), prune_threshold=threshold), strength=1.0)
    s = scores()
    out = proc(torch.tensor([[1], [2]]), s)
    kept = [i for i in range(V) if i not in pruned]
    assert torch.all(out[:, pruned] == NEG_INF)
    assert torch.isfinite(out[:, kept]).all()
    torch.testing.assert_close(out[:, kept], (s + plain_field().values)[:, kept])


def test_prune_never_empties_a_row() -> None:
    proc = NarrativeGravityLogitsProcessor(Program(plain_field(), prune_threshold=0.5), strength=1.0)
    s = torch.full((1, V), NEG_INF)
    s[0, 3] = 0.0  # the only candidate is a pruned token
    out = proc(torch.tensor([[1]]), s)
    assert out[0, 3] == 0.0


def test_no_pruning_by_default() -> None:
    proc = NarrativeGravityLogitsProcessor(plain_field(), strength=100.0)
    assert torch.isfinite(proc(torch.tensor([[1]]), torch.zeros(1, V))).all()


# ------------------------------------------------------------------------------------------------
# constructor validation


@pytest.mark.parametrize("bad", [torch.zeros(V), {"orbit": 1.0}, None])
def test_bad_field_type(bad: Any) -> None:
    with pytest.raises(ConfigurationError, match=r"`field` has to be a NarrativeField"):
        NarrativeGravityLogitsProcessor(bad, strength=1.0)


def test_controller_and_strength_both_given() -> None:
    with pytest.raises(ConfigurationError, match=r"either `controller` or `strength`"):
        NarrativeGravityLogitsProcessor(plain_field(), ConstantController(1.0), strength=2.0)


def test_controller_not_callable() -> None:
    with pytest.raises(ConfigurationError, match=r"`controller` has to be callable"):
        NarrativeGravityLogitsProcessor(plain_field(), 1.5)  # type: ignore[arg-type]


def test_bad_strength_is_rejected_at_construction() -> None:
    with pytest.raises(ConfigurationError, match="`strength`"):
        NarrativeGravityLogitsProcessor(plain_field(), strength=-1.0)


@pytest.mark.parametrize("bad", [0, -5, 2.5, "10"])
def test_bad_max_new_tokens(bad: Any) -> None:
    with pytest.raises(ConfigurationError, match=r"`max_new_tokens` has to be a positive integer") as exc:
        NarrativeGravityLogitsProcessor(plain_field(), strength=1.0, max_new_tokens=bad)
    assert repr(bad) in str(exc.value)


@pytest.mark.parametrize("bad", [1.0, 1.5, -1.01, float("nan")])
def test_prune_threshold_out_of_range(bad: float) -> None:
    with pytest.raises(ConfigurationError, match=r"`prune_threshold` has to be in \[-1, 1\)"):
        NarrativeGravityLogitsProcessor(Program(plain_field(), prune_threshold=bad), strength=1.0)


@pytest.mark.parametrize("bad", [0, -1])
def test_bad_nan_check_every(bad: int) -> None:
    with pytest.raises(ConfigurationError, match=r"`nan_check_every`"):
        NarrativeGravityLogitsProcessor(plain_field(), strength=1.0, nan_check_every=bad)


# ------------------------------------------------------------------------------------------------
# end to end on a tiny seeded random Llama


NARRATIVE_IDS = [100, 150, 200, 250, 300]
PROMPTS = ["The planet moves", "A comet drifts past", "The crew watches the dark sky"]


def token_field(vocab: int, ids: list[int]) -> NarrativeField:
    values = torch.zeros(vocab)
    values[ids] = 1.0
    return NarrativeField(values=values)


def greedy(model: Any, tok: Any, prompts: list[str], proc: Any = None, n: int = 8) -> tuple[torch.Tensor, int]:
    enc = tok(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(
            **enc,
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
            logits_processor=LogitsProcessorList([proc]) if proc is not None else None,
        )
    return out, enc["input_ids"].shape[1]


def test_e2e_big_pull_generates_only_field_tokens(tiny_model: tuple[Any, Any]) -> None:
    model, tok = tiny_model
    trace = Trace()
    proc = NarrativeGravityLogitsProcessor(token_field(len(tok), NARRATIVE_IDS), strength=50.0, trace=trace)
    out, plen = greedy(model, tok, PROMPTS[:1], proc)
    new = out[0, plen:].tolist()
    assert len(new) == 8
    assert set(new) <= set(NARRATIVE_IDS), new
    plain, _ = greedy(model, tok, PROMPTS[:1])
    assert not set(plain[0, plen:].tolist()) <= set(NARRATIVE_IDS)  # the pull did the work
    assert trace.tensor().shape == (1, 8, 5)
    t = trace.to_numpy()
    assert (t["mass_after"] > 0.99).all() and (t["mass"] < 0.5).all() and (t["kl"] > 0).all()


def test_e2e_measure_only_equals_plain_greedy(tiny_model: tuple[Any, Any]) -> None:
    model, tok = tiny_model
    trace = Trace()
    proc = NarrativeGravityLogitsProcessor(
        token_field(len(tok), NARRATIVE_IDS), strength=50.0, measure_only=True, trace=trace
    )
    out, _ = greedy(model, tok, PROMPTS, proc)
    plain, _ = greedy(model, tok, PROMPTS)
    assert torch.equal(out, plain)
    assert trace.tensor().shape[:2] == (3, len(trace)) and len(trace) >= 1
    assert (trace.to_numpy()["strength"] == 0).all()


def test_e2e_per_row_strengths_change_only_that_row(tiny_model: tuple[Any, Any]) -> None:
    model, tok = tiny_model
    proc = NarrativeGravityLogitsProcessor(token_field(len(tok), NARRATIVE_IDS), strength=[0.0, 0.0, 50.0])
    out, plen = greedy(model, tok, PROMPTS, proc)
    plain, _ = greedy(model, tok, PROMPTS)
    assert out.shape == plain.shape
    assert torch.equal(out[:2], plain[:2])
    assert not torch.equal(out[2], plain[2])
    assert set(out[2, plen:].tolist()) <= set(NARRATIVE_IDS)


def test_e2e_processor_reused_across_generations(tiny_model: tuple[Any, Any]) -> None:
    model, tok = tiny_model
    trace = Trace()
    sched = PhaseScheduleController(2.0)
    proc = NarrativeGravityLogitsProcessor(token_field(len(tok), NARRATIVE_IDS), sched, max_new_tokens=5, trace=trace)
    first, _ = greedy(model, tok, PROMPTS[:2], proc, n=5)
    first_trace = trace.tensor().clone()
    second, _ = greedy(model, tok, PROMPTS[:2], proc, n=5)
    assert torch.equal(first, second)
    assert torch.equal(trace.tensor(), first_trace)  # reset at the start of the second generation
    assert trace.to_numpy()["strength"][0].tolist()[:5] == [1.0, 2.0, 2.0, 2.0, 3.0][: len(trace)]


def test_row_with_both_infinities_is_not_mistaken_for_nan():
    import torch

    from narrative_gravity.engines.hf import NarrativeGravityLogitsProcessor
    from narrative_gravity.fields import NarrativeField

    proc = NarrativeGravityLogitsProcessor(NarrativeField(values=torch.tensor([1.0, 0.0, 0.0])), strength=1.0)
    scores = torch.tensor([[float("inf"), float("-inf"), 0.0]])
    out = proc(torch.tensor([[1]]), scores)
    assert torch.isposinf(out[0, 0]) and torch.isneginf(out[0, 1])


def test_thermostat_trace_matches_measure() -> None:
    from narrative_gravity.gravity.controllers import ThermostatController

    g = torch.Generator().manual_seed(5)
    values = torch.zeros(50)
    values[:6] = torch.linspace(0.2, 1.0, 6)
    values[10] = -0.5
    field = NarrativeField(values=values)
    ctl, trace = ThermostatController(6.0), Trace()
    proc = NarrativeGravityLogitsProcessor(field, ctl, max_new_tokens=10, trace=trace)
    ids = torch.randint(0, 50, (3, 4), generator=g)
    logits = torch.randn(3, 50, generator=g) * 2
    logits[:, :6] -= 4.0  # little mass on the narrative: the thermostat has to pull
    logits[1, 20:] = NEG_INF
    proc(ids, logits)
    lam = trace.tensor()[:, 0, 4]
    assert (lam > 0).any()
    reference = measure(logits, values, lam).stack()
    torch.testing.assert_close(trace.tensor()[:, 0], reference, rtol=1e-4, atol=1e-5)
