"""Structured output (`response_format`) with gravity on the transformers engine: the real llguidance grammar,
the real server on loopback, the tiny seeded Llama from conftest (one slow test on SmolLM2-135M)."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import torch  # noqa: E402

from narrative_gravity.engines.options import GenerationOptions  # noqa: E402
from narrative_gravity.profiles.schema import Profile  # noqa: E402
from narrative_gravity.profiles.store import ProfileStore  # noqa: E402
from narrative_gravity.server import HFBackend, ServerConfig, create_app  # noqa: E402
from narrative_gravity.server.backends.base import ResolvedGravity  # noqa: E402
from narrative_gravity.server.grammar import GrammarLogitsProcessor  # noqa: E402
from narrative_gravity.server.protocol import APIError  # noqa: E402
from narrative_gravity.server.scheduler import Job  # noqa: E402
from narrative_gravity.server.structured import (  # noqa: E402
    ResponseFormat,
    check_response_format,
    parse_response_format,
    reply_errors,
)
from servers import RunningServer  # noqa: E402

MODEL = "tiny"
SPACE = {"core_semantics": ["planet", "orbit"], "gravity_strength": 6.0, "schedule": "constant"}
THERMO = {"core_semantics": ["planet", "orbit"], "schedule": "thermostat", "field": {"mode": "lexical"}}
CARD = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 24},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 2},
    },
    "required": ["title", "tags"],
    "additionalProperties": False,
}
SCORE = {
    "type": "object",
    "properties": {"score": {"type": "integer", "minimum": 0, "maximum": 9}, "ok": {"type": "boolean"}},
    "required": ["score", "ok"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Tell me about the planet"}]


def json_schema(schema: dict[str, Any], name: str = "card") -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def server(tiny_backend: HFBackend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    store = ProfileStore(tmp_path_factory.mktemp("store"))
    store.set("space", SPACE)
    config = ServerConfig(batch_window_ms=400, max_tokens_limit=96, max_prompt_tokens=200, max_body_bytes=64_000)
    running = RunningServer(create_app(tiny_backend, config=config, store=store))
    yield running
    running.close()


def chat(client: Any, fmt: dict[str, Any] | None, gravity: Any = None, **kwargs: Any) -> Any:
    extra: dict[str, Any] = {}
    if gravity is not None:
        extra["gravity"] = gravity
    if fmt is not None:
        extra["response_format"] = fmt
    options = {"max_tokens": 64, "temperature": 0, **kwargs}
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body=extra, **options)


def generate_calls(server: RunningServer) -> float:
    with server.http() as http:
        text = http.get("/metrics").text
    match = re.search(r"^ngrav_generate_calls_total (\S+)$", text, flags=re.MULTILINE)
    return float(match.group(1)) if match else 0.0


# ----------------------------------------------------------------------------------------------- the server


def test_json_schema_with_gravity_returns_valid_json(server: RunningServer) -> None:
    """Inline and stored profiles, constant and thermostat: every reply parses, matches its schema, ends with
    "stop", and gravity moves the words inside the string field."""
    with server.client() as client:
        plain = chat(client, json_schema(CARD))
        pulled = [chat(client, json_schema(CARD), g) for g in (SPACE, {"profile": "space"}, THERMO)]
    for reply in (plain, *pulled):
        text = reply.choices[0].message.content
        assert reply_errors(CARD, text) is None, text
        assert reply.choices[0].finish_reason == "stop"
    titles = [json.loads(r.choices[0].message.content)["title"] for r in (plain, *pulled)]
    assert "planet" not in titles[0] and "orbit" not in titles[0]
    for title in titles[1:]:
        assert "planet" in title or "orbit" in title, titles
    for reply in pulled:  # the thermostat measured the constrained distribution: finite stats
        stats = reply.model_extra["gravity"]
        assert 0.0 <= stats["narrative_mass"] <= 1.0 and stats["kl"] >= 0.0


def test_json_object_streaming_and_completions(server: RunningServer) -> None:
    with server.client() as client:
        obj = chat(client, {"type": "json_object"}, SPACE, max_tokens=96)
        stream = chat(client, json_schema(CARD), SPACE, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        whole = chat(client, json_schema(CARD), SPACE)
        completion = client.completions.create(
            model=MODEL,
            prompt="The planet",
            max_tokens=64,
            temperature=0,
            extra_body={"response_format": json_schema(SCORE, "score"), "gravity": SPACE},
        )
        text = chat(client, {"type": "text"}, SPACE, max_tokens=8)
    text_obj = obj.choices[0].message.content
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text_obj), dict)
    else:  # an unbounded object may outrun the budget; what came is still the start of an object
        assert obj.choices[0].finish_reason == "length" and text_obj.startswith("{")
    assert streamed == whole.choices[0].message.content
    assert reply_errors(SCORE, completion.choices[0].text) is None
    assert text.choices[0].message.content  # {"type": "text"} is plain text, as before


def test_mixed_batch_rows_equal_their_solo_runs(server: RunningServer, tiny_backend: HFBackend, tmp_path: Any) -> None:
    """One batch with a schema row, a row without one and a row with another schema (greedy): each row gets
    exactly what it gets alone, and the plain row is not constrained. The batch runs on a server whose batches
    hold three rows and wait for them, so the three requests share one `generate` call however slowly they
    arrive."""
    requests = [
        (json_schema(CARD), SPACE, "Tell me about the planet"),
        (None, SPACE, "The crew watches the comet"),
        (json_schema(SCORE, "score"), None, "Rate the old telescope"),
    ]

    def body(fmt: Any, gravity: Any, prompt: str) -> dict[str, Any]:
        extra = {"gravity": gravity} if gravity else {}
        if fmt:
            extra["response_format"] = fmt
        messages = [{"role": "user", "content": prompt}]
        return {"model": MODEL, "messages": messages, "max_tokens": 40, "temperature": 0, "extra_body": extra}

    with server.client() as client:
        alone = [client.chat.completions.create(**body(*r)).choices[0].message.content for r in requests]

    config = ServerConfig(max_batch_size=3, batch_window_ms=10_000)
    trio = RunningServer(create_app(tiny_backend, config=config, store=ProfileStore(tmp_path)), config)

    async def together() -> list[str]:
        http = httpx.AsyncClient(trust_env=False, timeout=60)
        async with openai.AsyncOpenAI(base_url=f"{trio.url}/v1", api_key="x", max_retries=0, http_client=http) as c:
            replies = await asyncio.gather(*(c.chat.completions.create(**body(*r)) for r in requests))
        return [r.choices[0].message.content for r in replies]

    try:
        mixed = asyncio.run(together())
        assert generate_calls(trio) == 1, "the three requests should have shared one batch"
    finally:
        trio.close()
    assert mixed == alone
    assert reply_errors(CARD, mixed[0]) is None and reply_errors(SCORE, mixed[2]) is None
    assert reply_errors({"type": "object"}, mixed[1]) is not None  # the plain row wrote plain text


def test_budget_running_out_mid_json_reports_length(server: RunningServer) -> None:
    long_text = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}
    with server.client() as client:
        reply = chat(client, json_schema(long_text), SPACE, max_tokens=6)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 6
    assert reply_errors(long_text, reply.choices[0].message.content) is not None  # cut off: not valid JSON


@pytest.mark.parametrize(
    ("fmt", "says"),
    [
        (json_schema({"type": "strin"}), "not a valid JSON Schema"),
        (json_schema({"type": "string", "pattern": "(("}), "is not a 'regex'"),
        (json_schema({"type": "string", "format": "weird"}), "Unknown format: weird"),
        (json_schema({"type": "object", "properties": {"a": {"$ref": "#/defs/x"}}}), "cannot be used"),
        ({"type": "json_schema", "json_schema": {"name": "card"}}, "schema` is missing"),
        ({"type": "json_schema", "json_schema": {"name": "a card", "schema": {}}}, "json_schema.name"),
        ({"type": "xml"}, "response_format.type"),
        ("json", "must be an object"),
    ],
)
def test_bad_response_format_is_a_400_naming_it(server: RunningServer, fmt: Any, says: str) -> None:
    with server.client() as client, pytest.raises(openai.BadRequestError) as err:
        chat(client, fmt, SPACE)
    assert err.value.body["param"] == "response_format"
    assert says in err.value.body["message"]


def test_bad_schemas_fail_alone_while_others_run(server: RunningServer) -> None:
    """Bad schemas sent together with good requests: each bad one gets its 400 before batching, the good ones
    (schema or not) all finish with valid replies."""

    async def main() -> list[Any]:
        http = httpx.AsyncClient(trust_env=False, timeout=60)
        async with openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key="unused", max_retries=0, http_client=http
        ) as c:

            async def one(i: int) -> Any:
                fmt = [json_schema(CARD), json_schema({"type": "strin"}), None, json_schema({"format": "weird"})][i % 4]
                try:
                    return await c.chat.completions.create(
                        model=MODEL,
                        messages=MESSAGES,
                        max_tokens=40,
                        temperature=0,
                        extra_body={"gravity": SPACE, **({"response_format": fmt} if fmt else {})},
                    )
                except openai.APIStatusError as exc:
                    return exc

            return await asyncio.gather(*(one(i) for i in range(8)))

    results = asyncio.run(main())
    for i, r in enumerate(results):
        if i % 4 in (1, 3):
            assert isinstance(r, openai.BadRequestError) and r.body["param"] == "response_format"
        else:
            assert not isinstance(r, Exception), r
            if i % 4 == 0:
                assert reply_errors(CARD, r.choices[0].message.content) is None


# ----------------------------------------------------------------------------------------------- parsing


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
_KEYWORDS = st.sampled_from(["type", "properties", "items", "required", "enum", "pattern", "maxLength", "$ref"])
_SCHEMA = st.dictionaries(_KEYWORDS, _JSON | st.sampled_from(["string", "object", "integer", "(("]), max_size=4)
_FORMAT = st.one_of(
    _JSON,
    st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema", "xml"])}),
    st.fixed_dictionaries(
        {
            "type": st.just("json_schema"),
            "json_schema": st.fixed_dictionaries(
                {"name": st.sampled_from(["card", "", "a b"]), "schema": _SCHEMA | _JSON},
                optional={"strict": _JSON, "extra": _JSON},
            ),
        }
    ),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=_FORMAT)
def test_any_response_format_is_accepted_or_a_400(tiny_backend: HFBackend, value: Any) -> None:
    """Whatever a client sends as `response_format`, parsing and the engine's compile either accept it or answer
    a 400 naming `response_format`; an accepted schema constrains a real run to a valid reply or "length"."""
    try:
        fmt = parse_response_format(value)
        check_response_format(fmt, tiny_backend)
    except APIError as exc:
        assert exc.status == 400 and exc.param == "response_format", exc.message
        return
    if fmt is not None:
        assert isinstance(fmt, ResponseFormat)
        GrammarLogitsProcessor(tiny_backend.grammars(), [fmt], prompt_width=1)  # builds a matcher


# ----------------------------------------------------------------------------------------------- the processor


def test_grammar_processor_masks_only_its_rows(tiny_backend: HFBackend) -> None:
    fmt = parse_response_format(json_schema(SCORE, "score"))
    assert fmt is not None
    proc = GrammarLogitsProcessor(tiny_backend.grammars(), [None, fmt, None], prompt_width=2)
    scores = torch.randn(3, tiny_backend.vocab_size)
    before = scores.clone()
    out = proc(torch.zeros(3, 2, dtype=torch.long), scores)
    assert torch.equal(scores, before)  # not modified in place
    assert torch.equal(out[[0, 2]], scores[[0, 2]])  # rows without a format pass untouched
    allowed = torch.isfinite(out[1]).nonzero().flatten().tolist()
    assert allowed and all(tiny_backend.decode([t]).startswith("{") for t in allowed)


@pytest.mark.parametrize("profile", [SPACE, THERMO, {**SPACE, "penalize": ["the"], "prune_threshold": -0.5}])
def test_masked_tokens_stay_masked_under_every_schedule(tiny_backend: HFBackend, profile: dict[str, Any]) -> None:
    """The grammar's ``-inf`` survives the pull (``-inf + λ·a``); pruning may remove allowed tokens, never all."""
    from narrative_gravity.engines.hf import processor_from_profile

    fmt = parse_response_format(json_schema(CARD))
    grammar = GrammarLogitsProcessor(tiny_backend.grammars(), [fmt, fmt], prompt_width=2)
    ids = torch.zeros(2, 2, dtype=torch.long)
    masked = grammar(ids, torch.randn(2, tiny_backend.vocab_size, generator=torch.Generator().manual_seed(0)))
    pulled = processor_from_profile(Profile.from_mapping(profile), tiny_backend.tokenizer, max_new_tokens=8)(
        ids, masked.clone()
    )
    allowed, finite = torch.isfinite(masked), torch.isfinite(pulled)
    assert not (finite & ~allowed).any() and finite.any(dim=1).all()


