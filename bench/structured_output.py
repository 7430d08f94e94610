"""Structured output with gravity over the real HTTP API: schema validity, finish reasons, and whether gravity still
moves the words inside the JSON strings.

Every topic prompt (7 topics × 20 prefixes from the shared topic bench, ``narrative_gravity.eval.prompts``) is
sent as a chat request with a ``response_format`` JSON schema (a ``title`` and a ``description`` string), top-k 10
sampling at temperature 1, once per seed, in two arms paired by (prompt, seed): ``gravity`` (the topic default
profile, ``{"core_semantics": <the conditioning half of the topic's words>}``: a semantic field under the
thermostat) and ``plain`` (the same schema, no gravity). Each word list is split as in the topic benchmark
(``split_wordlist``): even positions condition the profile, odd positions are held out and only score.

Reported per arm: the share of replies that parse and match the schema (``jsonschema``), finish reasons, and
inside the string values of the reply the **held-out word rate** (held-out topic words per word, whole-word and
case-insensitive) and **held-out success** (a reply whose strings use at least one held-out word); then the paired
difference gravity − plain with a 95% bootstrap interval (``narrative_gravity.eval.stats.paired_bootstrap``).
On the transformers engine it also measures the grammar's cost per decoding step in-process (after the server
has stopped): the llguidance processor at batch 8, next to a plain decoding step of the same batch.

Examples::

    python bench/structured_output.py --out bench/results/structured_output_hf.json          # ~15 min, 2 cores
    VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python bench/structured_output.py --engine vllm \\
        --out bench/results/structured_output_vllm.json
    python bench/structured_output.py --limit 14 --seeds 1 --out /tmp/smoke.json               # a quick look
    python bench/structured_output.py --step-cost-only --out bench/results/structured_output_step_cost.json

Needs the ``server``, ``structured`` and ``dev`` extras (httpx, jsonschema, llguidance).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from common import machine, spawn_server, stop_server, write_json
from narrative_gravity.eval.metrics import word_spans
from narrative_gravity.eval.prompts import EvalPrompt, load_topics
from narrative_gravity.eval.stats import paired_bootstrap
from narrative_gravity.server.structured import reply_errors

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "minLength": 3, "maxLength": 48},
        "description": {"type": "string", "minLength": 20, "maxLength": 160},
    },
    "required": ["title", "description"],
    "additionalProperties": False,
}
# Every token inside a JSON string carries at least one character, so a budget a little above the strings'
# maxLength together always lets the reply close (finish_reason "stop"); see docs/server.md.
MAX_TOKENS = 256
ASK = 'Write a title and a short description for an article about {topic} that begins with "{prefix}". Answer in JSON.'
WORD = re.compile(r"[^\W_]+", re.UNICODE)


@dataclass
class Reply:
    arm: str
    prompt: int
    topic: str
    seed: int
    status: int
    finish: str | None = None
    valid: bool = False
    error: str | None = None
    tokens: int = 0
    words: int = 0
    heldout_hits: int = 0
    conditioning_hits: int = 0
    seconds: float = 0.0
    text: str = ""

    @property
    def heldout_rate(self) -> float:
        return self.heldout_hits / self.words if self.words else float("nan")

    @property
    def heldout_success(self) -> float:
        return float(self.heldout_hits > 0) if self.valid else float("nan")


def strings_of(value: Any) -> list[str]:
    """Every string value inside a decoded JSON value (keys excluded)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in strings_of(v)]
    if isinstance(value, list):
        return [s for v in value for s in strings_of(v)]
    return []


def score(reply: Reply, prompt: EvalPrompt) -> None:
    """Fill in validity and the word counts of the reply's string values."""
    error = reply_errors(SCHEMA, reply.text)
    reply.valid = error is None
    reply.error = error
    if not reply.valid:
        return
    text = "\n".join(strings_of(json.loads(reply.text)))
    reply.words = len(WORD.findall(text))
    reply.heldout_hits = len(word_spans(text, prompt.heldout_words))
    reply.conditioning_hits = len(word_spans(text, prompt.topic_words))


def body(model: str, prompt: EvalPrompt, seed: int, arm: str, max_tokens: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": ASK.format(prefix=prompt.text, topic=prompt.topic_name)}],
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "top_k": 10,
        "seed": seed,
        "response_format": {"type": "json_schema", "json_schema": {"name": "article", "schema": SCHEMA}},
    }
    if arm == "gravity":
        out["gravity"] = {"core_semantics": list(prompt.topic_words)}
    return out


async def ask(client: httpx.AsyncClient, payload: dict[str, Any], reply: Reply, prompt: EvalPrompt) -> Reply:
    t0 = time.perf_counter()
    resp = await client.post("/v1/chat/completions", json=payload)
    reply.seconds = time.perf_counter() - t0
    reply.status = resp.status_code
    if resp.status_code != 200:
        reply.error = resp.text[:300]
        return reply
    data = resp.json()
    choice = data["choices"][0]
    reply.finish = choice["finish_reason"]
    reply.text = choice["message"]["content"]
    reply.tokens = data["usage"]["completion_tokens"]
    score(reply, prompt)
    return reply


