"""The topic sentence (`lead`): the profile key, the words it names, the prompts it changes on every path (the
library, the eval harness, the HTTP server), and the paths it must leave alone (control, measure_only, shadows)."""

from __future__ import annotations

import time

import pytest

from narrative_gravity.engines.hf_generate import generate, sample_ids
from narrative_gravity.engines.options import GenerationOptions
from narrative_gravity.engines.prompts import encode_prompts
from narrative_gravity.errors import ProfileError
from narrative_gravity.lead import (
    central_words,
    join_words,
    lead_messages,
    lead_sentence,
    lead_text,
    reading_profile,
)
from narrative_gravity.profiles.schema import Profile

SPACE = ["planet", "orbit", "galaxy", "telescope", "astronaut", "banana"]


def test_the_profile_key_takes_defaults_and_refuses_what_cannot_work() -> None:
    p = Profile.from_mapping({"core_semantics": ["orbit"], "lead": {}})
    assert p.lead is not None and (p.lead.text, p.lead.words, p.lead.pick) == (None, 3, "central")
    assert Profile.from_mapping(p.model_dump(exclude_none=True)) == p  # dumps and reloads to itself
    for bad, says in [
        ({"text": "   "}, "lead.text is blank"),
        ({"words": 0}, "lead.words"),
        ({"pick": "random"}, "lead.pick"),
        ({"sentence": "x"}, "sentence"),
    ]:
        with pytest.raises(ProfileError, match=says):
            Profile.from_mapping({"core_semantics": ["orbit"], "lead": bad})


def test_the_topic_default_reads_one_word_and_can_be_switched_off() -> None:
    p = Profile.from_mapping({"core_semantics": ["orbit", "planet"]})  # only words: the topic default
    assert p.lead and (p.lead.words, p.lead.kl_budget) == (1, 0.05)
    assert (p.lead.kl_budget_steps, p.lead.late_kl_budget) == (128, 0.3)  # the pull takes over past token 128
    chat = p.lead.in_mode(raw=False)  # chat: three words, and the lead's budgets (0.05 nats, 128 steps, then 0.30)
    assert chat and (chat.words, chat.kl_budget, chat.kl_budget_steps, chat.late_kl_budget) == (3, 0.05, 128, 0.3)
    assert lead_sentence(p, raw=False) == "Write about orbit and planet."
    no_chat = Profile.from_mapping({"core_semantics": ["orbit"], "lead": {"chat": False}})
    assert lead_sentence(no_chat, raw=False) is None and lead_sentence(no_chat, raw=True) is not None
    assert Profile.from_mapping({"core_semantics": ["orbit"], "lead": None}).lead == p.lead  # null: left out
    off = Profile.from_mapping({"core_semantics": ["orbit"], "lead": False})
    assert off.lead is False and lead_sentence(off, raw=True) is None
    assert Profile.from_mapping(off.model_dump(mode="json")) == off  # `false` survives a store's round trip
    assert Profile.from_mapping({"core_semantics": ["orbit"], "schedule": "constant"}).lead is None  # classic
    assert Profile.from_mapping({"core_semantics": ["二分", "查找"]}).lead is None  # measured in English only
    for bad, says in [(True, "write {} for the defaults, or false for none"), ("yes", "or false for none")]:
        with pytest.raises(ProfileError, match=says):
            Profile.from_mapping({"core_semantics": ["orbit"], "lead": bad})
    with pytest.raises(ProfileError, match=r"lead\.kl_budget"):
        Profile.from_mapping({"core_semantics": ["orbit"], "lead": {"kl_budget": 0}})
    for bad_chat, says in [
        ("yes", r"`lead\.chat` .*true, false or a mapping"),
        ({"wrds": 3}, r"`lead\.chat\.wrds`; did you mean `words`"),
        ({"kl_budget": -1}, r"`lead\.chat\.kl_budget` \(got -1\)"),
        ({"text": "Say {required}."}, r"lead\.chat\.text names \{required\}"),
    ]:
        with pytest.raises(ProfileError, match=says):
            Profile.from_mapping({"core_semantics": ["orbit"], "lead": {"chat": bad_chat}})
    stored = Profile.from_mapping(p.model_dump(mode="json"))
    assert stored == p  # the chat settings survive a store's round trip


