"""The compiled step (``torch.compile(fullgraph=True)``) against the eager one: same logits, same λ grid point."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from narrative_gravity.errors import ConfigurationError
from narrative_gravity.gravity import GravityKernel
from narrative_gravity.gravity.kernel import COMPILE_ENV, Program, compile_mode
from test_kernel import V, _programs

# The compiled step is opt-in (GravityKernel(compile=...), NARRATIVE_GRAVITY_COMPILE). Its equality tests compile
# every program and take minutes to tens of minutes on a busy 2-core CPU, so they are marked `compile` and left out
# of the default run (pyproject's addopts); run them with `python -m pytest -m compile tests/test_kernel_compile.py`.
compiled = pytest.mark.compile


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    """Compiled CPU kernels spin their OpenMP threads: one thread keeps a busy test machine fast."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _pair(capacity: int) -> tuple[GravityKernel, GravityKernel]:
    return GravityKernel(capacity, compile="off"), GravityKernel(capacity, compile="default")


def _same_step_and_state(
    results: list[tuple[torch.Tensor, object]],
    kernels: tuple[GravityKernel, GravityKernel],
    t: int,
    nan_row: int | None,
) -> None:
    """The eager and compiled results of step ``t`` agree (``nan_row``'s NaN logits aside), and so do the kernels'
    state tables after it."""
    if nan_row is not None:
        for out, _ in results:
            out[nan_row] = 0.0
    _same(results[0], results[1], f"step {t}")
    eager, comp = kernels
    for name in ("recent", "step", "stage", "start", "seen", "written", "said"):
        want, got = getattr(eager, name), getattr(comp, name)
        assert (want is None) == (got is None) and (want is None or torch.equal(got, want)), f"step {t}: {name}"


def _every_program_side_by_side() -> tuple[list[Program], tuple[GravityKernel, GravityKernel]]:
    """Every test program on its own row (and a free row for one to join), in an eager and a compiled kernel."""
    programs = _programs()
    kernels = _pair(len(programs) + 1)
    for k in kernels:
        for r, program in enumerate(programs):
            k.add(r, program, budget=12, prompt=[1, 2, 3])
    return programs, kernels


def _leave_and_join(kernels: tuple[GravityKernel, GravityKernel], programs: list[Program], t: int) -> None:
    """At step 4 row 0 leaves; at step 6 a request joins in the last row."""
    for k in kernels:
        if t == 4:
            k.remove(0)
        if t == 6:
            k.add(len(programs), programs[6], budget=9, prompt=[4, 5])


def _same(eager: tuple[torch.Tensor, object], compiled: tuple[torch.Tensor, object], what: str) -> None:
    (want, want_res), (got, got_res) = eager, compiled
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=what)
    # the same grid point: λ equal to float32 rounding
    torch.testing.assert_close(got_res.strength, want_res.strength, atol=1e-6, rtol=1e-6, msg=what)
    if want_res.finite is not None:
        assert torch.equal(got_res.finite, want_res.finite), what
    if want_res.measurement is not None:
        torch.testing.assert_close(got_res.measurement.stack(), want_res.measurement.stack(), atol=1e-5, rtol=1e-4)


@compiled
@pytest.mark.parametrize("measure_step", [False, True])
def test_every_program_compiled_equals_eager_with_rows_leaving_and_joining(measure_step: bool) -> None:
    """Every program side by side, rows indexed as vLLM indexes them; one row leaves, another joins in its
    slot, and the batch shrinks and grows again: the compiled step (fullgraph, no break) equals the eager one."""
    programs, kernels = _every_program_side_by_side()
    n = len(programs)
    gen = torch.Generator().manual_seed(1)
    schedule = [np.arange(n)] * 4 + [np.arange(1, n)] * 2 + [np.array([n, *range(1, n)])] * 4
    for t, rows_np in enumerate(schedule):
        _leave_and_join(kernels, programs, t)
        logits = torch.randn(rows_np.size, V, generator=gen) * 2
        logits[0, 2] = float("-inf")
        rows = torch.from_numpy(rows_np)
        results = [k.apply(logits.clone(), rows, rows_np, measure_step=measure_step) for k in kernels]
        _same(results[0], results[1], f"step {t}")
        tokens = results[0][0].argmax(-1)
        for k in kernels:
            k.advance(tokens, rows)


