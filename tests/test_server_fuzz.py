"""Fuzz the request schema and profiles against a real uvicorn on loopback (the tiny seeded Llama).

Two properties, for every generated body: the server never answers 5xx, and a normal request still succeeds
right after. The bodies mix valid and wrong types, sizes and values for every field, and profiles with every
profile key (inline in ``gravity``, and stored with ``PUT /v1/profiles/NAME`` and then used).
Run with ``-s`` to print the counts (docs/server.md quotes them).
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from narrative_gravity.profiles.store import ProfileStore  # noqa: E402
from narrative_gravity.server import HFBackend, ServerConfig, create_app  # noqa: E402
from servers import RunningServer  # noqa: E402

MODEL = "tiny"
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
COUNTS: Counter[str] = Counter()

text = st.text(st.characters(codec="utf-8"), max_size=12) | st.sampled_from(["planet", "orbit", "", " ", "a_b"])
scalar = (
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False, allow_infinity=False) | text
)
anything = st.recursive(scalar, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3))
small_int = st.integers(-3, 70)
words = st.lists(st.sampled_from(["planet", "orbit", "star", "binary_search", "x", "ünï", "🚀"]) | text, max_size=4)


def maybe(value: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """A value of the right kind most of the time, anything at all otherwise."""
    return st.one_of(value, value, value, anything)


profile = st.fixed_dictionaries(
    {"core_semantics": maybe(words)},
    optional={
        "gravity_strength": maybe(st.floats(-1, 25, allow_nan=False)),
        "penalize": maybe(words),
        "schedule": maybe(st.sampled_from(["constant", "phases", "thermostat", "bogus"])),
        "prune_threshold": maybe(st.floats(-1.5, 1.5, allow_nan=False)),
        "decay_after_steps": maybe(small_int),
        "decay_half_life": maybe(st.floats(-1, 100, allow_nan=False)),
        "stages": maybe(
            st.lists(
                st.fixed_dictionaries(
                    {"core_semantics": maybe(words)}, optional={"share": maybe(st.floats(0, 1.2)), "name": text}
                ),
                max_size=5,
            )
        ),
        "field": maybe(
            st.fixed_dictionaries(
                {},
                optional={
                    "mode": st.sampled_from(["lexical", "hybrid", "semantic"]),
                    "semantic_source": st.just("lm"),
                    "semantic_top_k": maybe(st.integers(-1, 30000)),
                    "max_pieces": maybe(small_int),
                    "repeat_weight": maybe(st.floats(-0.5, 1.5)),
                },
            )
        ),
        "thermostat": maybe(
            st.fixed_dictionaries({}, optional={"max_strength": maybe(st.floats(-1, 60)), "candidates": small_int})
        ),
        "phases": maybe(st.fixed_dictionaries({}, optional={"explore_until": st.floats(-0.5, 1.5)})),
        "gravity_strenght": st.just(1),
    },
)

common = {
    "model": maybe(st.just(MODEL)),
    "max_tokens": maybe(small_int),
    "temperature": maybe(st.floats(-1, 3, allow_nan=False)),
    "top_p": maybe(st.floats(-0.5, 1.5, allow_nan=False)),
    "top_k": maybe(small_int),
    "n": maybe(st.integers(-1, 10)),
    "seed": maybe(st.integers(-(2**70), 2**70)),
    "stream": maybe(st.booleans()),
    "stop": maybe(st.lists(text, max_size=5) | text),
    "gravity": maybe(profile | st.fixed_dictionaries({"profile": st.just("fuzzed")}, optional={"version": small_int})),
    "logit_bias": anything,
    "stream_options": maybe(st.fixed_dictionaries({}, optional={"include_usage": st.booleans()})),
    "gravtiy": anything,
}
prompt = maybe(st.one_of(text, st.lists(text, max_size=3), st.lists(st.integers(-5, 500), max_size=8)))
message = st.fixed_dictionaries({"role": maybe(st.sampled_from(["user", "system", "tool"])), "content": maybe(text)})
completion_body = st.fixed_dictionaries({"prompt": prompt}, optional=common)
chat_body = st.fixed_dictionaries({"messages": maybe(st.lists(message, max_size=3))}, optional=common)


@pytest.fixture(scope="module")
def server(tiny_model: tuple[Any, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    model, tokenizer = tiny_model
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = CHAT_TEMPLATE
    backend = HFBackend(model, tokenizer, model_id=MODEL)
    config = ServerConfig(batch_window_ms=1, max_tokens_limit=16, max_prompt_tokens=64, max_body_bytes=64_000)
    store = ProfileStore(tmp_path_factory.mktemp("store"))
    store.set("fuzzed", {"core_semantics": ["planet"]})
    running = RunningServer(create_app(backend, config=config, store=store), config)
    yield running
    running.close()
    print(f"\nfuzz: {dict(COUNTS)}")


@pytest.fixture(scope="module")
def http(server: RunningServer) -> Iterator[Any]:
    with server.http() as client:
        yield client


def check(http: Any, kind: str, resp: Any) -> None:
    COUNTS[kind] += 1
    COUNTS[f"{resp.status_code // 100}xx"] += 1
    assert resp.status_code < 500, resp.text
    if resp.status_code >= 400:
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
    normal = http.post("/v1/completions", json={"model": MODEL, "prompt": "The planet", "max_tokens": 2})
    assert normal.status_code == 200, normal.text


FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)


@FUZZ
@given(body=completion_body)
def test_fuzz_completions(http: Any, body: dict[str, Any]) -> None:
    check(http, "completions", http.post("/v1/completions", json=body))


@FUZZ
@given(body=chat_body)
def test_fuzz_chat(http: Any, body: dict[str, Any]) -> None:
    check(http, "chat", http.post("/v1/chat/completions", json=body))


@FUZZ
@given(prof=profile, message=maybe(st.none() | text))
def test_fuzz_stored_profiles(http: Any, prof: dict[str, Any], message: Any) -> None:
    check(http, "profile_put", http.put("/v1/profiles/fuzzed", json={"profile": prof, "message": message}))
    use = {"model": MODEL, "prompt": "A star", "max_tokens": 3, "gravity": {"profile": "fuzzed"}}
    check(http, "profile_use", http.post("/v1/completions", json=use))
