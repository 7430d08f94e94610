"""The published API schema: ``/openapi.json`` declares every route with its request body, and requests that
schemathesis generates from it get no server error from a real server on loopback (SmolLM2-135M, small budgets)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402

from narrative_gravity.profiles.store import ProfileStore  # noqa: E402
from narrative_gravity.server import HFBackend, ServerConfig, create_app  # noqa: E402
from servers import RunningServer  # noqa: E402

KEY = "schema-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
EXAMPLES = 8  # generated requests per route
MODEL = "smollm2"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    store = ProfileStore(tmp_path_factory.mktemp("store"))
    store.set("space", {"core_semantics": ["planet", "orbit"], "schedule": "constant"}, message="for the schema test")
    config = ServerConfig(
        api_key=KEY,
        max_tokens_limit=4,  # small budgets: a generated request decodes at most 4 tokens
        default_max_tokens=4,
        max_prompt_tokens=64,
        max_choices=2,
        max_words=64,
        max_neighbours=4,
        preload_encoder=False,
    )
    running = RunningServer(create_app(HFBackend.load(), config=config, store=store), config)
    yield running
    running.close()


@pytest.mark.slow
def test_the_schema_is_behind_the_key_and_declares_every_body(served: RunningServer) -> None:
    with served.http() as http:
        assert http.get("/openapi.json").status_code == 401
        assert http.get("/docs").status_code == 401
        assert http.get("/docs", headers=AUTH).status_code == 200
        doc = http.get("/openapi.json", headers=AUTH).json()
    operations = {(m.upper(), p): op for p, ops in doc["paths"].items() for m, op in ops.items()}
    for route in ("/v1/chat/completions", "/v1/completions", "/v1/validate", "/v1/score"):
        assert ("POST", route) in operations
    for (method, path), op in operations.items():
        if method in ("POST", "PUT"):
            ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
            name = ref.rsplit("/", 1)[-1]
            assert name in doc["components"]["schemas"], (method, path, name)
    chat = doc["components"]["schemas"]["ChatRequest"]
    assert {"model", "messages", "gravity", "max_tokens"} <= set(chat["properties"])
    assert "text/event-stream" in operations[("POST", "/v1/chat/completions")]["responses"]["200"]["content"]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_generated_requests_get_no_server_error(served: RunningServer) -> None:
    schema = schemathesis.openapi.from_url(f"{served.url}/openapi.json", headers=AUTH)
    seen: list[str] = []
    failures: list[str] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        seen.append(f"{operation.method.upper()} {operation.path}")

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy())
        def call(case: Any) -> None:
            if isinstance(case.body, dict) and "model" in case.body:
                case.body["model"] = MODEL  # past the model check, into resolving, encoding and decoding
            response = case.call(base_url=served.url, headers=AUTH, timeout=120)
            if response.status_code >= 500:
                failures.append(f"{response.status_code} {case.as_curl_command()}\n{response.text[:300]}")

        call()
    assert "POST /v1/chat/completions" in seen and "PUT /v1/profiles/{name}/rollout" in seen
    assert not failures, "\n\n".join(failures[:5])
