"""Rollout on a real server (tiny seeded Llama, uvicorn on loopback): arms in responses, staged versions not
served, split and pinned requests, shadows that run, are recorded and never returned, shadows skipped under load,
per-arm `/metrics`, the report, and a promotion that is refused while the live version keeps serving."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from narrative_gravity.cli.main import app as cli_app  # noqa: E402
from narrative_gravity.profiles.rollout import ARMS  # noqa: E402
from narrative_gravity.profiles.store import ProfileStore  # noqa: E402
from narrative_gravity.server import HFBackend, ServerConfig, create_app  # noqa: E402
from servers import RunningServer  # noqa: E402

SPACE = {"core_semantics": ["planet", "orbit"], "gravity_strength": 3.0, "schedule": "constant"}
MODEL = "tiny"
runner = CliRunner()


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> ProfileStore:
    return ProfileStore(tmp_path_factory.mktemp("store"))


@pytest.fixture(scope="module")
def server(tiny_backend: HFBackend, store: ProfileStore) -> Iterator[RunningServer]:
    config = ServerConfig(batch_window_ms=20, max_tokens_limit=64, max_prompt_tokens=200, max_queue=32)
    running = RunningServer(create_app(tiny_backend, config=config, store=store))
    yield running
    running.close()


def metric(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))  # the exposition sorts labels
    pattern = re.escape(name) + (re.escape("{" + want + "}") if want else "") + r" (\S+)"
    match = re.search("^" + pattern + "$", text, flags=re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def records(store: ProfileStore, name: str, *, until: Any = None, timeout: float = 30.0) -> list[dict[str, Any]]:
    """The arm log of ``name`` once ``until(records)`` holds (the server writes it after answering)."""
    deadline = time.monotonic() + timeout
    while True:
        recs = store.arms_log(name).read()
        if until is None or until(recs) or time.monotonic() > deadline:
            return recs
        time.sleep(0.05)


def ask(client: Any, gravity: dict[str, Any], **kwargs: Any) -> Any:
    options = {"model": MODEL, "prompt": "The rocket", "max_tokens": 8, "temperature": 0.8, "seed": 5, **kwargs}
    return client.completions.create(**options, extra_body={"gravity": gravity})


# ----------------------------------------------------------------------------------------------- arms


def test_the_response_names_its_arm_and_a_staged_version_is_not_served(server: RunningServer) -> None:
    with server.client() as client, server.http() as http:
        assert http.put("/v1/profiles/space", json={"profile": SPACE}).json()["version"] == 1
        staged = http.post("/v1/profiles/space/stage", json={"profile": {**SPACE, "gravity_strength": 9.0}})
        assert staged.json() == {"name": "space", "version": 2, "live": 1}
        g = ask(client, {"profile": "space"}).model_extra["gravity"]
        assert (g["profile"], g["version"], g["arm"]) == ("space", 1, "live")
        assert http.get("/v1/profiles/space").json()["live"] == 1
        history = http.get("/v1/profiles/space/history").json()
        assert [(h["version"], h["live"], h["staged"]) for h in history["data"]] == [(1, True, False), (2, False, True)]

        put = http.put("/v1/profiles/space/rollout", json={"rollout": {"split": {"version": 2, "share": 0.5}}})
        assert put.status_code == 200 and put.json()["revision"] == 1
        arms = {}
        for user in [f"u{i}" for i in range(16)]:
            g = ask(client, {"profile": "space"}, user=user, max_tokens=2).model_extra["gravity"]
            assert (g["arm"], g["version"]) in (("split:a", 1), ("split:b", 2))
            arms[user] = g["arm"]
        assert set(arms.values()) == {"split:a", "split:b"}
        again = ask(client, {"profile": "space"}, user="u3", max_tokens=2).model_extra["gravity"]
        assert again["arm"] == arms["u3"]  # the same user stays on the same arm
        pinned = ask(client, {"profile": "space", "version": 1}, user="u3").model_extra["gravity"]
        assert (pinned["arm"], pinned["version"]) == ("pinned", 1)

        bad = http.put("/v1/profiles/space/rollout", json={"rollout": {"split": {"version": 2, "share": 1.5}}})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_rollout"
        assert "`split.share` (got 1.5)" in bad.json()["error"]["message"]
        bad = http.put("/v1/profiles/space/rollout", json={"rollout": {"split": {"version": 7, "share": 0.5}}})
        assert bad.status_code == 400 and "stage it first" in bad.json()["error"]["message"]

        promoted = http.post("/v1/profiles/space/promote", json={"message": "looks good"}).json()
        assert promoted == {"name": "space", "live": 2, "previous": 1}
        g = ask(client, {"profile": "space"}, user="u3").model_extra["gravity"]
        assert (g["version"], g["arm"]) == (2, "live")  # the split's version is live now: the split is inactive
        nothing = http.post("/v1/profiles/space/promote", json={})
        assert nothing.status_code == 409 and nothing.json()["error"]["code"] == "nothing_staged"
        rollout = http.get("/v1/profiles/space/rollout").json()
        assert rollout["live"] == 2 and rollout["staged"] == [] and rollout["rollout"]["split"]["version"] == 2


def test_a_shadow_runs_is_recorded_and_not_returned(server: RunningServer, store: ProfileStore) -> None:
    with server.client() as client, server.http() as http:
        http.put("/v1/profiles/shadowed", json={"profile": SPACE}).raise_for_status()
        http.put("/v1/profiles/shadowed/rollout", json={"rollout": {"shadow": 1.0}}).raise_for_status()
        resp = ask(client, {"profile": "shadowed"}, max_tokens=12)
        assert len(resp.choices) == 1
        g = resp.model_extra["gravity"]
        assert g["arm"] == "live" and not [k for k in g if "shadow" in k]  # nothing of the shadow
        recs = records(store, "shadowed", until=lambda rs: any(r.get("of") == resp.id for r in rs))
        main = next(r for r in recs if r["request"] == resp.id)
        shadow = next(r for r in recs if r.get("of") == resp.id)
        assert main["arm"] == "live" and shadow["arm"] == "shadow" and shadow["version"] == main["version"] == 1
        assert main["completion_tokens"] == resp.usage.completion_tokens
        assert shadow["completion_tokens"] <= main["completion_tokens"]  # capped at the answer's length
        assert main["kl"] > 0 and main["narrative_mass"] > main["narrative_mass_before"]
        assert shadow["kl"] == 0 and shadow["narrative_mass"] == shadow["narrative_mass_before"]
        assert 0.0 <= main["off_topic_rate"] <= 1.0 and 0.0 <= shadow["off_topic_rate"] <= 1.0

        # the shadow is the request run plain: the same prompt and seed, measured against the same field
        plain = ask(client, {"profile": "shadowed", "measure_only": True}, max_tokens=shadow["completion_tokens"])
        assert plain.usage.completion_tokens == shadow["completion_tokens"]
        assert plain.model_extra["gravity"]["narrative_mass"] == pytest.approx(shadow["narrative_mass"], abs=1e-4)

        # a streamed answer is recorded too, with its trace means, and shadowed
        chunks = list(
            client.completions.create(
                model=MODEL,
                prompt="A comet",
                max_tokens=6,
                seed=1,
                stream=True,
                extra_body={"gravity": {"profile": "shadowed"}},
            )
        )
        sid = chunks[0].id
        recs = records(store, "shadowed", until=lambda rs: any(r.get("of") == sid for r in rs))
        streamed = next(r for r in recs if r["request"] == sid)
        assert streamed["narrative_mass"] is not None and streamed["endpoint"] == "completions"

        report = http.get("/v1/profiles/shadowed/report").json()
        assert report["live"] == 1 and report["rollout"] == {"shadow": 1.0}
        paired = [c for c in report["comparisons"] if c["kind"] == "paired"]
        assert paired and paired[0]["name"] == "live@1 − shadow@1" and paired[0]["pairs"] >= 2
        kl = paired[0]["metrics"]["kl"]
        assert kl["difference"] > 0 and kl["low"] <= kl["difference"] <= kl["high"]
        res = runner.invoke(cli_app, ["profile", "report", "shadowed", "--server", server.url, "--format", "json"])
        assert res.exit_code == 0, res.output
        assert json.loads(res.output)["comparisons"][0]["pairs"] == paired[0]["pairs"]

        text = http.get("/metrics").text
        assert metric(text, "ngrav_arm_requests_total", profile="shadowed", arm="shadow") >= 2
        assert metric(text, "ngrav_arm_narrative_mass_count", profile="shadowed", arm="live") >= 2
        assert metric(text, "ngrav_arm_kl_sum", profile="shadowed", arm="live") > 0
        assert metric(text, "ngrav_arm_off_topic_rate_count", profile="shadowed", arm="shadow") >= 2
        assert metric(text, "ngrav_shadow_decoded_tokens_total", profile="shadowed") >= shadow["completion_tokens"]


def test_shadows_stay_within_their_share_of_the_decoded_tokens(server: RunningServer, store: ProfileStore) -> None:
    from narrative_gravity.profiles.rollout import RolloutConfig, route, route_key

    cfg = RolloutConfig(shadow=0.5)
    drawn = [i for i in range(100) if route(cfg, name="budgeted", live=1, key=route_key(seed=i)).shadow]
    undrawn = [i for i in range(100) if i not in drawn]
    with server.client() as client, server.http() as http:
        http.put("/v1/profiles/budgeted", json={"profile": SPACE}).raise_for_status()
        http.put("/v1/profiles/budgeted/rollout", json={"rollout": {"shadow": 0.5}}).raise_for_status()
        first = ask(client, {"profile": "budgeted"}, seed=drawn[0])  # alone it would cost 100% > 50%: skipped
        records(store, "budgeted", until=lambda rs: any(r["request"] == first.id for r in rs))
        for seed in undrawn[:3]:
            ask(client, {"profile": "budgeted"}, seed=seed)
        later = ask(client, {"profile": "budgeted"}, seed=drawn[1])  # now within the budget: it runs
        recs = records(store, "budgeted", until=lambda rs: any(r.get("of") == later.id for r in rs))
        text = http.get("/metrics").text
    assert metric(text, "ngrav_shadow_skipped_total", profile="budgeted", reason="budget") == 1
    assert [r["of"] for r in recs if r["arm"] == "shadow"] == [later.id]
    answered = sum(r["completion_tokens"] for r in recs if r["arm"] == "live")
    assert metric(text, "ngrav_shadow_decoded_tokens_total", profile="budgeted") <= 0.5 * answered


def test_metrics_have_a_series_per_arm_and_bounded_labels(server: RunningServer) -> None:
    with server.http() as http:
        text = http.get("/metrics").text
    arms = set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "arm" in sample.labels:
                arms.add(sample.labels["arm"])
    assert {"live", "split:a", "split:b", "pinned", "shadow"} <= arms <= set(ARMS)
    assert metric(text, "ngrav_arm_requests_total", profile="space", arm="split:b") >= 1
    assert metric(text, "ngrav_arm_latency_seconds_count", profile="space", arm="split:a") >= 1
    families = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert families["ngrav_arm_narrative_mass"] == "summary" and families["ngrav_arm_latency_seconds"] == "histogram"


def test_shadows_are_skipped_under_load(tiny_backend: HFBackend, tmp_path: Path) -> None:
    store = ProfileStore(tmp_path)
    store.set("busy", SPACE)
    store.set_rollout("busy", {"shadow": 1.0})
    config = ServerConfig(max_batch_size=1, batch_window_ms=0, max_tokens_limit=64, max_queue=32)
    running = RunningServer(create_app(tiny_backend, config=config, store=store))
    client = openai.AsyncOpenAI(
        base_url=f"{running.url}/v1", api_key="unused", max_retries=0, http_client=httpx.AsyncClient(trust_env=False)
    )

    async def one(i: int) -> Any:
        return await client.completions.create(
            model=MODEL, prompt=f"The crew {i}", max_tokens=12, seed=i, extra_body={"gravity": {"profile": "busy"}}
        )

    async def all_of_them() -> list[Any]:
        async with client:
            return await asyncio.gather(*(one(i) for i in range(8)))

    try:
        results = asyncio.run(all_of_them())
        assert all(r.choices[0].text is not None for r in results)  # no request failed or waited for a shadow
        recs = records(store, "busy", until=lambda rs: sum(r["arm"] == "live" for r in rs) == 8)
        with running.http() as http:
            deadline = time.monotonic() + 30
            while True:  # every shadow is accounted for: recorded, or skipped with its reason
                text = http.get("/metrics").text
                skipped = {
                    reason: metric(text, "ngrav_shadow_skipped_total", profile="busy", reason=reason)
                    for reason in ("load", "budget", "preempted", "error")
                }
                shadows = sum(r["arm"] == "shadow" for r in store.arms_log("busy").read())
                if shadows + sum(skipped.values()) == 8 or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        assert skipped["load"] >= 1 and skipped["error"] == 0
        assert shadows + sum(skipped.values()) == 8
        main_tokens = sum(r["completion_tokens"] for r in recs if r["arm"] == "live")
        assert metric(text, "ngrav_shadow_decoded_tokens_total", profile="busy") <= main_tokens
    finally:
        running.close()


# ----------------------------------------------------------------------------------------------- promotion


@pytest.fixture(scope="module")
def tiny_folder(tiny_model: tuple[Any, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    model, tokenizer = tiny_model
    folder = tmp_path_factory.mktemp("tiny-model")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_a_regressing_version_is_refused_and_the_live_version_keeps_serving(
    server: RunningServer, store: ProfileStore, tiny_folder: Path, tmp_path: Path
) -> None:
    """A huge constant pull on a lexical field collapses the tiny model into `planet orbit planet ...`:
    distinct-2 falls from 1.0 to about 0.2 and rep-2 rises from 0 to about 0.8. Promotion refuses it."""
    live = {**SPACE, "gravity_strength": 1.0, "field": {"mode": "lexical"}}
    with server.http() as http:
        http.put("/v1/profiles/canary", json={"profile": live}).raise_for_status()
        collapsing = {**live, "gravity_strength": 20.0}
        assert http.post("/v1/profiles/canary/stage", json={"profile": collapsing}).json()["version"] == 2
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The planet\nA small moon\nThe crew\n")
    args = ["profile", "--store", str(store.root), "promote", "canary", "--prompts", str(prompts)]
    args += ["--samples", "2", "--max-new-tokens", "20", "--raw", "--model", str(tiny_folder)]
    res = runner.invoke(
        cli_app, [*args, "--limit", "distinct_2:0.1", "--limit", "rep_2:0.1", "--out", str(tmp_path / "run")]
    )
    assert res.exit_code == 1, res.output
    assert "refused" in res.output and "version 1 stays live" in res.output
    assert re.search(r"distinct_2: live 0\.9\d* → candidate 0\.2\d*, difference -0\.7", res.output), res.output
    assert "rep_2" in res.output and (tmp_path / "run" / "report.md").exists()
    assert store.live_version("canary") == 1 and store.staged("canary") == [2]
    with server.client() as client:  # a real request after the refusal gets the live version
        g = ask(client, {"profile": "canary"}).model_extra["gravity"]
        assert (g["version"], g["arm"]) == (1, "live") and g["strength"] == pytest.approx(1.0)

    # a harmless candidate passes the same gate and goes live
    with server.http() as http:
        http.post("/v1/profiles/canary/stage", json={"profile": {**live, "gravity_strength": 1.1}}).raise_for_status()
    res = runner.invoke(cli_app, [*args, "--limit", "distinct_2:0.1", "--format", "json"])
    assert res.exit_code == 0, res.output
    body = json.loads(res.stdout[res.stdout.index("{") :])
    assert body["promoted"] and body["candidate"] == 3 and body["checks"][0]["passed"]
    assert store.live_version("canary") == 3
    with server.client() as client:
        assert ask(client, {"profile": "canary"}).model_extra["gravity"]["version"] == 3


# ----------------------------------------------------------------------------------------------- scheduler


class _StepBackend:
    """A backend that emits token 1 every 10 ms per row until each row's budget or its cancellation."""

    name, model_id, max_context, eos_ids = "steps", "steps", 1000, frozenset()

    def __init__(self) -> None:
        self.batches: list[list[bool]] = []  # the `background` flags of each batch's rows

    def generate(self, rows: Any, on_tokens: Any) -> list[Any]:
        from narrative_gravity.server.backends.base import RowStats

        self.batches.append([r.background for r in rows])
        done = [0] * len(rows)
        while any(d < r.max_tokens and not r.cancelled for d, r in zip(done, rows)):
            time.sleep(0.01)
            live = [d < r.max_tokens and not r.cancelled for d, r in zip(done, rows)]
            done = [d + int(x) for d, x in zip(done, live)]
            on_tokens([1 if x else None for x in live])
        return [RowStats(new_tokens=d) for d in done]


