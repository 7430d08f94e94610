"""Gravity on a CUDA GPU: how often a step waits on the device, and what gravity costs next to the forward pass.

The steering kernel is meant to run on the device that holds the logits, with no per-step host syncs. This
script checks that on a real GPU, in two steps:

1. ``prepare`` (here, on the CPU): builds the programs (the field and its tables) of four profiles on the
   default model's tokenizer (the topic default, the same with required words, a staged plan with pruning, and
   a phase schedule), and saves them with the tokenizer and the model's config into a kit folder. No model hub
   is needed on the GPU machine, and the semantic field needs no embedding model there.
2. ``run`` (on the GPU machine): for each profile,

   - **syncs**: the transformers processor, then the kernel as vLLM drives it (rows at different steps, rows
     leaving and joining), called for ``--steps`` steps on CUDA logits under
     ``torch.cuda.set_sync_debug_mode("warn")``. Every synchronizing call is counted with the line that made it.
     The processor reads its NaN flag back once every 16 steps by design (``nan_check_every``); nothing else
     should wait.
   - **cost**: ``model.generate`` of a model with SmolLM2-135M's shape and random weights (bfloat16), plain
     against gravity (thermometer off, and on), ``--new-tokens`` tokens for each batch size, rounds interleaved,
     median seconds per token and its ratio to plain. The processor alone, timed with CUDA events on the same
     logits, against the forward pass.

Run::

    python bench/gpu_check.py prepare --kit .gpukit
    # on the GPU machine, from the repository's root: every check in one go (the script prepare wrote)
    bash .gpukit/run_on_gpu.sh
    # or one check, with the repository's src on PYTHONPATH:
    python bench/gpu_check.py run --kit .gpukit --json gpu_check.json
    # on any machine: the operations (GPU kernel launches) of one step, by source line
    python bench/gpu_check.py ops --kit .gpukit --profile "topic default" --batch 8 --as-accelerator
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]

# Profiles of the kit: (name, profile mapping). The topic default's words stand in for any topic.
TOPIC = ["planet", "orbit", "galaxy", "telescope", "astronaut", "rocket"]


def _profiles() -> dict[str, dict[str, Any]]:
    import yaml

    topic = yaml.safe_load((REPO / "profiles" / "topic.yaml").read_text())
    space = yaml.safe_load((REPO / "profiles" / "space.yaml").read_text())
    return {
        "topic default": topic,
        "topic + required words": {**topic, "name": "require", "require": {"words": ["harbour", "lantern"]}},
        "stages + pruning": {
            "name": "staged",
            "core_semantics": TOPIC,
            "stages": [
                {"core_semantics": ["rocket", "launch", "engine"], "share": 0.3},
                {"core_semantics": ["orbit", "planet", "moon"], "share": 0.4},
                {"core_semantics": ["telescope", "galaxy", "star"], "share": 0.3},
            ],
            "prune_threshold": -0.5,
            "penalize": ["recipe", "restaurant"],
        },
        "phases (space.yaml)": space,
    }


def prepare(kit: Path) -> None:
    """Build the programs and save them with the tokenizer and the model config under ``kit``."""
    from narrative_gravity.models import hf_folder, load_tokenizer
    from narrative_gravity.profiles.build import controller_from_profile, program_from_profile
    from narrative_gravity.profiles.schema import Profile

    kit.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer()
    tok.save_pretrained(kit / "tokenizer")
    (kit / "config.json").write_text((hf_folder() / "config.json").read_text())
    programs = {}
    for name, raw in _profiles().items():
        profile = Profile.model_validate(raw)
        program = program_from_profile(profile, tok)
        programs[name] = {"program": program, "controller": controller_from_profile(profile)}
        print(f"built {name}: vocab {program.fields[0].vocab_size}, stages {program.stages is not None}")
    torch.save(programs, kit / "programs.pt")
    script = kit / "run_on_gpu.sh"
    where = kit.resolve()
    script.write_text(RUN_ON_GPU.format(kit=where.relative_to(REPO) if where.is_relative_to(REPO) else where))
    script.chmod(0o755)
    print(f"kit written to {kit}; on the GPU machine, from the repository's root: bash {script}")


RUN_ON_GPU = """#!/usr/bin/env bash
# Every check of bench/gpu_check.py in one go, on a CUDA machine, from the repository's root (written by
# `python bench/gpu_check.py prepare`). Results land in $OUT (or ./gpu-out): gpu_check.json and the whole log.
set -euo pipefail
OUT="${{OUT:-gpu-out}}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${{PYTHONPATH:+:$PYTHONPATH}}"
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
{{
  for profile in "topic default" "topic + required words"; do
    python3 bench/gpu_check.py ops --kit {kit} --profile "$profile" --batch 8 --device cuda
    python3 bench/gpu_check.py ops --kit {kit} --profile "$profile" --batch 8 --device cuda --compiled
  done
  python3 bench/gpu_check.py run --kit {kit} --json "$OUT/gpu_check.json"
}} 2>&1 | tee "$OUT/gpu_check.log"
"""


def _library_frame() -> traceback.FrameSummary | None:
    """The innermost frame of narrative_gravity on the stack (``None`` when the library is not on it)."""
    frames = [f for f in traceback.extract_stack() if "narrative_gravity" in f.filename]
    return frames[-1] if frames else None


class SyncCounter:
    """Counts the CUDA synchronizations that torch reports under ``set_sync_debug_mode("warn")``, by the line
    of this project that made them."""

    def __init__(self) -> None:
        self.count = 0
        self.where: collections.Counter[str] = collections.Counter()

    def __enter__(self) -> SyncCounter:
        self._old = warnings.showwarning
        warnings.simplefilter("always")
        warnings.showwarning = self._show  # type: ignore[assignment]
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def _show(self, message: Any, category: Any, filename: str, lineno: int, *args: Any) -> None:
        if "synchroniz" not in str(message):
            self._old(message, category, filename, lineno, *args)
            return
        frame = _library_frame()
        if frame is None:  # this script's own set-up (torch reports switching the mode on, say): not gravity's
            return
        self.count += 1
        self.where[f"{Path(frame.filename).name}:{frame.lineno} {frame.line}"] += 1

    def __exit__(self, *exc: Any) -> None:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = self._old  # type: ignore[assignment]


class OpCounter(TorchDispatchMode):
    """Counts the tensor operations the library issues (a kernel launch each on a GPU) by source line; views,
    which launch nothing, apart."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.views = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            self.views += 1
            return out
        frame = _library_frame()
        if frame is not None:  # this script's own operations (the next token) do not count
            self.ops[f"{frame.filename.split('narrative_gravity/')[-1]}:{frame.lineno} {frame.name}"] += 1
        return out


