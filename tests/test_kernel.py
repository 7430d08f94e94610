"""The steering kernel on its own: rows that join, advance and leave at any step, each equal to its solo run."""

from __future__ import annotations

import traceback
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from narrative_gravity.errors import ConfigurationError
from narrative_gravity.gravity import GravityKernel, NarrativeField, Program, StagePlan
from narrative_gravity.gravity.controllers import (
    ConstantController,
    DecayOptions,
    PhaseScheduleController,
    ThermostatController,
    ThermostatOptions,
)
from narrative_gravity.gravity.require import Requirement
from narrative_gravity.gravity.tilt import apply_gravity

V = 30


def _field(seed: int, continuations: bool = True) -> NarrativeField:
    g = torch.Generator().manual_seed(seed)
    values = torch.zeros(V)
    on = torch.randperm(V, generator=g)[:6]
    values[on] = torch.rand(6, generator=g) * 2 - 1
    if not continuations:
        return NarrativeField(values=values)
    return NarrativeField(
        values=values,
        prefixes=torch.tensor([[-1, 3], [4, 5]]),
        next_ids=torch.tensor([7, 8]),
        next_values=torch.tensor([0.9, 0.6]),
    )


def _programs() -> list[Program]:
    stages = StagePlan(
        fields=(_field(1), _field(2, continuations=False)),
        shares=(0.4, 0.6),
        words=((((3, 7),),), (((9,),), ((10, 11),))),  # stage 0: the word "3 7"; stage 1: "9" and "10 11"
        cover_fraction=0.5,
    )
    return [
        Program(field=_field(3), schedule=ConstantController(2.0).schedule(1)[0], key="constant"),
        Program(
            field=_field(4),
            schedule=PhaseScheduleController(3.0, decay=DecayOptions(2)).schedule(1)[0],
            repeat_weight=0.25,
            key="phases-repeat",
        ),
        Program(
            field=_field(5),
            schedule=ThermostatController(5.0, ThermostatOptions(drift_window=3, candidates=4)).schedule(1)[0],
            repeat_weight=0.0,
            key="thermostat",
        ),
        Program(field=_field(6), schedule=ConstantController(1.0).schedule(1)[0], prune_threshold=-0.2, key="prune"),
        Program(field=_field(7), schedule=ConstantController(1.0).schedule(1)[0], prune_threshold=0.0, key="prune0"),
        Program(
            field=_field(8),
            schedule=ConstantController(1.0).schedule(1)[0],
            requirement=_requirement(force=True),
            key="require",
        ),
        Program(
            field=_field(9),
            schedule=ThermostatController(3.0, ThermostatOptions(candidates=4)).schedule(1)[0],
            requirement=_requirement(force=False),
            key="require-soft",
        ),
        Program(
            stages=stages,
            schedule=ThermostatController(4.0, ThermostatOptions(drift_scope="text")).schedule(1)[0],
            key="stages",
        ),
    ]


def _requirement(*, force: bool) -> Requirement:
    """Two required words on the synthetic vocabulary: "12" (or "15 16"), and "17 18" of a script without
    spaces; tokens 20-24 continue a word, 25 ends a clause, 29 ends the text."""
    glue = torch.zeros(V, dtype=torch.bool)
    glue[20:25] = True
    breaks = torch.zeros(V, dtype=torch.bool)
    breaks[25] = True
    return Requirement(
        words=("a", "b"),
        forms=(((12,), (15, 16)), ((17, 18),)),
        starts=(((12,),), ((17, 18),)),
        boundary=(True, False),
        glue=glue,
        breaks=breaks,
        stops=(29,),
        strength=3.0,
        force=force,
        slack=2,
        window=4,
        spread=not force,
    )