def test_background_rows_use_idle_time_and_are_preempted_by_requests() -> None:
    from narrative_gravity.engines.options import GenerationOptions
    from narrative_gravity.server.scheduler import BatchScheduler, Job
    from narrative_gravity.server.telemetry import Metrics

    async def ends(job: Job) -> dict[int, Any]:
        out: dict[int, Any] = {}
        while len(out) < len(job.rows):
            index, kind, payload = await asyncio.wait_for(job.events.get(), 10)
            if kind == "end":
                out[index] = payload
        return out

    def job(tokens: int) -> Job:
        j = Job()
        j.add(prompt_ids=[1], options=GenerationOptions(max_new_tokens=tokens, top_k=0), gravity=None)
        return j

    async def main() -> None:
        backend = _StepBackend()
        sched = BatchScheduler(backend, max_batch_size=4, window_s=0.0, metrics=Metrics())
        await sched.start()
        try:
            shadow = job(300)  # 3 s alone
            sched.submit(shadow.rows, background=True)
            for _ in range(1000):  # idle for `idle_s`, so the background row runs
                if shadow.rows[0].sent:
                    break
                await asyncio.sleep(0.01)
            assert sched.running == 1 and sched.queued == 0 and shadow.rows[0].sent
            t0 = time.perf_counter()
            request = job(5)
            sched.submit(request.rows)
            got = await ends(request)
            assert got[0].new_tokens == 5 and time.perf_counter() - t0 < 1.0  # did not wait for the shadow
            stopped = await ends(shadow)
            assert shadow.rows[0].preempted and 0 < stopped[0].new_tokens < 300
            # a background row never joins a batch with requests, and waits while one is queued
            first, late = job(20), job(3)
            sched.submit(first.rows)
            sched.submit(late.rows, background=True)
            await ends(first)
            await ends(late)
            assert backend.batches == [[True], [False], [False], [True]] and not late.rows[0].preempted
        finally:
            await sched.stop()

    asyncio.run(main())


