"""The vLLM logits processor: bookkeeping and math on synthetic batches, then a real engine on SmolLM2.

These tests need vLLM, which lives in its own venv (``bash scripts/setup_vllm.sh``)::

    VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python -m pytest tests/test_vllm.py -q

Without vLLM the whole module is skipped.
"""

from __future__ import annotations

import gc
import os
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

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

from narrative_gravity.engines.vllm import (
    NarrativeGravityVLLMLogitsProcessor,
    _row_params,
    _V2LogitsProcessor,
    phase_scale,
    profile_from_extra_args,
)
from narrative_gravity.errors import ProfileError
from narrative_gravity.gravity.schedule import PhaseScheduleController
from narrative_gravity.gravity.tilt import apply_gravity
from narrative_gravity.profile import Profile
from narrative_gravity.steer import controller_from_profile, field_from_profile

FQCN = "narrative_gravity.engines.vllm:NarrativeGravityVLLMLogitsProcessor"

# Profiles for the synthetic tests (words of the tiny tokenizer in conftest.py).
P_PLANET = {"core_semantics": ["planet"], "gravity_strength": 2.0, "schedule": "constant"}
P_ORBIT = {"core_semantics": ["orbit", "galaxy"], "gravity_strength": 3.0, "decay_after_steps": 2}
P_PRUNE = {"core_semantics": ["moon"], "penalize": ["planet"], "gravity_strength": 1.0, "prune_threshold": -0.5}


def _params(profile: dict[str, Any] | None, max_tokens: int = 10) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, extra_args=None if profile is None else {"gravity": profile})


def _processor(tokenizer: Any, max_num_reqs: int = 8) -> NarrativeGravityVLLMLogitsProcessor:
    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=max_num_reqs))
    return NarrativeGravityVLLMLogitsProcessor(config, torch.device("cpu"), False, tokenizer=tokenizer)


def _expected(tokenizer: Any, profile: dict[str, Any] | None, logits: torch.Tensor, history: list[int], step: int):
    """One row as the transformers processor computes it: field for the history, controller's λ, apply_gravity."""
    if profile is None:
        return logits
    p = Profile.from_mapping(profile)
    field = field_from_profile(p, tokenizer).fit_vocab(logits.shape[-1])
    a = field.for_step(torch.tensor([history or [-2]]))
    if a.dim() == 1:
        a = a[None]
    lam = controller_from_profile(p)(SimpleNamespace(step=step, max_new_tokens=10, batch_size=1, device="cpu"))
    mask = None if p.prune_threshold is None else a <= p.prune_threshold
    return apply_gravity(logits, a, lam, mask)


def test_update_state_keeps_each_profile_on_its_row(tiny_tokenizer: Any) -> None:
    """Added, removed, moved and swapped rows: every row is pulled by its own request's profile."""
    proc = _processor(tiny_tokenizer)
    v = len(tiny_tokenizer)
    torch.manual_seed(0)
    prompt = tiny_tokenizer("The crew watches a")["input_ids"]
    outs = {name: [] for name in "abcd"}  # live output lists, as vLLM hands them out
    reqs = {"a": P_PLANET, "b": None, "c": P_ORBIT, "d": P_PRUNE}

    def check(rows: dict[int, str]) -> None:
        logits = torch.randn(len(rows), v)
        got = proc.apply(logits.clone())
        for i, name in rows.items():
            out = outs[name]
            want = _expected(tiny_tokenizer, reqs[name], logits[i : i + 1], prompt + out, len(out))
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
        BatchUpdate(batch_size=4, removed=[], added=[(3, _params(P_PLANET), prompt, outs["a"])], moved=[])
    )
    check({0: "d", 1: "c", 2: "b", 3: "a"})
    # Only the no-gravity row left: nothing is touched (the same tensor comes back).
    proc.update_state(
        BatchUpdate(batch_size=1, removed=[0, 1, 3], added=[], moved=[(2, 0, MoveDirectionality.UNIDIRECTIONAL)])
    )
    logits = torch.randn(1, v)
    assert proc.apply(logits) is logits
    assert proc.fields.refs == [0] * len(proc.fields.refs)  # every field released, still cached for reuse
    assert len(proc.fields.by_key) == 3  # the second P_PLANET request reused the first one's field