def _processor(entry: dict[str, Any], budget: int, *, trace: bool = False) -> Any:
    from narrative_gravity.engines.hf import NarrativeGravityLogitsProcessor
    from narrative_gravity.gravity.thermo import Trace

    p = entry["program"]
    return NarrativeGravityLogitsProcessor(
        p, entry["controller"], max_new_tokens=budget, trace=Trace() if trace else None, inplace=True
    )


class VLLMRows:
    """The kernel as the vLLM adapter drives it: rows by a device index (with its host copy), each step's newest
    tokens advanced with the step (``advance_apply``; ``new`` is false on a row's first step), and
    :meth:`leave_and_join`: one request leaves and a new one joins in another slot."""

    def __init__(self, entry: dict[str, Any], vocab: int, batch: int, budget: int, dev: Any, measure: bool) -> None:
        from narrative_gravity.gravity.kernel import GravityKernel

        self.entry, self.vocab, self.batch, self.dev, self.measure = entry, vocab, batch, torch.device(dev), measure
        self.kernel = GravityKernel(batch + 1, self.dev)
        for r in range(batch):
            self.kernel.add(
                r, entry["program"], budget=budget, prompt=list(range(r, r + 16)), schedule=self._schedule()
            )
        self.rows_np = np.arange(batch)
        self.rows = torch.as_tensor(self.rows_np).to(self.dev, non_blocking=True)
        self.tokens = torch.zeros(batch, dtype=torch.long, device=self.dev)
        self.new = torch.zeros(batch, dtype=torch.bool, device=self.dev)  # the first step: nothing to advance
        self.gen = torch.Generator(device=self.dev).manual_seed(0)

    def _schedule(self) -> Any:
        return self.entry["controller"].schedule(1)[0]

    def step(self) -> None:
        logits = torch.randn(self.batch, self.vocab, device=self.dev, generator=self.gen) * 3
        out, _ = self.kernel.advance_apply(
            self.tokens, logits, self.rows, self.rows_np, new=self.new, measure_step=self.measure
        )
        self.tokens = out.argmax(-1)
        self.new = torch.ones_like(self.new)

    def leave_and_join(self) -> None:
        self.kernel.remove(0)
        self.kernel.add(self.batch, self.entry["program"], budget=64, prompt=[1, 2, 3], schedule=self._schedule())
        self.rows_np = np.array([self.batch, *range(1, self.batch)])
        self.rows = torch.as_tensor(self.rows_np).to(self.dev, non_blocking=True)
        self.new = torch.ones_like(self.new)
        self.new[0] = False  # a fill on the device: the joining row has nothing to advance yet


