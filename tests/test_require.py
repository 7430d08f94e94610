"""Words that must appear (`require`): the kernel's tables and step, the builder, the profile key, and generation
with the tiny seeded Llama, whose text is noise, so every required word it holds is the requirement's doing."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from narrative_gravity.engines.hf import processor_from_profile
from narrative_gravity.errors import FieldError, ProfileError
from narrative_gravity.fields.required import build_requirement, token_tables
from narrative_gravity.gravity import GravityKernel, NarrativeField, Program
from narrative_gravity.gravity.controllers import ConstantController
from narrative_gravity.gravity.require import Requirement, RequireTables, advance_required, pull_required
from narrative_gravity.profiles.schema import Profile

V = 30


def _req(**kw: Any) -> Requirement:
    glue = torch.zeros(V, dtype=torch.bool)
    glue[20:25] = True
    breaks = torch.zeros(V, dtype=torch.bool)
    breaks[25] = True
    args: dict[str, Any] = {
        "words": ("a", "b"),
        "forms": (((12,), (15, 16)), ((17, 18),)),
        "starts": (((12,),), ((17, 18),)),
        "boundary": (True, True),
        "glue": glue,
        "breaks": breaks,
        "stops": (29,),
        "strength": 3.0,
        "slack": 2,
        "window": 6,
    }
    return Requirement(**{**args, **kw})


def _kernel(req: Requirement, budget: int) -> GravityKernel:
    k = GravityKernel(1)
    prog = Program(field=NarrativeField(values=torch.zeros(V)), schedule=ConstantController(0.0).schedule(1)[0])
    k.add(0, Program(field=prog.field, schedule=prog.schedule, requirement=req), budget=budget, prompt=[1])
    return k


def _step(k: GravityKernel, logits: torch.Tensor, token: int | None = None) -> torch.Tensor:
    out, _ = k.apply(logits.clone())
    k.advance(torch.tensor([int(out.argmax()) if token is None else token]))
    return out


def test_far_from_the_deadline_only_the_pull_acts() -> None:
    k = _kernel(_req(), budget=40)
    logits = torch.zeros(1, V)
    out = _step(k, logits, token=3)
    assert torch.isfinite(out[0, :29]).all()  # nothing masked but the end of text
    assert out[0, 29] == float("-inf")  # the text may not end while a word is missing
    assert 0.0 <= float(out[0, 12]) <= 3.0 * (1 / 32) ** 2 + 1e-6  # strength × progress^curve at step 0 … 1
    later = torch.zeros(1, V)
    for _ in range(20):
        later = _step(k, logits, token=3)
    assert float(later[0, 12]) > float(out[0, 12])  # the pull rises as the budget runs out
    assert float(later[0, 17]) == pytest.approx(float(later[0, 12]))


def test_the_deadline_forces_the_missing_words_and_the_text_holds_both() -> None:
    k = _kernel(_req(), budget=8)
    logits = torch.zeros(1, V)
    logits[0, 3] = 5.0  # the model wants token 3 every time
    written = []
    for _ in range(8):
        out, _ = k.apply(logits.clone())
        token = int(out.argmax())
        written.append(token)
        k.advance(torch.tensor([token]))
    assert 12 in written and written[written.index(17) + 1] == 18  # "a", and "b" as its two pieces
    assert bool(k.written[0, :2].all())


def test_forcing_prefers_the_end_of_a_clause_inside_the_window() -> None:
    k = _kernel(_req(window=6, slack=0), budget=10)  # need 3: the window opens at step 1
    logits = torch.zeros(1, V)
    logits[0, 22] = 5.0  # the model keeps gluing pieces (never a new word): no reason to force before the end
    out = _step(k, logits, token=3)
    assert torch.isfinite(out).sum() > 3  # step 0: outside the window
    out = _step(k, logits, token=22)
    assert torch.isfinite(out).sum() > 3  # inside the window, but the last token does not end a clause
    out = _step(k, logits, token=25)  # 25 ends a clause
    out, _ = k.apply(logits.clone())
    assert set(torch.nonzero(torch.isfinite(out[0])).flatten().tolist()) == {12, 17}


def test_a_word_counts_only_whole_and_stands_whole_near_the_deadline() -> None:
    tables = RequireTables.build([_req()], vocab=V)
    q = torch.tensor([0])
    done = torch.zeros(1, 2, dtype=torch.bool)
    step = torch.tensor([3])
    assert not advance_required(done, tables, q, torch.tensor([[3, 12, 21]]), step)[0, 0]  # "12" + glue: "planets"
    assert advance_required(done, tables, q, torch.tensor([[3, 12, 4]]), step)[0, 0]  # "12" then a new word
    assert advance_required(done, tables, q, torch.tensor([[15, 16, 25]]), step)[0, 0]  # another form of it
    # a word in the prompt does not count: only the newest token was generated
    assert not advance_required(done, tables, q, torch.tensor([[3, 12, 4]]), torch.tensor([1]))[0, 0]
    # right after "12", inside the window: a glued piece is masked, so the word stands whole
    out = torch.zeros(1, V)
    pull_required(out, tables, q, done, torch.tensor([[3, 12]]), torch.tensor([5]), torch.tensor([10]))
    assert (out[0, 20:25] == float("-inf")).all() and torch.isfinite(out[0, :20]).all()
    # far from the deadline the model may glue ("planets" is its word, and "planet" is not yet written)
    out = torch.zeros(1, V)
    pull_required(out, tables, q, done, torch.tensor([[3, 12]]), torch.tensor([1]), torch.tensor([60]))
    assert torch.isfinite(out[0, 20:25]).all()


def test_a_form_written_without_its_space_counts_only_where_a_word_starts() -> None:
    """``de`` + ``legitimacy`` is not ``legitimacy``: a glued form right after a token that ends inside a word does
    not count; after a full stop, or at the start of the text, it does."""
    joins = torch.zeros(V, dtype=torch.bool)
    joins[3] = True  # " de": ends with a letter
    req = _req(forms=(((12,), (22,)), ((17, 18),)), joins=joins)  # 22: "a" written without its space (glue)
    tables = RequireTables.build([req], vocab=V)
    done, q, step = torch.zeros(1, 2, dtype=torch.bool), torch.tensor([0]), torch.tensor([3])
    assert not advance_required(done, tables, q, torch.tensor([[3, 22, 4]]), step)[0, 0]  # "de" + "a": one word
    assert advance_required(done, tables, q, torch.tensor([[25, 22, 4]]), step)[0, 0]  # after "."
    assert advance_required(done, tables, q, torch.tensor([[22, 4]]), torch.tensor([2]))[0, 0]  # first token
    assert advance_required(done, tables, q, torch.tensor([[3, 12, 4]]), step)[0, 0]  # the spaced form stands alone
    unchecked = RequireTables.build([_req(forms=(((12,), (22,)), ((17, 18),)))], vocab=V)  # no `joins`: as before
    assert advance_required(done, unchecked, q, torch.tensor([[3, 22, 4]]), step)[0, 0]
    assert req.history == 4  # the longest form (2), the token before it and the one after


def test_a_word_of_a_script_without_spaces_counts_at_once() -> None:
    tables = RequireTables.build([_req(boundary=(True, False))], vocab=V)
    done = advance_required(
        torch.zeros(1, 2, dtype=torch.bool), tables, torch.tensor([0]), torch.tensor([[17, 18]]), torch.tensor([2])
    )
    assert done.tolist() == [[False, True]]


def test_soft_pull_never_masks_and_a_row_is_never_forced_into_nothing() -> None:
    tables = RequireTables.build([_req(force=False)], vocab=V)
    out = torch.zeros(1, V)
    pull_required(out, tables, torch.tensor([0]), torch.zeros(1, 2, dtype=torch.bool), torch.tensor([[3]]),
                  torch.tensor([9]), torch.tensor([10]))  # fmt: skip
    assert torch.isfinite(out[0, :29]).all() and out[0, 29] == float("-inf")
    forced = RequireTables.build([_req()], vocab=V)
    grammar = torch.full((1, V), float("-inf"))
    grammar[0, 4] = 0.0  # something else (a grammar, say) left only token 4: it stays
    pull_required(grammar, forced, torch.tensor([0]), torch.zeros(1, 2, dtype=torch.bool), torch.tensor([[3]]),
                  torch.tensor([9]), torch.tensor([10]))  # fmt: skip
    assert torch.isfinite(grammar).sum() == 1 and grammar[0, 4] == 0.0


@settings(max_examples=30, deadline=None)
@given(budget=st.integers(3, 30), wants=st.lists(st.integers(0, 28), min_size=30, max_size=30))
def test_whatever_the_model_wants_the_words_are_written_within_the_budget(budget: int, wants: list[int]) -> None:
    """Greedy on logits that favour any token (the end of text included): both words are written in time."""
    k = _kernel(_req(), budget=budget)
    tokens = []
    for step in range(budget):
        logits = torch.zeros(1, V)
        logits[0, wants[step]] = 8.0
        logits[0, 29] = 4.0  # the model would like to stop
        out, _ = k.apply(logits)
        token = int(out.argmax())
        tokens.append(token)
        if token == 29:  # the text ends: only once both words are in (checked below)
            break
        k.advance(torch.tensor([token]))
    has_a = any(t == 12 and (i + 1 == len(tokens) or tokens[i + 1] not in range(20, 25)) for i, t in enumerate(tokens))
    has_a |= any(tokens[i : i + 2] == [15, 16] for i in range(len(tokens)))
    assert has_a and any(tokens[i : i + 2] == [17, 18] for i in range(len(tokens))), tokens


# ------------------------------------------------------------------------------------------------ builder


def test_build_requirement_on_a_real_tokenizer(tiny_tokenizer: Any) -> None:
    req = build_requirement(tiny_tokenizer, ["orbit", "galaxy"])
    assert req.words == ("orbit", "galaxy") and all(req.boundary)
    for forms, starts in zip(req.forms, req.starts):
        assert set(starts) <= set(forms)
        assert all(tiny_tokenizer.decode(list(s)).startswith(" ") for s in starts)  # pulled after a space
    glue, breaks, sentence, stops, joins = token_tables(tiny_tokenizer)
    assert stops == (tiny_tokenizer.eos_token_id,)
    for word, expect, inside in (("s", True, True), (" the", False, True), (".", False, False)):
        ids = tiny_tokenizer(word, add_special_tokens=False)["input_ids"]
        assert bool(glue[ids[0]]) is expect, word
        assert bool(joins[ids[-1]]) is inside, word
    assert req.joins is not None and torch.equal(req.joins, joins)
    dot = tiny_tokenizer(".", add_special_tokens=False)["input_ids"][0]
    comma = tiny_tokenizer(",", add_special_tokens=False)["input_ids"][0]
    assert bool(breaks[dot]) and bool(sentence[dot]) and bool(breaks[comma]) and not bool(sentence[comma])
    assert req.capital is not None and [any(c) for c in req.capital] == [True, True]  # " Galaxy", " Orbit"


def test_after_a_sentence_ends_a_forced_word_starts_with_its_capital() -> None:
    sentence = torch.zeros(V, dtype=torch.bool)
    sentence[25] = True
    req = _req(starts=(((12,), (13,)), ((17, 18),)), capital=((False, True), (False,)), sentence=sentence)
    tables = RequireTables.build([req], vocab=V)
    none = torch.zeros(1, 2, dtype=torch.bool)
    for last, allowed in ((25, {13, 17}), (3, {12, 13, 17})):  # "a" only as 13 (its capital) after a full stop
        out = torch.zeros(1, V)
        pull_required(
            out, tables, torch.tensor([0]), none, torch.tensor([[last]]), torch.tensor([9]), torch.tensor([10])
        )
        assert set(torch.nonzero(torch.isfinite(out[0])).flatten().tolist()) == allowed, last


def test_a_word_the_tokenizer_cannot_write_is_named(tiny_sp_tokenizer: Any) -> None:
    with pytest.raises(FieldError, match="required word '日本' cannot be written"):
        build_requirement(tiny_sp_tokenizer, ["orbit", "日本"])
    with pytest.raises(FieldError, match="blank word"):
        build_requirement(tiny_sp_tokenizer, ["orbit", " "])


# ------------------------------------------------------------------------------------------------ profile


def test_the_profile_key_takes_a_list_or_settings() -> None:
    p = Profile.from_mapping({"core_semantics": ["orbit"], "require": ["planet", " moon "]})
    assert p.require.words == ["planet", "moon"] and p.require.force and p.require.strength == 4.0
    q = Profile.from_mapping({"core_semantics": ["orbit"], "require": {"words": ["planet"], "force": False}})
    assert not q.require.force
    assert Profile.from_mapping(q.model_dump()) == q


@pytest.mark.parametrize(
    ("require", "expect"),
    [
        ({"words": []}, "require.words"),
        ({"words": ["x"], "strenght": 2}, "did you mean `strength`"),
        ({"words": ["x"], "strength": True}, "boolean"),
        ({"words": ["x"], "slack": 9, "window": 4}, "must not exceed require.window"),
        (["x", ""], "empty"),
    ],
)
def test_bad_require_settings_are_named(require: Any, expect: str) -> None:
    with pytest.raises(ProfileError, match=re.escape(expect)):
        Profile.from_mapping({"core_semantics": ["orbit"], "require": require})


# ------------------------------------------------------------------------------------------------ generation


def _has(text: str, word: str) -> bool:
    return re.search(rf"\b{re.escape(word)}\b", text, re.IGNORECASE) is not None


@pytest.mark.parametrize("budget", [6, 12, 20])
def test_generation_writes_every_required_word(tiny_model: tuple[Any, Any], budget: int) -> None:
    model, tok = tiny_model
    words = ["galaxy", "telescope"]
    profile = Profile.from_mapping(
        {"core_semantics": ["orbit"], "schedule": "constant", "gravity_strength": 0.0, "require": words}
    )
    prompts = ["The crew", "A small moon moves", "Our galaxy", "The comet leaves"]
    enc = tok(prompts, return_tensors="pt", padding=True)
    plain_hits = 0
    for seed in range(3):
        for proc in (processor_from_profile(profile, tok, max_new_tokens=budget), None):
            torch.manual_seed(seed)
            out = model.generate(
                **enc,
                max_new_tokens=budget,
                do_sample=True,
                logits_processor=[proc] if proc else None,
                pad_token_id=tok.eos_token_id,
            )
            texts = tok.batch_decode(out[:, enc.input_ids.shape[1] :], skip_special_tokens=True)
            if proc is None:
                plain_hits += sum(_has(t, w) for t in texts for w in words)
                continue
            for text, row in zip(texts, out[:, enc.input_ids.shape[1] :]):
                assert all(_has(text, w) for w in words), text
                assert tok.eos_token_id not in row.tolist()  # it did not end before the budget
    assert plain_hits < 3 * len(prompts)  # the random model does not write them by itself


def test_measure_only_leaves_the_text_alone(tiny_model: tuple[Any, Any]) -> None:
    _, tok = tiny_model
    profile = Profile.from_mapping({"core_semantics": ["orbit"], "require": ["galaxy"]})
    proc = processor_from_profile(profile, tok, max_new_tokens=6, measure_only=True)
    scores = torch.randn(1, len(tok))
    assert torch.equal(proc(torch.tensor([[1, 2]]), scores), scores)


# ------------------------------------------------------------------------------------------------ server


def test_the_server_serves_required_words_beside_other_requests(tiny_backend: Any, tmp_path: Any) -> None:
    """Over HTTP on the transformers backend: each required word is in its text, and a plain request that
    shares the batch gets what it gets alone."""
    pytest.importorskip("fastapi")
    import asyncio

    import httpx

    from narrative_gravity.profiles.store import ProfileStore
    from narrative_gravity.server import ServerConfig, create_app
    from servers import RunningServer

    words = ["galaxy", "telescope"]
    gravity = {"core_semantics": ["orbit"], "require": words}
    running = RunningServer(
        create_app(tiny_backend, config=ServerConfig(batch_window_ms=150), store=ProfileStore(tmp_path))
    )

    def body(prompt: str, **extra: Any) -> dict[str, Any]:
        return {"model": "tiny", "prompt": prompt, "max_tokens": 10, "temperature": 1.0, "seed": 3, **extra}

    async def together() -> list[Any]:
        async with httpx.AsyncClient(base_url=running.url, trust_env=False, timeout=60) as client:
            reqs = [body("The crew", gravity=gravity), body("A small moon"), body("Our galaxy", gravity=gravity)]
            return await asyncio.gather(*(client.post("/v1/completions", json=b) for b in reqs))

    try:
        with running.http() as http:
            alone = http.post("/v1/completions", json=body("A small moon")).json()["choices"][0]["text"]
            bad = http.post("/v1/completions", json=body("x", gravity={**gravity, "require": {"words": []}}))
            assert bad.status_code == 400 and "require.words" in bad.json()["error"]["message"]
        steered, plain, other = asyncio.run(together())
        assert plain.json()["choices"][0]["text"] == alone
        for resp in (steered, other):
            text = resp.json()["choices"][0]["text"]
            assert all(_has(text, w) for w in words), text
    finally:
        running.close()


def test_spread_puts_each_word_due_at_its_share_of_the_budget() -> None:
    """With spread, the first of two words may be forced after a clause within `window` of a third of the
    budget, long before the whole budget runs short; without it the same step is left alone."""
    logits = torch.zeros(1, V)
    logits[0, 3] = 5.0
    for spread, forced in ((True, True), (False, False)):
        k = _kernel(_req(spread=spread, window=6, slack=0), budget=60)
        for _ in range(12):
            _step(k, logits, token=3)
        _step(k, logits, token=25)  # step 12 ends a clause; the first word is due at step 20
        out, _ = k.apply(logits.clone())
        assert (set(torch.nonzero(torch.isfinite(out[0])).flatten().tolist()) == {12, 17}) is forced, spread


def test_token_flags_read_false_for_no_token_and_ids_past_the_vocabulary() -> None:
    from narrative_gravity.gravity.field import NO_TOKEN

    tables = RequireTables.build([_req()], vocab=V)
    tokens = torch.tensor([[NO_TOKEN, -1, 20, 19, V - 1, V, V + 7]])
    assert tables.token_flags(tables.glue, tokens).tolist() == [[False, False, True, False, False, False, False]]
    assert tables.token_flags(tables.breaks, tokens[0, 2:]).tolist() == [False, False, False, False, False]
    assert tables.token_flags(tables.breaks, torch.tensor([25])).tolist() == [True]