@pytest.mark.parametrize("strategy", ["index", "mask"])
@pytest.mark.parametrize(
    "profiles",
    [[P_PLANET, None, P_PRUNE], [P_ORBIT, None, P_ORBIT], [P_ORBIT, P_ORBIT], [P_PRUNE, P_ORBIT]],
    ids=["two-fields", "one-field", "all-rows", "all-rows-two-fields"],
)
def test_strategies_and_layouts_agree(tiny_tokenizer: Any, strategy: str, profiles: list[Any]) -> None:
    """Every way of applying (gather/scatter, masked strength, whole batch; one field or several) gives
    each row what the transformers processor would."""
    proc = _processor(tiny_tokenizer)
    proc.strategy = strategy
    prompt = tiny_tokenizer("The crew watches a")["input_ids"]
    orbit = field_from_profile(Profile.from_mapping(P_ORBIT), tiny_tokenizer)
    out = [t for t in orbit.prefixes[-1].tolist() if t >= 0]  # mid-word: the continuation must fire
    added = [(i, _params(p), prompt, list(out)) for i, p in enumerate(profiles)]
    proc.update_state(BatchUpdate(batch_size=len(profiles), removed=[], added=added, moved=[]))
    logits = torch.randn(len(profiles), len(tiny_tokenizer))
    got = proc.apply(logits.clone())
    for i, p in enumerate(profiles):
        want = _expected(tiny_tokenizer, p, logits[i : i + 1], prompt + out, len(out))
        torch.testing.assert_close(got[i : i + 1], want)


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
        want = _expected(tiny_tokenizer, profile, logits[i : i + 1], prompt + out, len(out))
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


def test_phase_scale_matches_the_controller() -> None:
    profiles = [
        Profile(core_semantics=["x"]),
        Profile(core_semantics=["x"], decay_after_steps=5, decay_half_life=3.0),
        Profile(core_semantics=["x"], schedule="constant", decay_after_steps=0),
        Profile(core_semantics=["x"], schedule="constant"),
        Profile(core_semantics=["x"], phases={"explore_until": 0.3, "strict_from": 0.3, "strict": 2.5}),
    ]
    for profile in profiles:
        ctrl = controller_from_profile(profile)
        for budget in (None, 1, 7, 15, 100):
            steps = torch.arange(0, 120)
            params = torch.from_numpy(_row_params(profile, budget)).expand(len(steps), -1)
            got = phase_scale(steps, params).tolist()
            want = [ctrl.scale(t, budget) if isinstance(ctrl, PhaseScheduleController) else 1.0 for t in range(120)]
            assert got == pytest.approx(want, rel=1e-12, abs=0), (profile, budget)


def test_bad_profiles_are_rejected_with_the_key() -> None:
    validate = NarrativeGravityVLLMLogitsProcessor.validate_params
    validate(_params(None))
    validate(_params(P_ORBIT))
    cases = {
        "gravity_strenght": {"core_semantics": ["x"], "gravity_strenght": 2},
        "gravity_strength": {"core_semantics": ["x"], "gravity_strength": -1},
        "schedule": {"core_semantics": ["x"], "schedule": "thermostat"},
        "repeat_weight": {"core_semantics": ["x"], "field": {"repeat_weight": 0.5}},
        "not valid JSON": "{core_semantics: x}",
    }
    for needle, bad in cases.items():
        with pytest.raises(ProfileError, match=needle):
            validate(SamplingParams(extra_args={"gravity": bad}))
    assert profile_from_extra_args({"gravity": '{"core_semantics": ["x"]}'}).core_semantics == ["x"]


def test_entry_point_is_registered() -> None:
    from importlib.metadata import entry_points

    found = [ep.value for ep in entry_points(group="vllm.logits_processors")]
    assert FQCN in found, f"entry point missing ({found}); reinstall: pip install -e '.[vllm]'"


# --------------------------------------------------------------------------------------------------
# A real engine: SmolLM2-135M on vLLM's CPU backend, greedy.