def _solo(program: Program, budget: int, prompt: list[int], out: list[int], history: list[torch.Tensor]) -> Any:
    """The row alone in a kernel of its own, fed its tokens one by one with the logits it saw."""
    k = GravityKernel(1)
    k.add(0, program, budget=budget, prompt=prompt)
    for t, token in enumerate(out):
        k.apply(history[t])
        k.advance(torch.tensor([token]))
    return k


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_rows_at_different_steps_equal_their_solo_runs(data: Any) -> None:
    programs = _programs()
    kernel = GravityKernel(4)
    live: dict[int, dict[str, Any]] = {}
    for _ in range(data.draw(st.integers(3, 10), label="steps")):
        free = [r for r in range(4) if r not in live]
        if free and data.draw(st.booleans(), label="join"):
            row = data.draw(st.sampled_from(free), label="row")
            req = {
                "program": data.draw(st.sampled_from([None, *programs]), label="program"),
                "budget": data.draw(st.integers(2, 9), label="budget"),
                "prompt": data.draw(st.lists(st.integers(0, V - 1), min_size=1, max_size=4), label="prompt"),
                "out": [],
                "logits": [],
            }
            kernel.add(row, req["program"], budget=req["budget"], prompt=req["prompt"])
            live[row] = req
        if live and data.draw(st.booleans(), label="swap"):
            a, b = data.draw(st.sampled_from(sorted(live)), label="a"), data.draw(st.integers(0, 3), label="b")
            kernel.swap(a, b)
            live[a], live[b] = live.get(b), live.get(a)
            live = {r: q for r, q in live.items() if q is not None}
        for r in [r for r, q in live.items() if len(q["out"]) >= q["budget"]]:
            kernel.remove(r)
            del live[r]
        logits = torch.randn(4, V) * 2
        logits[0, 2] = float("-inf")
        got, result = kernel.apply(logits)
        new = torch.zeros(4, dtype=torch.long)
        for r in range(4):
            if r not in live or live[r]["program"] is None:
                torch.testing.assert_close(got[r], logits[r])
                continue
            req = live[r]
            solo = _solo(req["program"], req["budget"], req["prompt"], req["out"], req["logits"])
            want, want_result = solo.apply(logits[r : r + 1])
            torch.testing.assert_close(got[r : r + 1], want, msg=f"row {r}")
            assert float(result.strength[r]) == pytest.approx(float(want_result.strength[0]), abs=1e-6)
            req["logits"].append(logits[r : r + 1])
            token = int(torch.argmax(got[r]))
            req["out"].append(token)
            new[r] = token
        rows = torch.tensor(sorted(live), dtype=torch.long)
        if rows.numel():
            kernel.advance(new[rows], rows)


def test_a_row_added_with_output_replays_it() -> None:
    """vLLM re-adds a preempted request with its output: history, said-set and stage come back."""
    program = _programs()[-1]
    prompt, out = [1, 2], [3, 7, 9, 4]
    history = [torch.zeros(1, V)] * len(out)
    solo = _solo(program, 9, prompt, out, history)
    again = GravityKernel(3)
    again.add(2, program, budget=9, prompt=prompt, output=out)
    logits = torch.randn(1, V)
    assert int(again.stage[2]) == int(solo.stage[0]) == 1  # "3 7" covered stage 0's word
    torch.testing.assert_close(again.apply(logits, torch.tensor([2]))[0], solo.apply(logits)[0])


def test_programs_are_shared_and_idle_ones_evicted() -> None:
    p = _programs()
    kernel = GravityKernel(3, max_idle=1)
    kernel.add(0, p[0], budget=5)
    kernel.add(1, p[0], budget=5)
    assert len(kernel._by_key) == 1 and kernel._refs[kernel.prog[0]] == 2
    kernel.add(2, p[1], budget=5)
    kernel.remove(0)
    kernel.remove(1)  # p[0] idle
    kernel.remove(2)  # p[1] idle: more than max_idle, so p[0] goes
    assert list(kernel._by_key) == ["phases-repeat"]


def test_move_leaves_the_source_empty() -> None:
    p = _programs()
    kernel = GravityKernel(2)
    kernel.add(0, p[0], budget=5, prompt=[1])
    kernel.move(0, 1)
    assert kernel.prog[0] == -1 and kernel.program(1) is p[0]
    logits = torch.zeros(2, V)
    out, _ = kernel.apply(logits)
    torch.testing.assert_close(out[0], logits[0])
    assert out[1].abs().sum() > 0


def test_a_union_of_supports_wider_than_half_the_vocabulary_goes_dense() -> None:
    wide = NarrativeField(values=torch.linspace(-1, 1, V))
    kernel = GravityKernel(2)
    kernel.add(0, Program(field=wide, schedule=ConstantController(1.5).schedule(1)[0]), budget=4)
    kernel.add(1, _programs()[0], budget=4)
    logits = torch.randn(2, V)
    out, _ = kernel.apply(logits)
    assert kernel._bank[1].dense
    torch.testing.assert_close(out[0], apply_gravity(logits[:1], wide.values, 1.5)[0])


