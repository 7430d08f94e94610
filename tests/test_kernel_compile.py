"""The compiled step (``torch.compile(fullgraph=True)``) against the eager one: same logits, same λ grid point."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from narrative_gravity.errors import ConfigurationError
from narrative_gravity.gravity import GravityKernel
from narrative_gravity.gravity.kernel import COMPILE_ENV, compile_mode
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
    programs = _programs()
    n = len(programs)
    kernels = _pair(n + 1)
    for k in kernels:
        for r, program in enumerate(programs):
            k.add(r, program, budget=12, prompt=[1, 2, 3])
    gen = torch.Generator().manual_seed(1)
    schedule = [np.arange(n)] * 4 + [np.arange(1, n)] * 2 + [np.array([n, *range(1, n)])] * 4
    for t, rows_np in enumerate(schedule):
        if t == 4:
            for k in kernels:
                k.remove(0)
        if t == 6:
            for k in kernels:
                k.add(n, programs[6], budget=9, prompt=[4, 5])
        logits = torch.randn(rows_np.size, V, generator=gen) * 2
        logits[0, 2] = float("-inf")
        rows = torch.from_numpy(rows_np)
        results = [k.apply(logits.clone(), rows, rows_np, measure_step=measure_step) for k in kernels]
        _same(results[0], results[1], f"step {t}")
        tokens = results[0][0].argmax(-1)
        for k in kernels:
            k.advance(tokens, rows)


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
