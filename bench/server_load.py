"""Load test for `ngrav serve`: N concurrent streaming clients for T seconds, from a second process on loopback.

Each client sends a streaming chat (or completions) request with gravity, reads the server-sent events to the end,
and starts the next request, until the time is up. All clients start at once, or spread evenly over ``--ramp``
seconds (as load tools ramp up users): a burst of simultaneous first requests measures how fast the engine prefills
them all, a ramp measures requests arriving while others decode. ``--warmup`` requests (one by default) go first,
one at a time and unmeasured, so one-time costs (building a profile's field, loading an encoder) stay out of the
figures. Requests still running then get ``--grace`` seconds to finish and
are cancelled after that, so a run always ends. Reports requests, failures, p50/p95 latency, time to first token,
tokens/s, the server's batching from /metrics (generate calls and rows per call on the transformers engine, engine
steps and rows per step on vLLM), and the machine's load average before and after (other work on a shared machine
shows there).

Examples::

    # against a running server
    python bench/server_load.py --url http://127.0.0.1:8000 --clients 50 --duration 60

    # start `ngrav serve` for the run (and stop it afterwards)
    python bench/server_load.py --spawn --clients 4 --duration 5 --max-tokens 32

    # 5 of the 50 clients send invalid profiles (each must get a 4xx; the valid requests must not fail)
    python bench/server_load.py --spawn --clients 50 --duration 60 --invalid-clients 5

    # the vLLM engine, every request carrying a profile file inline
    python bench/server_load.py --spawn --clients 50 --duration 60 --gravity-file profiles/topic.yaml \
        --server-arg=--engine --server-arg=vllm --server-arg=--max-batch-size --server-arg=64

Needs httpx (in the `dev` extra).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from common import spawn_server, stop_server

PROMPTS = (
    "Tell me about your weekend plans.",
    "Explain how a binary search works.",
    "Write a short story about a lighthouse keeper.",
    "What should I cook for dinner tonight?",
    "Describe the view from a mountain top.",
    "Give me three tips for learning a language.",
)
DEFAULT_GRAVITY = {
    "core_semantics": ["planet", "orbit", "star", "galaxy"],
    "gravity_strength": 1.5,
    "schedule": "phases",
}


@dataclass
class Result:
    ok: bool
    seconds: float
    ttft: float | None = None
    tokens: int = 0
    error: str | None = None
    invalid: bool = False  # sent by a client of --invalid-clients
    status: int | None = None


# What the clients of --invalid-clients send, in turn: each must be refused with a 4xx before it reaches the
# engine, and must not disturb anyone else's request.
INVALID_GRAVITY: tuple[Any, ...] = (
    {"core_semantics": ["planet"], "gravity_strenght": 2.0},  # a typo
    {"core_semantics": ["planet"], "stages": [{"core_semantics": [f"w{i}"]} for i in range(400)]},  # over the cap
    {"core_semantics": ["planet"], "gravity_strength": "2"},  # a string for a number
    {"core_semantics": []},  # no words
    {"core_semantics": ["planet"], "thermostat": {"entropy_low": 0.5, "entropy_high": 0.1}},  # contradictory
    "planet",  # not a mapping
)


@dataclass
class Report:
    clients: int
    duration_s: float
    ramp_s: float
    wall_s: float
    requests: int
    ok: int
    failures: int
    failure_kinds: dict[str, int] = field(default_factory=dict)
    invalid_clients: int = 0
    invalid_requests: int = 0
    invalid_status: dict[str, int] = field(default_factory=dict)
    latency_p50_s: float | None = None
    latency_p95_s: float | None = None
    ttft_p50_s: float | None = None
    ttft_p95_s: float | None = None
    tokens: int = 0
    tokens_per_s: float = 0.0
    requests_per_s: float = 0.0
    generate_calls: float | None = None
    rows_per_call: float | None = None
    engine_steps: float | None = None
    rows_per_step: float | None = None
    gravity: dict[str, Any] | str | None = None
    cpus: int | None = None
    load_before: list[float] | None = None
    load_after: list[float] | None = None


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return round(ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo), 4)


def gravity_of(args: argparse.Namespace) -> dict[str, Any] | None:
    """The ``gravity`` every request carries: a stored profile, a profile file inline, the default, or none."""
    if args.no_gravity:
        return None
    if args.profile:
        return {"profile": args.profile}
    if args.gravity_file:
        data = yaml.safe_load(Path(args.gravity_file).read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise SystemExit(
                f"--gravity-file {args.gravity_file}: expected a profile mapping, got {type(data).__name__}"
            )
        return data
    return DEFAULT_GRAVITY


def request_body(args: argparse.Namespace, i: int, invalid: bool = False) -> tuple[str, dict[str, Any]]:
    prompt = PROMPTS[i % len(PROMPTS)]
    body: dict[str, Any] = {
        "model": args.model,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    gravity = INVALID_GRAVITY[i % len(INVALID_GRAVITY)] if invalid else gravity_of(args)
    if gravity is not None:
        body["gravity"] = gravity
    if args.completions:
        return "/v1/completions", {**body, "prompt": prompt}
    return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}


async def one_request(client: httpx.AsyncClient, path: str, body: dict[str, Any], timeout: float) -> Result:
    t0 = time.perf_counter()
    try:
        return await asyncio.wait_for(read_stream(client, path, body, t0), timeout)
    except asyncio.TimeoutError:
        return Result(False, time.perf_counter() - t0, error="timeout")
    except httpx.HTTPError as exc:
        return Result(False, time.perf_counter() - t0, error=type(exc).__name__)


async def read_stream(client: httpx.AsyncClient, path: str, body: dict[str, Any], t0: float) -> Result:
    ttft, tokens = None, 0
    async with client.stream("POST", path, json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return Result(False, time.perf_counter() - t0, error=f"http {resp.status_code}", status=resp.status_code)
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                return Result(True, time.perf_counter() - t0, ttft, tokens)
            chunk = json.loads(data)
            if "error" in chunk:
                return Result(False, time.perf_counter() - t0, error=f"stream error {chunk['error'].get('code')}")
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                text = choice.get("text") or (choice.get("delta") or {}).get("content")
                if text and ttft is None:
                    ttft = time.perf_counter() - t0
    return Result(False, time.perf_counter() - t0, error="stream ended without [DONE]")


async def client_loop(
    n: int, args: argparse.Namespace, client: httpx.AsyncClient, deadline: float, out: list[Result]
) -> None:
    i = n
    invalid = n < args.invalid_clients
    await asyncio.sleep(args.ramp * n / args.clients)
    while time.perf_counter() < deadline:
        path, body = request_body(args, i, invalid)
        result = await one_request(client, path, body, args.request_timeout)
        result.invalid = invalid
        out.append(result)
        i += args.clients
        if invalid:
            await asyncio.sleep(0.05)  # a refusal is instant: keep the invalid clients from spinning


def read_metric(text: str, name: str) -> float | None:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, flags=re.MULTILINE)
    return float(match.group(1)) if match else None


SCRAPED = ("ngrav_generate_calls_total", "ngrav_batch_rows_total", "ngrav_engine_steps_total", "ngrav_step_rows_sum")


async def scrape(client: httpx.AsyncClient) -> dict[str, float | None]:
    try:
        text = (await client.get("/metrics")).text
    except httpx.HTTPError:
        return dict.fromkeys(SCRAPED)
    return {name: read_metric(text, name) for name in SCRAPED}


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def delta(before: dict[str, float | None], after: dict[str, float | None], name: str) -> float | None:
    x, y = before[name], after[name]
    return y - x if x is not None and y is not None else None


async def run(args: argparse.Namespace) -> Report:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.clients + 4, max_keepalive_connections=args.clients + 4)
    async with httpx.AsyncClient(
        base_url=args.url, headers=headers, timeout=args.request_timeout, limits=limits, trust_env=False
    ) as client:
        for i in range(args.warmup):
            path, body = request_body(args, i)
            warm = await one_request(client, path, body, args.request_timeout)
            if not warm.ok:
                raise SystemExit(f"warm-up request {i} failed ({warm.error}); is the server healthy?")
        load_before = [round(x, 2) for x in os.getloadavg()]
        scraped0 = await scrape(client)
        results: list[Result] = []
        t0 = time.perf_counter()
        deadline = t0 + args.duration
        tasks = [asyncio.create_task(client_loop(n, args, client, deadline, results)) for n in range(args.clients)]
        _, pending = await asyncio.wait(tasks, timeout=args.duration + args.grace)
        for task in pending:  # bounded: whatever still runs after the grace period is cancelled
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        wall = time.perf_counter() - t0
        scraped1 = await scrape(client)
        load_after = [round(x, 2) for x in os.getloadavg()]
    bad = [r for r in results if r.invalid]
    results = [r for r in results if not r.invalid]
    invalid_status: dict[str, int] = {}
    for r in bad:
        key = str(r.status) if r.status is not None else ("200 (accepted!)" if r.ok else (r.error or "?"))
        invalid_status[key] = invalid_status.get(key, 0) + 1
    ok = [r for r in results if r.ok]
    kinds: dict[str, int] = {}
    for r in results:
        if not r.ok:
            kinds[r.error or "?"] = kinds.get(r.error or "?", 0) + 1
    if pending:
        kinds["cancelled after grace"] = len(pending)
    tokens = sum(r.tokens for r in ok)
    calls = delta(scraped0, scraped1, "ngrav_generate_calls_total")
    steps = delta(scraped0, scraped1, "ngrav_engine_steps_total")
    return Report(
        clients=args.clients,
        duration_s=args.duration,
        ramp_s=args.ramp,
        wall_s=round(wall, 2),
        requests=len(results),
        ok=len(ok),
        failures=len(results) - len(ok) + len(pending),
        failure_kinds=kinds,
        invalid_clients=args.invalid_clients,
        invalid_requests=len(bad),
        invalid_status=invalid_status,
        latency_p50_s=percentile([r.seconds for r in ok], 0.5),
        latency_p95_s=percentile([r.seconds for r in ok], 0.95),
        ttft_p50_s=percentile([r.ttft for r in ok if r.ttft is not None], 0.5),
        ttft_p95_s=percentile([r.ttft for r in ok if r.ttft is not None], 0.95),
        tokens=tokens,
        tokens_per_s=round(tokens / wall, 2) if wall > 0 else 0.0,
        requests_per_s=round(len(ok) / wall, 3) if wall > 0 else 0.0,
        generate_calls=calls,
        rows_per_call=ratio(delta(scraped0, scraped1, "ngrav_batch_rows_total"), calls),
        engine_steps=steps,
        rows_per_step=ratio(delta(scraped0, scraped1, "ngrav_step_rows_sum"), steps),
        gravity=gravity_of(args),
        cpus=os.cpu_count(),
        load_before=load_before,
        load_after=load_after,
    )


def spawn(args: argparse.Namespace) -> subprocess.Popen[bytes]:
    extra = []
    if args.server_model:
        extra += ["--model", args.server_model]
        args.model = args.server_model  # the server's model id is its --model
    env = dict(os.environ)
    if args.api_key:
        env["NGRAV_API_KEY"] = args.api_key
    proc, args.url = spawn_server([*extra, *args.server_arg], env=env, timeout_s=args.startup_timeout)
    return proc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (ignored with --spawn)")
    p.add_argument("--clients", type=int, default=4, help="concurrent streaming clients")
    p.add_argument("--duration", type=float, default=5.0, help="seconds to keep sending requests")
    p.add_argument("--ramp", type=float, default=0.0, help="start the clients evenly over this many seconds")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured requests sent one by one before the run")
    p.add_argument("--grace", type=float, default=30.0, help="seconds in-flight requests get after --duration")
    p.add_argument("--request-timeout", type=float, default=120.0, help="seconds before one request counts as failed")
    p.add_argument("--model", default="smollm2", help="the `model` field sent (the server's model id)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--completions", action="store_true", help="use /v1/completions instead of chat")
    p.add_argument("--profile", help="send gravity as {'profile': NAME} from the server's store")
    p.add_argument("--gravity-file", help="send this profile file (YAML or JSON) inline with every request")
    p.add_argument("--no-gravity", action="store_true", help="send no gravity (the control)")
    p.add_argument(
        "--invalid-clients",
        type=int,
        default=0,
        help="this many of the clients send invalid profiles (each must get a 4xx); the figures are the others'",
    )
    p.add_argument("--api-key", default=os.environ.get("NGRAV_API_KEY"), help="default: $NGRAV_API_KEY")
    p.add_argument("--json", help="also write the report to this file")
    p.add_argument("--spawn", action="store_true", help="start `ngrav serve` on a free loopback port for the run")
    p.add_argument("--server-model", help="--model for the spawned server")
    p.add_argument("--server-arg", action="append", default=[], help="extra argument for the spawned server")
    p.add_argument("--startup-timeout", type=float, default=180.0)
    args = p.parse_args(argv)
    if args.clients < 1 or args.duration <= 0 or not 0 <= args.ramp < args.duration:
        p.error("--clients must be >= 1, --duration > 0 and --ramp in [0, --duration)")
    proc = spawn(args) if args.spawn else None
    try:
        report = asyncio.run(run(args))
    finally:
        if proc is not None:
            stop_server(proc)
    print(json.dumps(asdict(report), indent=2))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(asdict(report), fh, indent=2)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
