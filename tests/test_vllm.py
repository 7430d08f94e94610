"""The vLLM logits processor: bookkeeping and math on synthetic batches, then a real engine on SmolLM2.

These tests need vLLM, which lives in its own venv (``bash scripts/setup_vllm.sh``)::

    VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python -m pytest tests/test_vllm.py -q

Without vLLM the whole module is skipped.
"""

from __future__ import annotations

import gc
import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

try:
    import vllm  # noqa: F401
except ImportError as exc:  # the main venv: vLLM pins another transformers, so it has a venv of its own
    pytest.skip(
        f"vLLM is not importable ({exc}); run `bash scripts/setup_vllm.sh` and use .venv-vllm/bin/python",
        allow_module_level=True,
    )

from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

from narrative_gravity.cli.main import app
from narrative_gravity.engines import vllm_generate
from narrative_gravity.engines.hf import processor_from_profile
from narrative_gravity.engines.options import GenerationOptions
from narrative_gravity.engines.vllm import (
    NarrativeGravityVLLMLogitsProcessor,
    _V2LogitsProcessor,
    profile_from_extra_args,
)
from narrative_gravity.errors import ProfileError
from narrative_gravity.profiles.build import field_from_profile
from narrative_gravity.profiles.schema import TOPIC_DEFAULTS, Profile

FQCN = "narrative_gravity.engines.vllm:NarrativeGravityVLLMLogitsProcessor"

# Profiles for the synthetic tests (words of the tiny tokenizer in conftest.py): every kind the kernel runs.
P_PLANET = {"core_semantics": ["planet"], "gravity_strength": 2.0, "schedule": "constant"}
P_ORBIT = {"core_semantics": ["orbit", "galaxy"], "gravity_strength": 3.0, "decay_after_steps": 2, "schedule": "phases"}
P_PRUNE = {
    "core_semantics": ["moon"],
    "penalize": ["planet"],
    "gravity_strength": 1.0,
    "prune_threshold": -0.5,
    "schedule": "phases",
}
P_THERMO = {
    "core_semantics": ["orbit", "planet", "moon"],
    "schedule": "thermostat",
    "field": {"mode": "lexical", "repeat_weight": 0.0},
    "thermostat": {"max_strength": 4.25, "explore_target": 0.4, "converge_target": 0.6, "strict_target": 0.8},
}
P_STAGES = {
    "core_semantics": ["planet"],
    "gravity_strength": 2.0,
    "schedule": "constant",
    "stages": [{"core_semantics": ["orbit"], "share": 0.3}, {"core_semantics": ["galaxy", "moon"]}],
}
P_STAGES_PRUNE = {
    **P_STAGES,
    "penalize": ["comet"],
    "prune_threshold": -0.5,
    "schedule": "thermostat",
    "field": {"mode": "lexical", "repeat_weight": 1.0},
}
P_TEXT_DRIFT = {**P_THERMO, "thermostat": {**P_THERMO["thermostat"], "drift_scope": "text", "drift_window": 4}}
P_REQUIRE = {
    "core_semantics": ["moon"],
    "schedule": "constant",
    "gravity_strength": 1.0,
    "require": ["orbit", "galaxy"],
}
P_REQUIRE_THERMO = {**P_THERMO, "require": {"words": ["comet", "star"], "slack": 2, "window": 4}}
# a KL budget for the first 3 tokens, another after them (the step is each row's own)
P_LATE_BUDGET = {
    **P_THERMO,
    "thermostat": {**P_THERMO["thermostat"], "kl_budget": 0.02, "kl_budget_steps": 3, "late_kl_budget": 0.2},
}
KINDS = [
    P_PLANET,
    P_ORBIT,
    P_PRUNE,
    P_THERMO,
    P_STAGES,
    P_STAGES_PRUNE,
    P_TEXT_DRIFT,
    P_REQUIRE,
    P_REQUIRE_THERMO,
    P_LATE_BUDGET,
]


def _params(profile: dict[str, Any] | None, max_tokens: int = 10) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, extra_args=None if profile is None else {"gravity": profile})


def _processor(tokenizer: Any, max_num_reqs: int = 8) -> NarrativeGravityVLLMLogitsProcessor:
    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=max_num_reqs))
    return NarrativeGravityVLLMLogitsProcessor(config, torch.device("cpu"), False, tokenizer=tokenizer)


def _solo(
    tokenizer: Any,
    profile: dict[str, Any] | None,
    prompt: list[int],
    out: list[int],
    logits: torch.Tensor,
    budget: int = 10,
    history: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, float]:
    """The row run alone through the transformers adapter: the prompt, then each output token, then
    ``logits``. Returns the pulled logits ``[1, V]`` and λ. ``history`` gives the logits of earlier steps
    (else zeros, which matter only for what the thermostat measured)."""
    if profile is None:
        return logits, 0.0
    proc = processor_from_profile(Profile.from_mapping(profile), tokenizer, max_new_tokens=budget)
    ids = list(prompt)
    for t, token in enumerate(out):
        step_logits = history[t] if history is not None else torch.zeros_like(logits)
        proc(torch.tensor([ids]), step_logits)
        ids.append(token)
    pulled = proc(torch.tensor([ids]), logits)
    return pulled, float(proc.last_strength[0])


def test_update_state_keeps_each_profile_on_its_row(tiny_tokenizer: Any) -> None:
    """Added, removed, moved and swapped rows: every row is pulled by its own request's profile."""
    proc = _processor(tiny_tokenizer)
    v = len(tiny_tokenizer)
    torch.manual_seed(0)
    prompt = tiny_tokenizer("The crew watches a")["input_ids"]
    outs = {name: [] for name in "abcd"}  # live output lists, as vLLM hands them out
    reqs = {"a": P_STAGES, "b": None, "c": P_ORBIT, "d": P_THERMO}

    def check(rows: dict[int, str]) -> None:
        logits = torch.randn(len(rows), v)
        got = proc.apply(logits.clone())
        for i, name in rows.items():
            out = outs[name]
            want, _ = _solo(tiny_tokenizer, reqs[name], prompt, out, logits[i : i + 1])
            torch.testing.assert_close(got[i : i + 1], want, msg=f"row {i} should carry request {name!r}")

    added = [(i, _params(reqs[n]), prompt, outs[n]) for i, n in enumerate("abcd")]
    proc.update_state(BatchUpdate(batch_size=4, removed=[], added=added, moved=[]))
    check({0: "a", 1: "b", 2: "c", 3: "d"})
    # Requests generate: the lists grow in place (steps and continuation prefixes follow). Emit the first
    # pieces of a multi-token form of "orbit"/"galaxy", so that row "c" must continue the word.
    orbit = field_from_profile(Profile.from_mapping(P_ORBIT), tiny_tokenizer)
    prefix = [t for t in orbit.prefixes[-1].tolist() if t >= 0]
    assert orbit.continuation(torch.tensor([prompt + prefix])).abs().sum() > 0
    for name in "abcd":
        outs[name].extend(prefix)
    proc.update_state(None)
    check({0: "a", 1: "b", 2: "c", 3: "d"})
    # "a" finishes; vLLM condenses by moving the last row into the hole, then swaps two rows.
    moved = [(3, 0, MoveDirectionality.UNIDIRECTIONAL), (1, 2, MoveDirectionality.SWAP)]
    proc.update_state(BatchUpdate(batch_size=3, removed=[0], added=[], moved=moved))
    check({0: "d", 1: "c", 2: "b"})
    # A new request takes a freed index and replaces nothing else.
    outs["a"] = []
    proc.update_state(
        BatchUpdate(batch_size=4, removed=[], added=[(3, _params(P_STAGES), prompt, outs["a"])], moved=[])
    )
    check({0: "d", 1: "c", 2: "b", 3: "a"})
    # Only the no-gravity row left: nothing is touched (the same tensor comes back).
    proc.update_state(
        BatchUpdate(batch_size=1, removed=[0, 1, 3], added=[], moved=[(2, 0, MoveDirectionality.UNIDIRECTIONAL)])
    )
    logits = torch.randn(1, v)
    assert proc.apply(logits) is logits
    assert set(proc.kernel._refs.values()) == {0}  # every program released, still cached for reuse
    assert len(proc.kernel._by_key) == 3  # the second P_STAGES request reused the first one's program


