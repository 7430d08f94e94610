"""What a shadow arm costs the server: N requests on one stored profile, once without a rollout and once with a
shadow share, against a real server (uvicorn on loopback, in this process, the same model for both runs).

Each request is a completion with its own seed (``seed = i``), so both runs decode exactly the same answers and the
shadow draw (a hash of the seed) picks the same requests every time. Figures come from the server's own counters
(``/metrics``): the tokens the answers decoded (``ngrav_arm_generated_tokens_total``), the tokens the shadows decoded
(``ngrav_shadow_decoded_tokens_total``, preempted shadows included), the engine's busy time
(``ngrav_batch_seconds_sum``) and the shadows run and skipped by reason; wall time and request latency are
secondary figures (the machine is shared and noisy).

``--clients C`` keeps C requests in flight (closed loop: the engine is never idle, so shadows mostly give way);
``--rate R`` sends R requests per second instead (open loop, Poisson arrivals: there is idle time for shadows).

Examples::

    python bench/shadow_cost.py --requests 200 --clients 4 --out bench/results/shadow_cost_closed.json
    python bench/shadow_cost.py --requests 200 --rate 1.5 --out bench/results/shadow_cost_paced.json
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from common import machine, write_json

PROMPTS = (
    "The planet",
    "Tell me about the stars",
    "Our journey to the moon began",
    "The telescope showed",
    "A comet crossed",
    "The astronaut looked out of the window and",
)
PROFILE = {"core_semantics": ["planet", "orbit", "star", "galaxy"], "gravity_strength": 1.5, "schedule": "phases"}


def metric(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    pattern = re.escape(name) + (re.escape("{" + want + "}") if want else "") + r" (\S+)"
    match = re.search("^" + pattern + "$", text, flags=re.MULTILINE)
    return float(match.group(1)) if match else 0.0


class Server:
    """uvicorn in a background thread on a free loopback port (as the test suite runs it)."""

    def __init__(self, app: Any, config: Any) -> None:
        import uvicorn

        from narrative_gravity.server.connections import uvicorn_config

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.app = app
        self.server = uvicorn.Server(uvicorn_config(app, config, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


async def send_all(url: str, args: argparse.Namespace) -> tuple[list[float], float]:
    """Send the requests; returns each request's latency and the wall time to the last answer."""
    latencies: list[float] = []
    # a connection per request: reusing one that the server's keep-alive timeout is closing fails the request
    limits = httpx.Limits(max_keepalive_connections=0)
    client = httpx.AsyncClient(base_url=url, trust_env=False, timeout=600, limits=limits)

    async def one(i: int) -> None:
        body = {
            "model": args.model_id,
            "prompt": PROMPTS[i % len(PROMPTS)],
            "max_tokens": args.max_tokens,
            "temperature": 0.8,
            "top_k": 10,
            "seed": i,
            "gravity": {"profile": "space"},
        }
        t0 = time.perf_counter()
        resp = await client.post("/v1/completions", json=body)
        resp.raise_for_status()
        latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    async with client:
        if args.rate > 0:  # open loop: Poisson arrivals at --rate per second
            rng = random.Random(0)
            tasks = []
            for i in range(args.requests):
                tasks.append(asyncio.create_task(one(i)))
                await asyncio.sleep(rng.expovariate(args.rate))
            await asyncio.gather(*tasks)
        else:  # closed loop: --clients requests in flight
            queue = list(range(args.requests))

            async def worker() -> None:
                while queue:
                    await one(queue.pop(0))

            await asyncio.gather(*(worker() for _ in range(args.clients)))
    return latencies, time.perf_counter() - t0