def sync_check(entry: dict[str, Any], vocab: int, steps: int, batch: int, dev: torch.device) -> dict[str, Any]:
    """Syncs per step of the processor (transformers) and of the kernel driven as vLLM drives it."""
    gen = torch.Generator(device=dev).manual_seed(0)
    out: dict[str, Any] = {}
    for trace in (False, True):
        proc = _processor(entry, steps + 8, trace=trace)
        ids = torch.randint(0, vocab, (batch, 24), device=dev, generator=gen)

        def step(ids: torch.Tensor, proc: Any = proc) -> torch.Tensor:
            scores = proc(ids, torch.randn(batch, vocab, device=dev, generator=gen) * 3)
            return torch.cat([ids, scores.argmax(-1, keepdim=True)], dim=1)

        for _ in range(4):  # the first steps build and upload tables: not counted
            ids = step(ids)
        torch.cuda.synchronize()
        with SyncCounter() as counter:
            for _ in range(steps):
                ids = step(ids)
        out["processor" + (" + trace" if trace else "")] = {
            "syncs": counter.count,
            "per_step": counter.count / steps,
            "where": dict(counter.where),
        }

    # the kernel as the vLLM adapter drives it: rows indexed by a device tensor (with its host copy), one row
    # leaving and a new one joining half-way
    driver = VLLMRows(entry, vocab, batch, steps + 8, dev, measure=True)
    for _ in range(3):
        driver.step()
    torch.cuda.synchronize()
    with SyncCounter() as counter:
        for step in range(steps):
            if step == steps // 2:
                driver.leave_and_join()
            driver.step()
    out["kernel (vLLM rows)"] = {
        "syncs": counter.count,
        "per_step": counter.count / steps,
        "where": dict(counter.where),
        "note": "the join half-way uploads the new row's state once",
    }
    return out


def _median_ms(fn: Any, n: int) -> float:
    times = []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def cost(
    model: Any, entry: dict[str, Any], vocab: int, batches: list[int], new_tokens: int, rounds: int, dev: torch.device
) -> dict[str, Any]:
    """``model.generate`` seconds per token: plain, gravity, gravity + thermometer; and the processor alone."""
    out: dict[str, Any] = {}
    for b in batches:
        out[f"batch {b}"] = row = _cost_at(model, entry, vocab, b, new_tokens, rounds, dev)
        print(f"  batch {b}: {json.dumps(row)}", flush=True)
    return out