PROMPTS = ["The planet", "Write a function", "Tell me a story about", "My favourite food is"]
STRONG = {"core_semantics": ["ocean", "wave"], "gravity_strength": 6.0, "schedule": "constant"}
SEARCH = {"core_semantics": ["binary_search", "array"], "gravity_strength": 2.0}
SPACE = {"core_semantics": ["planet", "orbit"], "gravity_strength": 1.5, "penalize": ["the"]}
PROFILES = [STRONG, SEARCH, SPACE, None]
NEW_TOKENS = 12


def _engine(**kwargs: Any) -> Any:
    from vllm import LLM

    from narrative_gravity import models

    folder = models._hf_folder(models.resolve_model(), None, with_model=True)
    return LLM(
        model=str(folder),
        dtype="float32",
        max_model_len=128,
        max_num_seqs=8,
        kv_cache_memory_bytes=64 * 2**20,
        enforce_eager=True,
        seed=0,
        **kwargs,
    )


def _greedy(profile: dict[str, Any] | None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, extra_args=profile and {"gravity": profile})


def _ids(outputs: list[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def runs(monkeypatch_module: pytest.MonkeyPatch) -> dict[str, Any]:
    """Plain vLLM (entry point switched off), then an engine with the processor: mixed batch and each row alone."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm.v1.sample.logits_processor as lp

    with monkeypatch_module.context() as m:
        m.setattr(lp, "_load_logitsprocs_plugins", list)
        lp.cached_load_custom_logitsprocs.cache_clear()
        plain_llm = _engine()
        plain = _ids(plain_llm.generate(PROMPTS, _greedy(None), use_tqdm=False))
        del plain_llm
        gc.collect()
    lp.cached_load_custom_logitsprocs.cache_clear()
    llm = _engine(logits_processors=[FQCN])  # the entry point loads it too: the second copy must stay inert
    mixed = _ids(llm.generate(PROMPTS, [_greedy(p) for p in PROFILES], use_tqdm=False))
    alone = [_ids(llm.generate([t], [_greedy(p)], use_tqdm=False))[0] for t, p in zip(PROMPTS, PROFILES)]
    return {"llm": llm, "plain": plain, "mixed": mixed, "alone": alone}


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
    assert runs["mixed"][0] != runs["plain"][0], "a strength-6 profile must change its row"


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
    assert done == {"good-0": runs["alone"][0], "good-2": runs["alone"][2]}


# --------------------------------------------------------------------------------------------------
# `ngrav serve --engine vllm`: the OpenAI-compatible server on the same engine


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_server_on_the_vllm_engine(runs: dict[str, Any], tmp_path: Any) -> None:
    import asyncio

    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    from narrative_gravity.server import ServerConfig, create_app
    from narrative_gravity.server.vllm import VLLMBackend
    from narrative_gravity.store import ProfileStore
    from servers import RunningServer

    tok = runs["llm"].get_tokenizer()
    backend = VLLMBackend(runs["llm"], model_id="smollm2")
    store = ProfileStore(tmp_path)
    store.set("search", SEARCH)
    running = RunningServer(create_app(backend, config=ServerConfig(batch_window_ms=200), store=store))
    try:
        greedy = {"model": "smollm2", "max_tokens": NEW_TOKENS, "temperature": 0}
        gravity = [{"gravity": STRONG}, {"gravity": {"profile": "search"}}, {"gravity": SPACE}, None]

        async def all_rows() -> list[str]:
            client = openai.AsyncOpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0)
            async with client:

                async def one(prompt: str, extra: Any) -> str:
                    stream = await client.completions.create(prompt=prompt, stream=True, extra_body=extra, **greedy)
                    return "".join([c.choices[0].text async for c in stream])

                return await asyncio.gather(*(one(p, g) for p, g in zip(PROMPTS, gravity)))

        # four concurrent streams with three profiles and none: each equals its row run alone on the engine
        texts = asyncio.run(all_rows())
        assert texts == [tok.decode(ids, skip_special_tokens=True) for ids in runs["alone"]]
        with running.client() as client:
            with pytest.raises(openai.BadRequestError, match="thermostat"):
                client.completions.create(
                    prompt="x", extra_body={"gravity": {**SPACE, "schedule": "thermostat"}}, **greedy
                )
            again = client.completions.create(prompt=PROMPTS[0], extra_body={"gravity": STRONG}, **greedy)
            assert again.choices[0].text == texts[0]
            assert again.model_extra["gravity"]["profile"] == "inline"
    finally:
        running.close()