async def run(args: argparse.Namespace, prompts: list[EvalPrompt]) -> tuple[list[Reply], float]:
    limits = httpx.Limits(max_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=args.url, timeout=args.timeout, limits=limits, trust_env=False) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        # unmeasured: one request per topic builds its semantic field (cached by the server afterwards)
        seen: dict[str, EvalPrompt] = {}
        for p in prompts:
            seen.setdefault(p.topic_name or "", p)
        for p in seen.values():
            warm = body(model, p, 0, "gravity", 1)
            (await client.post("/v1/chat/completions", json=warm)).raise_for_status()
        gate = asyncio.Semaphore(args.concurrency)

        async def one(p: EvalPrompt, seed: int, arm: str) -> Reply:
            async with gate:
                reply = Reply(arm=arm, prompt=p.index, topic=p.topic_name or "", seed=seed, status=0)
                return await ask(client, body(model, p, seed, arm, args.max_tokens), reply, p)

        jobs = [one(p, seed, arm) for seed in range(args.seeds) for p in prompts for arm in ("gravity", "plain")]
        t0 = time.perf_counter()
        replies = await asyncio.gather(*jobs)
        return list(replies), time.perf_counter() - t0


def summarize(replies: list[Reply]) -> dict[str, Any]:
    arms: dict[str, Any] = {}
    for arm in ("gravity", "plain"):
        rs = [r for r in replies if r.arm == arm]
        ok = [r for r in rs if r.valid]
        arms[arm] = {
            "requests": len(rs),
            "http_200": sum(r.status == 200 for r in rs),
            "schema_valid": len(ok),
            "schema_valid_share": round(len(ok) / len(rs), 4) if rs else None,
            "finish_reasons": dict(Counter(str(r.finish) for r in rs)),
            "heldout_word_rate": _mean([r.heldout_rate for r in ok]),
            "heldout_success": _mean([r.heldout_success for r in ok]),
            "conditioning_word_rate": _mean([r.conditioning_hits / r.words for r in ok if r.words]),
            "completion_tokens_mean": _mean([r.tokens for r in rs]),
            "words_mean": _mean([r.words for r in ok]),
            "seconds_mean": _mean([r.seconds for r in rs]),
        }
    key = {(r.prompt, r.seed): r for r in replies if r.arm == "plain"}
    pairs = [(key[(r.prompt, r.seed)], r) for r in replies if r.arm == "gravity" and (r.prompt, r.seed) in key]
    paired = {}
    for name, fn in (
        ("heldout_word_rate", lambda r: r.heldout_rate),
        ("heldout_success", lambda r: r.heldout_success),
        ("conditioning_word_rate", lambda r: r.conditioning_hits / r.words if r.words else float("nan")),
    ):
        comp = paired_bootstrap([fn(c) for c, _ in pairs], [fn(t) for _, t in pairs], higher_is_better=True)
        paired[name] = comp.to_json()
    topics = sorted({r.topic for r in replies})
    per_topic = {}
    for t in topics:
        tp = [(c, g) for c, g in pairs if g.topic == t]
        per_topic[t] = {
            "pairs": len(tp),
            "plain_heldout_word_rate": _mean([c.heldout_rate for c, _ in tp]),
            "gravity_heldout_word_rate": _mean([g.heldout_rate for _, g in tp]),
        }
    return {"arms": arms, "paired_gravity_minus_plain": paired, "per_topic": per_topic}


def _mean(values: list[float]) -> float | None:
    finite = [v for v in values if v == v]
    return round(statistics.fmean(finite), 5) if finite else None


# ------------------------------------------------------------------------------------------- grammar step cost


