"""`ngrav serve`: the OpenAI-compatible server, driven by the official `openai` client against a real uvicorn
server on loopback. Most tests use the tiny seeded Llama from conftest; one slow test uses SmolLM2-135M."""

from __future__ import annotations

import asyncio
import importlib.util
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("prometheus_client")

import torch  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from narrative_gravity.errors import ConfigurationError  # noqa: E402
from narrative_gravity.fields import NarrativeField  # noqa: E402
from narrative_gravity.profiles.store import ProfileStore  # noqa: E402
from narrative_gravity.server import HFBackend, ServerConfig, create_app, make_backend  # noqa: E402
from narrative_gravity.server.backends.hf import GroupedGravityLogitsProcessor  # noqa: E402
from servers import RunningServer  # noqa: E402

SPACE = {"core_semantics": ["planet", "orbit"], "gravity_strength": 3.0, "schedule": "constant"}
MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tiny_backend: HFBackend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    store = ProfileStore(tmp_path_factory.mktemp("store"))
    config = ServerConfig(
        batch_window_ms=60, max_tokens_limit=64, max_prompt_tokens=200, max_body_bytes=64_000, max_queue=32
    )
    running = RunningServer(create_app(tiny_backend, config=config, store=store))
    yield running
    running.close()


def metric(text: str, name: str, **labels: str) -> float:
    """One sample of ``/metrics`` (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = re.escape(name) + (re.escape("{" + want + "}") if want else "") + r" (\S+)"
    match = re.search("^" + pattern + "$", text, flags=re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def stream_text(stream: Any, *, chat: bool) -> tuple[str, str | None]:
    parts, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            parts.append((choice.delta.content or "") if chat else choice.text)
            finish = choice.finish_reason or finish
    return "".join(parts), finish


# ----------------------------------------------------------------------------------------------- generation


def test_chat_and_completions_streamed_equals_plain(server: RunningServer) -> None:
    with server.client() as client:
        check_chat_and_completions(client)


def check_chat_and_completions(client: Any) -> None:
    messages = [{"role": "user", "content": "Tell me about the planet"}]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, extra_body={"gravity": SPACE}
    )
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert chat.usage.completion_tokens <= 12 and chat.usage.prompt_tokens > 0
    gravity = chat.model_extra["gravity"]
    assert gravity["profile"] == "inline" and 0.0 <= gravity["narrative_mass"] <= 1.0 and gravity["kl"] >= 0.0
    streamed = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True, extra_body={"gravity": SPACE}
    )
    assert stream_text(streamed, chat=True) == (chat.choices[0].message.content, chat.choices[0].finish_reason)

    # plain completions, sampled with a seed: the same seed gives the same text, streamed or not
    kwargs: dict[str, Any] = {"model": MODEL, "prompt": "The comet", "max_tokens": 10, "temperature": 0.8, "seed": 7}
    plain = client.completions.create(**kwargs)
    assert plain.object == "text_completion" and plain.choices[0].text
    assert stream_text(client.completions.create(**kwargs, stream=True), chat=False) == (
        plain.choices[0].text,
        plain.choices[0].finish_reason,
    )
    # gravity changes the greedy continuation of this random model
    greedy = {"model": MODEL, "prompt": "The comet", "max_tokens": 10, "temperature": 0}
    pulled = client.completions.create(**greedy, extra_body={"gravity": {**SPACE, "gravity_strength": 20.0}})
    assert pulled.choices[0].text != client.completions.create(**greedy).choices[0].text
    # stop strings end the text before the stop string, streamed or not
    cut = pulled.choices[0].text[3:5]
    stopped = client.completions.create(
        **greedy, stop=[cut], extra_body={"gravity": {**SPACE, "gravity_strength": 20.0}}
    )
    assert stopped.choices[0].finish_reason == "stop" and cut not in stopped.choices[0].text


def test_models_health_and_metrics_per_profile(server: RunningServer) -> None:
    with server.client() as client, server.http() as http:
        check_models_health_and_metrics(client, http)


def check_models_health_and_metrics(client: Any, http: Any) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    assert http.get("/health").json()["status"] == "ok"
    http.put("/v1/profiles/metered", json={"profile": SPACE}).raise_for_status()
    before = http.get("/metrics").text
    for _ in range(2):
        client.completions.create(
            model=MODEL, prompt="A star", max_tokens=4, extra_body={"gravity": {"profile": "metered"}}
        )
    after = http.get("/metrics").text
    labels = {"profile": "metered"}
    assert (
        metric(after, "ngrav_requests_total", endpoint="completions", **labels)
        == metric(before, "ngrav_requests_total", endpoint="completions", **labels) + 2
    )
    assert (
        metric(after, "ngrav_generated_tokens_total", **labels)
        >= metric(before, "ngrav_generated_tokens_total", **labels) + 2
    )
    assert metric(after, "ngrav_request_latency_seconds_count", **labels) >= 2
    assert 0.0 <= metric(after, "ngrav_narrative_mass_mean", **labels) <= 1.0
    assert metric(after, "ngrav_kl_mean", **labels) >= 0.0
    assert "# TYPE ngrav_request_latency_seconds histogram" in after
    families = {f.name: f.type for f in text_string_to_metric_families(after)}  # a Prometheus scraper reads it
    assert families["ngrav_requests"] == "counter" and families["ngrav_time_to_first_token_seconds"] == "histogram"
    assert families["ngrav_queued_rows"] == families["ngrav_running_rows"] == "gauge"


def test_profiles_over_http_and_hot_reload(server: RunningServer) -> None:
    with server.client() as client, server.http() as http:
        check_profiles_and_hot_reload(client, http)


def check_profiles_and_hot_reload(client: Any, http: Any) -> None:
    assert http.put("/v1/profiles/space", json={"profile": SPACE, "message": "first"}).json()["version"] == 1

    def ask() -> dict[str, Any]:
        resp = client.completions.create(
            model=MODEL, prompt="The rocket", max_tokens=6, temperature=0, extra_body={"gravity": {"profile": "space"}}
        )
        return resp.model_extra["gravity"]

    first = ask()
    assert (first["profile"], first["version"]) == ("space", 1)
    stronger = {**SPACE, "gravity_strength": 12.0}
    assert http.put("/v1/profiles/space", json={"profile": stronger}).json()["version"] == 2
    second = ask()  # the next request uses the new version, no restart
    assert second["version"] == 2 and second["strength"] > first["strength"]
    pinned = client.completions.create(
        model=MODEL, prompt="x", max_tokens=2, extra_body={"gravity": {"profile": "space", "version": 1}}
    )
    assert pinned.model_extra["gravity"]["version"] == 1

    listed = {p["name"]: p["version"] for p in http.get("/v1/profiles").json()["data"]}
    assert listed["space"] == 2
    assert http.get("/v1/profiles/space", params={"version": 1}).json()["profile"]["gravity_strength"] == 3.0
    assert [h["message"] for h in http.get("/v1/profiles/space/history").json()["data"]] == ["first", None]
    diff = http.get("/v1/profiles/space/diff", params={"from": 1, "to": 2}).json()
    assert diff["changes"] == [{"key": "gravity_strength", "old": 3.0, "new": 12.0, "kind": "changed"}]
    assert http.post("/v1/profiles/space/rollback", json={"to": 1}).json()["version"] == 3
    assert ask()["strength"] == pytest.approx(first["strength"])


def test_concurrent_requests_are_batched(server: RunningServer) -> None:
    with server.http() as http:
        calls_before = metric(http.get("/metrics").text, "ngrav_generate_calls_total")
    client = openai.AsyncOpenAI(
        base_url=f"{server.url}/v1", api_key="unused", max_retries=0, http_client=httpx.AsyncClient(trust_env=False)
    )

    async def one(i: int) -> Any:
        gravity = {"gravity": SPACE} if i % 2 else {"gravity": {**SPACE, "core_semantics": ["galaxy"]}}
        if i % 4 == 0:
            gravity = {}
        return await client.completions.create(
            model=MODEL, prompt=f"The crew {i}", max_tokens=8 + i, temperature=0.7, seed=i, extra_body=gravity
        )

    async def all_of_them() -> list[Any]:
        async with client:
            return await asyncio.gather(*(one(i) for i in range(8)))

    results = asyncio.run(all_of_them())
    with server.http() as http:
        calls = metric(http.get("/metrics").text, "ngrav_generate_calls_total") - calls_before
    assert 1 <= calls < 8
    assert all(r.choices[0].text for r in results)
    assert [("gravity" in r.model_extra) for r in results] == [i % 4 != 0 for i in range(8)]


def test_grouped_processor_matches_each_profile_alone() -> None:
    from narrative_gravity.engines.hf import NarrativeGravityLogitsProcessor

    a = NarrativeGravityLogitsProcessor(NarrativeField(values=torch.tensor([1.0, 0.0, -1.0, 0.0])), strength=2.0)
    b = NarrativeGravityLogitsProcessor(NarrativeField(values=torch.tensor([0.0, 1.0, 0.0, 0.5])), strength=1.0)
    ids, scores = torch.zeros(3, 2, dtype=torch.long), torch.randn(3, 4)
    grouped = GroupedGravityLogitsProcessor([(torch.tensor([0, 2]), a), (torch.tensor([1]), b)])
    out = grouped(ids, scores)
    assert torch.equal(out[[0, 2]], a(ids[[0, 2]], scores[[0, 2]]))
    assert torch.equal(out[1:2], b(ids[1:2], scores[1:2]))
    assert not torch.equal(out, scores)  # the input was not modified in place


# ----------------------------------------------------------------------------------------------- errors


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server: RunningServer) -> None:
    with server.client() as client, server.http() as http:
        check_bad_requests(client, http)


def check_bad_requests(client: Any, http: Any) -> None:
    http.put("/v1/profiles/space", json={"profile": SPACE})

    def error(resp: Any, status: int) -> dict[str, Any]:
        assert resp.status_code == status, resp.text
        body = resp.json()["error"]
        assert set(body) == {"message", "type", "param", "code"}
        assert "Traceback" not in body["message"]
        return body

    ok = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    body = error(http.post("/v1/completions", content=b'{"model": "tiny", "prompt": '), 400)
    assert body["code"] == "invalid_json"
    body = error(http.post("/v1/completions", json={**ok, "gravity": {"profile": "spcae"}}), 404)
    assert "did you mean 'space'" in body["message"] and body["code"] == "profile_not_found"
    body = error(http.post("/v1/completions", json={**ok, "prompt": "x" * 70_000}), 413)
    assert body["code"] == "body_too_large"
    body = error(http.post("/v1/completions", json={**ok, "max_tokens": -5}), 400)
    assert body["param"] == "max_tokens" and "-5" in body["message"]
    error(http.post("/v1/completions", json={**ok, "max_tokens": 10_000}), 400)
    body = error(http.post("/v1/completions", json={**ok, "prompt": "planet " * 300}), 400)
    assert body["code"] == "context_length_exceeded"
    body = error(http.post("/v1/completions", json={**ok, "gravtiy": SPACE}), 400)
    assert "did you mean `gravity`" in body["message"]
    body = error(
        http.post("/v1/completions", json={**ok, "gravity": {"core_semantics": ["x"], "gravity_strenght": 1}}), 400
    )
    assert "gravity_strength" in body["message"]
    error(http.post("/v1/completions", json={**ok, "model": "gpt-4"}), 404)
    error(http.get("/v1/nothing"), 404)
    error(http.post("/v1/chat/completions", json={"model": MODEL, "messages": []}), 400)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=0)
    # still healthy, still generating
    assert http.get("/health").json()["status"] == "ok"
    assert client.completions.create(**ok).choices[0].text is not None


def test_api_key_and_queue_limit(tiny_backend: HFBackend, tmp_path: Path) -> None:
    config = ServerConfig(api_key="s3cret", max_queue=2, max_choices=4, batch_window_ms=5, allow_inline_gravity=False)
    running = RunningServer(create_app(tiny_backend, config=config, store=ProfileStore(tmp_path)))
    try:
        with (
            running.http() as http,
            running.client(api_key="wrong") as wrong,
            running.client(api_key="s3cret") as client,
        ):
            check_api_key_and_queue_limit(http, wrong, client)
    finally:
        running.close()


def check_api_key_and_queue_limit(http: Any, wrong: Any, client: Any) -> None:
    assert http.get("/health").status_code == 200  # open for probes
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
        resp = http.get("/v1/models", headers=headers)
        assert resp.status_code == 401 and resp.json()["error"]["type"] == "authentication_error"
    assert http.get("/v1/profiles").status_code == 401 and http.get("/metrics").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].text is not None
    with pytest.raises(openai.RateLimitError, match="busy"):  # 3 rows never fit a queue of 2
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, n=3)
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2, n=2).choices[1].index == 1
    with pytest.raises(openai.PermissionDeniedError, match="stored profiles"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"gravity": SPACE})


def test_decoding_keeps_the_intra_op_threads_and_side_work_gets_one(
    tiny_backend: HFBackend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One OpenMP pool in the process: ``generate`` has every intra-op thread, a request's preparation (its
    field, on a side thread) has one, so it starts no second pool (see the scheduler's module doc)."""
    from narrative_gravity.server.scheduler import _generate_threads

    seen: dict[str, int] = {}
    generate, prepare = tiny_backend.generate, tiny_backend.prepare

    def counting_generate(rows: Any, on_tokens: Any) -> Any:
        seen["generate"] = torch.get_num_threads()
        return generate(rows, on_tokens)

    def counting_prepare(profile: Any) -> None:
        seen["prepare"] = torch.get_num_threads()
        prepare(profile)

    monkeypatch.setattr(tiny_backend, "generate", counting_generate)
    monkeypatch.setattr(tiny_backend, "prepare", counting_prepare)
    running = RunningServer(create_app(tiny_backend, config=ServerConfig(), store=ProfileStore(tmp_path)))
    try:
        with running.client() as client:
            space = {**SPACE, "core_semantics": ["threads", "pool"]}  # a new profile: prepared on this request
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"gravity": space})
    finally:
        running.close()
    assert seen == {"generate": _generate_threads(), "prepare": 1}