@pytest.mark.parametrize(
    "profiles",
    [
        [P_PLANET, None, P_PRUNE],
        [P_ORBIT, None, P_ORBIT],
        [P_ORBIT, P_ORBIT],
        [P_PRUNE, P_ORBIT],
        [P_THERMO, None, P_STAGES, P_STAGES_PRUNE],
        [P_TEXT_DRIFT, P_THERMO, P_PRUNE],
    ],
    ids=["two-fields", "one-field", "all-rows", "all-rows-two-fields", "thermostat-stages", "drift-scopes"],
)
def test_layouts_agree(tiny_tokenizer: Any, profiles: list[Any]) -> None:
    """Rows of one field or several, with rows of no gravity or none: each row gets what the transformers
    adapter gives it alone."""
    proc = _processor(tiny_tokenizer)
    prompt = tiny_tokenizer("The crew watches a")["input_ids"]
    orbit = field_from_profile(Profile.from_mapping(P_ORBIT), tiny_tokenizer)
    out = [t for t in orbit.prefixes[-1].tolist() if t >= 0]  # mid-word: the continuation must fire
    added = [(i, _params(p), prompt, list(out)) for i, p in enumerate(profiles)]
    proc.update_state(BatchUpdate(batch_size=len(profiles), removed=[], added=added, moved=[]))
    logits = torch.randn(len(profiles), len(tiny_tokenizer), generator=torch.Generator().manual_seed(len(profiles)))
    got = proc.apply(logits.clone())
    for i, p in enumerate(profiles):
        want, _ = _solo(tiny_tokenizer, p, prompt, out, logits[i : i + 1])
        # A thermostat row alone sits on its own field's support, in a batch on the union of every row's: the
        # solver sums the same probabilities in another order, and where m(λ) is flat that float rounding can
        # move λ by a few points of its grid (λ_max / 2^14, a few 1e-4 here); everything else is exact.
        thermostat = p is not None and Profile.from_mapping(p).schedule == "thermostat"
        tol = {"atol": 1e-3, "rtol": 0.0} if thermostat else {}
        torch.testing.assert_close(got[i : i + 1], want, **tol)


def _grid_unit(profile: dict[str, Any] | None) -> float:
    """One point of a thermostat row's λ grid (``λ_max / 2^iterations``); 0 for every other row."""
    if profile is None or Profile.from_mapping(profile).schedule != "thermostat":
        return 0.0
    block = profile.get("thermostat", {})
    return float(block.get("max_strength", 6.0)) / 2 ** int(block.get("iterations", 14))


def _join_and_leave(tokenizer: Any, draw: Any) -> None:
    """Rows join and leave a batch at the steps ``draw`` picks; at every step each row's λ and logits equal its
    run alone through the transformers adapter.

    ``draw(strategy, label)`` is hypothesis' ``data.draw``, or a script of the same draws. A thermostat row may
    land on the neighbouring point of its λ grid, and nowhere further: the kernel keeps every program's field
    on one support, the union of them all, and the solver's float32 sums over another support round
    differently. Where its mass target or KL budget falls within that rounding of a grid point, the two runs
    pick its two sides (:func:`test_a_thermostat_row_at_a_kl_budget_tie` replays such a case)."""
    v = len(tokenizer)
    proc = _processor(tokenizer, max_num_reqs=4)
    prompts = [tokenizer(t)["input_ids"] for t in ("The crew", "A small moon moves", "Our galaxy")]
    live: dict[int, dict[str, Any]] = {}  # batch index -> request
    n_steps = draw(st.integers(4, 9), "steps")
    # the logits come from a drawn seed, so that hypothesis replays (and shrinks) a failing example
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1), "seed"))
    for _ in range(n_steps):
        free = [i for i in range(4) if i not in live]
        added = []
        if free and draw(st.booleans(), "join"):
            req = {
                "profile": draw(st.sampled_from([None, *KINDS]), "profile"),
                "prompt": draw(st.sampled_from(prompts), "prompt"),
                "budget": draw(st.integers(3, 12), "budget"),
                "out": [],
                "logits": [],
            }
            live[free[0]] = req
            added.append((free[0], _params(req["profile"], req["budget"]), req["prompt"], req["out"]))
        done = [i for i, r in live.items() if len(r["out"]) >= r["budget"]]
        for i in done:
            del live[i]
        if not live:
            continue
        # vLLM keeps its batch dense: compact the rows (moves), then the batch holds indices 0..n-1
        moved = []
        for dst in range(len(live)):
            if dst not in live:
                src = max(live)
                live[dst] = live.pop(src)
                moved.append((src, dst, MoveDirectionality.UNIDIRECTIONAL))
        proc.update_state(BatchUpdate(batch_size=len(live), removed=done, added=added, moved=moved))
        logits = torch.randn(len(live), v, generator=gen) * 2
        got = proc.apply(logits.clone())
        for i, req in live.items():
            want, lam = _solo(
                tokenizer,
                req["profile"],
                req["prompt"],
                req["out"],
                logits[i : i + 1],
                req["budget"],
                req["logits"],
            )
            unit = _grid_unit(req["profile"])
            got_lam = 0.0 if proc.last_strength is None else float(proc.last_strength[i])
            # the same grid point, or its neighbour (|a| <= 1: the logits move by at most one unit)
            assert abs(got_lam - lam) <= unit * 1.001 + 1e-5, f"row {i}: {req['profile']}: λ {got_lam} != {lam}"
            tol = {"atol": unit * 1.001 + 1e-5, "rtol": 1e-5} if unit else {}
            torch.testing.assert_close(got[i : i + 1], want, msg=f"row {i}: {req['profile']}", **tol)
            req["logits"].append(logits[i : i + 1])
            req["out"].append(int(torch.argmax(got[i])))


