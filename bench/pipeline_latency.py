"""One request, every level, through the HTTP API: the pipeline against the full context on the news cases.

The cases of the context-pruning benchmark (:mod:`narrative_gravity.ragbench`, seed 1: the seed no pruning
setting was chosen on): a question, 12 passages (3 gold). Each case is asked three ways, as chat requests to a
real ``ngrav serve`` app on loopback (transformers or vLLM engine), greedy, one request at a time, the arms'
order rotating from case to case after one unmeasured warm-up request per arm:

- ``full``: every passage in ``documents``, no gravity (what the model reads without us);
- ``pruned``: the same, with a profile whose only level is ``context`` (60% of the passages' tokens) and no
  pull (``gravity_strength`` 0), to show the context level alone;
- ``pipeline``: ``context`` and ``conversation`` on, and the topic default's pull toward the question's content
  words (its profile is built from the question, as a client would).

Reported: end-to-end latency per request (client side: from sending the request to the last byte), the ratio
of medians and the median paired ratio against ``full``, prompt tokens, and answer quality (the measures of
docs/pruning.md): the answer's MiniLM cosine to the gold passages and whether it names the key entity, each
with a paired bootstrap interval against ``full``.

    python bench/pipeline_latency.py --engine hf --cases 24 --json bench/results/pipeline_latency_hf.json
    .venv-vllm/bin/python bench/pipeline_latency.py --engine vllm --cases 24 --json bench/results/pipeline_latency_vllm.json
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, write_json
from narrative_gravity.eval.text_metrics import mean_ci
from narrative_gravity.ragbench import build_cases, load_news_articles
from narrative_gravity.text import content_words

ARMS = ("full", "pruned", "pipeline")


def gravity_for(arm: str, question: str, share: float) -> dict[str, Any] | None:
    if arm == "full":
        return None
    context = {"budget_share": share}
    if arm == "pruned":
        return {"core_semantics": ["answer"], "schedule": "constant", "gravity_strength": 0.0, "context": context}
    words = list(dict.fromkeys(content_words(question)))[:8] or ["answer"]
    return {"core_semantics": words, "context": context, "conversation": {}}


def start_server(engine: str, max_tokens: int) -> tuple[Any, str, str]:
    import tempfile

    import uvicorn

    from narrative_gravity.profiles.store import ProfileStore
    from narrative_gravity.server import ServerConfig, create_app, make_backend
    from narrative_gravity.server.connections import uvicorn_config

    config = ServerConfig(batch_window_ms=5, max_tokens_limit=max_tokens, max_prompt_tokens=4096)
    options = {"max_num_seqs": 4, "max_model_len": 4096} if engine == "vllm" else {}
    backend = make_backend(engine, **options)
    app = create_app(backend, config=config, store=ProfileStore(tempfile.mkdtemp()))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn_config(app, config, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return server, f"http://127.0.0.1:{sock.getsockname()[1]}", backend.model_id


def ask(http: httpx.Client, model: str, case: Any, arm: str, max_tokens: int, share: float) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": case.question}],
        "documents": case.chunks(),
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    gravity = gravity_for(arm, case.question, share)
    if gravity is not None:
        body["gravity"] = gravity
    t0 = time.perf_counter()
    resp = http.post("/v1/chat/completions", json=body)
    seconds = time.perf_counter() - t0
    resp.raise_for_status()
    out = resp.json()
    return {
        "seconds": seconds,
        "text": out["choices"][0]["message"]["content"],
        "prompt_tokens": out["usage"]["prompt_tokens"],
        "completion_tokens": out["usage"]["completion_tokens"],
        "pipeline": out.get("pipeline"),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    ap.add_argument("--cases", type=int, default=24)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--budget-share", type=float, default=0.6, help="the context level's budget_share")
    ap.add_argument("--arms", default=",".join(ARMS), help="which of full, pruned, pipeline to run")
    args = ap.parse_args(argv)
    arms = tuple(a for a in ARMS if a in args.arms.split(","))

    from narrative_gravity.embeddings import encode

    cases = build_cases(load_news_articles(), n_cases=args.cases, seed=args.seed)
    server, url, model = start_server(args.engine, args.max_tokens)
    rows: dict[str, list[dict[str, Any]]] = {a: [] for a in arms}
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    with httpx.Client(base_url=url, timeout=600, trust_env=False) as http:
        for arm in arms:  # warm-up: one-time costs (MiniLM, the vocabulary table of the semantic field)
            ask(http, model, cases[-1], arm, args.max_tokens, args.budget_share)
        for i, case in enumerate(cases):
            k = i % len(arms)
            for arm in arms[k:] + arms[:k]:
                rows[arm].append(ask(http, model, case, arm, args.max_tokens, args.budget_share))
            print(f"case {i + 1}/{len(cases)}: " + ", ".join(f"{a} {rows[a][-1]['seconds']:.2f}s" for a in arms))
    load_after = Path("/proc/loadavg").read_text().split()[:3]
    server.should_exit = True

    gold = np.asarray(encode([c.gold_text for c in cases]))
    result: dict[str, Any] = {
        "command": "python bench/pipeline_latency.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "engine": args.engine,
        "cases": len(cases),
        "seed": args.seed,
        "max_tokens": args.max_tokens,
        "budget_share": args.budget_share,
        "machine": machine(),
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "arms": {},
    }
    sims, hits, secs = {}, {}, {}
    for arm in arms:
        texts = [r["text"] for r in rows[arm]]
        sims[arm] = [float(x) for x in (np.asarray(encode(texts)) * gold).sum(axis=1)]
        hits[arm] = [float(c.entity.lower() in t.lower()) for c, t in zip(cases, texts)]
        secs[arm] = [r["seconds"] for r in rows[arm]]
        result["arms"][arm] = {
            "median_seconds": statistics.median(secs[arm]),
            "prompt_tokens": statistics.median(r["prompt_tokens"] for r in rows[arm]),
            "completion_tokens": statistics.median(r["completion_tokens"] for r in rows[arm]),
            "similarity": mean_ci(sims[arm]),
            "entity": mean_ci(hits[arm]),
        }
    for arm in (a for a in arms if a != "full" and "full" in arms):
        result["arms"][arm]["vs_full"] = {
            "ratio_of_medians": result["arms"][arm]["median_seconds"] / result["arms"]["full"]["median_seconds"],
            "median_paired_ratio": statistics.median(a / b for a, b in zip(secs[arm], secs["full"])),
            "similarity_diff": mean_ci([a - b for a, b in zip(sims[arm], sims["full"])]),
            "entity_diff": mean_ci([a - b for a, b in zip(hits[arm], hits["full"])]),
        }
    result["examples"] = [
        {"question": c.question, "entity": c.entity, **{a: rows[a][i]["text"] for a in arms}}
        for i, c in enumerate(cases[:3])
    ]
    if "pipeline" in arms:
        result["pipeline_reports"] = [rows["pipeline"][i]["pipeline"] for i in range(min(3, len(cases)))]
    for arm in arms:
        a = result["arms"][arm]
        line = f"{arm:9s} median {a['median_seconds']:.2f}s  prompt {a['prompt_tokens']:.0f} tok  "
        line += f"sim {a['similarity'][0]:.3f}  entity {a['entity'][0]:.2f}"
        if "vs_full" in a:
            v = a["vs_full"]
            line += f"  | ratio {v['ratio_of_medians']:.3f} (paired {v['median_paired_ratio']:.3f})"
            line += f"  sim diff {v['similarity_diff'][0]:+.3f} [{v['similarity_diff'][1]:+.3f}, {v['similarity_diff'][2]:+.3f}]"
            line += f"  entity diff {v['entity_diff'][0]:+.2f} [{v['entity_diff'][1]:+.2f}, {v['entity_diff'][2]:+.2f}]"
        print(line)
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
