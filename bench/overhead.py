"""Per-step cost of narrative gravity against the model's forward pass (SmolLM2-135M, float32, CPU).

Arms (all greedy, same prompts, same number of generated tokens):

- ``plain``: no processor;
- ``gravity``: our processor from ``--profile`` (default ``profiles/binary_search.json``: lexical field, phase
  schedule; ``profiles/topic.yaml`` is the topic default), thermometer off;
- ``gravity+thermo``: the same with the thermometer on (``trace=Trace()``);
- ``article``: the blog-post replica (Python loops, in place);
- ``seq_bias``: transformers' ``SequenceBiasLogitsProcessor`` with the profile's words (single-token forms after a space).

Two measurements, in one run:

(a) end-to-end: ``model.generate(max_new_tokens=N, min_new_tokens=N)``, seconds per generated token. ``--rounds``
    rounds; in every round each (batch size, arm) pair runs once, in an order shuffled per round with a fixed seed,
    so machine noise hits every arm alike. Reported: the median per arm, its ratio to ``plain``'s median, and the
    median of the per-round paired ratios.
(b) direct: each processor called on real logits ``[B, V]`` and input ids ``[B, prompt + step]`` (the steps of one
    generation, cycled), ``--calls`` times, interleaved across arms and timed per call. The median call time is
    divided by the median per-token time of ``plain`` from (a): the processor's share of a decoding step.

A breakdown of our processor's call into its parts (NaN check, field lookup, controller, pull, thermometer) is
printed as well, so an over-budget cost can be traced to an op.

Run (the defaults, 5 rounds of about 1 minute plus warm-up, take an estimated 6 minutes on an idle 2-core
machine; the results in docs/benchmarks.md come from 7 rounds)::

    python bench/overhead.py --rounds 7 --new-tokens 64 --batch-sizes 1 8 --json /tmp/overhead.json

On a shared machine the default torch threads stall in every parallel op while other processes hold the cores;
``--threads 1`` then keeps the timings proportional.
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from common import DEFAULT_PROFILE, PROMPTS, REPO

# product spec: extra share of the per-token decode time (a thermostat profile, such as the topic default,
# solves for λ at every step and has 2%)
BUDGETS = {"gravity": 0.01, "gravity compiled": 0.01, "gravity+thermo": 0.03}
THERMOSTAT_BUDGET = 0.02


@dataclass
class Arm:
    name: str
    description: str
    make: Callable[[], Any]  # a fresh processor (or None for plain decoding)


def build_arms(profile: Any, tok: Any, new_tokens: int, compiled: bool = False) -> list[Arm]:
    from transformers import SequenceBiasLogitsProcessor

    from narrative_gravity.engines.baselines import ArticleGravityLogitsProcessor
    from narrative_gravity.engines.hf import processor_from_profile
    from narrative_gravity.gravity.thermo import Trace
    from narrative_gravity.profiles.build import field_from_profile

    field_from_profile(profile, tok)  # build (and cache) the field once, outside every timing

    def spaced_single(words: list[str]) -> list[int]:
        ids = []
        for w in words:
            enc = tok.encode(" " + w, add_special_tokens=False)
            if len(enc) == 1:
                ids.append(int(enc[0]))
        return ids

    strength = float(profile.gravity_strength)
    bias: dict[tuple[int, ...], float] = {(i,): strength for i in spaced_single(profile.keywords())}
    bias.update({(i,): -strength for i in spaced_single(profile.penalized())})  # penalize wins

    ours = [
        Arm(
            "gravity",
            f"ours: the profile's {profile.field.mode} field, {profile.schedule} schedule; thermometer off; "
            "in place, as ngrav runs it",
            lambda: processor_from_profile(profile, tok, max_new_tokens=new_tokens, inplace=True, compile="off"),
        )
    ]
    if compiled:
        ours.append(
            Arm(
                "gravity compiled",
                "the same, the kernel's state update and step under torch.compile (compile='default')",
                lambda: processor_from_profile(
                    profile, tok, max_new_tokens=new_tokens, inplace=True, compile="default"
                ),
            )
        )
    return [
        Arm("plain", "no processor", lambda: None),
        *ours,
        Arm(
            "gravity+thermo",
            "ours, thermometer on (trace=Trace()), in place",
            lambda: processor_from_profile(profile, tok, max_new_tokens=new_tokens, trace=Trace(), inplace=True),
        ),
        Arm(
            "article",
            "blog-post replica (raw-word lookup, Python loops, in place)",
            lambda: ArticleGravityLogitsProcessor(
                tok,
                profile.core_semantics,
                profile.gravity_strength,
                profile.penalize,
                50 if profile.decay_after_steps is None else profile.decay_after_steps,
            ),
        ),
        Arm(
            "seq_bias",
            f"transformers SequenceBiasLogitsProcessor ({len(bias)} single tokens)",
            lambda: SequenceBiasLogitsProcessor(dict(bias)),
        ),
    ]


def generate(model: Any, tok: Any, enc: Any, proc: Any, new_tokens: int) -> tuple[float, torch.Tensor]:
    """Greedy generation of exactly ``new_tokens`` tokens; returns (seconds per token, output ids)."""
    from transformers import GenerationConfig, LogitsProcessorList

    config = GenerationConfig(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    procs = LogitsProcessorList([proc]) if proc is not None else None
    t0 = time.perf_counter()
    out = model.generate(**enc, generation_config=config, logits_processor=procs)
    elapsed = time.perf_counter() - t0
    produced = out.shape[1] - enc["input_ids"].shape[1]
    if produced != new_tokens:
        raise RuntimeError(f"generated {produced} tokens instead of {new_tokens}")
    return elapsed / new_tokens, out


def encode(tok: Any, batch: int) -> Any:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    return tok(prompts, return_tensors="pt", padding=True)


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def quartiles(xs: list[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def end_to_end(
    model: Any, tok: Any, arms: list[Arm], batch_sizes: list[int], rounds: int, new_tokens: int, seed: int, log: Any
) -> tuple[dict[int, dict[str, list[float]]], dict[int, torch.Tensor]]:
    """Per (batch, arm): seconds per generated token in each round. Also the plain output ids per batch."""
    encs = {b: encode(tok, b) for b in batch_sizes}
    outputs: dict[int, torch.Tensor] = {}
    # warm-up: one short untimed run per (batch, arm); one full plain run per batch for the direct inputs
    for b in batch_sizes:
        for arm in arms:
            t0 = time.perf_counter()
            generate(model, tok, encs[b], arm.make(), min(8, new_tokens))
            if arm.name == "gravity compiled":
                log(f"batch {b}: the compiled arm's first generation took {time.perf_counter() - t0:.1f} s (compiles)")
        _, outputs[b] = generate(model, tok, encs[b], None, new_tokens)
        log(f"batch {b}: warm-up done")
    times: dict[int, dict[str, list[float]]] = {b: {a.name: [] for a in arms} for b in batch_sizes}
    rng = random.Random(seed)
    pairs = [(b, a) for b in batch_sizes for a in arms]
    for r in range(rounds):
        order = pairs[:]
        rng.shuffle(order)
        t0 = time.perf_counter()
        for b, arm in order:
            per_tok, _ = generate(model, tok, encs[b], arm.make(), new_tokens)
            times[b][arm.name].append(per_tok)
        log(f"round {r + 1}/{rounds} done in {time.perf_counter() - t0:.1f} s")
    return times, outputs


def direct(
    model: Any,
    tok: Any,
    arms: list[Arm],
    batch: int,
    output_ids: torch.Tensor,
    prompt_len: int,
    new_tokens: int,
    calls: int,
    seed: int,
) -> dict[str, list[float]]:
    """Seconds per processor call, each arm called ``calls`` times on real logits, interleaved."""
    enc = encode(tok, batch)
    with torch.no_grad():
        logits = model(**enc).logits[:, -1, :].float().contiguous()
    steps = [output_ids[:, : prompt_len + s].contiguous() for s in range(new_tokens)]
    procs = {a.name: a.make() for a in arms if a.name != "plain"}
    scores = {name: logits.clone() for name in procs}  # processors that pull in place: one copy per arm
    names = list(procs)
    rng = random.Random(seed)
    out: dict[str, list[float]] = {n: [] for n in names}
    with torch.no_grad():
        for c in range(min(16, calls)):  # warm-up
            for n in names:
                procs[n](steps[c % new_tokens], scores[n])
        # restart every generation at step 0, then step through; the processors see a realistic id sequence
        for c in range(calls):
            ids = steps[c % new_tokens]
            rng.shuffle(names)
            for n in names:
                scores[n].copy_(logits)  # every call sees the model's logits (untimed)
                t0 = time.perf_counter()
                procs[n](ids, scores[n])
                out[n].append(time.perf_counter() - t0)
    return out


def breakdown(
    tok: Any, profile: Any, batch: int, output_ids: torch.Tensor, prompt_len: int, new_tokens: int, calls: int
) -> dict[str, float]:
    """Median seconds of each part of our processor's call (the same calls, in the same order, as engines/hf.py):
    the kernel's ``advance`` (history, said-set, stages) and its ``apply`` (field, schedule, tilt), the NaN
    check (from the thermostat's softmax where it ran, else one sum per row), and ``apply`` with the
    thermometer on."""
    from narrative_gravity.engines.hf import processor_from_profile

    proc = processor_from_profile(profile, tok, max_new_tokens=new_tokens)
    vocab = len(tok)
    torch.manual_seed(0)
    scores = torch.randn(batch, vocab) * 3
    proc(output_ids[:, :prompt_len].contiguous(), scores)  # the kernel's rows start on the prompts
    kernel = proc.kernel
    names = ("nan check", "kernel.advance", "kernel.apply", "kernel.apply + thermometer")
    parts: dict[str, list[float]] = {k: [] for k in names}

    def timed(name: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        r = fn()
        parts[name].append(time.perf_counter() - t0)
        return r

    with torch.no_grad():
        for c in range(calls + 16):
            token = output_ids[:, prompt_len + c % new_tokens]
            timed("kernel.advance", lambda token=token: kernel.advance(token))
            _, result = timed("kernel.apply", lambda: kernel.apply(scores))
            timed(
                "nan check",
                lambda result=result, c=c: proc._check_nan(
                    scores, prompt_len + c, result.finite, proc._nan_every(scores)
                ),
            )
            timed("kernel.apply + thermometer", lambda: kernel.apply(scores, measure_step=True))
    return {k: median(v[16:]) for k, v in parts.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="end-to-end rounds, arms interleaved in each (about 1 min each on 2 cores)",
    )
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens generated per run (min = max)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--calls", type=int, default=200, help="direct measurement: calls per processor")
    ap.add_argument("--profile", type=Path, default=DEFAULT_PROFILE)
    ap.add_argument("--model", default=None, help="model name or path (default: SmolLM2-135M)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="write the results as JSON here")
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: leave torch's default). On a shared, loaded machine the default "
        "threads stall in every parallel op; 1 thread keeps the timings proportional",
    )
    ap.add_argument(
        "--compiled",
        action="store_true",
        help="add the arm `gravity compiled`: the kernel under torch.compile (its first call compiles)",
    )
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.new_tokens < 1 or args.calls < 1 or any(b < 1 for b in args.batch_sizes):
        ap.error("--rounds, --new-tokens, --calls and --batch-sizes must be positive")

    if args.threads is not None:
        if args.threads < 1:
            ap.error("--threads must be positive")
        torch.set_num_threads(args.threads)

    import transformers

    from narrative_gravity.models import load_model
    from narrative_gravity.profiles.schema import load_profile

    console = Console(width=max(Console().width, 150))

    def log(msg: str) -> None:
        console.print(f"[dim]{time.strftime('%H:%M:%S')} {msg}[/dim]")

    started = time.perf_counter()
    load_start = os.getloadavg()[0]
    model, tok = load_model(args.model, dtype=torch.float32)
    profile = load_profile(args.profile)
    arms = build_arms(profile, tok, args.new_tokens, compiled=args.compiled)
    log(
        f"model loaded; torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f}"
    )

    times, outputs = end_to_end(model, tok, arms, args.batch_sizes, args.rounds, args.new_tokens, args.seed, log)
    results: dict[str, Any] = {}
    for b in args.batch_sizes:
        prompt_len = encode(tok, b)["input_ids"].shape[1]
        calls = direct(model, tok, arms, b, outputs[b], prompt_len, args.new_tokens, args.calls, args.seed)
        parts = breakdown(tok, profile, b, outputs[b], prompt_len, args.new_tokens, args.calls)
        log(f"batch {b}: direct measurement done")
        plain = times[b]["plain"]
        plain_med = median(plain)
        rows = {}
        for arm in arms:
            ts = times[b][arm.name]
            paired = [t / p for t, p in zip(ts, plain)]
            row: dict[str, Any] = {
                "description": arm.description,
                "per_token_s": ts,
                "per_token_median_s": median(ts),
                "per_token_iqr_s": quartiles(ts),
                "ratio_to_plain": median(ts) / plain_med,
                "paired_ratio_median": median(paired),
            }
            if arm.name in calls:
                cs = calls[arm.name]
                row |= {
                    "call_median_s": median(cs),
                    "call_iqr_s": quartiles(cs),
                    "call_share_of_plain_token": median(cs) / plain_med,
                }
                budget = BUDGETS.get(arm.name)
                if arm.name in ("gravity", "gravity compiled") and profile.schedule == "thermostat":
                    budget = THERMOSTAT_BUDGET
                if budget is not None:
                    row["budget_share"] = budget
                    row["within_budget"] = median(cs) / plain_med <= budget
            rows[arm.name] = row
        results[str(b)] = {"prompt_tokens": prompt_len, "arms": rows, "gravity_breakdown_s": parts}

    meta = {
        "command": "python "
        + " ".join([os.path.relpath(__file__, REPO), *(argv if argv is not None else sys.argv[1:])]),
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()})",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "threads_default": args.threads is None,
        "model": args.model or "SmolLM2-135M-Instruct (float32, CPU)",
        "profile": os.path.relpath(args.profile, REPO),
        "rounds": args.rounds,
        "new_tokens": args.new_tokens,
        "calls": args.calls,
        "seed": args.seed,
        "wall_s": time.perf_counter() - started,
        "load_average_start": load_start,
        "load_average_end": os.getloadavg()[0],
    }
    report(console, meta, results)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n", encoding="utf-8")
        log(f"wrote {args.json}")
    return 0


def report(console: Console, meta: dict[str, Any], results: dict[str, Any]) -> None:
    console.print(
        f"\n[bold]Gravity overhead[/bold]: {meta['model']}, torch {meta['torch']}, {meta['threads']} threads, "
        f"{meta['rounds']} rounds × {meta['new_tokens']} tokens, {meta['calls']} direct calls, "
        f"run took {meta['wall_s']:.0f} s; load average {meta['load_average_start']:.2f} at start, "
        f"{meta['load_average_end']:.2f} at end"
    )
    for b, res in results.items():
        arms = res["arms"]
        plain_ms = arms["plain"]["per_token_median_s"] * 1e3
        t = Table(title=f"batch {b} (prompt {res['prompt_tokens']} tokens; plain {plain_ms:.2f} ms/token)")
        t.add_column("arm")
        t.add_column("(a) ms/token\nmedian [IQR]", justify="right")
        t.add_column("(a) ratio\nto plain", justify="right")
        t.add_column("(a) paired\nratio", justify="right")
        t.add_column("(b) µs/call\nmedian [IQR]", justify="right")
        t.add_column("(b) share of\nplain token", justify="right")
        t.add_column("budget", justify="right")
        for name, row in arms.items():
            lo, hi = row["per_token_iqr_s"]
            e2e = f"{row['per_token_median_s'] * 1e3:.2f} [{lo * 1e3:.2f}-{hi * 1e3:.2f}]"
            if "call_median_s" in row:
                clo, chi = row["call_iqr_s"]
                call = f"{row['call_median_s'] * 1e6:.0f} [{clo * 1e6:.0f}-{chi * 1e6:.0f}]"
                share = f"{row['call_share_of_plain_token'] * 100:.2f}%"
            else:
                call = share = "-"
            if "budget_share" in row:
                ok = "[green]ok[/green]" if row["within_budget"] else "[red]over[/red]"
                budget = f"≤{row['budget_share'] * 100:.0f}% {ok}"
            else:
                budget = ""
            t.add_row(
                name, e2e, f"{row['ratio_to_plain']:.3f}", f"{row['paired_ratio_median']:.3f}", call, share, budget
            )
        console.print(t)
        bt = Table(title=f"batch {b}: our processor's call, by part (median µs; thermo only with the thermometer on)")
        bt.add_column("part")
        bt.add_column("µs", justify="right")
        bt.add_column("share of plain token", justify="right")
        for part, s in res["gravity_breakdown_s"].items():
            bt.add_row(part, f"{s * 1e6:.0f}", f"{s / arms['plain']['per_token_median_s'] * 100:.3f}%")
        console.print(bt)


if __name__ == "__main__":
    raise SystemExit(main())
