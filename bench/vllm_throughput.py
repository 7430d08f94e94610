"""Throughput of vLLM with narrative gravity on every row against none, on the default model (SmolLM2-135M).

One engine, one process, with :class:`~narrative_gravity.engines.vllm.NarrativeGravityVLLMLogitsProcessor`
loaded. Arms, for each concurrency ``C`` (``C`` requests submitted together, all greedy, each forced to
generate exactly ``--new-tokens`` tokens):

- ``none``: no request carries a profile (the processor returns at once);
- ``gravity``: every request carries ``--profile`` in ``SamplingParams.extra_args["gravity"]``.

``--rounds`` rounds; in each round every (concurrency, arm) pair runs once, in an order shuffled per round
with a fixed seed, so machine noise hits both arms alike. Reported per pair: the median generated tokens
per second, and per concurrency the ratio gravity/none of the medians and the median of the per-round
paired ratios.

``--micro`` also times the processor's step alone (each row's newest token read and advanced, then
``apply()``) on synthetic logits ``[B, V]``, with half the rows pulled (``half``) and every row (``full``).

Run (vLLM lives in its own venv: ``bash scripts/setup_vllm.sh``)::

    VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python bench/vllm_throughput.py \\
        --concurrency 1 8 32 --new-tokens 128 --rounds 5 --micro --kv-cache-mb 1024 --json bench/results/vllm_throughput.json

A quick smoke run::

    VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python bench/vllm_throughput.py \\
        --concurrency 1 8 32 --new-tokens 4 --rounds 1 --micro --micro-calls 10 --threads 1 --kv-cache-mb 256
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from common import DEFAULT_PROFILE, PROMPTS

FQCN = "narrative_gravity.engines.vllm:NarrativeGravityVLLMLogitsProcessor"
ARMS = ("none", "gravity")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None, help="model name or folder (default: smollm2, de-quantized and cached)")
    ap.add_argument("--profile", default=str(DEFAULT_PROFILE), help="profile file (JSON/YAML) for the gravity arm")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32], help="requests submitted together")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens generated per request (exactly)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved repetitions")
    ap.add_argument("--seed", type=int, default=0, help="seed of the per-round arm order")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--dtype", default="float32", help="vLLM dtype (float32 on CPU; bfloat16 on GPUs)")
    ap.add_argument("--kv-cache-mb", type=int, default=None, help="KV cache size (default: vLLM's own choice)")
    ap.add_argument("--compile", action="store_true", help="let vLLM compile (default: enforce_eager)")
    ap.add_argument(
        "--micro", action="store_true", help="also time the processor's step alone (half or all rows pulled)"
    )
    ap.add_argument("--micro-batch", type=int, nargs="+", default=[8, 32], help="batch sizes for --micro")
    ap.add_argument("--micro-calls", type=int, default=50, help="timed steps per batch size and share")
    ap.add_argument("--micro-device", default="cpu", help="device of the synthetic logits (cpu, cuda)")
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch.set_num_threads before anything starts (CPU; default: vLLM's choice); on a busy machine 1 "
        "avoids OpenMP stalls",
    )
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args(argv)
    if min(args.concurrency) < 1 or args.new_tokens < 1 or args.rounds < 1:
        ap.error("--concurrency, --new-tokens and --rounds must be positive")
    return args


def build_engine(args: argparse.Namespace) -> Any:
    from vllm import LLM

    from narrative_gravity import models

    folder = models.hf_folder(args.model)
    extra: dict[str, Any] = {}
    if args.kv_cache_mb is not None:
        extra["kv_cache_memory_bytes"] = args.kv_cache_mb * 2**20
    return LLM(
        model=str(folder),
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=max(max(args.concurrency), max(args.micro_batch)),
        enforce_eager=not args.compile,
        seed=0,
        logits_processors=[FQCN],  # also loaded through the entry point when installed; one copy pulls
        **extra,
    )


def run_once(llm: Any, n: int, new_tokens: int, gravity: dict[str, Any] | None) -> tuple[float, int]:
    from vllm import SamplingParams

    params = SamplingParams(
        temperature=0.0,
        max_tokens=new_tokens,
        min_tokens=new_tokens,
        ignore_eos=True,
        extra_args=None if gravity is None else {"gravity": gravity},
    )
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt_s = time.perf_counter() - t0
    return dt_s, sum(len(o.outputs[0].token_ids) for o in outs)


def throughput(llm: Any, args: argparse.Namespace, profile: dict[str, Any]) -> dict[str, Any]:
    pairs = [(c, arm) for c in args.concurrency for arm in ARMS]
    for c, arm in pairs:  # warm-up: shapes, the field, the per-width tables
        run_once(llm, c, min(args.new_tokens, 4), profile if arm == "gravity" else None)
    rng = random.Random(args.seed)
    tps: dict[tuple[int, str], list[float]] = {p: [] for p in pairs}
    for r in range(args.rounds):
        order = pairs[:]
        rng.shuffle(order)
        for c, arm in order:
            secs, toks = run_once(llm, c, args.new_tokens, profile if arm == "gravity" else None)
            tps[(c, arm)].append(toks / secs)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    out: dict[str, Any] = {}
    for c in args.concurrency:
        none, grav = tps[(c, "none")], tps[(c, "gravity")]
        out[str(c)] = {
            "none_tok_s": none,
            "gravity_tok_s": grav,
            "none_median": statistics.median(none),
            "gravity_median": statistics.median(grav),
            "ratio_of_medians": statistics.median(grav) / statistics.median(none),
            "median_paired_ratio": statistics.median(g / n for g, n in zip(grav, none)),
        }
    return out


def micro(args: argparse.Namespace, profile: dict[str, Any]) -> dict[str, Any]:
    """The processor's step alone on synthetic logits: its cost per decoding step, half or all rows pulled."""
    from types import SimpleNamespace

    import torch
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate

    from narrative_gravity import models
    from narrative_gravity.engines.vllm import NarrativeGravityVLLMLogitsProcessor

    tok = models.load_tokenizer(args.model)
    v = len(tok)
    device = torch.device(args.micro_device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    prompt = tok(PROMPTS[0])["input_ids"]
    results: dict[str, Any] = {}
    for b in args.micro_batch:
        for name, share in (("half", 0.5), ("full", 1.0)):
            cfg = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=b))
            proc = NarrativeGravityVLLMLogitsProcessor(cfg, device, False, tokenizer=tok)
            n_grav = max(1, round(b * share))
            outs: list[list[int]] = [[] for _ in range(b)]
            added = [
                (
                    i,
                    SamplingParams(max_tokens=10**6, extra_args={"gravity": profile} if i < n_grav else None),
                    prompt,
                    outs[i],
                )
                for i in range(b)
            ]
            proc.update_state(BatchUpdate(batch_size=b, removed=[], added=added, moved=[]))
            logits = torch.randn(b, v, device=device)
            gen = torch.Generator().manual_seed(0)
            times = []
            for call in range(3 + args.micro_calls):
                for out in outs:  # each row generated one token since the last step, as in an engine
                    out.append(int(torch.randint(0, v, (1,), generator=gen)))
                x = logits.clone()
                sync()
                t0 = time.perf_counter()
                proc.apply(x)
                sync()
                if call >= 3:
                    times.append(time.perf_counter() - t0)
            results[f"B={b} {name}"] = {"gravity_rows": n_grav, "median_us": 1e6 * statistics.median(times)}
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    from narrative_gravity.profiles.schema import load_profile

    profile = load_profile(args.profile).model_dump(mode="json", exclude_none=True)
    # Before the engine: vLLM's CPU worker pins its threads, and --micro measures the processor alone.
    micro_results = micro(args, profile) if args.micro else None
    t0 = time.perf_counter()
    llm = build_engine(args)
    startup = time.perf_counter() - t0
    results = throughput(llm, args, profile)
    report: dict[str, Any] = {
        "when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"python": platform.python_version(), "cpu_count": os.cpu_count(), "platform": platform.platform()},
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "engine_startup_s": startup,
        "throughput": results,
    }
    print(f"\nengine start-up {startup:.1f} s; {args.new_tokens} new tokens per request, {args.rounds} rounds")
    print(f"{'concurrency':>11} {'none tok/s':>11} {'gravity tok/s':>14} {'ratio':>7} {'paired':>7}")
    for c, r in results.items():
        print(
            f"{c:>11} {r['none_median']:>11.1f} {r['gravity_median']:>14.1f} "
            f"{r['ratio_of_medians']:>7.3f} {r['median_paired_ratio']:>7.3f}"
        )
    if micro_results is not None:
        report["micro_apply"] = micro_results
        print("\napply() alone (synthetic logits):")
        for k, r in report["micro_apply"].items():
            print(f"  {k:<14} gravity rows {r['gravity_rows']:>3}: {r['median_us']:>9.1f} µs")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