def test_pruning_at_or_above_zero_reaches_tokens_off_the_support() -> None:
    program = _programs()[4]  # prune_threshold 0: every token with a <= 0 goes
    kernel = GravityKernel(1)
    kernel.add(0, program, budget=4)
    out, result = kernel.apply(torch.zeros(1, V), measure_step=True)
    kept = torch.isfinite(out[0])
    assert kept.sum() == (program.field.values > 0).sum()
    assert float(result.measurement.mass_after[0]) == pytest.approx(1.0)


def test_bad_programs_and_capacity_are_named() -> None:
    with pytest.raises(ConfigurationError, match="capacity"):
        GravityKernel(0)
    with pytest.raises(ConfigurationError, match="NarrativeField or stages"):
        Program(field=None)
    with pytest.raises(ConfigurationError, match="repeat_weight"):
        Program(field=_field(1), repeat_weight=2.0)
    with pytest.raises(ConfigurationError, match="prune_threshold"):
        Program(field=_field(1), prune_threshold=1.0)
    with pytest.raises(ConfigurationError, match="schedule"):
        Program(field=_field(1), schedule=np.zeros(3))
    kernel = GravityKernel(1)
    with pytest.raises(ConfigurationError, match="2 rows"):
        kernel.add_batch(_programs()[0], torch.zeros(2, 3, dtype=torch.long), budget=4)


def test_a_reused_transformers_processor_keeps_one_program_and_one_table() -> None:
    from narrative_gravity.engines.hf import NarrativeGravityLogitsProcessor

    proc = NarrativeGravityLogitsProcessor(_field(3), strength=1.0)
    banks = set()
    for prompt_len in (2, 5, 3):  # three generations (each restarts the processor's rows)
        proc(torch.zeros(2, prompt_len, dtype=torch.long), torch.zeros(2, V))
        banks.add(id(proc.kernel._bank[1]))
    assert len(proc.kernel._programs) == 1 and len(banks) == 1


class _HostReads(TorchDispatchMode):
    """Records every operation that reads a tensor's value back to the host (on a GPU each one waits for the
    device): ``.item()``, ``bool()`` and ``int()`` of a tensor, ``nonzero``, boolean-mask selection, ``equal``."""

    READS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::equal", "aten::unique")

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func._schema.name.startswith(self.READS):
            frames = [f for f in traceback.extract_stack() if "narrative_gravity" in f.filename]
            where = f"{frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno}" if frames else "?"
            self.seen.append(f"{func._schema.name} at {where}")
        return func(*args, **(kwargs or {}))


def test_a_step_reads_nothing_back_from_the_device() -> None:
    """Every program's steps, with rows indexed as vLLM indexes them and as transformers does (all rows), and a
    row that leaves and one that joins, read no value back: on a GPU none of them waits for the device."""
    programs = _programs()
    n = len(programs)
    gen = torch.Generator().manual_seed(0)
    vllm_like = GravityKernel(n + 1)
    for r, program in enumerate(programs):
        vllm_like.add(r, program, budget=20, prompt=[1, 2, 3])
    hf_like = GravityKernel(2)
    hf_like.add_batch(programs[2], torch.tensor([[1, 2, 3], [4, 5, 6]]), budget=20)

    def step(rows_np: np.ndarray) -> None:
        rows = torch.from_numpy(rows_np)
        out, _ = vllm_like.apply(torch.randn(n, V, generator=gen), rows, rows_np, measure_step=True)
        vllm_like.advance(out.argmax(-1), rows)
        out, _ = hf_like.apply(torch.randn(2, V, generator=gen), measure_step=True)
        hf_like.advance(out.argmax(-1))

    for _ in range(2):  # the first steps build each program's tables, once
        step(np.arange(n))
    with _HostReads() as reads:
        for _ in range(7):
            step(np.arange(n))
        # a request leaves and another joins in its slot, on a program the kernel already holds
        vllm_like.remove(0)
        vllm_like.add(n, programs[5], budget=12, prompt=[4, 5])
        for _ in range(7):
            step(np.array([n, *range(1, n)]))
    assert reads.seen == []