def test_gravity_runs_after_the_grammar_in_one_batch(tiny_backend: HFBackend) -> None:
    """Backend level: greedy rows of schema + gravity, plain + gravity and schema alone, batched and alone."""
    fmt_card, fmt_score = (parse_response_format(json_schema(s)) for s in (CARD, SCORE))
    gravity = ResolvedGravity(Profile.from_mapping(SPACE), "inline", "space")
    specs = [(fmt_card, gravity), (None, gravity), (fmt_score, None), (fmt_card, None)]

    def run(items: list[tuple[Any, Any]]) -> list[str]:
        job = Job()
        ids = tiny_backend.encode_chat(MESSAGES)
        for fmt, g in items:
            greedy = GenerationOptions(max_new_tokens=40, temperature=0.0, top_k=0)
            job.add(prompt_ids=ids, options=greedy, gravity=g, response_format=fmt)
        steps: list[list[int | None]] = []
        stats = tiny_backend.generate(job.rows, lambda tokens, *_: steps.append(list(tokens)))
        return [tiny_backend.decode([s[i] for s in steps][: stats[i].new_tokens]) for i in range(len(items))]

    batched = run(specs)
    assert batched == [run([s])[0] for s in specs]
    assert reply_errors(CARD, batched[0]) is None and reply_errors(SCORE, batched[2]) is None
    assert batched[0] != batched[3]  # gravity changed the words inside the schema


# ----------------------------------------------------------------------------------------------- SmolLM2


@pytest.mark.slow
def test_smollm2_json_schema_with_the_topic_profile(tmp_path: Any) -> None:
    """The real default model and the default topic profile (semantic field, thermostat): sampled replies are
    valid JSON for the schema."""
    backend = HFBackend.load()
    schema = {
        "type": "object",
        "properties": {
            "title": {"type": "string", "minLength": 3, "maxLength": 60},
            "description": {"type": "string", "minLength": 10, "maxLength": 200},
        },
        "required": ["title", "description"],
        "additionalProperties": False,
    }
    topic = {"core_semantics": ["planet", "orbit", "galaxy", "telescope", "astronaut", "rocket"]}
    running = RunningServer(create_app(backend, store=ProfileStore(tmp_path)))
    try:
        with running.client() as client:
            reply = client.chat.completions.create(
                model="smollm2",
                messages=[{"role": "user", "content": "Write a title and a short description for an essay."}],
                max_tokens=120,
                temperature=1.0,
                top_p=0.95,
                seed=3,
                n=2,
                extra_body={"gravity": topic, "response_format": json_schema(schema, "essay")},
            )
    finally:
        running.close()
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        assert reply_errors(schema, choice.message.content) is None, choice.message.content