# ----------------------------------------------------------------------------------------------- vLLM


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_on_the_vllm_engine_arms_are_recorded_and_shadows_join_the_batch(tmp_path: Path) -> None:
    """Run from .venv-vllm: `VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python -m pytest -m slow -k vllm_engine`."""
    pytest.importorskip("vllm")
    from narrative_gravity.server.backends.vllm import VLLMBackend

    backend = VLLMBackend.load(max_num_seqs=8, max_model_len=512, kv_cache_mb=64)
    store = ProfileStore(tmp_path)
    store.set("space", SPACE)
    store.stage("space", {**SPACE, "gravity_strength": 6.0})
    store.set_rollout("space", {"shadow": 1.0, "split": {"version": 2, "share": 0.5}})
    running = RunningServer(create_app(backend, config=ServerConfig(max_batch_size=8), store=store))
    try:
        with running.client() as client:
            answers = [
                client.completions.create(
                    model="smollm2",
                    prompt="The planet",
                    max_tokens=12,
                    seed=i,
                    extra_body={"gravity": {"profile": "space"}},
                )
                for i in range(6)
            ]
        arms = {a.model_extra["gravity"]["arm"] for a in answers}
        assert arms <= {"split:a", "split:b"} and len(arms) == 2
        ids = {a.id for a in answers}
        recs = records(store, "space", until=lambda rs: {r.get("of") for r in rs} >= ids, timeout=120)
        shadows = [r for r in recs if r["arm"] == "shadow"]
        with running.http() as http:
            skipped = [line for line in http.get("/metrics").text.splitlines() if "skipped_total" in line]
        assert {r["of"] for r in shadows} == ids, skipped
        by_id = {r["request"]: r for r in recs}
        for s in shadows:
            assert (
                s["completion_tokens"] <= by_id[s["of"]]["completion_tokens"]
                and s["version"] == by_id[s["of"]]["version"]
            )
    finally:
        running.close()