@settings(max_examples=15, deadline=None, derandomize=True)
@given(data=st.data())
def test_rows_joining_at_different_steps_equal_their_solo_runs(tiny_tokenizer: Any, data: Any) -> None:
    """A batch where rows join and leave at any step, with different budgets and profiles (and none): at
    every step each row's λ and logits equal its run alone through the transformers adapter."""
    _join_and_leave(tiny_tokenizer, lambda strategy, label: data.draw(strategy, label=label))


def test_a_thermostat_row_at_a_kl_budget_tie(tiny_tokenizer: Any) -> None:
    """A case a random run found: a row with a KL budget of 0.02 whose cost at one grid point of λ is 0.019999953
    nats (float64), 2.4e-6 of the budget below it. Alone the row takes the next point, 3.138733; in the batch,
    whose support also holds a finished request's field, the float32 sums round the other way and it takes
    3.138474. Every other row and step is exact; this one is one grid point off, as the tolerance allows."""
    prompt = tiny_tokenizer("The crew")["input_ids"]
    joins = [True, None, prompt, 4, True, None, prompt, 5, False]
    joins += [True, P_ORBIT, prompt, 3, True, P_LATE_BUDGET, prompt, 3, False, False]
    script = iter([7, 1017716, *joins])  # steps, seed, then each step's draws

    _join_and_leave(tiny_tokenizer, lambda strategy, label: next(script))
    assert next(script, "end") == "end"


@pytest.mark.skipif(_V2LogitsProcessor is None, reason="this vLLM has no Model Runner V2 interface")
def test_model_runner_v2_interface(tiny_tokenizer: Any) -> None:
    """V2: state by request slot, rows mapped to slots each step, history read from the device buffers."""
    v, max_reqs, max_len = len(tiny_tokenizer), 8, 64
    orbit = field_from_profile(Profile.from_mapping(P_ORBIT), tiny_tokenizer)
    mid_word = [t for t in orbit.prefixes[-1].tolist() if t >= 0]
    reqs = {  # slot: (profile, prompt, output so far)
        5: (P_ORBIT, tiny_tokenizer("The crew watches a")["input_ids"], list(mid_word)),
        2: (None, tiny_tokenizer("The comet")["input_ids"], [7, 8]),
        7: (P_PLANET, tiny_tokenizer("A small moon")["input_ids"], []),
        1: (P_ORBIT, tiny_tokenizer("Our galaxy leaves")["input_ids"], [9, *mid_word]),
    }
    all_ids = torch.zeros(max_reqs, max_len, dtype=torch.int32)
    prompt_len = torch.zeros(max_reqs, dtype=torch.int32)
    for slot, (_, prompt, out) in reqs.items():
        seq = prompt + out
        all_ids[slot, : len(seq) - 1] = torch.tensor(seq[:-1])  # the newest token is only in ctx.input_ids
        prompt_len[slot] = len(prompt)
    req_states = SimpleNamespace(
        device=torch.device("cpu"),
        max_num_reqs=max_reqs,
        vocab_size=v,
        all_token_ids=SimpleNamespace(gpu=all_ids),
        prompt_len=SimpleNamespace(gpu=prompt_len),
    )
    proc = NarrativeGravityVLLMLogitsProcessor(SimpleNamespace(), req_states, tokenizer=tiny_tokenizer)
    assert [proc.add_request(slot, _params(p)) for slot, (p, _, _) in reqs.items()] == [True, False, True, True]
    proc.apply_staged_writes()
    order = [7, 2, 1, 5]  # batch position -> slot
    seqs = [reqs[slot][1] + reqs[slot][2] for slot in order]
    ctx = SimpleNamespace(
        idx_mapping=torch.tensor(order, dtype=torch.int32),
        idx_mapping_np=np.array(order, dtype=np.int32),
        expanded_idx_mapping=torch.tensor(order, dtype=torch.int32),
        pos=torch.tensor([len(q) - 1 for q in seqs], dtype=torch.int64),
        input_ids=torch.tensor([q[-1] for q in seqs], dtype=torch.int32),
    )
    logits = torch.randn(len(order), v)
    got = proc.apply(logits.clone(), ctx)
    for i, slot in enumerate(order):
        profile, prompt, out = reqs[slot]
        want, _ = _solo(tiny_tokenizer, profile, prompt, out, logits[i : i + 1])
        torch.testing.assert_close(got[i : i + 1], want, msg=f"row {i} (slot {slot})")
    # A recycled slot is fully re-initialized: slot 5 now holds a request without gravity.
    proc.add_request(5, _params(None))
    proc.apply_staged_writes()
    ctx5 = SimpleNamespace(
        idx_mapping=torch.tensor([5, 2], dtype=torch.int32),
        idx_mapping_np=np.array([5, 2], dtype=np.int32),
        pos=ctx.pos[[3, 1]],
        input_ids=ctx.input_ids[[3, 1]],
    )
    logits = torch.randn(2, v)
    assert proc.apply(logits, ctx5) is logits


@pytest.mark.parametrize("profile", KINDS, ids=range(len(KINDS)))
def test_grammar_masked_tokens_stay_masked(tiny_tokenizer: Any, profile: dict[str, Any]) -> None:
    """vLLM applies a structured-output bitmask (``-inf``) before the logits processors: no kind of profile
    brings a masked token back, and only pruning removes allowed ones."""
    proc = _processor(tiny_tokenizer)
    prompt = tiny_tokenizer("The crew watches a")["input_ids"]
    added = [(i, _params(profile), prompt, []) for i in range(3)]
    proc.update_state(BatchUpdate(batch_size=3, removed=[], added=added, moved=[]))
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, len(tiny_tokenizer), generator=gen)
    allowed = torch.rand(3, len(tiny_tokenizer), generator=gen) < 0.05
    allowed[:, tiny_tokenizer.convert_tokens_to_ids("Ġplanet")] = True  # a field token among the allowed
    masked = logits.masked_fill(~allowed, float("-inf"))
    out = proc.apply(masked.clone())
    finite = torch.isfinite(out)
    assert not (finite & ~allowed).any()  # -inf + λ·a is -inf
    assert finite.any(dim=1).all()  # pruning never empties a row
    if Profile.from_mapping(profile).prune_threshold is None:
        assert torch.equal(finite, allowed)


def test_bad_profiles_are_rejected_with_the_key() -> None:
    validate = NarrativeGravityVLLMLogitsProcessor.validate_params
    validate(_params(None))
    validate(_params(P_ORBIT))
    cases = {
        "gravity_strenght": {"core_semantics": ["x"], "gravity_strenght": 2},
        "gravity_strength": {"core_semantics": ["x"], "gravity_strength": -1},
        "schedule": {"core_semantics": ["x"], "schedule": "thermostat!"},
        "repeat_weight": {"core_semantics": ["x"], "field": {"repeat_weight": 1.5}},
        "not valid JSON": "{core_semantics: x}",
    }
    for needle, bad in cases.items():
        with pytest.raises(ProfileError, match=needle):
            validate(SamplingParams(extra_args={"gravity": bad}))
    assert profile_from_extra_args({"gravity": '{"core_semantics": ["x"]}'}).core_semantics == ["x"]
    for kind in KINDS:  # every profile the transformers engine runs is valid here too
        validate(_params(kind))


