"""One request, every level (narrative_gravity.levels.pipeline): passages, memory, a plan; as a library call, an `ngrav`
command, and a chat request to a real server on loopback (the tiny seeded Llama; a hashing encoder where
MiniLM is not the point)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from narrative_gravity.errors import ConfigurationError, ProfileError
from narrative_gravity.levels.pipeline import (
    CONTEXT_TEMPLATE,
    needs_pipeline,
    parse_documents,
    prepare,
    split_documents,
    stage_report,
)
from narrative_gravity.levels.ranking import hashing_encoder
from narrative_gravity.profiles.schema import Profile

ENC = hashing_encoder()
QUESTION = "How does the planet move along its orbit?"
PASSAGES = [
    {
        "id": "orbit",
        "text": "The planet moves along its orbit around the sun, and the orbit of the planet is an ellipse.",
    },
    {"id": "bread", "text": "Knead the dough, let the bread rise, and bake the loaf in a hot oven for forty minutes."},
    {"id": "moon", "text": "A small moon circles the planet and reaches the inner orbit every night."},
    {"id": "cake", "text": "Whisk the eggs with sugar, fold in the flour and bake the cake until it is golden."},
]


def _profile(**levels: Any) -> Profile:
    return Profile.from_mapping({"core_semantics": ["planet", "orbit"], "schedule": "constant", **levels})


# ------------------------------------------------------------------------------------------------ passages


def test_documents_are_strings_or_objects_and_bad_ones_are_named() -> None:
    got = parse_documents(["alpha", {"id": "b", "text": " beta "}])
    assert [(p.id, p.text) for p in got] == [("0", "alpha"), ("b", "beta")]
    for bad, needle in [
        ("text", "must be a list"),
        ([3], "documents[0]"),
        ([{"text": "x", "url": "y"}], "documents[0]"),
        (["  "], "is empty"),
        ([{"id": "a", "text": "x"}, {"id": "a", "text": "y"}], "same id"),
    ]:
        with pytest.raises(ConfigurationError, match=needle.replace("[", r"\[").replace("]", r"\]")):
            parse_documents(bad)


def test_passages_marked_in_messages_are_taken_out() -> None:
    msgs, docs = split_documents(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": 'Why? <document id="x">One.</document>\n<DOCUMENT>Two.</DOCUMENT>'},
        ]
    )
    assert msgs[1]["content"] == "Why?" and msgs[0]["content"] == "Be brief."
    assert [(d.id, d.text) for d in docs] == [("x", "One."), ("m1-1", "Two.")]


def test_which_requests_take_the_pipeline() -> None:
    one = [{"role": "user", "content": "q"}]
    two = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    assert not needs_pipeline(_profile(), [], one)
    assert needs_pipeline(None, parse_documents(["x"]), one)
    assert not needs_pipeline(_profile(conversation={}), [], one)  # no earlier turn to remember
    assert needs_pipeline(_profile(conversation={}), [], two)
    assert needs_pipeline(_profile(plan={}), [], one)


# ------------------------------------------------------------------------------------------------ levels


def test_the_context_level_prunes_to_its_budget_and_says_why(tiny_tokenizer: Any) -> None:
    prof = _profile(context={"budget_share": 0.5})
    out = prepare(
        [{"role": "user", "content": QUESTION}], parse_documents(PASSAGES), prof, tokenizer=tiny_tokenizer, encoder=ENC
    )
    ctx = out.report["context"]
    assert ctx["pruned"] and ctx["tokens_kept"] <= ctx["budget_tokens"] <= ctx["tokens_total"] // 2
    kept = {k["id"] for k in ctx["kept"]}
    assert "orbit" in kept and not kept & {"bread", "cake"}
    assert all(d["reason"] for d in ctx["dropped"])
    last = out.messages[-1]["content"]
    assert last.startswith(CONTEXT_TEMPLATE.split("{context}")[0]) and last.endswith(
        CONTEXT_TEMPLATE.split("{question}")[1]
    )
    assert "orbit around the sun" in last and "bread" not in last and QUESTION in last
    # without `context` every passage is kept, in order
    full = prepare([{"role": "user", "content": QUESTION}], parse_documents(PASSAGES), _profile(), tokenizer=None)
    assert not full.report["context"]["pruned"] and [k["id"] for k in full.report["context"]["kept"]] == [
        p["id"] for p in PASSAGES
    ]


def test_the_memory_level_puts_earlier_turns_into_the_field() -> None:
    turns = [
        {"role": "user", "content": "Tell me about the comet and its tail."},
        {"role": "assistant", "content": "The comet has a bright tail of dust."},
        {"role": "user", "content": QUESTION},
    ]
    out = prepare(turns, [], _profile(conversation={"decay": 0.5}), tokenizer=None)
    words = out.report["memory"]["words"]
    assert {"comet", "tail"} <= set(words) and out.report["memory"]["turns"] == 1
    assert out.profile.memory and set(words) <= set(out.profile.memory)
    assert Profile.from_mapping(out.profile.model_dump()) == out.profile  # a valid profile


def test_the_plan_level_drafts_and_keeps_the_best_outline() -> None:
    asked = []

    def draft(prompts: list[str], max_tokens: int) -> list[str]:
        asked.append((len(prompts), max_tokens))
        return ["1. Orbit of the planet\n2. Speed near the sun\n3. Moons", "1. bake\n2. bake\n3. bake"][: len(prompts)]

    out = prepare(
        [{"role": "user", "content": QUESTION}], [], _profile(plan={"drafts": 2, "outline_tokens": 20}), tokenizer=None,
        encoder=ENC, draft=draft,
    )  # fmt: skip
    assert asked == [(2, 20)]
    assert out.report["plan"]["outline"][0].lower().startswith("orbit")
    assert [s["core_semantics"][0] for s in out.stages][:2] == ["orbit", "speed"]
    assert out.profile.stages and len(out.profile.stages) == 3
    reached = stage_report(out.stages, "The speed is high.")  # every stage also holds the profile's words
    assert [r["reached"] for r in reached] == [False, True, False] and reached[1]["words"] == ["speed"]
    with pytest.raises(ConfigurationError, match="draft="):
        prepare([{"role": "user", "content": QUESTION}], [], _profile(plan={}), tokenizer=None)


def test_level_settings_are_validated() -> None:
    with pytest.raises(ProfileError, match="context needs a budget"):
        _profile(context={"budget_share": None})
    with pytest.raises(ProfileError, match="did you mean `decay`"):
        _profile(conversation={"decya": 0.3})
    with pytest.raises(ProfileError, match=r"plan\.drafts"):
        _profile(plan={"drafts": 0})


# ------------------------------------------------------------------------------------------------ library, CLI


def test_answer_runs_every_level_on_the_transformers_engine(tiny_model: tuple[Any, Any]) -> None:
    from narrative_gravity.engines.options import GenerationOptions
    from narrative_gravity.levels.answer import answer
    from servers import with_chat_template

    model, tok = tiny_model
    tok = with_chat_template(tok)
    prof = _profile(context={"budget_share": 0.5}, conversation={}, plan={"drafts": 2, "outline_tokens": 8})
    turns = [
        {"role": "user", "content": "The comet leaves the dark sky."},
        {"role": "assistant", "content": "The comet drifts past."},
        {"role": "user", "content": QUESTION},
    ]
    res = answer(turns, documents=PASSAGES, profile=prof, model=model, tokenizer=tok, encoder=ENC,
                 options=GenerationOptions(max_new_tokens=8, temperature=0.0))  # fmt: skip
    assert res.text and len(res.token_ids) <= 8
    assert {"context", "memory"} <= set(res.report)
    assert "plan" in res.report or res.prepared.stages is None
    assert "bread" not in res.prepared.messages[-1]["content"]


@pytest.mark.slow
def test_ngrav_answer_prints_what_each_level_did(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from narrative_gravity.cli.main import app

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps(p) + "\n" for p in PASSAGES), encoding="utf-8")
    prof = tmp_path / "p.yaml"
    prof.write_text("core_semantics: [planet, orbit]\nschedule: constant\ncontext: {budget_share: 0.5}\n")
    runner = CliRunner()
    bad = runner.invoke(app, ["answer", "--documents", str(docs)])
    assert bad.exit_code != 0 and "--question" in bad.output
    out = tmp_path / "a.json"
    res = runner.invoke(
        app,
        ["answer", "--question", QUESTION, "--documents", str(docs), "--profile", str(prof), "--max-new-tokens", "6",
         "--output", str(out)],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "context: kept" in res.output and "dropped bread" in res.output
    body = json.loads(out.read_text())
    assert body["pipeline"]["context"]["pruned"] and body["answer"] is not None


# ------------------------------------------------------------------------------------------------ server


@pytest.fixture(scope="module")
def server(tiny_backend: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    pytest.importorskip("fastapi")
    from narrative_gravity.profiles.store import ProfileStore
    from narrative_gravity.server import ServerConfig, create_app
    from servers import RunningServer

    store = ProfileStore(tmp_path_factory.mktemp("store"))
    store.set("rag", {"core_semantics": ["planet", "orbit"], "context": {"budget_share": 0.5}, "conversation": {}})
    running = RunningServer(create_app(tiny_backend, config=ServerConfig(batch_window_ms=50), store=store))
    yield running
    running.close()


def _chat(messages: list[dict[str, str]], **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 0, **extra}


def test_a_chat_request_with_documents_runs_the_pipeline(server: Any) -> None:
    turns = [
        {"role": "user", "content": "The comet leaves the dark sky."},
        {"role": "assistant", "content": "The comet drifts past."},
        {"role": "user", "content": QUESTION},
    ]
    with server.http() as http:
        body = http.post("/v1/chat/completions", json=_chat(turns, documents=PASSAGES, gravity={"profile": "rag"}))
        assert body.status_code == 200, body.text
        report = body.json()["pipeline"]
        ctx = report["context"]
        assert ctx["pruned"] and "orbit" in {k["id"] for k in ctx["kept"]}
        assert {d["id"] for d in ctx["dropped"]} >= {"bread", "cake"} and all(d["reason"] for d in ctx["dropped"])
        assert "comet" in report["memory"]["words"]
        assert body.json()["gravity"]["profile"] == "rag"
        # passages marked in the message work the same way; no gravity keeps them all
        marked = QUESTION + "".join(f'<document id="{p["id"]}">{p["text"]}</document>' for p in PASSAGES)
        plain = http.post("/v1/chat/completions", json=_chat([{"role": "user", "content": marked}])).json()
        assert not plain["pipeline"]["context"]["pruned"] and len(plain["pipeline"]["context"]["kept"]) == 4
        # streamed: the first chunk says what the levels did
        with http.stream(
            "POST",
            "/v1/chat/completions",
            json=_chat(turns, documents=PASSAGES, gravity={"profile": "rag"}, stream=True),
        ) as resp:
            first = next(line for line in resp.iter_lines() if line.startswith("data: "))
        assert json.loads(first[6:])["pipeline"]["context"]["pruned"]


def test_bad_documents_are_a_400_and_the_server_serves_on(server: Any) -> None:
    with server.http() as http:
        for bad, needle in [("x", "must be a list"), ([{"text": ""}], "empty")]:
            resp = http.post("/v1/chat/completions", json=_chat([{"role": "user", "content": "q"}], documents=bad))
            assert resp.status_code == 400 and needle in resp.json()["error"]["message"]
            assert resp.json()["error"]["param"] == "documents"
        ok = http.post("/v1/chat/completions", json=_chat([{"role": "user", "content": "q"}]))
        assert ok.status_code == 200 and "pipeline" not in ok.json()


def test_the_token_table_encoder_ranks_related_passages_first(
    tiny_tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default passage encoder of the context level: MiniLM's token table, no transformer pass."""
    import numpy as np

    from narrative_gravity.fields import minilm
    from narrative_gravity.levels.token_encoder import token_encoder

    if importlib.util.find_spec(minilm.MINILM_MODULE) is None:
        pytest.skip(minilm.MINILM_INSTALL)
    monkeypatch.setenv("NARRATIVE_GRAVITY_CACHE", str(tmp_path))
    enc = token_encoder(tiny_tokenizer)
    assert token_encoder(tiny_tokenizer) is enc  # built once per tokenizer
    vecs = enc(["the planet circles its orbit", "a distant planet moves along the orbit of the sun", "the crew", ""])
    assert vecs.shape == (4, 384) and np.allclose(np.linalg.norm(vecs[:3], axis=1), 1.0, atol=1e-5)
    assert not vecs[3].any()  # no usable token: the zero vector
    assert vecs[0] @ vecs[1] > vecs[0] @ vecs[2]