def run(backend: Any, args: argparse.Namespace, shadow: float) -> dict[str, Any]:
    from narrative_gravity.profiles.store import ProfileStore
    from narrative_gravity.server import ServerConfig, create_app

    with tempfile.TemporaryDirectory() as tmp:
        store = ProfileStore(tmp)
        store.set("space", PROFILE)
        if shadow:
            store.set_rollout("space", {"shadow": shadow})
        config = ServerConfig(max_batch_size=args.batch_size, max_tokens_limit=256, max_queue=512)
        app = create_app(backend, config=config, store=store)
        server = Server(app, config)
        try:
            latencies, wall = asyncio.run(send_all(server.url, args))
            t0 = time.perf_counter()
            while app.state.server.followups.in_flight:  # shadows still running after the last answer
                time.sleep(0.05)
            drained = wall + time.perf_counter() - t0
            text = httpx.get(server.url + "/metrics", trust_env=False).text
        finally:
            server.close()
        recs = store.arms_log("space").read()
    answered = metric(text, "ngrav_arm_generated_tokens_total", arm="live", profile="space")
    shadow_tokens = metric(text, "ngrav_shadow_decoded_tokens_total", profile="space")
    skipped = {
        r: metric(text, "ngrav_shadow_skipped_total", profile="space", reason=r)
        for r in ("load", "budget", "preempted", "error")
    }
    lat = sorted(latencies)
    return {
        "shadow_share": shadow,
        "requests": len(latencies),
        "answer_tokens": answered,
        "shadow_decoded_tokens": shadow_tokens,
        "decoded_tokens": answered + shadow_tokens,
        "shadows_recorded": sum(r.get("arm") == "shadow" for r in recs),
        "shadows_skipped": skipped,
        "engine_busy_s": round(metric(text, "ngrav_batch_seconds_sum"), 3),
        "batches": metric(text, "ngrav_generate_calls_total"),
        "rows_per_batch": round(
            metric(text, "ngrav_batch_rows_total") / max(1.0, metric(text, "ngrav_generate_calls_total")), 3
        ),
        "wall_s": round(wall, 3),
        "wall_drained_s": round(drained, 3),
        "latency_p50_s": round(statistics.median(lat), 4),
        "latency_p95_s": round(lat[int(0.95 * (len(lat) - 1))], 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--clients", type=int, default=4, help="closed loop: requests in flight")
    parser.add_argument("--rate", type=float, default=0.0, help="open loop: requests per second (0: closed loop)")
    parser.add_argument("--shadow", type=float, default=0.05, help="shadow share of the second run")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--model", default=None, help="smollm2 (default), a HF folder or a .gguf file")
    parser.add_argument("--repeat", type=int, default=1, help="alternate plain and shadow runs this many times")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.requests < 1 or not 0 < args.shadow <= 1:
        sys.exit("--requests must be >= 1 and --shadow in (0, 1]")

    import torch

    from narrative_gravity.profiles.rollout import RolloutConfig, route, route_key
    from narrative_gravity.server import HFBackend

    backend = HFBackend.load(args.model)
    args.model_id = backend.model_id
    cfg = RolloutConfig(shadow=args.shadow)
    drawn = sum(route(cfg, name="space", live=1, key=route_key(seed=i)).shadow for i in range(args.requests))
    warm = argparse.Namespace(**{**vars(args), "requests": 4, "clients": 1, "rate": 0.0})
    run(backend, warm, 0.0)  # one-time costs (the field, the first batches) stay out of the figures
    pairs = [(run(backend, args, 0.0), run(backend, args, args.shadow)) for _ in range(max(1, args.repeat))]
    plain, shadowed = pairs[0]
    result = {
        "command": " ".join(["python", *sys.argv]),
        "machine": machine(torch.get_num_threads()),
        "model": backend.model_id,
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "model_id")},
        "shadows_drawn": drawn,
        "plain": plain,
        "shadow": shadowed,
        "same_answers": plain["answer_tokens"] == shadowed["answer_tokens"],
        "decoded_ratio": round(shadowed["decoded_tokens"] / plain["decoded_tokens"], 4),
        "shadow_share_of_decoded": round(shadowed["shadow_decoded_tokens"] / shadowed["answer_tokens"], 4),
        "engine_busy_ratio": round(shadowed["engine_busy_s"] / plain["engine_busy_s"], 4),
        "wall_ratio": round(shadowed["wall_s"] / plain["wall_s"], 4),
        "latency_p50_ratio": round(shadowed["latency_p50_s"] / plain["latency_p50_s"], 4),
    }
    if len(pairs) > 1:  # every repetition, plain then shadow, back to back
        result["repeats"] = [
            {
                "answer_tokens": [p["answer_tokens"], s["answer_tokens"]],
                "shadow_decoded_tokens": s["shadow_decoded_tokens"],
                "decoded_ratio": round(s["decoded_tokens"] / p["decoded_tokens"], 4),
                "engine_busy_ratio": round(s["engine_busy_s"] / p["engine_busy_s"], 4),
                "wall_ratio": round(s["wall_s"] / p["wall_s"], 4),
                "rows_per_batch": [p["rows_per_batch"], s["rows_per_batch"]],
                "shadows_recorded": s["shadows_recorded"],
                "shadows_skipped": s["shadows_skipped"],
            }
            for p, s in pairs
        ]
    write_json(args.out, result)
    import json

    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