def test_the_pull_takes_the_leads_budget_only_where_the_sentence_is_read() -> None:
    p = Profile.from_mapping({"core_semantics": ["orbit", "planet"]})
    read = reading_profile(p, raw=True)
    assert p.thermostat.kl_budget is None and read.thermostat.kl_budget == 0.05 and read.lead == p.lead
    assert (read.thermostat.kl_budget_steps, read.thermostat.late_kl_budget) == (128, 0.3)
    assert reading_profile(read, raw=True) is read  # once is enough
    assert reading_profile(p, raw=False).thermostat.kl_budget == 0.05  # the default's chat budget
    no_chat = Profile.from_mapping({"core_semantics": ["orbit"], "lead": {"chat": False}})
    assert reading_profile(no_chat, raw=False) is no_chat  # no sentence in chat, so no budget there
    in_chat = Profile.from_mapping({"core_semantics": ["orbit"], "lead": {"kl_budget": 0.1}})
    assert reading_profile(in_chat, raw=False).thermostat.kl_budget == 0.1  # an explicit lead is read in chat
    own = Profile.from_mapping({"core_semantics": ["orbit"], "thermostat": {"kl_budget": 0.2}})
    assert reading_profile(own, raw=True) is own  # the thermostat's own budget wins
    no_budget = Profile.from_mapping({"core_semantics": ["orbit"], "lead": {}})
    assert reading_profile(no_budget, raw=True).thermostat.kl_budget is None
    late = Profile.from_mapping(
        {"core_semantics": ["orbit"], "lead": {"kl_budget": 0.05, "kl_budget_steps": 64, "late_kl_budget": 0.3}}
    )
    t = reading_profile(late, raw=True).thermostat
    assert (t.kl_budget, t.kl_budget_steps, t.late_kl_budget) == (0.05, 64, 0.3)
    with pytest.raises(ProfileError, match=r"lead\.kl_budget_steps"):
        Profile.from_mapping({"core_semantics": ["orbit"], "lead": {"kl_budget_steps": 0}})


def test_an_eval_arm_pulls_with_the_budget_while_it_reads_the_sentence(tiny_model, tmp_path) -> None:
    from narrative_gravity.eval import EvalModels, EvalSettings, run_eval
    from narrative_gravity.eval.store import ResultStore

    model, tok = tiny_model
    arms = {}
    for name, lead in [("read", "{words: 1, kl_budget: 0.01, pick: first}"), ("unread", "false")]:
        arms[name] = tmp_path / f"{name}.yaml"
        arms[name].write_text(
            f"name: {name}\ncore_semantics: [the, and, of]\nfield: {{mode: lexical}}\n"
            f"thermostat: {{max_strength: 8.0, converge_target: 0.9, strict_target: 0.9}}\nlead: {lead}\n"
        )
    prompts = tmp_path / "p.txt"
    prompts.write_text("The crew\nA small moon moves\n")
    settings = EvalSettings(
        prompts=str(prompts), profiles=tuple(str(a) for a in arms.values()), seeds=(0,), max_new_tokens=10,
        batch_size=2, raw=True, judge="none", metrics=("distinct_2",),
    )  # fmt: skip
    run_eval(settings, tmp_path / "run", models=EvalModels(model, tok), progress=False, write_report=False)
    rows = ResultStore(tmp_path / "run" / "results.jsonl").load()
    kl = {a: max(k for r in rows if r["profile"] == a for k in r["trace"]["kl"]) for a in arms}
    assert all(r["lead"] == "The following is about the." for r in rows if r["profile"] == "read")
    assert kl["read"] <= 0.01 * 1.5 < kl["unread"]  # the lead's budget holds; without a lead, no budget


def test_central_words_are_the_topic_not_the_odd_one_out_and_ignore_the_order() -> None:
    chosen = central_words(SPACE, 3)
    assert len(chosen) == 3 and "banana" not in chosen
    assert central_words(list(reversed(SPACE)), 3) == chosen
    assert central_words(["orbit", "planet"], 3) == ["orbit", "planet"]  # no more words than asked for
    assert central_words(["二分", "查找", "算法", "数组"], 2) == ["二分", "查找"]  # MiniLM does not read these


def test_the_sentence_names_the_chosen_words_in_either_mode() -> None:
    p = Profile(core_semantics=SPACE, lead={"pick": "first", "words": 2})
    assert lead_sentence(p, raw=True) == "The following is about planet and orbit."
    assert lead_sentence(p, raw=False) == "Write about planet and orbit."
    custom = Profile(core_semantics=SPACE, lead={"text": "Topic: {words}. {words}!", "words": 1, "pick": "first"})
    assert lead_sentence(custom, raw=True) == "Topic: planet. planet!"
    assert join_words(["a", "b", "c", "d"]) == "a, b, c and d"
    compound = Profile(core_semantics=["binary_search", "array"], lead={"pick": "first", "words": 1})
    assert lead_sentence(compound, raw=False) == "Write about binary search."  # as Profile.keywords() reads it
    assert lead_text(" rest", "Lead.") == "Lead. rest"  # no doubled space
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    led = lead_messages(system, "Write about planets.")
    assert led[0] == {"role": "system", "content": "Write about planets.\n\nBe brief."} and led[1:] == system[1:]
    assert system[0]["content"] == "Be brief."  # the caller's messages are untouched