@compiled
def test_the_state_update_by_row_index_compiled_equals_eager() -> None:
    """``advance_apply`` with rows by index, as vLLM's adapter drives it: every program side by side, a row
    leaves, another joins (its first step advances nothing), one row skips a step (``new`` false), and NaN
    logits are recorded; the compiled graph equals the eager update and step."""
    programs, kernels = _every_program_side_by_side()
    n = len(programs)
    gen = torch.Generator().manual_seed(4)
    schedule = [np.arange(n)] * 4 + [np.arange(1, n)] * 2 + [np.array([n, *range(1, n)])] * 4
    nan_steps = [torch.full((n,), -1, dtype=torch.long) for _ in kernels]
    for t, rows_np in enumerate(schedule):
        _leave_and_join(kernels, programs, t)
        b = rows_np.size
        tokens = torch.randint(0, V, (b,), generator=gen)
        tokens[: min(b, 2)] = torch.tensor([3, 7])[: min(b, 2)]  # the words stages and requirements wait for
        new = torch.ones(b, dtype=torch.bool)
        if t == 6:
            new[0] = False  # the row that just joined
        if t == 3:
            new[2] = False  # a row whose token the kernel already has
        logits = torch.randn(b, V, generator=gen) * 2
        if t == 7:
            logits[1, 5] = float("nan")
        rows = torch.from_numpy(rows_np)
        results = []
        for k, nan_step in zip(kernels, nan_steps, strict=True):
            mine = nan_step[:b] if b == n else nan_step[1:]
            results.append(
                k.advance_apply(tokens, logits.clone(), rows, rows_np, new=new, measure_step=t % 3 == 0, nan_step=mine)
            )
        _same_step_and_state(results, kernels, t, nan_row=1 if t == 7 else None)
    assert nan_steps[0].tolist() == nan_steps[1].tolist()
    assert (nan_steps[0] >= 0).sum() == 1


@compiled
def test_the_transformers_case_compiled_equals_eager_and_pulls_in_place() -> None:
    program = _programs()[2]  # the thermostat, repeat_weight 0
    kernels = _pair(3)
    prompts = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    for k in kernels:
        k.add_batch(program, prompts, budget=10)
    gen = torch.Generator().manual_seed(2)
    for t in range(6):
        logits = torch.randn(3, V, generator=gen) * 2
        results = [k.apply(logits.clone(), inplace=True) for k in kernels]
        _same(results[0], results[1], f"step {t}")
        for k in kernels:
            k.advance(results[0][0].argmax(-1))


@compiled
@pytest.mark.parametrize("index", range(len(_programs())), ids=[p.key for p in _programs()])
def test_the_state_update_compiled_into_the_step_equals_eager(index: int) -> None:
    """``advance_apply``: the state update (history, step, said, stage, required words) and the step in one
    compiled graph give the eager kernel's logits, λ and state at every step, and record the step of a NaN."""
    program = _programs()[index]
    kernels = _pair(3)
    prompts = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    for k in kernels:
        k.add_batch(program, prompts, budget=10)
    nan_steps = [torch.full((3,), -1, dtype=torch.long) for _ in kernels]
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, V, generator=gen) * 2
    results = [k.apply(logits.clone()) for k in kernels]  # the first step: nothing to advance yet
    for t in range(1, 9):
        tokens = results[0][0].argmax(-1)
        if t in (2, 3):  # the words the stages and requirements wait for, written on row 0
            tokens[0] = (3, 7)[t - 2]
        logits = torch.randn(3, V, generator=gen) * 2
        if t == 5:
            logits[1, 4] = float("nan")
        results = [
            k.advance_apply(tokens, logits.clone(), measure_step=t % 2 == 0, nan_step=n)
            for k, n in zip(kernels, nan_steps, strict=True)
        ]
        _same_step_and_state(results, kernels, t, nan_row=1 if t == 5 else None)
    assert nan_steps[0].tolist() == nan_steps[1].tolist() == [-1, 5, -1]


def test_compile_mode_reads_the_argument_then_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(COMPILE_ENV, raising=False)
    assert compile_mode(None) == "off"
    monkeypatch.setenv(COMPILE_ENV, "reduce-overhead")
    assert compile_mode(None) == "reduce-overhead"
    assert GravityKernel(1).compile == "reduce-overhead"
    assert compile_mode("off") == "off"
    monkeypatch.setenv(COMPILE_ENV, "fast")
    with pytest.raises(ConfigurationError, match=COMPILE_ENV):
        GravityKernel(1)
    with pytest.raises(ConfigurationError, match="`compile`"):
        GravityKernel(1, compile="max")
