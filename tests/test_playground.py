"""The playground: its API (per-token stats in streams, measure-only runs, validation, scores) on the tiny
seeded Llama, and the page itself in headless Chromium driven by Selenium (bad input, stopping, the API key).

The full walk-through on the default model (SmolLM2), with the speed check and the screenshot, is the slow
test at the end."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from narrative_gravity.eval.metrics import contains_any

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

import yaml  # noqa: E402

from narrative_gravity.profiles.schema import Profile  # noqa: E402
from narrative_gravity.profiles.store import ProfileStore  # noqa: E402
from narrative_gravity.server import HFBackend, ServerConfig, create_app  # noqa: E402
from narrative_gravity.server.routes.playground import topic_profile  # noqa: E402
from servers import RunningServer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SPACE = {"core_semantics": ["planet", "orbit"], "gravity_strength": 3.0, "schedule": "constant"}
MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tiny_backend: HFBackend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    store = ProfileStore(tmp_path_factory.mktemp("store"))
    config = ServerConfig(batch_window_ms=20, max_tokens_limit=256, max_prompt_tokens=200)
    running = RunningServer(create_app(tiny_backend, config=config, store=store))
    yield running
    running.close()


def sse(resp: Any) -> list[dict[str, Any]]:
    """The JSON events of a streamed response, up to ``[DONE]``."""
    out = []
    for line in resp.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


def stream(http: Any, body: dict[str, Any]) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
    """``(text, token records, usage)`` of a streamed completion with per-token stats."""
    body = {"model": MODEL, "stream": True, "stream_options": {"include_usage": True, "include_trace": True}, **body}
    with http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200, resp.read()
        events = sse(resp)
    text = "".join(c["text"] for e in events for c in e["choices"])
    tokens = [t for e in events for c in e["choices"] for t in c.get("tokens", [])]
    usage = next(e["usage"] for e in events if e.get("usage"))
    return text, tokens, usage


# ----------------------------------------------------------------------------------------------- API


def test_stream_carries_each_tokens_stats_and_measure_only_is_plain(server: RunningServer) -> None:
    greedy = {"prompt": "The comet", "max_tokens": 12, "temperature": 0}
    with server.http() as http:
        text, tokens, usage = stream(http, {**greedy, "gravity": {**SPACE, "gravity_strength": 20.0}})
        assert len(tokens) == usage["completion_tokens"] > 0
        assert all(set(t) == {"id", "strength", "entropy", "mass", "mass_after", "kl"} for t in tokens)
        assert all(t["strength"] == 20.0 and t["mass_after"] >= t["mass"] for t in tokens)

        plain = http.post("/v1/completions", json={"model": MODEL, **greedy}).json()["choices"][0]["text"]
        measured, mtokens, _ = stream(http, {**greedy, "gravity": {**SPACE, "measure_only": True}})
        assert measured == plain != text  # no pull: the plain text, measured against the field
        assert all(t["strength"] == 0.0 and t["kl"] == 0.0 and t["mass"] == t["mass_after"] for t in mtokens)
        assert mtokens[0]["mass"] == pytest.approx(tokens[0]["mass"], abs=1e-4)  # same first distribution

        # no gravity: ids only; without include_trace: no `tokens` at all
        _, bare, usage = stream(http, greedy)
        assert [set(t) for t in bare] == [{"id"}] * usage["completion_tokens"]
        with http.stream("POST", "/v1/completions", json={"model": MODEL, "stream": True, **greedy}) as resp:
            assert all("tokens" not in c for e in sse(resp) for c in e["choices"])

        bad = http.post("/v1/completions", json={"model": MODEL, **greedy, "gravity": {**SPACE, "measure_only": 1}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "gravity.measure_only"


def test_validate_names_the_key_path(server: RunningServer) -> None:
    with server.http() as http:
        ok = http.post("/v1/validate", json={"profile": SPACE}).json()
        assert ok["valid"] and ok["profile"]["thermostat"]["strict_target"] == 0.8
        bad = http.post(
            "/v1/validate",
            json={"profile": {"core_semantics": [], "thermostat": {"explore_target": 1.5}, "stages": [{"share": 2}]}},
        ).json()
        params = {e["param"] for e in bad["errors"]}
        assert not bad["valid"] and {"core_semantics", "thermostat.explore_target", "stages.0.share"} <= params
        assert any("explore_target" in e["message"] and "1.5" in e["message"] for e in bad["errors"])
        typo = http.post("/v1/validate", json={"profile": {"core_semantics": ["x"], "gravity_strenght": 1}}).json()
        assert typo["errors"] == [
            {"param": "gravity_strenght", "message": "unknown key `gravity_strenght`; did you mean `gravity_strength`?"}
        ]
        prepared = http.post("/v1/validate", json={"profile": SPACE, "prepare": True}).json()
        assert prepared["valid"]
        resp = http.post("/v1/validate", json={"profile": SPACE, "prepare": "yes"})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "prepare"


def test_score_gives_the_compare_table(server: RunningServer) -> None:
    with server.http() as http:
        runs = []
        for seed in range(3):
            sides = {}
            for side, gravity in (("control", {**SPACE, "measure_only": True}), ("gravity", SPACE)):
                body = {"prompt": "The comet", "max_tokens": 10, "temperature": 1.0, "seed": seed, "gravity": gravity}
                text, tokens, _ = stream(http, body)
                sides[side] = {
                    "token_ids": [t["id"] for t in tokens],
                    "text": text,
                    "seconds": 0.5,
                    "kl": sum(t["kl"] for t in tokens) / len(tokens),
                }
            runs.append(sides)
        scored = {"held_out": ["moon", "star"], "description": "a text about space"}
        out = http.post("/v1/score", json={"gravity": SPACE, "prompt": "The comet", "runs": runs, **scored}).json()
        assert len(out["runs"]) == 3 and out["runs"][0]["control"]["kl"] == 0.0
        summary = out["summary"]
        assert list(summary)[:2] == ["held_out_words", "description_similarity"]  # the independent measures lead
        for side in ("control", "gravity"):
            hits = [r[side]["held_out_words"] for r in out["runs"]]
            assert hits == [float(contains_any(r[side]["text"], ["moon", "star"])) for r in runs]
            assert all(-1.0 <= r[side]["description_similarity"] <= 1.0 for r in out["runs"])
        assert summary["narrative_rate"]["label"] == "narrative-token rate (what the pull pushes)"
        mean, lo, hi = summary["narrative_rate"]["gravity"]
        assert lo <= mean <= hi and mean > summary["narrative_rate"]["control"][0]
        assert summary["entropy"]["control"] == [None, None, None]  # not measured: null, not NaN
        assert summary["tokens_per_s"]["gravity"][0] == pytest.approx(20.0)

        def error(body: dict[str, Any]) -> str:
            resp = http.post("/v1/score", json=body)
            assert resp.status_code == 400
            return resp.json()["error"]["param"]

        assert error({"gravity": SPACE, "runs": runs}) == "prompt"
        assert error({"gravity": SPACE, "prompt": "x", "runs": []}) == "runs"
        assert error({"gravity": {"core_semantics": []}, "prompt": "x", "runs": runs}) == "gravity"
        assert error({"gravity": SPACE, "prompt": "x", "runs": runs, "held_out": ["orbit"]}) == "held_out"  # named
        plain = http.post("/v1/score", json={"gravity": SPACE, "prompt": "The comet", "runs": runs}).json()
        assert plain["summary"]["held_out_words"]["control"] == [None, None, None]  # nothing to score against


def test_page_is_open_and_does_no_model_work(tiny_backend: HFBackend, tmp_path: Path) -> None:
    config = ServerConfig(api_key="s3cret")
    running = RunningServer(create_app(tiny_backend, config=config, store=ProfileStore(tmp_path)))
    try:
        with running.http() as http:
            before = running.app.state.server.metrics.batches
            page = http.get("/")
            assert page.status_code == 200 and "text/html" in page.headers["content-type"]
            for name in ("app.js", "app.css"):
                assert http.get(f"/playground/{name}").status_code == 200
            assert http.get("/playground/..%2Fapp.py").status_code == 404
            assert http.get("/playground/nope.js").status_code == 404
            # everything the page calls needs the key
            for path in ("/v1/playground", "/v1/profiles", "/v1/profiles/x/history"):
                assert http.get(path).status_code == 401
            assert http.post("/v1/validate", json={"profile": SPACE}).status_code == 401
            key = {"Authorization": "Bearer s3cret"}
            cfg = http.get("/v1/playground", headers=key).json()
            assert cfg["model"] == MODEL and cfg["engine"] == "hf" and cfg["token_stats"] and cfg["chat"]
            assert running.app.state.server.metrics.batches == before  # opening the page ran nothing
    finally:
        running.close()


def test_topic_default_matches_profiles_topic_yaml() -> None:
    data = yaml.safe_load((ROOT / "profiles" / "topic.yaml").read_text())
    assert topic_profile() == data
    Profile.from_mapping(topic_profile())


# ----------------------------------------------------------------------------------------------- browser

CHROMEDRIVER = shutil.which("chromedriver")
_skip_without_browser = pytest.mark.skipif(
    CHROMEDRIVER is None or shutil.which("chromium") is None,
    reason="needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)",
)


def needs_browser(fn: Any) -> Any:
    """A test that drives Chromium: marked ``browser`` (counted at the end of the run) and skipped without it."""
    return pytest.mark.browser(_skip_without_browser(fn))


@contextlib.contextmanager
def browser(width: int = 1500, height: int = 1300) -> Iterator[Any]:
    webdriver = pytest.importorskip("selenium.webdriver")
    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", f"--window-size={width},{height}"):
        options.add_argument(arg)
    options.binary_location = shutil.which("chromium") or "chromium"
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()
        # Selenium's HTTP pool to chromedriver leaves its sockets to the garbage collector: collect them here,
        # where their ResourceWarning belongs, not in whichever test runs next.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            gc.collect()


def wait_for(driver: Any, condition: Any, timeout: float = 60.0) -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(condition)


def by(css: str) -> tuple[str, str]:
    from selenium.webdriver.common.by import By

    return (By.CSS_SELECTOR, css)


def open_page(driver: Any, url: str) -> None:
    driver.get(url)
    wait_for(driver, lambda d: d.execute_script("return document.body.dataset.ready === '1'"))


def set_value(driver: Any, css: str, value: str) -> None:
    el = driver.find_element(*by(css))
    el.clear()
    el.send_keys(value)


def running_rows(http: Any) -> tuple[float, float]:
    text = http.get("/metrics").text
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("ngrav_running_rows", "ngrav_queued_rows"):
            values[name] = float(value)
    return values["ngrav_running_rows"], values["ngrav_queued_rows"]


@needs_browser
def test_page_shows_invalid_profiles_and_stops_runs(server: RunningServer) -> None:
    with browser() as driver, server.http() as http:
        open_page(driver, server.url + "/")
        set_value(driver, "#core-words", "planet, orbit")
        set_value(driver, "[data-path='thermostat.explore_target']", "1.5")
        slot = '[data-key="thermostat.explore_target"] > .err'
        wait_for(driver, lambda d: "1.5" in d.find_element(*by(slot)).text)
        assert "less than or equal to 1" in driver.find_element(*by(slot)).text
        set_value(driver, "#store-name", "broken")
        driver.find_element(*by("#save")).click()
        wait_for(driver, lambda d: "not saved" in d.find_element(*by("#store-status")).text)
        assert http.get("/v1/profiles/broken/history").status_code == 404  # nothing stored
        batches = server.app.state.server.metrics.batches
        driver.find_element(*by("#run-button")).click()
        wait_for(driver, lambda d: d.find_element(*by("#run-status")).get_attribute("data-state") == "invalid")
        assert server.app.state.server.metrics.batches == batches  # nothing ran

        # a valid profile, a long run, stopped half-way: the server drops both rows
        set_value(driver, "[data-path='thermostat.explore_target']", "0.3")
        wait_for(driver, lambda d: d.find_element(*by(slot)).text == "")
        set_value(driver, "#max-tokens", "256")
        driver.find_element(*by("#mode-raw")).click()
        driver.find_element(*by("#run-button")).click()
        wait_for(driver, lambda d: len(d.find_elements(*by("#text-gravity .tok"))) >= 3)
        # the gravity row is in flight while its text streams (plain's may be over already: a tiny random model
        # can end its text early, and the two rows arrive as two requests)
        assert sum(running_rows(http)) >= 1
        driver.find_element(*by("#stop-button")).click()
        wait_for(driver, lambda d: d.find_element(*by("#run-status")).get_attribute("data-state") == "stopped")
        deadline = time.monotonic() + 20
        while running_rows(http) != (0.0, 0.0):
            assert time.monotonic() < deadline, f"rows still in flight: {running_rows(http)}"
            time.sleep(0.05)
        n = len(driver.find_elements(*by("#text-gravity .tok")))
        assert 3 <= n < 256

        # compare over seeds, cancelled while it runs: progress shown, then no table and no rows left
        set_value(driver, "#seeds-n", "4")
        driver.find_element(*by("#compare-button")).click()
        wait_for(driver, lambda d: running_rows(http)[0] > 0)
        assert driver.find_element(*by("#compare-progress")).is_displayed()
        driver.find_element(*by("#compare-cancel")).click()
        wait_for(driver, lambda d: d.find_element(*by("#compare-status")).text == "cancelled")
        assert not driver.find_element(*by("#compare-table")).is_displayed()
        deadline = time.monotonic() + 20
        while running_rows(http) != (0.0, 0.0):
            assert time.monotonic() < deadline, f"rows still in flight: {running_rows(http)}"
            time.sleep(0.05)


@needs_browser
def test_page_asks_for_the_api_key_once(tiny_backend: HFBackend, tmp_path: Path) -> None:
    store = ProfileStore(tmp_path)
    store.set("space", SPACE, message="first")
    running_server = RunningServer(create_app(tiny_backend, config=ServerConfig(api_key="s3cret"), store=store))
    try:
        with browser() as driver, running_server.http() as http:
            driver.get(running_server.url + "/")
            wait_for(driver, lambda d: d.find_element(*by("#key-dialog")).is_displayed())
            set_value(driver, "#key-input", "s3cret")
            driver.find_element(*by("#key-ok")).click()
            wait_for(driver, lambda d: d.execute_script("return document.body.dataset.ready === '1'"))
            options = [o.text for o in driver.find_elements(*by("#start-from option"))]
            assert any(o.startswith("space") for o in options)
            # more requests (load, validate, history): no second question
            driver.find_element(*by("#start-from option[value=space]")).click()
            driver.find_element(*by("#load-profile")).click()
            wait_for(driver, lambda d: len(d.find_elements(*by("#history li"))) == 1)
            driver.refresh()
            wait_for(driver, lambda d: d.execute_script("return document.body.dataset.ready === '1'"))
            assert not driver.find_element(*by("#key-dialog")).is_displayed()
            # the profile routes refuse requests without the key
            assert http.get("/v1/profiles").status_code == 401
            assert http.put("/v1/profiles/space", json={"profile": SPACE}).status_code == 401
            assert http.post("/v1/profiles/space/rollback", json={"to": 1}).status_code == 401
            assert store.head_version("space") == 1
    finally:
        running_server.close()


# ----------------------------------------------------------------------------------------------- real model

SCREENSHOT = ROOT / "docs" / "img" / "playground.png"


@contextlib.contextmanager
def ngrav_serve(store: Path) -> Iterator[str]:
    """``ngrav serve`` with the default model in a subprocess on a free loopback port; yields its URL."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-c", "from narrative_gravity.cli.main import main; main()", "serve"]
    cmd += ["--port", str(port), "--store", str(store), "--log-level", "warning"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    log = store.parent / "serve.log"
    with log.open("w") as err:  # a file, not a pipe: a pipe nobody reads would stall the server when full
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"ngrav serve exited with {proc.returncode}: {log.read_text()[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "ngrav serve did not start in 300 s"
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def page_run(driver: Any) -> dict[str, Any]:
    """Click run and wait until both texts have finished streaming; the page's record of the run."""
    driver.execute_script("window.ngrav.lastRun = null")
    driver.find_element(*by("#run-button")).click()
    wait_for(driver, lambda d: d.find_element(*by("#run-status")).get_attribute("data-state") in ("done", "error"), 600)
    status = driver.find_element(*by("#run-status"))
    assert status.get_attribute("data-state") == "done", status.text
    return driver.execute_script(
        "const r = window.ngrav.lastRun; return {ms_total: r.ms_total, ms_streams: r.ms_streams, tokens: r.tokens,"
        " usage: [r.plain.usage.completion_tokens, r.gravity.usage.completion_tokens]}"
    )


def direct_pair(url: str, bodies: list[dict[str, Any]]) -> float:
    """Wall time in ms of the same two streamed requests made directly, at the same time."""
    import concurrent.futures
    import threading

    clients = [httpx.Client(base_url=url, trust_env=False, timeout=600) for _ in bodies]
    for client in clients:  # connected before the clock starts, as the page's are
        assert client.get("/health").status_code == 200
    ready = threading.Barrier(len(bodies) + 1)

    def one(client: Any, body: dict[str, Any]) -> int:
        ready.wait()
        with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            return len(sse(resp))

    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        futures = [pool.submit(one, c, b) for c, b in zip(clients, bodies)]
        ready.wait()  # both requests leave together, so they share a batch as the page's do
        t0 = time.perf_counter()
        assert all(f.result() > 1 for f in futures)
        ms = (time.perf_counter() - t0) * 1000
    for client in clients:
        client.close()
    return ms


def points(driver: Any, chart: str, series: str) -> int:
    pts = driver.find_element(*by(f"#{chart} polyline[data-series={series}]")).get_attribute("points")
    return len(pts.split())


@pytest.mark.slow
@needs_browser
def test_playground_on_the_default_model(tmp_path: Path) -> None:
    with ngrav_serve(tmp_path / "store") as url, browser(1500, 1450) as driver:
        http = httpx.Client(base_url=url, trust_env=False, timeout=60)
        calls = http.get("/health").json()["generate_calls"]
        open_page(driver, url + "/")
        assert http.get("/health").json()["generate_calls"] == calls  # opening the page ran nothing

        set_value(driver, "#prompt", "Write a few sentences about your morning.")
        set_value(driver, "#core-words", "ocean, whale")
        set_value(driver, "#max-tokens", "64")
        wait_for(driver, lambda d: d.find_element(*by("#valid-badge")).text.startswith("✓"))
        profile = driver.execute_script("return window.ngrav.state.profile")
        assert profile["core_semantics"] == ["ocean", "whale"] and profile["schedule"] == "thermostat"

        run = page_run(driver)
        assert run["tokens"]["gravity"] == run["usage"][1] > 0 and run["tokens"]["plain"] == run["usage"][0] > 0
        assert len(driver.find_elements(*by("#text-gravity .tok.tinted"))) > 0
        assert not driver.find_elements(*by("#text-plain .tok.tinted"))
        title = driver.find_element(*by("#text-gravity .tok.tinted")).get_attribute("title")
        assert "λ" in title and "entropy" in title and "mass" in title
        for chart in ("chart-strength", "chart-entropy", "chart-kl"):
            assert points(driver, chart, "gravity") == run["tokens"]["gravity"]
            assert points(driver, chart, "plain") == run["tokens"]["plain"]
        wait_for(driver, lambda d: "narrative-token rate" in d.find_element(*by("#summary")).text)

        # speed: the page's pair against the same two requests made directly, interleaved, best of three each
        # (the fastest run is the one least disturbed by whatever else shares the machine)
        body = {
            "model": "smollm2",
            "messages": [{"role": "user", "content": "Write a few sentences about your morning."}],
            "max_tokens": 64,
            "temperature": 0.8,
            "top_k": 50,
            "seed": 0,
            "stream": True,
            "stream_options": {"include_usage": True, "include_trace": True},
        }
        bodies = [{**body, "gravity": {**profile, "measure_only": True}}, {**body, "gravity": profile}]
        directs, pages = [], []
        for _ in range(3):
            directs.append(direct_pair(url, bodies))
            pages.append(page_run(driver)["ms_total"])
        direct, page = min(directs), min(pages)
        print(
            f"\nplayground pair of 64 tokens: page {page:.0f} ms, direct API {direct:.0f} ms, ratio {page / direct:.2f}"
        )
        # Reported, not asserted: timing belongs in benchmarks (0.97x on an idle machine), and on 2 cores the
        # browser's own work shares the CPU with the model (1.58x in one CI run on an otherwise idle machine).
        assert page > 0 and direct > 0
        wait_for(driver, lambda d: "narrative-token rate" in d.find_element(*by("#summary")).text)

        # compare over seeds, small: progress, then the table with intervals
        set_value(driver, "#seeds-n", "3")
        set_value(driver, "#max-tokens", "16")
        set_value(driver, "#held-out", "moon, star")
        driver.find_element(*by("#compare-button")).click()
        wait_for(driver, lambda d: d.find_element(*by("#compare-table")).is_displayed(), 600)
        rows = driver.find_elements(*by("#compare-table tbody tr"))
        assert rows[0].text.startswith("held-out words") and "[" in rows[0].text  # the independent measure leads
        assert not any(r.text.startswith("similarity to the description") for r in rows)  # none given: no row
        set_value(driver, "#max-tokens", "64")

        # keep what works: save, change, save, roll back
        set_value(driver, "#store-name", "morning")
        set_value(driver, "#save-message", "ocean and whale")
        driver.find_element(*by("#save")).click()
        wait_for(driver, lambda d: "version 1" in d.find_element(*by("#store-status")).text)
        set_value(driver, "[data-path='thermostat.strict_target']", "0.6")
        set_value(driver, "#save-message", "softer at the end")
        driver.find_element(*by("#save")).click()
        wait_for(driver, lambda d: "version 2" in d.find_element(*by("#store-status")).text)
        driver.find_element(*by("#history li[data-version='2'] button.diff")).click()
        wait_for(driver, lambda d: "strict_target" in d.find_element(*by("#diff")).text)
        driver.find_element(*by("#history li[data-version='1'] button.rollback")).click()
        wait_for(driver, lambda d: "version 3" in d.find_element(*by("#store-status")).text)
        history = http.get("/v1/profiles/morning/history").json()["data"]
        assert [h["version"] for h in history] == [1, 2, 3]
        v1, v3 = (http.get(f"/v1/profiles/morning?version={v}").json()["profile"] for v in (1, 3))
        assert v1 == v3 and v1["thermostat"]["strict_target"] == 0.8
        assert driver.find_element(*by("[data-path='thermostat.strict_target']")).get_attribute("value") == "0.8"

        driver.execute_script("window.scrollTo(0, 0)")
        shot = SCREENSHOT if os.environ.get("NGRAV_UPDATE_SCREENSHOT") == "1" else tmp_path / "playground.png"
        shot.parent.mkdir(parents=True, exist_ok=True)
        assert driver.save_screenshot(str(shot))
        http.close()


class _NoStatsBackend(HFBackend):
    """The transformers backend with its per-token stats turned off: an engine that does not measure each step
    (the vLLM engine today), for the page's fallback."""

    token_stats = False

    def generate(self, rows: Any, on_tokens: Any) -> Any:
        return super().generate(rows, lambda tokens, stats=None: on_tokens(tokens))


@needs_browser
def test_engine_without_token_stats_degrades(tiny_backend: HFBackend, tmp_path: Path) -> None:
    backend = _NoStatsBackend(tiny_backend.model, tiny_backend.tokenizer, model_id=MODEL)
    running_server = RunningServer(create_app(backend, store=ProfileStore(tmp_path)))
    try:
        with running_server.http() as http:
            assert not http.get("/v1/playground").json()["token_stats"]
            _, tokens, usage = stream(http, {"prompt": "The comet", "max_tokens": 8, "gravity": SPACE})
            assert [set(t) for t in tokens] == [{"id"}] * usage["completion_tokens"]
        with browser() as driver:
            open_page(driver, running_server.url + "/")
            set_value(driver, "#core-words", "planet, orbit")
            driver.find_element(*by("#mode-raw")).click()
            set_value(driver, "#max-tokens", "8")
            driver.find_element(*by("#run-button")).click()
            wait_for(driver, lambda d: d.find_element(*by("#run-status")).get_attribute("data-state") == "done")
            assert driver.find_elements(*by("#text-gravity .tok")) and not driver.find_elements(*by(".tok.tinted"))
            assert "does not report per-token stats" in driver.find_element(*by("#chart-strength")).text
            wait_for(driver, lambda d: "narrative-token rate" in d.find_element(*by("#summary")).text)
    finally:
        running_server.close()