def test_entry_point_is_registered() -> None:
    from importlib.metadata import entry_points

    found = [ep.value for ep in entry_points(group="vllm.logits_processors")]
    assert FQCN in found, f"entry point missing ({found}); reinstall: pip install -e '.[vllm]'"


# --------------------------------------------------------------------------------------------------
# A real engine: SmolLM2-135M on vLLM's CPU backend, greedy.

PROMPTS = [
    "The planet",
    "Write a function",
    "Tell me a story about",
    "My favourite food is",
    "The harbour at dawn",
    "Explain how to bake bread.",
    "Our trip to the mountains",
    "A letter to my neighbour",
    "The chicken",
    "Yesterday my neighbour",
]
STRONG = {"core_semantics": ["ocean", "wave"], "gravity_strength": 6.0, "schedule": "constant"}
SEARCH = {"core_semantics": ["binary_search", "array"], "gravity_strength": 2.0}
SPACE = {"core_semantics": ["planet", "orbit"], "gravity_strength": 1.5, "penalize": ["the"]}
TOPIC = {"core_semantics": ["ship", "sail", "sea", "storm"], **TOPIC_DEFAULTS}  # the topic default
STAGED = {
    "core_semantics": ["bread"],
    "gravity_strength": 3.0,
    "schedule": "thermostat",
    "field": {"repeat_weight": 0.0},
    "stages": [{"core_semantics": ["flour", "water"], "share": 0.4}, {"core_semantics": ["oven", "bake"]}],
}
PRUNED = {
    "core_semantics": ["snow", "peak"],
    "penalize": ["the", "a"],
    "gravity_strength": 5.0,
    "schedule": "constant",
    "prune_threshold": -0.5,
}
LM = {
    "core_semantics": ["garden", "flowers"],
    "field": {"mode": "semantic", "semantic_source": "lm"},
    "schedule": "thermostat",
    "thermostat": {"max_strength": 6.0, "explore_target": 0.5, "converge_target": 0.7, "strict_target": 0.8},
}
REQUIRED = {
    "core_semantics": ["river"],
    "schedule": "constant",
    "gravity_strength": 0.0,
    "require": ["volcano", "telescope"],
}
CONTRAST = {  # the field of a sentence's contrast: the adapter reads it with the model loaded from the checkpoint
    "core_semantics": ["court"],
    "field": {"mode": "lexical", "contrast": {"sentence": "The following is about a trial in court.", "raw": True}},
    "schedule": "thermostat",  # λ reads the narrative mass, so the adapters' λ agree only if their fields do
    "thermostat": {"max_strength": 6.0, "explore_target": 0.5, "converge_target": 0.7, "strict_target": 0.8},
}
PROFILES = [STRONG, SEARCH, SPACE, None, TOPIC, STAGED, PRUNED, LM, REQUIRED, CONTRAST]
BUDGETS = [12, 9, 12, 12, 14, 12, 7, 10, 12, 12]  # rows finish at different steps, so later rows join mid-way
NEW_TOKENS = 12


def _engine(**kwargs: Any) -> Any:
    from vllm import LLM

    from narrative_gravity import models

    folder = models.hf_folder()
    return LLM(
        model=str(folder),
        dtype="float32",
        max_model_len=128,
        max_num_seqs=4,  # 8 requests: the last four join as the first ones finish
        kv_cache_memory_bytes=64 * 2**20,
        enforce_eager=True,
        seed=0,
        **kwargs,
    )


def _greedy(profile: dict[str, Any] | None, max_tokens: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, extra_args=profile and {"gravity": profile})


