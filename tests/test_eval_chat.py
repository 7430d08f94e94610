"""The chat benchmark: chat sets of neutral requests, the `ask` and `cfg:γ` arms, and the description metric."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from narrative_gravity.engines.prompts import encode_prompts
from narrative_gravity.errors import ConfigurationError
from narrative_gravity.eval import (
    EvalModels,
    EvalSettings,
    MetricContext,
    ResultStore,
    Sample,
    compute_metrics,
    run_eval,
)
from narrative_gravity.eval.batch import _Guidance, _Runner
from narrative_gravity.eval.chat import CHAT_REQUESTS, chat_prompts
from narrative_gravity.eval.prompts import limit_prompts, load_prompts
from narrative_gravity.eval.settings import check_engine_arms, make_plan
from narrative_gravity.lead import lead_messages
from servers import with_chat_template


def _bench(tmp_path: Path) -> Path:
    topics = tmp_path / "bench" / "topics"
    (topics / "wordlists").mkdir(parents=True)
    (topics / "prefixes.txt").write_text("In summary\nThis essay discusses\n")
    (topics / "wordlists" / "space.txt").write_text("planet\ngalaxy\norbit\nmoon\nrocket\nstar\n")
    (topics / "wordlists" / "legal.txt").write_text("law\ncourt\njudge\njury\n")
    return tmp_path / "bench"


def test_chat_sets_put_every_topic_under_every_request_with_the_topic_sets_word_split(tmp_path, monkeypatch):
    monkeypatch.setenv("NARRATIVE_GRAVITY_BENCH", str(_bench(tmp_path)))
    plain = {p.topic_name: p for p in load_prompts("topics")}
    chat = load_prompts("chat-topics")
    assert len(chat) == 2 * len(CHAT_REQUESTS)
    for name in ("legal", "space"):
        mine = [p for p in chat if p.topic_name == name]
        assert sorted(p.text for p in mine) == sorted(CHAT_REQUESTS)
        assert {(p.topic_words, p.heldout_words) for p in mine} == {
            (plain[name].topic_words, plain[name].heldout_words)
        }
        assert {p.description for p in mine} == {f"a text about {name}"}
    # the tuning chat set conditions and scores on the tuning split only
    tune = {p.topic_name: p for p in load_prompts("chat-topics-tune")}
    assert tune["space"].topic_words == ("planet", "rocket") and tune["space"].heldout_words == ("orbit",)
    # chat sets decode in the chat template, the topic sets as plain continuation
    assert not EvalSettings(prompts="chat-topics", profiles=("ask",)).raw_mode
    assert EvalSettings(prompts="topics", profiles=("ask",)).raw_mode


def test_chat_sets_rotate_the_requests_so_a_limited_run_uses_them_evenly():
    base = [load_prompt for load_prompt in _topic_prompts(10)]
    chat = chat_prompts(base)
    kept = limit_prompts(chat, 10 * 4)  # 4 requests a topic
    counts = Counter(p.text for p in kept)
    assert len(counts) == len(CHAT_REQUESTS) and set(counts.values()) == {2}
    with pytest.raises(ConfigurationError, match="at least one request"):
        chat_prompts(base, requests=())


def _topic_prompts(n: int):
    from narrative_gravity.eval.topics import EvalPrompt

    return [EvalPrompt(i, "In summary", f"topic{i}", (f"w{i}",), (f"h{i}",)) for i in range(n)]


def test_description_relevance_reads_the_description_and_nothing_else():
    vecs = {"a text about space": [1.0, 0.0], "the moon": [0.6, 0.8], "law": [0.0, 1.0]}
    ctx = MetricContext(encoder=lambda texts: torch.tensor([vecs[t] for t in texts]))
    rows = compute_metrics(
        [
            Sample("p", "the moon", description="a text about space", score_words=("law",)),
            Sample("p", "law", description="a text about space"),
            Sample("p", "the moon"),  # no description: undefined
        ],
        ["description_relevance"],
        ctx,
    )
    got = [r["description_relevance"] for r in rows]
    assert got[:2] == pytest.approx([0.6, 0.0]) and got[2] != got[2]


def test_engine_support_of_the_new_arms():
    check_engine_arms(["ask", "cfg:3"], "hf")
    check_engine_arms(["ask"], "vllm")
    with pytest.raises(ConfigurationError, match=r"`cfg-3`\) runs on transformers only"):
        check_engine_arms(["ask", "cfg:3"], "vllm")
    for bad in ("cfg:", "cfg:-1", "cfg:nan"):
        with pytest.raises(ConfigurationError, match="needs a number >= 0"):
            check_engine_arms([bad], "hf")


@pytest.fixture
def chat_model(tiny_model):
    model, tok = tiny_model
    return model, with_chat_template(tok)


def test_the_guidance_arm_is_transformers_cfg_against_the_prompt_without_the_topic(chat_model):
    model, tok = chat_model
    prompts, lead = ["tell me a story", "hi"], "Write about planet, orbit and moon."
    positive = encode_prompts(tok, prompts, raw=False, lead=lead)
    negative = encode_prompts(tok, prompts, raw=False)
    assert negative[1] == tok(tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                                      tokenize=False), add_special_tokens=False)["input_ids"]  # fmt: skip
    assert positive[1] == tok(tok.apply_chat_template(lead_messages([{"role": "user", "content": "hi"}], lead),
                                                      add_generation_prompt=True, tokenize=False),
                              add_special_tokens=False)["input_ids"]  # fmt: skip
    proc = _Guidance(3.0).build(model, tok, negative)
    # the first step: γ·(log p(·|with topic) − log p(·|without)) + log p(·|without), row by row
    with torch.no_grad():
        cond = torch.stack([model(torch.tensor([ids])).logits[0, -1] for ids in positive])
        uncond = torch.stack([model(torch.tensor([ids])).logits[0, -1] for ids in negative])
    want = 3.0 * (cond.log_softmax(-1) - uncond.log_softmax(-1)) + uncond.log_softmax(-1)
    pad = max(len(p) for p in positive)
    ids = torch.tensor([[0] * (pad - len(p)) + p for p in positive])
    got = proc(ids, cond)
    assert torch.allclose(got, want, atol=1e-4)


def test_ask_and_cfg_arms_run_in_one_chat_eval(chat_model, tmp_path):
    model, tok = chat_model
    prompts = tmp_path / "p.jsonl"
    lines = [
        {"prompt": "tell me a story", "topic": ["planet", "orbit", "moon", "star"], "heldout": ["galaxy"],
         "topic_name": "space"},
        {"prompt": "hi there", "topic": ["planet", "orbit", "moon", "star"], "heldout": ["galaxy"], "topic_name": "space"},
    ]  # fmt: skip
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    settings = EvalSettings(
        prompts=str(prompts),
        profiles=("ask", "cfg:1", "cfg:4"),
        seeds=(0,),
        max_new_tokens=8,
        batch_size=2,
        raw=False,
        judge="none",
        metrics=("topic_success", "length"),
    )
    out = tmp_path / "run"
    run_eval(settings, out, models=EvalModels(model, tok), progress=False, write_report=False)
    rows = {(r["profile"], r["prompt_index"]): r for r in ResultStore(out / "results.jsonl").load()}
    assert {a for a, _ in rows} == {"control", "ask", "cfg-1", "cfg-4"}
    for i in (0, 1):
        # ask and cfg read the 3 most central words in a system message; control reads none
        assert rows[("ask", i)]["lead"] == rows[("cfg-4", i)]["lead"]
        assert rows[("ask", i)]["lead"].startswith("Write about ") and "lead" not in rows[("control", i)]
        # at γ = 1 guidance is the conditional distribution itself: the same text as ask, token for token
        assert rows[("cfg-1", i)]["token_ids"] == rows[("ask", i)]["token_ids"]
    assert any(rows[("cfg-4", i)]["token_ids"] != rows[("ask", i)]["token_ids"] for i in (0, 1))


def test_a_model_without_a_chat_template_chats_in_the_plain_frame(tiny_model, tmp_path):
    model, tok = tiny_model
    assert not getattr(tok, "chat_template", None)
    prompts = tmp_path / "p.jsonl"
    line = {
        "prompt": "tell me a story",
        "topic": ["planet", "orbit", "moon"],
        "heldout": ["star"],
        "topic_name": "space",
    }
    prompts.write_text(json.dumps(line) + "\n")
    settings = EvalSettings(
        prompts=str(prompts), profiles=("ask",), seeds=(0,), max_new_tokens=6, batch_size=1, raw=False,
        judge="none", metrics=("length",),
    )  # fmt: skip
    out = tmp_path / "run"
    run_eval(settings, out, models=EvalModels(model, tok), progress=False, write_report=False)
    rows = {r["profile"]: r for r in ResultStore(out / "results.jsonl").load()}
    assert rows["ask"]["frame"] == "plain" and rows["control"]["frame"] == "plain"
    runner = _Runner(settings, make_plan(settings), model, tok, MetricContext(), [], lambda _: None)
    lead = runner.lead("ask", runner.plan.prompts[0])
    shown = runner.tok.decode(encode_prompts(runner.tok, ["tell me a story"], raw=False, lead=lead)[0])
    assert shown == f"{tok.bos_token}{lead}\n\nUser: tell me a story\nAssistant:"
    assert not getattr(tok, "chat_template", None)  # the caller's tokenizer is untouched
    with pytest.raises(ConfigurationError, match="--chat-frame must be template or plain"):
        EvalSettings(prompts=str(prompts), profiles=("ask",), chat_frame="chatml")