def test_encoded_prompts_carry_the_sentence_per_prompt(tiny_model) -> None:
    from servers import with_chat_template

    _, tok = tiny_model
    prompts = ["The planet", "The crew"]
    raw = encode_prompts(tok, prompts, raw=True, lead=["The orbit.", None])
    assert raw == [tok("The orbit. The planet")["input_ids"], tok("The crew")["input_ids"]]
    chat_tok = with_chat_template(tok)
    (ids,) = encode_prompts(chat_tok, ["The planet"], raw=False, lead="Write about orbits.")
    assert chat_tok.decode(ids) == "system: Write about orbits.\nuser: The planet\nassistant:"
    with pytest.raises(ValueError, match="1 leads for 2 prompts"):
        encode_prompts(tok, prompts, raw=True, lead=["x"])


def test_generate_reads_the_sentence_and_returns_only_the_continuation(tiny_model) -> None:
    model, tok = tiny_model
    opts = GenerationOptions(max_new_tokens=6, top_k=10, temperature=1.0, seed=3)
    sentence = "They said orbit again."
    (res,) = generate(model, tok, ["The crew"], opts.replace(raw=True), lead=sentence)
    (same,) = sample_ids(model, tok, [tok(f"{sentence} The crew")["input_ids"]], opts)
    assert res.token_ids == same and res.prompt == "The crew"
    (plain,) = generate(model, tok, ["The crew"], opts.replace(raw=True))
    assert plain.token_ids == sample_ids(model, tok, [tok("The crew")["input_ids"]], opts)[0]


def test_an_eval_arm_with_a_lead_reads_it_and_control_does_not(tiny_model, tmp_path) -> None:
    from narrative_gravity.eval import EvalModels, EvalSettings, run_eval
    from narrative_gravity.eval.store import ResultStore

    model, tok = tiny_model
    arm = tmp_path / "lead.yaml"  # the sentence alone: no pull, so its tokens are plain decoding's after the lead
    arm.write_text(
        "name: lead\ncore_semantics: [planet, orbit]\nschedule: constant\ngravity_strength: 0\n"
        "lead: {text: 'They said {words} again.', pick: first}\n"
    )
    prompts = tmp_path / "p.txt"
    prompts.write_text("The crew\nOur galaxy\n")
    settings = EvalSettings(
        prompts=str(prompts), profiles=(str(arm),), seeds=(0,), max_new_tokens=6, batch_size=2, raw=True,
        judge="none", metrics=("distinct_2",),
    )  # fmt: skip
    run_eval(settings, tmp_path / "run", models=EvalModels(model, tok), progress=False, write_report=False)
    rows = {(r["profile"], r["prompt"]): r for r in ResultStore(tmp_path / "run" / "results.jsonl").load()}
    opts = GenerationOptions(max_new_tokens=6, top_k=10, temperature=1.0, seed=0)
    for text in ("The crew", "Our galaxy"):
        led, control = rows[("lead", text)], rows[("control", text)]
        assert led["lead"] == "They said planet and orbit again." and "lead" not in control
        batch = encode_prompts(tok, ["The crew", "Our galaxy"], raw=True, lead=led["lead"])
        expected = sample_ids(model, tok, batch, opts)[["The crew", "Our galaxy"].index(text)]
        assert led["token_ids"] == expected
        assert (
            control["token_ids"]
            == sample_ids(model, tok, encode_prompts(tok, ["The crew", "Our galaxy"], raw=True), opts)[
                ["The crew", "Our galaxy"].index(text)
            ]
        )


def test_the_sentence_can_name_the_required_words_per_prompt(tiny_model, tmp_path) -> None:
    with pytest.raises(ProfileError, match=r"names \{required\}, but the profile has no `require`"):
        Profile.from_mapping({"core_semantics": ["orbit"], "lead": {"text": "It mentions {required}."}})
    both = Profile(core_semantics=["orbit"], require=["comet", "moon"], lead={"text": "{words}: {required}."})
    assert lead_sentence(both, raw=True) == "orbit: comet and moon."

    import json

    from narrative_gravity.eval import EvalModels, EvalSettings, run_eval
    from narrative_gravity.eval.store import ResultStore

    model, tok = tiny_model
    arm = tmp_path / "lead.yaml"  # each prompt's own required words replace the template's, in the sentence too
    arm.write_text("name: lead\ncore_semantics: [x]\nrequire: {words: [x]}\nlead: {text: 'It mentions {required}.'}\n")
    prompts = tmp_path / "p.jsonl"
    rows = [
        {"prompt": "The crew", "topic": ["planet"], "heldout": ["star"], "require": ["comet", "moon"]},
        {"prompt": "Our galaxy", "topic": ["planet"], "heldout": ["star"], "require": ["orbit"]},
    ]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    settings = EvalSettings(
        prompts=str(prompts), profiles=(f"auto:{arm}",), seeds=(0,), max_new_tokens=8, batch_size=2, raw=True,
        judge="none", metrics=("required_inclusion",),
    )  # fmt: skip
    run_eval(settings, tmp_path / "run", models=EvalModels(model, tok), progress=False, write_report=False)
    led = {r["prompt"]: r for r in ResultStore(tmp_path / "run" / "results.jsonl").load() if r["profile"] == "lead"}
    assert led["The crew"]["lead"] == "It mentions comet and moon."
    assert led["Our galaxy"]["lead"] == "It mentions orbit."