def step_cost(batch: int = 8, steps: int = 48, repeats: int = 3) -> dict[str, Any]:
    """ms per decoding step of a batch of ``batch`` schema rows on the transformers engine: the grammar processor
    alone (timed around its calls) and the whole step, with the topic profile on every row, with and without
    ``response_format``."""
    import torch

    from narrative_gravity.engines.options import GenerationOptions
    from narrative_gravity.profiles.schema import Profile
    from narrative_gravity.server import HFBackend
    from narrative_gravity.server import grammar as grammar_module
    from narrative_gravity.server.backends.base import ResolvedGravity
    from narrative_gravity.server.scheduler import Job
    from narrative_gravity.server.structured import ResponseFormat

    load_before = os.getloadavg()[0]
    backend = HFBackend.load()
    fmt = ResponseFormat.of("json_schema", SCHEMA, name="article")
    backend.prepare_format(fmt)
    topic = load_topics()[0]
    profile = Profile.from_mapping({"core_semantics": list(topic.topic_words)})
    gravity = ResolvedGravity(profile, "inline", "bench")
    backend.prepare(profile)
    ids = backend.encode_chat([{"role": "user", "content": ASK.format(prefix=topic.text, topic=topic.topic_name)}])
    calls: list[float] = []
    original = grammar_module.GrammarLogitsProcessor.__call__

    def timed(self: Any, input_ids: Any, scores: Any) -> Any:
        t = time.perf_counter()
        out = original(self, input_ids, scores)
        calls.append(time.perf_counter() - t)
        return out

    grammar_module.GrammarLogitsProcessor.__call__ = timed  # type: ignore[method-assign]
    per_step: dict[str, list[float]] = {"with_schema": [], "without_schema": []}
    grammar_ms: list[float] = []
    try:
        for r in range(repeats + 1):  # the first round warms up
            for arm in ("without_schema", "with_schema"):
                job = Job()
                for k in range(batch):
                    job.add(
                        prompt_ids=ids,
                        options=GenerationOptions(max_new_tokens=steps, top_k=10, seed=100 * r + k),
                        gravity=gravity,
                        response_format=fmt if arm == "with_schema" else None,
                    )
                steps_seen: list[int] = []
                calls.clear()
                t0 = time.perf_counter()
                backend.generate(job.rows, lambda *_, seen=steps_seen: seen.append(1))
                if r:
                    per_step[arm].append(1000 * (time.perf_counter() - t0) / max(len(steps_seen), 1))
                    if arm == "with_schema":
                        grammar_ms.append(1000 * statistics.fmean(calls))
    finally:
        grammar_module.GrammarLogitsProcessor.__call__ = original  # type: ignore[method-assign]
    step = statistics.median(per_step["without_schema"])
    return {
        "batch": batch,
        "steps_per_run": steps,
        "runs": repeats,
        "torch_threads": torch.get_num_threads(),
        "step_ms_without_schema": round(step, 2),
        "step_ms_with_schema": round(statistics.median(per_step["with_schema"]), 2),
        "grammar_processor_ms_per_step": round(statistics.median(grammar_ms), 3),
        "grammar_share_of_a_step": round(statistics.median(grammar_ms) / step, 4),
        "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],  # before, after
    }


# ------------------------------------------------------------------------------------------- server process


def spawn(args: argparse.Namespace) -> subprocess.Popen[bytes]:
    extra = ["--engine", args.engine, "--max-batch-size", str(args.max_batch_size), *args.server_arg]
    proc, args.url = spawn_server(extra)
    return proc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--engine", default="hf", choices=["hf", "vllm"], help="the engine of the spawned server")
    p.add_argument("--url", help="a running server instead of spawning one")
    p.add_argument("--seeds", type=int, default=2, help="seeds per prompt (each a pair of requests)")
    p.add_argument("--limit", type=int, help="only the first N prompts (7 topics × 20 prefixes in all)")
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--server-arg", action="append", default=[], help="extra `ngrav serve` argument (repeatable)")
    p.add_argument("--step-cost", action=argparse.BooleanOptionalAction, default=None, help="default: on for hf")
    p.add_argument("--step-cost-only", action="store_true", help="only measure the grammar's cost per step (hf)")
    p.add_argument("--out", help="write the results JSON here")
    args = p.parse_args(argv)
    if args.step_cost_only:
        cost = step_cost()
        write_json(args.out, {"command": " ".join([Path(sys.executable).name, *sys.argv]), **cost, **machine()})
        print(json.dumps(cost, indent=2))
        return 0
    prompts = load_topics()
    if args.limit:
        prompts = prompts[:: max(1, len(prompts) // args.limit)][: args.limit]  # spread over the topics
    command = " ".join([Path(sys.executable).name, *sys.argv])
    proc = None if args.url else spawn(args)
    try:
        replies, seconds = asyncio.run(run(args, prompts))
    finally:
        if proc is not None:
            stop_server(proc)
    result: dict[str, Any] = {
        "command": command,
        "engine": args.engine,
        "schema": SCHEMA,
        "ask": ASK,
        "sampling": {"temperature": 1.0, "top_k": 10, "seeds": args.seeds, "max_tokens": args.max_tokens},
        "prompts": len(prompts),
        "requests": len(replies),
        "seconds": round(seconds, 1),
        **summarize(replies),
        "machine": machine(),
    }
    if args.step_cost or (args.step_cost is None and args.engine == "hf"):
        result["grammar_step_cost"] = step_cost()
    result["examples"] = [asdict(r) for r in replies[:6]] + [asdict(r) for r in replies if not r.valid][:10]
    write_json(args.out, result)
    print(json.dumps({k: result[k] for k in ("requests", "seconds", "arms", "paired_gravity_minus_plain")}, indent=2))
    if "grammar_step_cost" in result:
        print(json.dumps(result["grammar_step_cost"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
