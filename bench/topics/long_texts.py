"""Long texts: does the pull hold the narrative over a long continuation, window by window?

Reads an ``ngrav eval`` run on the topic prompts made with a long budget (``--max-new-tokens 256``), cuts every
continuation into windows of ``--window`` tokens (64: four windows), and scores each window's topic relevance:
the MiniLM cosine between the window's text and the centroid of the prompt's held-out words (the
``topic_relevance`` metric, per window). Reported per arm and window: the mean relevance with a 95% bootstrap
interval, and per arm the paired change from the first window to the last (over the continuations that reach
the last window), with the judge's perplexity ratio against plain beside it. ``--plot`` draws relevance by
window, one line per arm with its interval.

Usage::

    ngrav eval --engine vllm --prompts topics --profile auto --seeds 0-2 --max-new-tokens 256 --batch-size 20 \\
        --out /tmp/topics-long
    python bench/topics/long_texts.py /tmp/topics-long --json bench/results/topics-long.json \\
        --plot docs/img/topics-long.png
"""

from __future__ import annotations

import argparse
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
from run_io import read_run, write_outputs

from narrative_gravity.eval.metrics import MetricContext
from narrative_gravity.eval.prompts import load_prompts
from narrative_gravity.eval.stats import bootstrap_ci, paired_bootstrap
from narrative_gravity.models import load_tokenizer

LABELS = {"control": "plain decoding", "auto": "topic default (thermostat)"}


def window_texts(tokenizer: Any, token_ids: list[int], window: int, n_windows: int) -> list[str | None]:
    """The text of each window (``None`` where the continuation ended before the window starts)."""
    out: list[str | None] = []
    for k in range(n_windows):
        piece = token_ids[k * window : (k + 1) * window]
        out.append(tokenizer.decode(piece, skip_special_tokens=True) if piece else None)
    return out


def relevance_by_window(
    rows: list[dict[str, Any]], manifest: dict[str, Any], window: int, ctx: MetricContext
) -> tuple[int, dict[str, dict[tuple[int, int], list[float]]]]:
    """``(windows, {arm: {(prompt index, seed): [relevance per window, NaN where the text had ended]}})``."""
    settings = manifest["settings"]
    budget = int(settings["max_new_tokens"])
    n_windows = max(1, math.ceil(budget / window))
    prompts = {p.index: p for p in load_prompts(settings["prompts"])}
    tokenizer = load_tokenizer(settings.get("model"))
    pieces: list[tuple[str, tuple[int, int], int, str, tuple[str, ...]]] = []
    for r in rows:
        words = prompts[r["prompt_index"]].score_words()
        for k, text in enumerate(window_texts(tokenizer, r["token_ids"], window, n_windows)):
            if text is not None and text.strip() and words:
                pieces.append((r["profile"], (r["prompt_index"], r["seed"]), k, text, tuple(words)))
    out: dict[str, dict[tuple[int, int], list[float]]] = defaultdict(dict)
    for r in rows:
        out[r["profile"]][(r["prompt_index"], r["seed"])] = [math.nan] * n_windows
    vectors = ctx.vectors([p[3] for p in pieces])
    for (arm, key, k, _, words), v in zip(pieces, vectors, strict=True):
        out[arm][key][k] = float(v @ ctx.centroid(words))
    return n_windows, out


def judge_ratio(rows: list[dict[str, Any]], arm: str) -> float:
    """Geometric-mean judge perplexity of ``arm`` over plain's, on the pairs both have."""
    ppl: dict[str, dict[tuple[int, int], float]] = defaultdict(dict)
    for r in rows:
        v = r["metrics"].get("judge_ppl")
        if v is not None and v > 0:
            ppl[r["profile"]][(r["prompt_index"], r["seed"])] = v
    keys = sorted(set(ppl[arm]) & set(ppl.get("control", {})))
    if not keys:
        return math.nan
    return math.exp(float(np.mean([math.log(ppl[arm][k] / ppl["control"][k]) for k in keys])))


def summarize(
    n_windows: int, rel: dict[str, dict[tuple[int, int], list[float]]], rows: list[dict[str, Any]], window: int
) -> dict[str, Any]:
    arms: dict[str, Any] = {}
    for arm, by_key in rel.items():
        grid = np.array(list(by_key.values()), dtype=float)  # [texts, windows]
        per_window = []
        for k in range(n_windows):
            mean, lo, hi = bootstrap_ci(grid[:, k])
            per_window.append(
                {
                    "tokens": f"{k * window + 1}-{(k + 1) * window}",
                    "mean": mean,
                    "low": lo,
                    "high": hi,
                    "texts": int(np.isfinite(grid[:, k]).sum()),
                }
            )
        change = paired_bootstrap(grid[:, 0], grid[:, -1], higher_is_better=True)
        arms[arm] = {
            "windows": per_window,
            "last_minus_first": change.to_json(),
            "judge_ppl_ratio": judge_ratio(rows, arm) if arm != "control" else 1.0,
            "mean_new_tokens": float(np.mean([r["new_tokens"] for r in rows if r["profile"] == arm])),
        }
    return {"window": window, "n_windows": n_windows, "arms": arms}


def markdown(summary: dict[str, Any]) -> str:
    n = summary["n_windows"]
    first = summary["arms"][next(iter(summary["arms"]))]["windows"]
    head = "| method | " + " | ".join(f"tokens {w['tokens']}" for w in first) + " | last − first [95% CI] | PPL ratio |"
    lines = [head, "|---|" + "---:|" * (n + 2)]
    for arm, a in summary["arms"].items():
        cells = [f"{w['mean']:.3f} [{w['low']:.3f}, {w['high']:.3f}]" for w in a["windows"]]
        c = a["last_minus_first"]
        lines.append(
            f"| {LABELS.get(arm, arm)} | "
            + " | ".join(cells)
            + f" | {c['difference']:+.3f} [{c['low']:+.3f}, {c['high']:+.3f}] (n={c['n']}) | {a['judge_ppl_ratio']:.2f} |"
        )
    return "\n".join(lines)


def plot(summary: dict[str, Any]) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for arm, a in summary["arms"].items():
        x = np.arange(1, summary["n_windows"] + 1)
        mean = [w["mean"] for w in a["windows"]]
        ax.plot(x, mean, marker="o", label=LABELS.get(arm, arm))
        ax.fill_between(x, [w["low"] for w in a["windows"]], [w["high"] for w in a["windows"]], alpha=0.2)
    ax.set_xticks(np.arange(1, summary["n_windows"] + 1), [f"{w['tokens']}" for w in a["windows"]])
    ax.set_xlabel(f"window of {summary['window']} generated tokens")
    ax.set_ylabel("topic relevance (MiniLM cosine to held-out words)")
    ax.set_title("Relevance along the continuation (95% bootstrap intervals)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="an `ngrav eval` output folder (topic prompts, a long budget)")
    ap.add_argument("--window", type=int, default=64, help="tokens per window")
    ap.add_argument("--json", type=Path, default=None, help="write the summary here")
    ap.add_argument("--plot", type=Path, default=None, help="write the relevance-by-window plot here (PNG)")
    args = ap.parse_args(argv)
    if args.window < 1:
        ap.error("--window has to be >= 1")
    rows, manifest = read_run(args.run)
    n_windows, rel = relevance_by_window(rows, manifest, args.window, MetricContext())
    summary = summarize(n_windows, rel, rows, args.window)
    summary["run"] = {"settings": manifest["settings"], "rows": len(rows)}
    write_outputs(summary, markdown(summary), args.json, args.plot, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
