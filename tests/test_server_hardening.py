"""Hostile and careless input against a real uvicorn server on loopback (issue 12's findings, one test each):
one bad request never fails another, limits on what a request may build, strict types, unencodable text,
connection timeouts, a damaged store. Uses the tiny seeded Llama from conftest."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from narrative_gravity.errors import ConfigurationError  # noqa: E402
from narrative_gravity.profiles.store import ProfileStore  # noqa: E402
from narrative_gravity.server import HFBackend, ServerConfig, create_app  # noqa: E402
from narrative_gravity.server.backends.base import RowStats, TokenCallback  # noqa: E402
from servers import RunningServer, with_chat_template  # noqa: E402

SPACE = {"core_semantics": ["planet", "orbit"], "gravity_strength": 3.0, "schedule": "constant"}
MODEL = "tiny"
POISON = "The poisoned comet"


class FlakyBackend(HFBackend):
    """The real transformers backend, except that a batch holding a row whose prompt starts with ``POISON``
    raises after ``fail_after`` steps (the way a processor that breaks mid-batch would)."""

    fail_after = 0

    def generate(self, rows: Sequence[Any], on_tokens: TokenCallback) -> list[RowStats]:
        poison = self.encode_text(POISON)
        if not any(r.prompt_ids[: len(poison)] == poison for r in rows):
            return super().generate(rows, on_tokens)
        steps = 0

        def counting(tokens: list[int | None]) -> None:
            nonlocal steps
            if steps >= self.fail_after:
                raise RuntimeError("this row breaks every batch it is in")
            steps += 1
            on_tokens(tokens)

        return super().generate(rows, counting)


@pytest.fixture(scope="module")
def backend(tiny_model: tuple[Any, Any]) -> FlakyBackend:
    model, tokenizer = tiny_model
    tokenizer = with_chat_template(tokenizer)
    return FlakyBackend(model, tokenizer, model_id=MODEL)


CONFIG = ServerConfig(
    batch_window_ms=150,
    max_tokens_limit=64,
    max_prompt_tokens=200,
    max_body_bytes=64_000,
    max_queue=32,
    max_stages=4,
    max_words_per_list=8,
    max_words=12,
    max_semantic_top_k=300,
    max_neighbours=50,
    read_timeout_s=1.0,
)


@pytest.fixture(scope="module")
def server(backend: FlakyBackend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    store = ProfileStore(tmp_path_factory.mktemp("store"))
    running = RunningServer(create_app(backend, config=CONFIG, store=store), CONFIG)
    running.store = store  # type: ignore[attr-defined]
    yield running
    running.close()


def post_all(server: RunningServer, bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    """Send the bodies at once (so that they share a batch) and return the responses in order."""

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, trust_env=False, timeout=60) as client:
            return await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))

    return asyncio.run(run())


def greedy(prompt: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, **extra}


# ----------------------------------------------------------------------------------------------- finding 1


def test_a_profile_that_cannot_be_built_fails_alone(server: RunningServer) -> None:
    """stages + prune_threshold passed validation and then failed its whole batch (the plain rows got 500)."""
    bad = {
        "core_semantics": ["planet"],
        "schedule": "constant",
        "prune_threshold": 0.1,
        "stages": [{"core_semantics": ["orbit"]}],
    }
    with server.http() as http:
        alone = [http.post("/v1/completions", json=greedy(p)).json()["choices"][0]["text"] for p in ("A star", "Moon")]
    plain, staged, other = post_all(
        server,
        [greedy("A star"), greedy("A rocket", gravity=bad), greedy("Moon", gravity=SPACE | {"gravity_strength": 0})],
    )
    assert plain.status_code == 200 and other.status_code == 200, (plain.text, other.text)
    assert [plain.json()["choices"][0]["text"], other.json()["choices"][0]["text"]] == alone
    # refused before it joined a batch (or, once the kernel supports the combination, served): never a 500
    assert staged.status_code in (200, 400), staged.text
    if staged.status_code == 400:
        assert staged.json()["error"]["param"] == "gravity"


@pytest.mark.parametrize("fail_after", [0, 3])
def test_a_row_that_breaks_its_batch_fails_alone(server: RunningServer, backend: FlakyBackend, fail_after: int) -> None:
    """A failure inside a batch (at its first step, or after tokens were streamed) fails only its own row."""
    backend.fail_after = fail_after
    bodies = [greedy("A star"), greedy(POISON), greedy("The crew", gravity=SPACE), greedy("A moon", stream=True)]
    with server.http() as http:
        alone = [http.post("/v1/completions", json=b | {"stream": False}).json() for b in bodies if b is not bodies[1]]
    responses = post_all(server, bodies)
    assert responses[1].status_code == 500 and responses[1].json()["error"]["code"] == "internal_error"
    ok = [r for i, r in enumerate(responses) if i != 1]
    assert [r.status_code for r in ok] == [200, 200, 200]
    texts = [r.json()["choices"][0]["text"] for r in ok[:2]]
    streamed = "".join(
        json.loads(line[6:])["choices"][0]["text"] for line in ok[2].text.splitlines() if line.startswith("data: {")
    )
    assert [*texts, streamed] == [a["choices"][0]["text"] for a in alone]  # no token lost or sent twice


# ----------------------------------------------------------------------------------------------- finding 2


def test_limits_on_what_a_request_may_build(server: RunningServer) -> None:
    cases = [
        ({"core_semantics": ["planet"], "stages": [{"core_semantics": ["a"]}] * 50}, "--max-stages", "stages"),
        ({"core_semantics": [f"w{i}" for i in range(9)]}, "--max-words-per-list", "core_semantics"),
        ({"core_semantics": ["a"], "require": [f"w{i}" for i in range(9)]}, "--max-words-per-list", "require.words"),
        (
            {"core_semantics": ["a"] * 8, "penalize": ["b"] * 8},
            "--max-words",
            None,
        ),
        (
            {"core_semantics": ["planet"], "field": {"mode": "semantic", "semantic_top_k": 5000}},
            "--max-semantic-top-k",
            "semantic_top_k",
        ),
        (
            {
                "core_semantics": ["planet"],
                "field": {"neighbours": 51, "semantic_top_k": 300},
                "thermostat": {"candidates": 300},
            },
            "--max-neighbours",
            "field.neighbours",
        ),
        (
            {
                "core_semantics": ["planet"],
                "field": {"neighbours": 5, "neighbours_vocabulary": 1000, "semantic_top_k": 300},
                "thermostat": {"candidates": 300},
            },
            "draws neighbour words from the default 40000 only",
            "field.neighbours_vocabulary",
        ),
    ]
    with server.http() as http:
        for gravity, flag, param in cases:
            started = time.perf_counter()
            resp = http.post("/v1/completions", json=greedy("hi", gravity=gravity))
            assert resp.status_code == 400, resp.text
            err = resp.json()["error"]
            assert flag in err["message"] and err["code"] == "profile_limit_exceeded"
            assert param is None or param in err["param"]
            assert time.perf_counter() - started < 2.0  # refused before anything is built
            # a stored profile obeys the same limits
            put = http.put("/v1/profiles/big", json={"profile": gravity})
            assert put.status_code == 400 and flag in put.json()["error"]["message"]
        assert http.post("/v1/completions", json=greedy("hi", gravity=SPACE)).status_code == 200


def test_semantic_field_disk_cache_is_bounded(tiny_model: tuple[Any, Any], tmp_path: Path) -> None:
    """One file per distinct profile grew without bound; now the least recently used files are removed."""
    from narrative_gravity.fields import cache, semantic

    model, tokenizer = tiny_model
    folder = tmp_path / "semantic" / "fields"

    def build(topic: str) -> set[str]:
        semantic.build_semantic_field(tokenizer, [topic], source="lm", model=model, cache_dir=tmp_path)
        time.sleep(0.01)  # distinct modification times
        return {p.name for p in folder.glob("*.pt")}

    before = cache.FIELD_CACHE_ENTRIES
    cache.set_field_cache_limit(3)
    try:
        files: dict[str, str] = {}
        for topic in ("planet", "orbit", "galaxy"):
            files[topic] = (build(topic) - set(files.values())).pop()
        build("planet")  # a cache hit marks it as used
        assert build("comet") == {files["planet"], files["galaxy"]} | (build("comet") - set(files.values()))
        assert files["orbit"] not in build("comet") and len(build("rocket")) == 3
        for topic in ("telescope", "crew", "moon", "star"):
            assert len(build(topic)) == 3
    finally:
        cache.set_field_cache_limit(before)


# ----------------------------------------------------------------------------------------------- finding 3


def test_empty_api_key_and_open_bind_without_a_key_are_refused(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from narrative_gravity.cli.main import app

    with pytest.raises(ConfigurationError, match="NGRAV_API_KEY"):
        ServerConfig(api_key="")
    with pytest.raises(ConfigurationError, match="--insecure-no-auth"):
        ServerConfig(host="0.0.0.0")
    assert ServerConfig(host="0.0.0.0", insecure_no_auth=True).api_key is None
    runner = CliRunner()
    res = runner.invoke(app, ["serve", "--store", str(tmp_path)], env={"NGRAV_API_KEY": ""})
    assert res.exit_code == 2 and "NGRAV_API_KEY" in res.output and "Traceback" not in res.output
    res = runner.invoke(app, ["serve", "--host", "0.0.0.0", "--store", str(tmp_path)], env={"NGRAV_API_KEY": None})
    assert res.exit_code == 2 and "--insecure-no-auth" in res.output


def test_open_bind_warns_on_every_start(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    from narrative_gravity.errors import ModelNotFoundError
    from narrative_gravity.server import serve

    config = ServerConfig(host="0.0.0.0", insecure_no_auth=True)
    for _ in range(2):
        with pytest.raises(ModelNotFoundError):  # the warning comes before the model loads
            serve(config, model=str(tmp_path / "none"), store=tmp_path / "store")
    assert capfd.readouterr().err.count("without an API key") == 2


# ----------------------------------------------------------------------------------------------- finding 4 + strict


def test_unencodable_text_gets_a_400_naming_the_field(server: RunningServer) -> None:
    bodies = {
        "prompt": b'{"model": "tiny", "prompt": "hi \\ud800", "max_tokens": 2}',
        "messages.0.content": b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}',
        "gravity.core_semantics.0": b'{"model": "tiny", "prompt": "hi", "gravity": {"core_semantics": ["\\udfff"]}}',
    }
    with server.http() as http:
        for param, body in bodies.items():
            path = "/v1/chat/completions" if "messages" in param else "/v1/completions"
            resp = http.post(path, content=body, headers={"Content-Type": "application/json"})
            assert resp.status_code == 400, resp.text
            assert resp.json()["error"]["param"] == param and param in resp.json()["error"]["message"]
        put = http.put("/v1/profiles/bad", content=b'{"profile": {"core_semantics": ["\\ud800"]}}', headers={"X": "y"})
        assert put.status_code == 400 and put.json()["error"]["param"] == "profile.core_semantics.0"
        assert http.get("/v1/profiles/bad").status_code == 404


def test_request_types_are_strict(server: RunningServer) -> None:
    with server.http() as http:
        for field, value in [("max_tokens", "5"), ("max_tokens", True), ("temperature", "0.5"), ("n", 1.0)]:
            resp = http.post("/v1/completions", json=greedy("hi") | {field: value})
            assert resp.status_code == 400 and resp.json()["error"]["param"] == field, (field, value, resp.text)
        for value in ("1", 1):
            resp = http.post("/v1/completions", json=greedy("hi") | {"stream": value})
            assert resp.status_code == 400 and resp.json()["error"]["param"] == "stream"
        assert http.post("/v1/completions", json=greedy("hi") | {"temperature": 1}).status_code == 200


# ----------------------------------------------------------------------------------------------- timeouts


def _connect(server: RunningServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    chunks = []
    while True:
        data = sock.recv(65536)
        if not data:
            return b"".join(chunks)
        chunks.append(data)


def test_a_body_that_never_finishes_gets_a_408_and_the_socket_is_closed(server: RunningServer) -> None:
    sock = _connect(server)
    started = time.perf_counter()
    with sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n" + b'{"model": "tiny", '
        )
        reply = _read_all(sock)  # the server answers and closes: recv returns b"" (no hang)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b"request_timeout" in reply
    assert time.perf_counter() - started < CONFIG.read_timeout_s + 5


def test_headers_that_never_finish_are_dropped(server: RunningServer) -> None:
    for opening in (b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"):
        sock = _connect(server)
        started = time.perf_counter()
        with sock:
            sock.sendall(opening)
            assert _read_all(sock) == b""  # closed, not held open
        assert time.perf_counter() - started < CONFIG.read_timeout_s + 5
    with server.http() as http:  # and the server still answers
        assert http.get("/health").status_code == 200


# ----------------------------------------------------------------------------------------------- store


def test_a_damaged_snapshot_is_flagged_in_listings_and_is_a_500(server: RunningServer) -> None:
    store: ProfileStore = server.store  # type: ignore[attr-defined]
    with server.http() as http:
        assert http.put("/v1/profiles/fine", json={"profile": SPACE}).status_code == 200
        assert http.put("/v1/profiles/broken", json={"profile": SPACE}).status_code == 200
        (store.root / "broken" / "000001.json").write_text("{not json", encoding="utf-8")
        listing = http.get("/v1/profiles")
        assert listing.status_code == 200, listing.text
        rows = {r["name"]: r for r in listing.json()["data"]}
        assert rows["fine"]["version"] == 1 and "error" not in rows["fine"]
        assert "damaged" in rows["broken"]["error"] and str(store.root) not in listing.text
        for resp in (
            http.get("/v1/profiles/broken"),
            http.post("/v1/completions", json=greedy("hi", gravity={"profile": "broken"})),
        ):
            assert resp.status_code == 500, resp.text
            assert resp.json()["error"]["code"] == "store_error" and str(store.root) not in resp.text


def test_a_put_that_fails_validation_leaves_no_folder(server: RunningServer) -> None:
    store: ProfileStore = server.store  # type: ignore[attr-defined]
    with server.http() as http:
        for body in (
            b'{"profile": {"core_semantics": ["a"], "decay_half_life": 1e400}}',
            b'{"profile": {"core_semantics": []}}',
            b'{"profile": {"core_semantics": ["a"]}, "message": 5}',
        ):
            resp = http.put("/v1/profiles/ghost", content=body)
            assert resp.status_code == 400, resp.text
            assert not (store.root / "ghost").exists()