def _ids(outputs: list[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def runs(monkeypatch_module: pytest.MonkeyPatch) -> dict[str, Any]:
    """Plain vLLM (entry point switched off), then an engine with the processor: a mixed batch, recorded
    step by step, and each row alone."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm.v1.sample.logits_processor as lp

    with monkeypatch_module.context() as m:
        m.setattr(lp, "_load_logitsprocs_plugins", list)
        lp.cached_load_custom_logitsprocs.cache_clear()
        plain_llm = _engine()
        plain = _ids(plain_llm.generate(PROMPTS, [_greedy(None, n) for n in BUDGETS], use_tqdm=False))
        del plain_llm
        gc.collect()
    lp.cached_load_custom_logitsprocs.cache_clear()
    llm = _engine(logits_processors=[FQCN])  # the entry point loads it too: the second copy must stay inert
    steps: dict[int, tuple[list[int], list[tuple[int, torch.Tensor, float]]]] = {}

    def record(proc: Any, logits: torch.Tensor, pulled: torch.Tensor, result: Any) -> None:
        for i in np.flatnonzero(proc.kernel.prog[: logits.shape[0]] >= 0):
            out = proc._outputs[i]
            steps.setdefault(id(out), (out, []))[1].append((len(out), logits[i].clone(), float(result.strength[i])))

    NarrativeGravityVLLMLogitsProcessor.on_step = record
    try:
        params = [_greedy(p, n) for p, n in zip(PROFILES, BUDGETS)]
        mixed_out = llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        NarrativeGravityVLLMLogitsProcessor.on_step = None
    mixed = _ids(mixed_out)
    alone = [_ids(llm.generate([t], [_greedy(p, n)], use_tqdm=False))[0] for t, p, n in zip(PROMPTS, PROFILES, BUDGETS)]
    recorded = {}
    for out, rec in steps.values():  # the live output lists hold each request's whole output by now
        row = mixed.index(list(out))
        recorded[row] = sorted(rec, key=lambda r: r[0])
    prompts = [list(o.prompt_token_ids) for o in mixed_out]
    return {"llm": llm, "plain": plain, "mixed": mixed, "alone": alone, "recorded": recorded, "prompts": prompts}


@pytest.fixture(scope="module")
def monkeypatch_module() -> Any:
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")  # vLLM's own start-up warnings
def test_mixed_batch_rows_match_their_solo_runs(runs: dict[str, Any]) -> None:
    for i, (mixed, alone) in enumerate(zip(runs["mixed"], runs["alone"])):
        assert mixed == alone, f"row {i} ({PROFILES[i]}) changed when batched with other profiles"
    assert runs["mixed"][3] == runs["plain"][3], "the row without gravity must equal plain vLLM"
    for i in (0, 4, 5, 6, 7, 9):
        assert runs["mixed"][i] != runs["plain"][i], f"row {i} ({PROFILES[i]}) must change its row"


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_vllm_and_transformers_adapters_give_the_same_pull(runs: dict[str, Any]) -> None:
    """The kernel through the vLLM adapter and through the transformers adapter: the same λ at every step,
    and the same greedy token, for every profile kind. The comparison replays vLLM's own recorded logits
    through the transformers adapter: vLLM's CPU kernels and transformers' differ in the last bits of the
    logits, so comparing two independent greedy runs would test their numerics, not ours."""
    from narrative_gravity.models import load_model

    model, tok = load_model()
    assert sorted(runs["recorded"]) == [i for i, p in enumerate(PROFILES) if p is not None]
    for row, rec in runs["recorded"].items():
        out = runs["mixed"][row]
        assert [r[0] for r in rec] == list(range(len(out))), f"row {row}: one record per generated token"
        proc = processor_from_profile(
            Profile.from_mapping(PROFILES[row]), tok, max_new_tokens=BUDGETS[row], model=model
        )
        ids = list(runs["prompts"][row])
        for step, logits, lam in rec:
            pulled = proc(torch.tensor([ids]), logits[None])
            assert float(proc.last_strength[0]) == pytest.approx(lam, rel=1e-4, abs=1e-4), (row, step)
            assert int(pulled.argmax()) == out[step], (row, step)
            ids.append(out[step])


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_gravity_pulls_toward_the_field(runs: dict[str, Any]) -> None:
    tok = runs["llm"].get_tokenizer()
    pulled = tok.decode(runs["mixed"][0]).lower()
    plain = tok.decode(runs["plain"][0]).lower()
    assert "ocean" not in plain and "wave" not in plain, plain
    assert "ocean" in pulled or "wave" in pulled, pulled


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_a_sentences_contrast_pulls_on_the_vllm_engine(runs: dict[str, Any]) -> None:
    """The field holds "court" and the contrast of a sentence about a trial; "trial" comes from the contrast
    (on transformers, "court" alone writes "had a court case against a local business")."""
    tok = runs["llm"].get_tokenizer()
    row = PROFILES.index(CONTRAST)
    text, plain = (tok.decode(runs[k][row], skip_special_tokens=True).lower() for k in ("mixed", "plain"))
    assert "trial" in text and "trial" not in plain and "court" not in plain, (text, plain)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_required_words_are_written_on_the_vllm_engine(runs: dict[str, Any]) -> None:
    tok = runs["llm"].get_tokenizer()
    row = PROFILES.index(REQUIRED)
    text, plain = (tok.decode(runs[k][row], skip_special_tokens=True) for k in ("mixed", "plain"))
    for word in REQUIRED["require"]:
        assert re.search(rf"\b{word}\b", text, re.IGNORECASE), text
        assert word not in plain.lower(), plain


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_bad_profile_is_rejected_and_others_run_on(runs: dict[str, Any]) -> None:
    engine = runs["llm"].llm_engine
    engine.add_request("good-0", PROMPTS[0], _greedy(STRONG))
    with pytest.raises(VLLMValidationError, match="gravity_strenght") as err:  # a 400 in `vllm serve`
        engine.add_request("bad", PROMPTS[1], _greedy({"core_semantics": ["x"], "gravity_strenght": 3}))
    assert "did you mean `gravity_strength`" in str(err.value)
    engine.add_request("good-2", PROMPTS[2], _greedy(SPACE))
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    assert done["good-0"][:NEW_TOKENS] == runs["alone"][0][:NEW_TOKENS]
    assert done["good-2"] == runs["alone"][2]


# --------------------------------------------------------------------------------------------------
# `ngrav serve --engine vllm`: the OpenAI-compatible server on the same engine


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_server_on_the_vllm_engine(runs: dict[str, Any], tmp_path: Any) -> None:
    import asyncio

    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    from narrative_gravity.profiles.store import ProfileStore
    from narrative_gravity.server import ServerConfig, create_app
    from narrative_gravity.server.backends.vllm import VLLMBackend
    from servers import RunningServer

    tok = runs["llm"].get_tokenizer()
    backend = VLLMBackend(runs["llm"], model_id="smollm2")
    store = ProfileStore(tmp_path)
    store.set("search", SEARCH)
    running = RunningServer(create_app(backend, config=ServerConfig(batch_window_ms=200), store=store))
    try:
        greedy = {"model": "smollm2", "max_tokens": NEW_TOKENS, "temperature": 0}
        # SPACE without its topic sentence: the row must read the prompt the engine read alone
        gravity = [{"gravity": STRONG}, {"gravity": {"profile": "search"}}, {"gravity": {**SPACE, "lead": False}}, None]

        async def all_rows() -> list[str]:
            client = openai.AsyncOpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0)
            async with client:

                async def one(prompt: str, extra: Any) -> str:
                    stream = await client.completions.create(prompt=prompt, stream=True, extra_body=extra, **greedy)
                    return "".join([c.choices[0].text async for c in stream])

                return await asyncio.gather(*(one(p, g) for p, g in zip(PROMPTS, gravity)))

        # four concurrent streams with three profiles and none: each equals its row run alone on the engine
        texts = asyncio.run(all_rows())
        want = [tok.decode(ids, skip_special_tokens=True) for ids in runs["alone"][:4]]
        assert [texts[i] for i in (0, 2, 3)] == [want[i] for i in (0, 2, 3)]  # the rows of the same budget
        with running.client() as client:
            with pytest.raises(openai.BadRequestError, match="gravity_strenght"):
                client.completions.create(prompt="x", extra_body={"gravity": {"gravity_strenght": 2}}, **greedy)
            topic = client.completions.create(prompt=PROMPTS[4], extra_body={"gravity": TOPIC}, **greedy)
            assert topic.choices[0].text  # the topic default runs on this engine too, its sentence read first
            assert topic.model_extra["gravity"]["lead"].startswith("The following is about ")
            again = client.completions.create(prompt=PROMPTS[0], extra_body={"gravity": STRONG}, **greedy)
            assert again.choices[0].text == texts[0]
            assert again.model_extra["gravity"]["profile"] == "inline"
    finally:
        running.close()


# --------------------------------------------------------------------------------------------------
# Step-level admission: requests join vLLM's running batch as they arrive; cancelled ones leave it


LONG_PROMPT = "Once upon a time"
PHASES = {"core_semantics": ["planet", "orbit"], "schedule": "phases"}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``ngrav serve --engine vllm`` as the CLI builds it (vLLM's stats on), on a loopback port."""
    pytest.importorskip("fastapi")
    from narrative_gravity.profiles.store import ProfileStore
    from narrative_gravity.server import ServerConfig, create_app
    from narrative_gravity.server.backends.vllm import VLLMBackend
    from servers import RunningServer

    backend = VLLMBackend.load(max_num_seqs=8, max_model_len=512, kv_cache_mb=64)
    store = ProfileStore(tmp_path_factory.mktemp("store"))
    running = RunningServer(create_app(backend, config=ServerConfig(max_batch_size=8), store=store))
    yield running, backend
    running.close()


def _families(text: str) -> dict[str, Any]:
    from prometheus_client.parser import text_string_to_metric_families

    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(families: dict[str, Any], name: str, sample: str | None = None) -> float:
    """The sum of a family's samples named ``sample`` (default: the family's name) over all label sets."""
    return sum(s.value for s in families[name].samples if s.name == (sample or name))


# `ngrav generate --engine vllm` and `ngrav eval --engine vllm`: the CLI on one shared engine

CLI_PROMPTS = ["The planet", "Tell me a story about"]
CLI_TOKENS = 10


@pytest.fixture(scope="module")
def generator() -> Any:
    """The engine that both commands below ask for (8 requests at once, a context of 512): started once,
    then reused by the CLI in this process."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    vllm_generate.require_vllm()
    gen = vllm_generate.VLLMGenerator.load(None, max_num_seqs=8, longest=CLI_TOKENS + 16)
    yield gen
    vllm_generate.release_shared()


def _cli(*args: str) -> Any:
    res = CliRunner().invoke(app, list(args), env={"COLUMNS": "300"})
    assert res.exit_code == 0, res.output
    return res


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_vllm_server_admits_a_new_request_into_the_running_batch(served: Any) -> None:
    """Two long streams are decoding; a short request sent now streams its first token (and all of its tokens)
    before either long one ends, so it joined their batch instead of waiting for it."""
    import asyncio
    import time

    import httpx
    import openai

    running, _ = served
    with running.http() as http:
        before = _families(http.get("/metrics").text)

    async def main() -> tuple[float, float, list[float]]:
        http_client = httpx.AsyncClient(trust_env=False, timeout=120)
        client = openai.AsyncOpenAI(
            base_url=f"{running.url}/v1", api_key="unused", max_retries=0, http_client=http_client
        )
        async with client:
            started = [asyncio.Event(), asyncio.Event()]
            ends = [0.0, 0.0]

            async def long(i: int) -> None:
                extra = {"gravity": PHASES} if i else {}
                stream = await client.completions.create(
                    model="smollm2", prompt=LONG_PROMPT, max_tokens=160, temperature=0, stream=True, extra_body=extra
                )
                n = 0
                async for chunk in stream:
                    n += bool(chunk.choices and chunk.choices[0].text)
                    if n >= 3:
                        started[i].set()
                ends[i] = time.perf_counter()

            tasks = [asyncio.create_task(long(i)) for i in range(2)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
            first = None
            stream = await client.completions.create(
                model="smollm2", prompt="The planet", max_tokens=4, temperature=0, stream=True
            )
            async for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].text:
                    first = time.perf_counter()
            last = time.perf_counter()
            await asyncio.gather(*tasks)
            assert first is not None
            return first, last, ends

    first, last, ends = asyncio.run(main())
    assert first < last < min(ends), (first, last, ends)
    with running.http() as http:
        after = _families(http.get("/metrics").text)
    # some engine step advanced all three rows at once
    rows_le_2 = "ngrav_step_rows_bucket"
    three = [
        s.value
        for fam in (before, after)
        for s in fam["ngrav_step_rows"].samples
        if s.name == rows_le_2 and s.labels["le"] == "2.0"
    ]
    counts = [_value(f, "ngrav_step_rows", "ngrav_step_rows_count") for f in (before, after)]
    assert (counts[1] - three[1]) - (counts[0] - three[0]) >= 1


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_vllm_server_cancel_aborts_the_request_and_metrics_show_the_engine(served: Any) -> None:
    """A client that leaves a stream aborts its request in the engine: nothing stays in flight, in the engine or
    in /metrics (ours and vLLM's gauges), long before the request could have run to ``max_tokens``."""
    import time

    running, backend = served
    body = {"model": "smollm2", "prompt": LONG_PROMPT, "max_tokens": 400, "temperature": 0, "stream": True}
    with running.http() as http:
        before = _families(http.get("/metrics").text)
        with http.stream("POST", "/v1/completions", json={**body, "gravity": PHASES}) as resp:
            assert resp.status_code == 200
            chunks = 0
            for line in resp.iter_lines():
                chunks += line.startswith("data: ")
                if chunks >= 3:
                    break
        left = time.perf_counter()
        while True:
            families = _families(http.get("/metrics").text)
            gauges = [
                _value(families, name)
                for name in (
                    "ngrav_running_rows",
                    "ngrav_queued_rows",
                    "vllm:num_requests_running",
                    "vllm:num_requests_waiting",
                )
            ]
            if not any(gauges) or time.perf_counter() - left > 10:
                break
            time.sleep(0.1)
    assert gauges == [0, 0, 0, 0]
    assert not backend.engine.has_unfinished_requests()
    assert backend.in_flight() == (0, 0)
    # the engine stopped it far short of its 400 tokens
    generated = [_value(f, "vllm:generation_tokens", "vllm:generation_tokens_total") for f in (before, families)]
    assert 3 <= generated[1] - generated[0] < 200
    # vLLM's engine gauges sit beside ours in one exposition that prometheus_client parses
    assert {"vllm:kv_cache_usage_perc", "ngrav_requests", "ngrav_time_to_first_token_seconds"} <= families.keys()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_vllm_backend_a_refused_request_fails_alone(served: Any) -> None:
    """A row the engine refuses (its prompt is longer than the engine's context) gets its own error; the row
    submitted with it decodes to the end."""
    import threading

    _, backend = served
    greedy = GenerationOptions(max_new_tokens=4, temperature=0.0, top_k=0)
    too_long = SimpleNamespace(prompt_ids=[1] * 600, max_tokens=4, options=greedy, gravity=None, cancelled=False)
    good = SimpleNamespace(
        prompt_ids=backend.encode_text("The planet"), max_tokens=4, options=greedy, gravity=None, cancelled=False
    )
    events: list[tuple[Any, str, Any]] = []
    done = threading.Event()

    def on_events(batch: list[tuple[Any, str, Any]]) -> None:
        events.extend(batch)
        if sum(kind != "token" for _, kind, _ in events) == 2:
            done.set()

    backend.submit([too_long, good], on_events)
    assert done.wait(120)
    last = {id(row): (kind, payload) for row, kind, payload in events if kind != "token"}
    kind, error = last[id(too_long)]
    assert kind == "error" and "512" in str(error)
    kind, stats = last[id(good)]
    tokens = [t for row, k, t in events if row is good and k == "token"]
    assert kind == "end" and stats.new_tokens == len(tokens) >= 1
    assert backend.in_flight() == (0, 0)
    # the blocking Backend.generate runs through the same engine thread: the same greedy tokens
    steps: list[list[int | None]] = []
    assert backend.generate([good], steps.append) == [stats]
    assert [ids[0] for ids in steps] == tokens


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_vllm_backend_a_burst_of_seeded_long_prompts_all_finish(served: Any) -> None:
    """Sampled rows are seeded, and vLLM's CPU engine fails (with every row in it) when it splits a seeded
    prompt's prefill over steps: three 200-token prompts exceed one step of a 512-token budget together. On
    the CPU the backend turns chunked prefill off, and paces the burst over steps (``prefill_tokens``)."""
    import threading

    _, backend = served
    scheduler = backend.engine.vllm_config.scheduler_config
    assert scheduler.enable_chunked_prefill is False and scheduler.max_num_batched_tokens >= backend.max_context
    long_ids = (backend.encode_text("The planet orbits a distant star. ") * 40)[:200]
    rows = [
        SimpleNamespace(
            prompt_ids=long_ids,
            max_tokens=4,
            options=GenerationOptions(max_new_tokens=4, temperature=0.8, top_k=0, seed=i),
            gravity=None,
            cancelled=False,
        )
        for i in range(3)
    ]
    events: list[tuple[Any, str, Any]] = []
    done = threading.Event()

    def on_events(batch: list[tuple[Any, str, Any]]) -> None:
        events.extend(batch)
        if sum(kind != "token" for _, kind, _ in events) == len(rows):
            done.set()

    backend.submit(rows, on_events)
    assert done.wait(300)
    ends = [(kind, payload) for _, kind, payload in events if kind != "token"]
    assert all(kind == "end" and stats.new_tokens == 4 for kind, stats in ends), ends
    assert backend.in_flight() == (0, 0)


def test_vllm_backend_paces_a_burst_by_prompt_tokens(served: Any) -> None:
    """``prefill_tokens``: each engine step admits the oldest waiting rows up to that many prompt tokens, and
    always at least one (a longer prompt goes alone); 0 admits everything that arrived."""
    from collections import deque

    from narrative_gravity.server.backends.vllm import VLLMBackend

    _, running_backend = served
    backend = VLLMBackend(running_backend.llm, model_id="smollm2", prefill_tokens=100)  # its thread never starts

    def rows(*lengths: int) -> deque[tuple[Any, Any]]:
        return deque((SimpleNamespace(prompt_ids=[1] * n), None) for n in lengths)

    backend._inbox = rows(40, 40, 40, 300, 10)
    steps = []
    while backend._inbox:
        steps.append([len(row.prompt_ids) for row, _ in backend._arrivals()])
    assert steps == [[40, 40], [40], [300], [10]]
    backend.prefill_tokens = 0
    backend._inbox = rows(40, 40, 40, 300, 10)
    assert len(backend._arrivals()) == 5 and not backend._inbox


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_vllm_server_streams_each_tokens_stats_when_asked(served: Any) -> None:
    """``stream_options.include_trace`` on the vLLM engine: every streamed token carries λ, entropy and the masses
    the kernel measured at its step (the same records as on transformers), and the row ends with their means."""
    running, _ = served
    greedy = {"model": "smollm2", "prompt": PROMPTS[4], "max_tokens": 10, "temperature": 0, "stream": True}
    body = {**greedy, "gravity": TOPIC, "stream_options": {"include_usage": True, "include_trace": True}}
    with running.http() as http, http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    tokens = [t for e in events for c in e["choices"] for t in c.get("tokens", [])]
    usage = next(e["usage"] for e in events if e.get("usage"))
    assert len(tokens) == usage["completion_tokens"] == 10
    assert all(set(t) == {"id", "strength", "entropy", "mass", "mass_after", "kl"} for t in tokens)
    assert all(t["mass_after"] >= t["mass"] - 1e-6 and t["kl"] >= 0 for t in tokens)
    assert any(t["strength"] > 0 for t in tokens)  # the thermostat pulled at some step
    with running.http() as http:  # the row's means reached the gravity metrics
        families = _families(http.get("/metrics").text)
    assert _value(families, "ngrav_gravity_rows", "ngrav_gravity_rows_total") >= 1


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_vllm_server_runs_the_pipeline_of_a_chat_request(served: Any) -> None:
    """One request, every level, on the vLLM engine: passages pruned, earlier turns remembered, plan drafts
    written by the engine itself, then gravity; the response says what each level did."""
    running, _ = served
    passages = [
        {"id": "orbit", "text": "The planet moves along its orbit around the sun; its orbit is an ellipse."},
        {"id": "bread", "text": "Knead the dough, let the bread rise, and bake the loaf in a hot oven."},
        {"id": "moon", "text": "A small moon circles the planet and crosses its inner orbit every night."},
    ]
    turns = [
        {"role": "user", "content": "Tell me about comets."},
        {"role": "assistant", "content": "A comet has a bright tail."},
        {"role": "user", "content": "How does the planet move along its orbit?"},
    ]
    gravity = {
        "core_semantics": ["planet", "orbit"],
        "context": {"budget_share": 0.6},
        "conversation": {},
        "plan": {"drafts": 2, "outline_tokens": 16},
    }
    body = {"model": "smollm2", "messages": turns, "documents": passages, "gravity": gravity, "max_tokens": 16,
            "temperature": 0}  # fmt: skip
    with running.http() as http:
        resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    report = resp.json()["pipeline"]
    assert report["context"]["pruned"] and "bread" in {d["id"] for d in report["context"]["dropped"]}
    assert "comets" in report["memory"]["words"] or "comet" in report["memory"]["words"]
    assert report["plan"]["drafts"] == 2 and report["plan"]["stages"]
    assert len(report["stages"]) == 1 and resp.json()["choices"][0]["message"]["content"]


CARD = {
    "type": "object",
    "properties": {"title": {"type": "string", "maxLength": 32}, "description": {"type": "string", "maxLength": 64}},
    "required": ["title", "description"],
    "additionalProperties": False,
}
SCORE = {
    "type": "object",
    "properties": {
        "score": {"type": "integer", "minimum": 1, "maximum": 5},
        "why": {"type": "string", "maxLength": 24},
    },
    "required": ["score", "why"],
    "additionalProperties": False,
}


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_vllm_server_structured_output_with_gravity(served: Any) -> None:
    """`response_format` on the vLLM engine (vLLM's own structured outputs) with gravity: a concurrent mix of a
    schema row with the topic profile, a plain row and a row with another schema gets, row by row, what each gets
    alone (greedy); the replies match their schemas; a bad schema is a 400 naming `response_format` and the
    others run on."""
    import asyncio

    import httpx
    import openai

    from narrative_gravity.server.structured import reply_errors

    running, _ = served
    topic = {"core_semantics": ["ship", "sail", "sea", "storm"]}
    asks = [
        ("Describe a voyage as JSON.", {"gravity": topic, "response_format": _schema(CARD)}),
        ("The planet", {"gravity": topic}),
        ("Rate a sea story from 1 to 5 as JSON.", {"response_format": _schema(SCORE)}),
        ("Describe a voyage as JSON.", {"gravity": topic, "response_format": _schema({"type": "strin"})}),
        ("Describe a voyage as JSON.", {"response_format": _schema({"type": "string", "format": "weird"})}),
    ]

    async def send(indices: list[int]) -> list[Any]:
        http = httpx.AsyncClient(trust_env=False, timeout=120)
        async with openai.AsyncOpenAI(base_url=f"{running.url}/v1", api_key="x", max_retries=0, http_client=http) as c:

            async def one(i: int) -> Any:
                prompt, extra = asks[i]
                try:
                    reply = await c.chat.completions.create(
                        model="smollm2",
                        messages=[{"role": "user", "content": prompt}],
                        max_tokens=96,  # the schemas' maxLength bound a reply well below it
                        temperature=0,
                        extra_body=extra,
                    )
                except openai.APIStatusError as exc:
                    return exc
                return reply.choices[0].message.content, reply.choices[0].finish_reason

            return await asyncio.gather(*(one(i) for i in indices))

    alone = [asyncio.run(send([i]))[0] for i in range(3)]
    mixed = asyncio.run(send(list(range(5))))
    assert mixed[:3] == alone
    for (text, finish), schema in ((mixed[0], CARD), (mixed[2], SCORE)):
        assert finish == "stop" and reply_errors(schema, text) is None, text
    assert reply_errors({"type": "object"}, mixed[1][0]) is not None  # the plain row is not constrained
    for bad in mixed[3:]:
        assert isinstance(bad, openai.BadRequestError) and bad.body["param"] == "response_format", bad
    assert "not a valid JSON Schema" in mixed[3].body["message"]
    assert "weird" in mixed[4].body["message"]  # vLLM's own check of what its grammar backend supports
    # gravity moved the words inside the schema's strings: the same request without it writes other ones
    asks.append((asks[0][0], {"response_format": _schema(CARD)}))
    (unpulled, finish), *_ = asyncio.run(send([len(asks) - 1]))
    assert finish == "stop" and reply_errors(CARD, unpulled) is None and unpulled != mixed[0][0]


def _schema(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}}


def test_cli_generate_on_vllm_equals_the_python_api(generator: Any, tmp_path: Any) -> None:
    """Greedy: the texts of `ngrav generate --engine vllm` are those of `LLM.generate` with the profile in
    `SamplingParams(extra_args=...)` (raw text, and the chat template), and each row carries its trace."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(CLI_PROMPTS) + "\n")
    profile = tmp_path / "strong.json"
    profile.write_text(json.dumps({"name": "strong", **STRONG}))
    base = ["generate", "--engine", "vllm", "--prompts", str(prompts), "--temperature", "0"]
    base += ["--max-new-tokens", str(CLI_TOKENS), "--trace"]
    _cli(*base, "--profile", str(profile), "--raw", "--output", str(tmp_path / "raw.jsonl"))
    _cli(*base, "--profile", str(profile), "--output", str(tmp_path / "chat.jsonl"))
    _cli(*base, "--no-gravity", "--raw", "--output", str(tmp_path / "plain.jsonl"))
    rows = {
        name: [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        for name in ("raw", "chat", "plain")
    }

    llm = generator.llm
    raw = llm.generate(CLI_PROMPTS, _greedy(STRONG, CLI_TOKENS), use_tqdm=False)
    chat = llm.chat(
        [[{"role": "user", "content": p}] for p in CLI_PROMPTS], _greedy(STRONG, CLI_TOKENS), use_tqdm=False
    )
    for name, api in (("raw", raw), ("chat", chat)):
        assert [r["text"] for r in rows[name]] == [o.outputs[0].text for o in api], name
        assert [r["new_tokens"] for r in rows[name]] == [len(o.outputs[0].token_ids) for o in api], name
    assert [r["prompt"] for r in rows["raw"]] == CLI_PROMPTS
    assert "ocean" in rows["raw"][0]["text"] and "ocean" not in rows["plain"][0]["text"]
    for r in rows["raw"] + rows["chat"]:
        assert r["gravity"] is True and r["profile"] == "strong" and r["seed"] == 0
        assert set(r["thermo"]) == {"entropy", "mass", "mass_after", "kl", "strength"}
        assert r["thermo"]["strength"] == pytest.approx(6.0)
        assert r["thermo"]["mass_after"] > r["thermo"]["mass"] and r["thermo"]["kl"] > 0
    assert all(r["gravity"] is False and "thermo" not in r for r in rows["plain"])  # no gravity, no trace


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_cli_eval_on_vllm_reports_the_gravity_arms_trace(generator: Any, tmp_path: Any) -> None:
    """`ngrav eval --engine vllm`: control and the profile arm run on the engine, the arm's rows carry its
    trace and trace means, control (no gravity there) carries none, and the report is written."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(CLI_PROMPTS) + "\n")
    profile = tmp_path / "strong.json"
    profile.write_text(json.dumps({"name": "strong", **STRONG}))
    out = tmp_path / "run"
    metrics = "topic_success,length,mean_kl,mean_strength,mean_entropy"
    _cli(
        "eval", "--engine", "vllm", "--prompts", str(prompts), "--profile", str(profile), "--seeds", "0",
        "--max-new-tokens", str(CLI_TOKENS), "--temperature", "0", "--raw", "--judge", "none",
        "--metrics", metrics, "--out", str(out),
    )  # fmt: skip
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert sorted((r["profile"], r["prompt_index"]) for r in rows) == [
        (a, i) for a in ("control", "strong") for i in (0, 1)
    ]
    raw = generator.llm.generate(CLI_PROMPTS, _greedy(STRONG, CLI_TOKENS), use_tqdm=False)
    for r in rows:
        if r["profile"] == "control":
            assert r["trace"] is None and r["metrics"]["mean_strength"] is None
            continue
        assert r["text"] == raw[r["prompt_index"]].outputs[0].text
        assert all(len(v) == r["new_tokens"] for v in r["trace"].values())
        assert r["metrics"]["mean_strength"] == pytest.approx(6.0)
        assert r["metrics"]["mean_kl"] == pytest.approx(float(np.mean(r["trace"]["kl"])), abs=1e-4)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["settings"]["engine"] == "vllm" and summary["n_traces"] == {"control": 0, "strong": 2}
    assert summary["per_arm"]["strong"]["metrics"]["mean_strength"]["value"] == pytest.approx(6.0)
    assert (out / "report.md").exists()


def test_the_cli_does_not_import_vllm_until_the_engine_is_chosen() -> None:
    """vLLM is heavy: `ngrav --help` never imports it, even where it is installed."""
    code = (
        "import sys; from typer.testing import CliRunner; from narrative_gravity.cli.main import app; "
        "[CliRunner().invoke(app, [c, '--help']) for c in ('generate', 'eval')]; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_each_trace_follows_its_request_when_outputs_are_equal(generator: Any) -> None:
    """Traces are matched to requests by their outputs; a pull that decides every token makes different
    prompts write the same tokens, and each still gets its own trace (the one it has alone)."""
    heavy = Profile.from_mapping({"core_semantics": ["ocean"], "gravity_strength": 20.0, "schedule": "constant"})
    options = GenerationOptions(max_new_tokens=4, temperature=0, trace=True)
    ids = [generator.tokenizer(p)["input_ids"] for p in ("The planet", "A planet")]
    both = generator.generate([*ids, ids[0]], options, heavy)
    assert both[0].token_ids == both[1].token_ids == both[2].token_ids, [o.token_ids for o in both]
    assert both[0].trace["mass"] != both[1].trace["mass"]  # the prompts differ, so do their traces
    assert both[2].trace == both[0].trace  # the same prompt twice: the same trace
    for i in (0, 1):
        alone = generator.generate([ids[i]], options, heavy)[0]
        for key, values in alone.trace.items():
            assert both[i].trace[key] == pytest.approx(values, abs=1e-4), (i, key)


def test_the_rows_of_one_seeded_call_sample_independently(generator: Any) -> None:
    """Each request of a seeded call gets its own seed: the same prompt twice in one call writes two
    different samples (one shared seed gave every row the same draws), and the call is reproducible."""
    options = GenerationOptions(max_new_tokens=24, temperature=1.0, top_k=0, seed=7)
    ids = generator.tokenizer("Once upon a time")["input_ids"]
    first = [o.token_ids for o in generator.generate([ids, ids, ids], options)]
    again = [o.token_ids for o in generator.generate([ids, ids, ids], options)]
    assert first == again
    assert len({tuple(t) for t in first}) == 3, first
    # a call of one is the first row of a longer call with the same seed
    assert generator.generate([ids], options)[0].token_ids == first[0]
