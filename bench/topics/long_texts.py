"""Long texts: does the pull hold the narrative over a long continuation, window by window?

Reads an ``ngrav eval`` run on the topic prompts made with a long budget (``--max-new-tokens 256``), cuts every
continuation into windows of ``--window`` tokens (64: four windows), and scores each window's topic relevance:
the MiniLM cosine between the window's text and the centroid of the prompt's held-out words (the
``topic_relevance`` metric, per window). Reported per arm and window: the mean relevance with a 95% bootstrap
interval, and per arm the paired change from the first window to the last (over the continuations that reach
the last window), with the judge's perplexity ratio against plain beside it. ``--plot`` draws relevance by
window, one line per arm with its interval.

``--judge-windows`` also reads the judge's (Gemma 3 270M) NLL of every token of each continuation and sums
it by window, so that the perplexity a pull costs can be read along the text: per window, each arm's median
perplexity and its geometric-mean paired ratio to plain with a 95% bootstrap interval (the plot gets a second
panel).

Usage::

    ngrav eval --engine vllm --prompts topics --profile auto --seeds 0-2 --max-new-tokens 256 --batch-size 20 \\
        --out /tmp/topics-long
    python bench/topics/long_texts.py /tmp/topics-long --json bench/results/topics-long.json \\
        --plot docs/img/topics-long.png --judge-windows

``--also RUN`` joins the arms of another run of the same prompts, seeds and budget (its plain rows are
dropped: the same seeds give the same texts), so that arms run on different days share one table and plot;
``--label ARM=TEXT`` names an arm there.
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


Windows = dict[tuple[str, int, int], list[str | None]]


def cut_windows(rows: list[dict[str, Any]], manifest: dict[str, Any], window: int) -> tuple[int, Windows]:
    """``(windows per text, {(arm, prompt index, seed): window_texts(...)})``: every continuation cut once."""
    settings = manifest["settings"]
    n_windows = max(1, math.ceil(int(settings["max_new_tokens"]) / window))
    tokenizer = load_tokenizer(settings.get("model"))
    texts = {
        (r["profile"], r["prompt_index"], r["seed"]): window_texts(tokenizer, r["token_ids"], window, n_windows)
        for r in rows
    }
    return n_windows, texts


def relevance_by_window(
    n_windows: int, windows: Windows, manifest: dict[str, Any], ctx: MetricContext
) -> dict[str, dict[tuple[int, int], list[float]]]:
    """``{arm: {(prompt index, seed): [relevance per window, NaN where the text had ended]}}``."""
    prompts = {p.index: p for p in load_prompts(manifest["settings"]["prompts"])}
    pieces: list[tuple[str, tuple[int, int], int, str, tuple[str, ...]]] = []
    out: dict[str, dict[tuple[int, int], list[float]]] = defaultdict(dict)
    for (arm, index, seed), texts in windows.items():
        out[arm][(index, seed)] = [math.nan] * n_windows
        words = prompts[index].score_words()
        for k, text in enumerate(texts):
            if text is not None and text.strip() and words:
                pieces.append((arm, (index, seed), k, text, tuple(words)))
    vectors = ctx.vectors([p[3] for p in pieces])
    for (arm, key, k, _, words), v in zip(pieces, vectors, strict=True):
        out[arm][key][k] = float(v @ ctx.centroid(words))
    return out


def judge_by_window(
    n_windows: int, windows: Windows, prompts: dict[tuple[int, int], str], judge: Any, batch: int = 16
) -> dict[str, dict[tuple[int, int], list[float]]]:
    """``{arm: {(prompt index, seed): [judge NLL per token in each window, NaN where the text had ended]}}``.

    Each continuation is scored once, given its prompt (``judge.token_nll``); a judge token belongs to the
    window in which its first character lies, so the windows' NLLs add up to the whole continuation's."""
    from tqdm import tqdm

    out: dict[str, dict[tuple[int, int], list[float]]] = defaultdict(dict)
    jobs: list[tuple[str, tuple[int, int], str, str, list[int]]] = []
    for (arm, index, seed), cut in windows.items():
        key = (index, seed)
        out[arm][key] = [math.nan] * n_windows
        texts = [t for t in cut if t is not None]
        ends = np.cumsum([len(t) for t in texts]).tolist()  # where each window's text ends in the continuation
        if "".join(texts).strip():
            jobs.append((arm, key, prompts[key], "".join(texts), ends))
    for i in tqdm(range(0, len(jobs), batch), desc="judging windows", unit="batch", leave=False):
        chunk = jobs[i : i + batch]
        scored = judge.token_nll([j[2] for j in chunk], [j[3] for j in chunk])
        for (arm, key, _, text, ends), nll in zip(chunk, scored, strict=True):
            spans = judge.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
            spans = spans[: judge.max_length - 1]  # as the judge cut the continuation; it scored the last tokens
            spans = spans[len(spans) - nll.numel() :] if nll.numel() else []
            sums, counts = np.zeros(n_windows), np.zeros(n_windows)
            for (first, _), v in zip(spans, nll.tolist(), strict=True):
                k = min(int(np.searchsorted(ends, first, side="right")), len(ends) - 1)
                sums[k] += v
                counts[k] += 1
            out[arm][key] = [sums[k] / counts[k] if counts[k] else math.nan for k in range(n_windows)]
    return out


def summarize_judge(nll: dict[str, dict[tuple[int, int], list[float]]], window: int) -> dict[str, Any]:
    """Per arm and window: median perplexity, and the paired ratio to plain (exp of the mean NLL difference)."""
    plain = nll.get("control", {})
    arms: dict[str, Any] = {}
    for arm, by_key in nll.items():
        keys = sorted(by_key)
        grid = np.array([by_key[k] for k in keys], dtype=float)
        per_window = []
        for k in range(grid.shape[1]):
            entry: dict[str, Any] = {
                "tokens": f"{k * window + 1}-{(k + 1) * window}",
                "median_ppl": float(np.exp(np.nanmedian(grid[:, k]))) if np.isfinite(grid[:, k]).any() else math.nan,
            }
            if arm != "control":
                base = np.array([plain.get(key, [math.nan] * grid.shape[1])[k] for key in keys], dtype=float)
                c = paired_bootstrap(base, grid[:, k], higher_is_better=False)
                entry.update(ratio=math.exp(c.difference), low=math.exp(c.low), high=math.exp(c.high), pairs=c.n)
            per_window.append(entry)
        arms[arm] = per_window
    return arms


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
    if "judge_windows" in summary:
        lines += ["", "| method | " + " | ".join(f"PPL, tokens {w['tokens']}" for w in first) + " |"]
        lines.append("|---|" + "---:|" * n)
        for arm, per in summary["judge_windows"].items():
            cells = [
                f"{w['median_ppl']:.1f}"
                + (f" ({w['ratio']:.2f}× [{w['low']:.2f}, {w['high']:.2f}])" if "ratio" in w else "")
                for w in per
            ]
            lines.append(f"| {LABELS.get(arm, arm)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(summary: dict[str, Any]) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    judged = "judge_windows" in summary
    fig, axes = plt.subplots(1, 2 if judged else 1, figsize=(11.5 if judged else 6.4, 3.8), squeeze=False)
    ax = axes[0, 0]
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
    if judged:
        right = axes[0, 1]
        colours = {arm: f"C{i}" for i, arm in enumerate(summary["arms"])}  # each arm as in the left panel
        for arm, per in summary["judge_windows"].items():
            if arm == "control":
                continue
            x = np.arange(1, len(per) + 1)
            right.plot(x, [w["ratio"] for w in per], marker="o", color=colours[arm], label=LABELS.get(arm, arm))
            right.fill_between(x, [w["low"] for w in per], [w["high"] for w in per], color=colours[arm], alpha=0.2)
            right.set_xticks(x, [w["tokens"] for w in per])
        right.axhline(1.0, color=colours.get("control", "C0"), lw=1, label="plain decoding")
        right.set_xlabel(f"window of {summary['window']} generated tokens")
        right.set_ylabel("judge perplexity / plain's (paired, geometric)")
        right.set_title("What the pull costs, window by window")
        right.grid(alpha=0.3)
        right.legend()
    fig.tight_layout()
    return fig


def joined_arms(
    rows: list[dict[str, Any]],
    manifest: dict[str, Any],
    other: list[dict[str, Any]],
    other_manifest: dict[str, Any],
    where: Path,
) -> list[dict[str, Any]]:
    """The rows of ``other``'s arms that ``rows`` lacks, once its settings are checked against ``manifest``'s.

    Its plain rows are dropped when ``rows`` has them (the same seeds give the same texts on one engine).
    """
    keys = ("prompts", "seeds", "max_new_tokens", "model", "engine")
    mine, theirs = manifest["settings"], other_manifest["settings"]
    differ = [k for k in keys if mine.get(k) != theirs.get(k)]
    if differ:
        raise SystemExit(f"error: {where} differs from the first run in {', '.join(differ)}; join runs of one setup")
    seen = {r["profile"] for r in rows}
    return [r for r in other if r["profile"] not in seen]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="an `ngrav eval` output folder (topic prompts, a long budget)")
    ap.add_argument(
        "--also",
        type=Path,
        action="append",
        default=[],
        help="another run of the same prompts, seeds and budget: its arms join the first run's (repeatable)",
    )
    ap.add_argument(
        "--label", action="append", default=[], metavar="ARM=TEXT", help="name an arm in the tables and plot"
    )
    ap.add_argument("--window", type=int, default=64, help="tokens per window")
    ap.add_argument("--json", type=Path, default=None, help="write the summary here")
    ap.add_argument("--plot", type=Path, default=None, help="write the relevance-by-window plot here (PNG)")
    ap.add_argument(
        "--judge-windows", action="store_true", help="also score each window's perplexity with the judge (minutes)"
    )
    args = ap.parse_args(argv)
    if args.window < 1:
        ap.error("--window has to be >= 1")
    rows, manifest = read_run(args.run)
    for other in args.also:
        rows += joined_arms(rows, manifest, *read_run(other), other)
    for spec in args.label:
        arm, sep, text = spec.partition("=")
        if not sep or not arm or not text:
            ap.error(f"--label {spec!r}: write ARM=TEXT, e.g. --label auto='topic default'")
        LABELS[arm] = text
    n_windows, windows = cut_windows(rows, manifest, args.window)
    rel = relevance_by_window(n_windows, windows, manifest, MetricContext())
    summary = summarize(n_windows, rel, rows, args.window)
    if args.judge_windows:
        from narrative_gravity.eval.judge import load_judge

        name = manifest["settings"].get("judge")  # the run's judge; the default where the run had none
        judge = load_judge(None if name in (None, "none") else name)
        prompts = {(r["prompt_index"], r["seed"]): r["prompt"] for r in rows}
        nll = judge_by_window(n_windows, windows, prompts, judge)
        summary["judge_windows"] = summarize_judge(nll, args.window)
    summary["run"] = {"settings": manifest["settings"], "rows": len(rows)}
    write_outputs(summary, markdown(summary), args.json, args.plot, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