def _cost_at(
    model: Any, entry: dict[str, Any], vocab: int, b: int, new_tokens: int, rounds: int, dev: torch.device
) -> dict[str, Any]:
    from transformers import LogitsProcessorList

    ids = torch.randint(0, vocab, (b, 32), device=dev, generator=torch.Generator(device=dev).manual_seed(b))
    arms = {
        "plain": lambda: None,
        "gravity": lambda: _processor(entry, new_tokens),
        "gravity+thermo": lambda: _processor(entry, new_tokens, trace=True),
    }
    times: dict[str, list[float]] = {a: [] for a in arms}

    def one(make: Any) -> float:
        proc = make()
        kw = {"logits_processor": LogitsProcessorList([proc])} if proc is not None else {}
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            **kw,
        )
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / new_tokens

    for make in arms.values():  # warm-up
        one(make)
    for r in range(rounds):
        order = list(arms) if r % 2 == 0 else list(reversed(arms))
        for a in order:
            times[a].append(one(arms[a]))
    plain = statistics.median(times["plain"])
    row: dict[str, Any] = {"plain_ms_per_token": plain * 1e3}
    for a in ("gravity", "gravity+thermo"):
        med = statistics.median(times[a])
        paired = statistics.median(x / y for x, y in zip(times[a], times["plain"], strict=True))
        row[a] = {"ms_per_token": med * 1e3, "ratio": med / plain, "paired_ratio": paired}

    # the processor alone on real-shaped logits (the clone that generate makes subtracted), against a step
    proc = _processor(entry, new_tokens + 64)
    scores = torch.randn(b, vocab, device=dev)
    proc(ids, scores.clone())
    state = {"ids": torch.cat([ids, ids[:, :1]], dim=1)}

    def call() -> None:
        proc(state["ids"], scores.clone())
        state["ids"] = torch.cat([state["ids"], state["ids"][:, -1:]], dim=1)

    proc_ms = _median_ms(call, 50) - _median_ms(scores.clone, 50)
    row["processor_call_ms"] = proc_ms
    row["processor_share_of_step"] = proc_ms / (plain * 1e3)
    return row


class CompiledCalls:
    """Wraps one of the kernel's compiled functions: counts its calls and the inductor kernels it generated,
    and runs it outside any dispatch mode (torch.compile refuses to run under one), so that :class:`OpCounter`
    sees only the eager operations around it."""

    def __init__(self, fn: Any, name: str) -> None:
        self.fn, self.name, self.calls, self.kernels = fn, name, 0, 0

    def __call__(self, *args: Any) -> Any:
        import torch._inductor.metrics as inductor
        from torch.utils._python_dispatch import _disable_current_modes

        self.calls += 1
        before = inductor.generated_kernel_count
        with _disable_current_modes():
            out = self.fn(*args)
        self.kernels = max(self.kernels, inductor.generated_kernel_count - before)  # the call that compiled
        return out


def _count_compiled_calls() -> list[CompiledCalls]:
    """Wrap the kernel's compiled functions (the step; the state update and the step) as they are made."""
    import narrative_gravity.gravity.kernel as kernel

    wrapped: list[CompiledCalls] = []
    for name in ("compiled_step", "compiled_advance_step"):
        make = getattr(kernel, name)

        def patched(mode: str = "default", make: Any = make, name: str = name) -> CompiledCalls:
            mine = [w for w in wrapped if w.name == name]
            if not mine:
                mine = [CompiledCalls(make(mode), name)]
                wrapped.extend(mine)
            return mine[0]

        setattr(kernel, name, patched)
    return wrapped


