"""``ngrav compare``: control and gravity with the same seeds, side by side, with paired statistics."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .engines.hf_generate import GenerationResult, SamplingOptions, encode_prompts, generate
from .eval.text_metrics import distinct_n, mean_ci, narrative_token_rate, penalized_hits
from .lead import lead_sentence, reading_profile
from .profiles.build import field_from_profile, processor_from_profile
from .profiles.schema import Profile

__all__ = ["ComparisonRow", "compare_runs", "row_metrics", "run_compare", "summarize", "summarize_metrics"]

METRICS = (
    ("narrative-token rate", "narrative_rate", True),
    ("penalized-word hits", "penalized_hits", False),
    ("distinct-2", "distinct_2", True),
    ("mean entropy [nats]", "entropy", None),
    ("mean KL [nats/token]", "kl", False),
    ("tokens/s", "tokens_per_s", True),
)


@dataclass
class ComparisonRow:
    """One seed: the control and gravity generations and their metrics."""

    seed: int
    control: GenerationResult
    gravity: GenerationResult
    metrics: dict[str, dict[str, float]]


def row_metrics(
    prof: Profile,
    field: Any,
    prompt_ids: list[int],
    token_ids: list[int],
    text: str,
    *,
    seconds: float,
    means: dict[str, float] | None = None,
) -> dict[str, float]:
    """One generation's metrics (the keys of ``METRICS``); ``means`` are its trace means, if measured."""
    means = means or {}
    return {
        "narrative_rate": narrative_token_rate(field, prompt_ids, token_ids),
        "penalized_hits": float(penalized_hits(text, prof.penalized())),
        "distinct_2": distinct_n([text], 2),
        "entropy": means.get("entropy", float("nan")),
        "kl": means.get("kl", float("nan")),
        "tokens_per_s": len(token_ids) / seconds if seconds > 0 else float("nan"),
    }


def _metrics(result: GenerationResult, prof: Profile, field: Any, prompt_ids: list[int]) -> dict[str, float]:
    return row_metrics(
        prof,
        field,
        prompt_ids,
        result.token_ids,
        result.text,
        seconds=result.seconds,
        means=result.trace_means,
    ) | {"tokens_per_s": result.new_tokens / result.seconds if result.seconds > 0 else float("nan")}


def compare_runs(
    model: Any,
    tokenizer: Any,
    profile: Profile,
    prompt: str,
    *,
    seeds: int = 3,
    raw: bool = False,
    max_new_tokens: int = 80,
    top_k: int = 10,
    temperature: float = 1.0,
    progress: Any = None,
) -> list[ComparisonRow]:
    """Generate control and gravity for seeds ``0..seeds-1`` and measure both."""
    field = field_from_profile(profile, tokenizer, model=model)  # model: for fields from the LM's embeddings
    prompt_ids = encode_prompts(tokenizer, [prompt], raw=raw)[0]
    lead = lead_sentence(profile, raw=raw)  # gravity's rows read the topic sentence first; control's do not
    rows = []
    for seed in range(seeds):
        opts = SamplingOptions(max_new_tokens=max_new_tokens, top_k=top_k, temperature=temperature, seed=seed)
        pair = {}
        for mode in ("control", "gravity"):

            def factory(budget: int, trace: Any, _mode: str = mode) -> Any:
                pull = profile if _mode == "control" else reading_profile(profile, raw=raw)
                return processor_from_profile(
                    pull, tokenizer, max_new_tokens=budget, trace=trace, measure_only=_mode == "control", model=model
                )

            (res,) = generate(
                model,
                tokenizer,
                [prompt],
                options=opts,
                processor_factory=factory,
                raw=raw,
                batch_size=1,
                record_trace=True,
                lead=lead if mode == "gravity" else None,
            )
            pair[mode] = res
            if progress is not None:
                progress()
        rows.append(
            ComparisonRow(
                seed=seed,
                control=pair["control"],
                gravity=pair["gravity"],
                metrics={m: _metrics(pair[m], profile, field, prompt_ids) for m in ("control", "gravity")},
            )
        )
    return rows


def summarize(rows: list[ComparisonRow]) -> dict[str, dict[str, Any]]:
    """Per metric: control and gravity means with 95% bootstrap intervals, and the paired difference."""
    return summarize_metrics([r.metrics for r in rows])


def summarize_metrics(pairs: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, Any]]:
    """:func:`summarize` from each seed's ``{"control": metrics, "gravity": metrics}``."""
    out: dict[str, dict[str, Any]] = {}
    for label, key, higher in METRICS:
        c = np.array([p["control"][key] for p in pairs], dtype=float)
        g = np.array([p["gravity"][key] for p in pairs], dtype=float)
        ok = ~(np.isnan(c) | np.isnan(g))
        out[key] = {
            "label": label,
            "higher_is_better": higher,
            "control": mean_ci(c[ok].tolist()),
            "gravity": mean_ci(g[ok].tolist()),
            "difference": mean_ci((g[ok] - c[ok]).tolist()),
        }
    return out


def _fmt(ci: tuple[float, float, float]) -> str:
    m, lo, hi = ci
    if np.isnan(m):
        return "n/a"
    return f"{m:.3f} [{lo:.3f}, {hi:.3f}]"


def run_compare(
    model: Any,
    tokenizer: Any,
    profile: Profile,
    prompt: str,
    *,
    seeds: int = 3,
    raw: bool = False,
    max_new_tokens: int = 80,
    top_k: int = 10,
    temperature: float = 1.0,
    plot: Path | None = None,
    json_out: Path | None = None,
    show: int = 2,
) -> dict[str, Any]:
    """The ``ngrav compare`` command: run, print, optionally plot and save; returns the summary."""
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    console = Console()
    with Progress(transient=True, console=console) as bar:
        task = bar.add_task("control vs gravity", total=2 * seeds)
        rows = compare_runs(
            model,
            tokenizer,
            profile,
            prompt,
            seeds=seeds,
            raw=raw,
            max_new_tokens=max_new_tokens,
            top_k=top_k,
            temperature=temperature,
            progress=lambda: bar.advance(task),
        )
    texts = Table(title=f"prompt: {prompt!r}", show_lines=True)
    texts.add_column("seed", justify="right")
    texts.add_column("control (no gravity)", ratio=1)
    texts.add_column(f"gravity ({profile.name})", ratio=1)
    for r in rows[:show]:
        texts.add_row(str(r.seed), r.control.text, r.gravity.text)
    console.print(texts)
    summary = summarize(rows)
    table = Table(title=f"{seeds} seeds, mean [95% bootstrap interval]")
    for col in ("metric", "control", "gravity", "gravity − control (paired)"):
        table.add_column(col)
    for s in summary.values():
        table.add_row(s["label"], _fmt(s["control"]), _fmt(s["gravity"]), _fmt(s["difference"]))
    console.print(table)
    if plot is not None:
        from .plots import plot_traces

        path = plot_traces(
            {"control": [r.control.trace for r in rows], "gravity": [r.gravity.trace for r in rows]},
            plot,
            title=f"{profile.name}: {prompt[:60]}",
        )
        console.print(f"trace plot saved to {path}")
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "prompt": prompt,
            "profile": profile.model_dump(),
            "summary": summary,
            "runs": [
                {
                    "seed": r.seed,
                    "control": r.control.to_json(),
                    "gravity": r.gravity.to_json(),
                    "metrics": r.metrics,
                }
                for r in rows
            ],
        }
        json_out.write_text(json.dumps(payload, indent=2, ensure_ascii=False), encoding="utf-8")
        console.print(f"results saved to {json_out}")
    return summary
