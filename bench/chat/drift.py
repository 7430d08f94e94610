"""Drift in chat: does an answer stay on its topic to the end, and does a conversation stay on it turn after turn?

Two shapes, on a chat set of ``ngrav eval`` (neutral requests, one topic per prompt; held-out words only score):

- ``--turns 1 --max-new-tokens 256``: one long answer, cut into thirds by tokens;
- ``--turns 3 --max-new-tokens 96``: a three-turn conversation. After each answer the user writes a neutral
  follow-up (:data:`FOLLOW_UPS`, fixed before any run), and the next answer reads the whole conversation.
  Each arm keeps its own conversation: its topic sentence stays in the system message, and its pull starts
  afresh on every answer.

Each segment (a third, or a turn's answer) is scored two ways, neither of which built any field: held-out
success (a held-out word in the segment) and relevance to the topic's description ("a text about space",
MiniLM cosine). Per arm: each segment's mean with a 95% interval, and the paired change from the first
segment to the last, resampling (request, seed) clusters.

Arms are ``ngrav eval``'s: ``control`` always, then ``ask``, ``cfg:γ``, ``auto``, ``auto:FILE``.

Usage::

    python bench/chat/drift.py --prompts chat-topics-tune --limit-prompts 35 --arms ask auto \\
        --turns 3 --max-new-tokens 96 --out out/drift-turns-tune
    python bench/chat/drift.py --summarize out/drift-turns-tune --json bench/results/x.json --plot docs/img/x.png
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

FOLLOW_UPS = ("Go on.", "Tell me more.", "And then?", "What else?")
SEGMENTS = 3


def _segments(tokenizer: Any, ids: list[int], n: int) -> list[str]:
    """The text of each of ``n`` equal token spans of ``ids`` (the last takes the remainder)."""
    size = max(1, math.ceil(len(ids) / n))
    return [tokenizer.decode(ids[k * size : (k + 1) * size], skip_special_tokens=True) for k in range(n)]


def generate(args: argparse.Namespace) -> None:
    from rich.progress import Progress

    from narrative_gravity.engines.hf_generate import sample_ids
    from narrative_gravity.engines.options import GenerationOptions
    from narrative_gravity.engines.prompts import chat_ids
    from narrative_gravity.eval.batch import _Guidance, _Runner
    from narrative_gravity.eval.metrics import MetricContext
    from narrative_gravity.eval.runner import CONTROL, EvalSettings, make_plan
    from narrative_gravity.lead import lead_messages
    from narrative_gravity.models import load_model

    settings = EvalSettings(
        prompts=args.prompts,
        profiles=tuple(args.arms),
        seeds=tuple(args.seeds),
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        raw=False,
        judge="none",
        limit_prompts=args.limit_prompts,
    )
    plan = make_plan(settings)
    model, tok = load_model(args.model)
    runner = _Runner(settings, plan, model, tok, MetricContext(), [], print)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "run.json").write_text(json.dumps({**vars(args), "out": str(args.out)}, default=str, indent=1))
    done = set()
    path = args.out / "rows.jsonl"
    if path.exists():
        done = {(r["arm"], r["prompt_index"], r["seed"]) for r in map(json.loads, path.read_text().splitlines())}
    arms = [CONTROL, *plan.arms]
    total = len(plan.prompts) * len(arms) * len(settings.seeds)
    with Progress() as bar, path.open("a", encoding="utf-8") as fh:
        task = bar.add_task("conversations", total=total, completed=len(done))
        for chunk in plan.chunks:
            for seed in settings.seeds:
                for arm in arms:
                    todo = [plan.prompts[i] for i in chunk.indices if (arm, i, seed) not in done]
                    if not todo:
                        continue
                    lead = runner.lead(arm, todo[0])
                    talks: list[list[dict[str, str]]] = [[{"role": "user", "content": p.text}] for p in todo]
                    answers: list[list[list[int]]] = [[] for _ in todo]
                    seconds = 0.0
                    for turn in range(args.turns):
                        proc = None if arm == CONTROL else runner.processor(arm, todo[0], chunk)
                        ids = [chat_ids(tok, lead_messages(t, lead)) for t in talks]
                        if isinstance(proc, _Guidance):
                            proc = proc.build(model, tok, [chat_ids(tok, t) for t in talks])
                        options = GenerationOptions(
                            max_new_tokens=args.max_new_tokens,
                            top_k=settings.top_k,
                            temperature=settings.temperature,
                            seed=seed + turn,
                        )
                        t0 = time.perf_counter()
                        rows = sample_ids(model, tok, ids, options, [proc] if proc is not None else [])
                        seconds += time.perf_counter() - t0
                        for k, row in enumerate(rows):
                            answers[k].append(row)
                            talks[k] += [
                                {"role": "assistant", "content": tok.decode(row, skip_special_tokens=True)},
                                {"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]},
                            ]
                    for p, turns in zip(todo, answers, strict=True):
                        if args.turns == 1:
                            segments = _segments(tok, turns[0], SEGMENTS)
                        else:
                            segments = [tok.decode(t, skip_special_tokens=True) for t in turns]
                        row = {
                            "arm": arm,
                            "prompt_index": p.index,
                            "seed": seed,
                            "prompt": p.text,
                            "topic": p.topic_name,
                            "lead": lead,
                            "tokens": [len(t) for t in turns],
                            "segments": segments,
                            "seconds": seconds,
                        }
                        fh.write(json.dumps(row, ensure_ascii=False) + "\n")
                        fh.flush()
                    bar.advance(task, len(todo))


def score(run: Path) -> list[dict[str, Any]]:
    """Every row of ``run`` with per-segment ``hit`` (a held-out word) and ``relevance`` (to the description)."""
    from narrative_gravity.eval.metrics import MetricContext, contains_any
    from narrative_gravity.eval.prompts import load_prompts

    meta = json.loads((run / "run.json").read_text())
    prompts = {p.index: p for p in load_prompts(meta["prompts"])}
    rows = [json.loads(line) for line in (run / "rows.jsonl").read_text().splitlines() if line.strip()]
    ctx = MetricContext()
    texts = [s for r in rows for s in r["segments"]]
    vecs = ctx.vectors([t if t.strip() else "." for t in texts])
    described = {}
    i = 0
    for r in rows:
        p = prompts[r["prompt_index"]]
        if p.description not in described:
            described[p.description] = ctx.vectors([p.description])[0]
        r["hit"] = [float(contains_any(s, p.heldout_words)) for s in r["segments"]]
        r["relevance"] = [
            float(vecs[i + k] @ described[p.description]) if s.strip() else math.nan
            for k, s in enumerate(r["segments"])
        ]
        i += len(r["segments"])
    return rows


def _cluster_ci(pairs: list[tuple[Any, float]], n_boot: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """Mean of the values and its 95% interval, resampling clusters."""
    pairs = [(k, v) for k, v in pairs if v == v]
    if not pairs:
        return math.nan, math.nan, math.nan
    members: dict[Any, list[float]] = defaultdict(list)
    for k, v in pairs:
        members[k].append(v)
    groups = list(members.values())
    rng = np.random.default_rng(seed)
    draws = []
    for _ in range(n_boot):
        pick = rng.integers(0, len(groups), len(groups))
        draws.append(np.mean(np.concatenate([groups[j] for j in pick])))
    lo, hi = np.quantile(draws, [0.025, 0.975])
    return float(np.mean([v for _, v in pairs])), float(lo), float(hi)


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    by: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by[r["arm"]].append(r)
    out: dict[str, Any] = {}
    for arm, rs in by.items():
        n = len(rs[0]["segments"])
        entry: dict[str, Any] = {"texts": len(rs), "tokens": float(np.mean([sum(r["tokens"]) for r in rs]))}
        for key in ("hit", "relevance"):
            cluster = [(r["prompt"], r["seed"]) for r in rs]
            entry[key] = [_cluster_ci([(c, r[key][k]) for c, r in zip(cluster, rs)]) for k in range(n)]
            entry[f"{key}_last_minus_first"] = _cluster_ci([(c, r[key][-1] - r[key][0]) for c, r in zip(cluster, rs)])
        out[arm] = entry
    return out


def markdown(summary: dict[str, Any]) -> str:
    def ci(t: tuple[float, float, float], signed: bool = False) -> str:
        f = "{:+.3f}" if signed else "{:.3f}"
        return f"{f.format(t[0])} [{f.format(t[1])}, {f.format(t[2])}]"

    lines = []
    for key, name in (("hit", "held-out success"), ("relevance", "relevance to the description")):
        n = len(next(iter(summary.values()))[key])
        lines += [
            f"\n{name}, by segment\n",
            "| arm | " + " | ".join(f"segment {k + 1}" for k in range(n)) + " | last − first |",
            "|---|" + "---:|" * (n + 1),
        ]
        for arm, e in summary.items():
            lines.append(
                f"| {arm} | " + " | ".join(ci(t) for t in e[key]) + f" | {ci(e[key + '_last_minus_first'], True)} |"
            )
    return "\n".join(lines)


def plot(summary: dict[str, Any], path: Path, title: str) -> None:
    from narrative_gravity.plots import pyplot

    plt = pyplot()
    if plt is None:
        raise SystemExit("drawing needs matplotlib: pip install 'narrative-gravity[plot]'")
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, key, label in (
        (axes[0], "hit", "held-out success"),
        (axes[1], "relevance", "relevance to the description"),
    ):
        for arm, e in summary.items():
            x = np.arange(1, len(e[key]) + 1)
            ax.plot(x, [t[0] for t in e[key]], marker="o", label=arm)
            ax.fill_between(x, [t[1] for t in e[key]], [t[2] for t in e[key]], alpha=0.15)
        ax.set_xticks(x)
        ax.set_xlabel("segment")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title + "\nlines: means; bands: 95% intervals over (request, seed) clusters", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", default="chat-topics-tune", help="a chat set of ngrav eval")
    ap.add_argument("--arms", nargs="*", default=["ask", "auto"], help="ngrav eval arms besides control")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96, help="per answer")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--limit-prompts", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=10)
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", type=Path, default=None, help="generate into this folder (resumes)")
    ap.add_argument("--summarize", type=Path, default=None, help="summarize this folder instead")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.turns < 1:
        ap.error("--turns has to be >= 1")
    run = args.summarize or args.out
    if run is None:
        ap.error("give --out (generate) or --summarize RUN")
    if args.summarize is None:
        generate(args)
    summary = summarize(score(run))
    print(markdown(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    if args.plot:
        meta = json.loads((run / "run.json").read_text())
        shape = (
            f"{meta['turns']} turns of {meta['max_new_tokens']} tokens"
            if meta["turns"] > 1
            else (f"one answer of {meta['max_new_tokens']} tokens, in thirds")
        )
        plot(summary, args.plot, f"Drift in chat: {meta['prompts']}, {shape}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