def count_ops(
    kit: Path,
    name: str,
    batch: int,
    steps: int,
    as_accelerator: bool,
    lines: int,
    compiled: bool = False,
    device: str = "cpu",
    vllm: bool = False,
) -> dict[str, Any]:
    """The tensor operations one processor step issues (each one a kernel launch on a GPU), by source line.

    Views (slices, reshapes) launch nothing and are counted apart. ``as_accelerator`` applies the choices the
    code makes off the CPU (the solver's λ per level, one softmax block), so the count on a CPU is the GPU's.
    ``compiled``: the step under ``torch.compile`` (the kernel's ``compile="default"``); launches are the eager
    operations around it plus the kernels inductor generated for it (``torch._inductor.metrics``) per call. On a
    CPU those are inductor's C++ kernels, which fuse as its GPU kernels do but not always alike: a proxy there;
    ``device="cuda"`` counts its Triton kernels. ``vllm``: the kernel as vLLM's adapter drives it
    (:class:`VLLMRows`) instead of the transformers processor, one row leaving and one joining half-way through
    the counted steps.
    """
    import os

    import narrative_gravity.gravity.kernel as kernel
    import narrative_gravity.gravity.solve as schedule
    import narrative_gravity.gravity.thermo as thermo

    if compiled:
        import torch._inductor.config as inductor_config

        os.environ["NARRATIVE_GRAVITY_COMPILE"] = "default"
        # kernels loaded from inductor's on-disk cache are not counted as generated: compile everything afresh
        inductor_config.force_disable_caches = True

    programs = torch.load(kit / "programs.pt", weights_only=False)
    if name not in programs:
        sys.exit(f"no profile {name!r} in the kit; it has: {', '.join(programs)}")
    if as_accelerator:
        grid_bits, compiled_bits = schedule.grid_bits, kernel.compiled_bits
        schedule.grid_bits = lambda r, k, device: grid_bits(r, k, "cuda")  # type: ignore[assignment]
        thermo.block_rows = lambda logits: max(logits.shape[0], 1)  # type: ignore[assignment]
        kernel.compiled_bits = lambda device: compiled_bits("cuda")  # type: ignore[assignment]
    vocab = programs[name]["program"].fields[0].vocab_size
    proc = _processor(programs[name], 4 * steps + 64)
    if as_accelerator:  # the NaN flag as off the CPU: kept on the device, read back once every 16 steps
        proc.nan_check_every = 16
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, 24), generator=gen).to(device)
    scores = [(torch.randn(batch, vocab, generator=gen) * 3).to(device) for _ in range(2 * steps)]

    def step(ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = proc(ids, scores.clone())
        return torch.cat([ids, out.argmax(-1, keepdim=True)], dim=1)

    wrapped = _count_compiled_calls() if compiled else []
    driver = VLLMRows(programs[name], vocab, batch, 4 * steps + 64, device, measure=False) if vllm else None
    start = time.perf_counter()
    for scores_i in scores[:steps]:  # warm-up: tables are built and uploaded once (and the step compiled)
        if driver is None:
            ids = step(ids, scores_i)
        else:
            driver.step()
    if driver is not None:  # the join's step compiles nothing new: warm it up too, then start again
        driver.leave_and_join()
        driver.step()
        driver = VLLMRows(programs[name], vocab, batch, 4 * steps + 64, device, measure=False)
        driver.step()
    for w in wrapped:
        print(f"{w.name}: compiled with {w.kernels} inductor kernels ({time.perf_counter() - start:.1f} s of warm-up)")
        w.calls = 0
    with OpCounter() as counter:
        for t, scores_i in enumerate(scores[steps:]):
            if driver is None:
                ids = step(ids, scores_i)
                continue
            if t == steps // 2:
                driver.leave_and_join()
            driver.step()
    total = sum(counter.ops.values()) / steps
    where = (" (as on an accelerator)" if as_accelerator else "") + (", the kernel as vLLM drives it" if vllm else "")
    result = {"operations_per_step": total, "views_per_step": counter.views / steps}
    if compiled:
        inside = sum(w.calls * w.kernels for w in wrapped) / steps
        launches = total + inside
        print(f"{name}, batch {batch}{where}, compiled: {launches:.0f} launches a step")
        calls = ", ".join(f"{w.calls / steps:.1f} call(s) of {w.name} ({w.kernels} kernels)" for w in wrapped)
        print(f"  {total:.1f} eager operations around the compiled code, and {inside:.1f} inductor kernels: {calls}")
        result.update(
            launches_per_step=launches,
            inductor_kernels={w.name: w.kernels for w in wrapped},
            compiled_calls_per_step={w.name: w.calls / steps for w in wrapped},
        )
    else:
        print(f"{name}, batch {batch}{where}: {total:.0f} launches a step (operations)")
    print(f"  and {counter.views / steps:.0f} views; the lines that issue the most, per step:")
    for line, n in counter.ops.most_common(lines):
        print(f"  {n / steps:6.1f}  {line}")
    return result


def run(
    kit: Path, json_path: str | None, steps: int, batches: list[int], new_tokens: int, rounds: int, only: str | None
) -> None:
    from transformers import AutoConfig, LlamaForCausalLM

    if not torch.cuda.is_available():
        sys.exit("no CUDA device: this check runs on a GPU machine (prepare the kit on any machine)")
    if not (kit / "programs.pt").is_file():
        sys.exit(f"no kit at {kit}: make it first with `python bench/gpu_check.py prepare --kit {kit}`")
    dev = torch.device("cuda")
    programs = torch.load(kit / "programs.pt", weights_only=False)
    config = AutoConfig.from_pretrained(kit)
    vocab = config.vocab_size
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "model": "SmolLM2-135M shape, random weights, bfloat16",
        "steps": steps,
        "profiles": {},
    }
    print(f"{result['device']}, torch {torch.__version__}", flush=True)
    for name, entry in programs.items():
        if only == "cost":
            result["profiles"][name] = {}
            continue
        print(f"syncs: {name}", flush=True)
        result["profiles"][name] = {"syncs": sync_check(entry, vocab, steps, 8, dev)}
        print(json.dumps(result["profiles"][name]["syncs"], indent=1), flush=True)
    if only != "syncs":
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(dev, torch.bfloat16).eval()
        for name in ("topic default", "topic + required words"):
            print(f"cost: {name}", flush=True)
            result["profiles"][name]["cost"] = cost(model, programs[name], vocab, batches, new_tokens, rounds, dev)
    text = json.dumps(result, indent=2)
    if json_path:
        Path(json_path).write_text(text)
    print(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="build the kit (any machine)")
    p.add_argument("--kit", type=Path, default=REPO / ".gpukit")
    r = sub.add_parser("run", help="run the checks (a CUDA machine)")
    r.add_argument("--kit", type=Path, default=REPO / ".gpukit")
    r.add_argument("--json", default=None)
    r.add_argument("--steps", type=int, default=64)
    r.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    r.add_argument("--new-tokens", type=int, default=64)
    r.add_argument("--rounds", type=int, default=5)
    r.add_argument("--only", choices=["syncs", "cost"], default=None, help="run one of the two checks")
    o = sub.add_parser("ops", help="count the operations of one step (any machine)")
    o.add_argument("--kit", type=Path, default=REPO / ".gpukit")
    o.add_argument("--profile", default="topic default", help="a profile of the kit")
    o.add_argument("--batch", type=int, default=8)
    o.add_argument("--steps", type=int, default=10)
    o.add_argument("--as-accelerator", action="store_true", help="the choices the code makes off the CPU")
    o.add_argument("--lines", type=int, default=15, help="how many source lines to list")
    o.add_argument("--compiled", action="store_true", help="the step under torch.compile (launches: eager + inductor)")
    o.add_argument("--device", default="cpu", help="where the logits live (cuda: inductor's GPU kernels)")
    o.add_argument(
        "--vllm",
        action="store_true",
        help="the kernel as vLLM's adapter drives it: rows by index, one leaves, one joins",
    )
    args = parser.parse_args()
    if args.cmd == "prepare":
        prepare(args.kit)
    elif args.cmd == "ops":
        if args.device.startswith("cuda") and not torch.cuda.is_available():
            sys.exit("no CUDA device here: count with --device cpu --as-accelerator, or run this on a GPU machine")
        if not (args.kit / "programs.pt").is_file():
            sys.exit(f"no kit at {args.kit}: make it first with `python bench/gpu_check.py prepare --kit {args.kit}`")
        count_ops(
            args.kit,
            args.profile,
            args.batch,
            args.steps,
            args.as_accelerator,
            args.lines,
            args.compiled,
            args.device,
            args.vllm,
        )
    else:
        run(args.kit, args.json, args.steps, args.batch_sizes, args.new_tokens, args.rounds, args.only)


if __name__ == "__main__":
    main()