def test_the_server_reads_the_sentence_says_so_and_keeps_it_from_plain_runs(tiny_backend, tmp_path) -> None:
    pytest.importorskip("fastapi")
    from narrative_gravity.profiles.store import ProfileStore
    from narrative_gravity.server import ServerConfig, create_app
    from servers import RunningServer

    store = ProfileStore(tmp_path / "store")
    profile = {
        "core_semantics": ["planet", "orbit"], "gravity_strength": 2.0, "schedule": "constant",
        "lead": {"text": "They said {words} again.", "pick": "first"},
    }  # fmt: skip
    store.set("led", profile)
    config = ServerConfig(batch_window_ms=5, max_tokens_limit=32, max_prompt_tokens=200)
    running = RunningServer(create_app(tiny_backend, config=config, store=store))
    try:
        with running.http() as http:
            body = {"model": "tiny", "prompt": "The crew", "max_tokens": 4, "seed": 1}
            plain_tokens = len(tiny_backend.encode_text("The crew"))
            led = http.post("/v1/completions", json={**body, "gravity": {"profile": "led"}}).json()
            assert led["gravity"]["lead"] == "They said planet and orbit again."
            assert led["usage"]["prompt_tokens"] == len(
                tiny_backend.encode_text("They said planet and orbit again. The crew")
            )
            assert not led["choices"][0]["text"].startswith("They said")  # the sentence is read, not returned
            measured = http.post(
                "/v1/completions", json={**body, "gravity": {"profile": "led", "measure_only": True}}
            ).json()
            assert "lead" not in measured["gravity"] and measured["usage"]["prompt_tokens"] == plain_tokens
            chat = http.post(
                "/v1/chat/completions",
                json={"model": "tiny", "messages": [{"role": "user", "content": "The crew"}], "max_tokens": 4,
                      "gravity": {"profile": "led"}},
            ).json()  # fmt: skip
            assert chat["gravity"]["lead"] == "They said planet and orbit again."  # the profile's own text
            as_system = lead_messages([{"role": "user", "content": "The crew"}], chat["gravity"]["lead"])
            assert chat["usage"]["prompt_tokens"] == len(tiny_backend.encode_chat(as_system))
            ids = http.post(
                "/v1/completions", json={**body, "prompt": [5, 6, 7], "gravity": {"profile": "led"}}
            ).json()  # token ids are sent as they came
            assert ids["usage"]["prompt_tokens"] == 3

            # a shadow is plain decoding: it reads the prompt without the sentence
            http.put("/v1/profiles/led/rollout", json={"rollout": {"shadow": 1.0}}).raise_for_status()
            resp = http.post("/v1/completions", json={**body, "gravity": {"profile": "led"}}).json()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                recs = store.arms_log("led").read()
                shadow = [r for r in recs if r.get("of") == resp["id"]]
                if shadow:
                    break
                time.sleep(0.05)
            assert shadow and shadow[0]["prompt_tokens"] == plain_tokens
            main = next(r for r in recs if r.get("request") == resp["id"])
            assert main["prompt_tokens"] == resp["usage"]["prompt_tokens"] > plain_tokens
    finally:
        running.close()


def test_the_server_pulls_a_topic_default_as_read_and_measures_it_plain(tmp_path) -> None:
    from narrative_gravity.profiles.store import ProfileStore
    from narrative_gravity.server.resolver import GravityResolver

    resolver = GravityResolver(ProfileStore(tmp_path / "store"))
    served = resolver.resolve({"core_semantics": ["orbit", "planet"]}, chat=False)
    assert served.profile.lead and served.profile.thermostat.kl_budget == 0.05  # text prompts read the sentence
    chat = resolver.resolve({"core_semantics": ["orbit", "planet"]}, chat=True)
    assert chat.profile.thermostat.kl_budget == 0.05  # the default reads its chat message: 0.05 nats a step
    measured = resolver.resolve({"core_semantics": ["orbit", "planet"], "measure_only": True}, chat=False)
    assert measured.profile.lead is False and measured.profile.gravity_strength == 0.0
    classic = resolver.resolve({"core_semantics": ["orbit"], "schedule": "constant"}, chat=False)
    assert classic.profile.lead is None and classic.profile.thermostat.kl_budget is None