def test_vllm_engine_without_vllm_names_the_fix(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from narrative_gravity.cli.main import app

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here; tests/test_vllm.py serves with it")
    with pytest.raises(ConfigurationError, match=r"setup_vllm\.sh"):
        make_backend("vllm")
    with pytest.raises(ConfigurationError, match="unknown engine"):
        make_backend("tgi")
    with pytest.raises(ConfigurationError, match="--engine vllm only"):
        make_backend("hf", max_num_seqs=4)
    res = CliRunner().invoke(app, ["serve", "--engine", "vllm", "--store", str(tmp_path)])
    assert res.exit_code == 2 and "needs vLLM" in res.output


# ----------------------------------------------------------------------------------------------- real model


@pytest.mark.slow
def test_real_model_chat_with_gravity(tmp_path: Path) -> None:
    backend = HFBackend.load()
    store = ProfileStore(tmp_path)
    store.set("space", {"core_semantics": ["planet", "orbit", "star", "galaxy"], "gravity_strength": 2.0})
    running = RunningServer(create_app(backend, store=store))
    try:
        with running.client() as client:
            check_real_model(client)
    finally:
        running.close()


def check_real_model(client: Any) -> None:
    kwargs: dict[str, Any] = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "Write one sentence about your weekend."}],
        "max_tokens": 24,
        "temperature": 0,
        "extra_body": {"gravity": {"profile": "space"}},
    }
    plain = client.chat.completions.create(**kwargs)
    text = plain.choices[0].message.content
    assert text.strip() and plain.model_extra["gravity"]["version"] == 1
    assert plain.model_extra["gravity"]["narrative_mass"] > plain.model_extra["gravity"]["narrative_mass_before"]
    assert stream_text(client.chat.completions.create(**kwargs, stream=True), chat=True)[0] == text


@pytest.mark.parametrize("preload", [True, False])
def test_the_server_loads_the_sentence_encoder_while_it_starts(
    tiny_backend: HFBackend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, preload: bool
) -> None:
    """The topic default's sentence picks its word with MiniLM: loaded at start, the first such request does not
    wait for it while the requests beside it run. ``preload_encoder=False`` leaves it to the first request."""
    from narrative_gravity import embeddings

    monkeypatch.setattr(embeddings, "_DEFAULT", None)  # as in a fresh process
    config = ServerConfig(preload_encoder=preload)
    running = RunningServer(create_app(tiny_backend, config=config, store=ProfileStore(tmp_path)), config)
    try:
        assert (embeddings._DEFAULT is not None) is preload
    finally:
        running.close()
