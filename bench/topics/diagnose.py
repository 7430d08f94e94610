"""Why a topic gains little: what the topic default's field can and cannot reach, per Empath topic.

For each topic (the tuning half by default, ``--test`` for the test half) it builds the field the topic
default pulls with (the profile ``auto``, from the topic's conditioning words) on the generator's tokenizer,
and measures on the held-out words:

- ``one_token``: the share written as a single token after a space (the rest are split into pieces);
- ``reached``: the share whose first piece the field pulls (value > 0);
- ``reached_split``: the same among split words only (their first piece is shared with other words);
- ``zipf``: the median wordfreq Zipf frequency (common words are reached by chance);
- ``field_tokens``: how many tokens the field pulls at all;
- ``lift``: the per-topic lift of a finished run (``--per-topic``, from ``bench/topics/per_topic.py``).

It then prints the Spearman correlation of each measure with the lift, over the topics that have one.

``--run RUN --arm ARM`` adds, per topic, the means of the arm's decoding trace in that ``ngrav eval`` run: the
narrative mass before the pull (``mass``) and after it (``mass_after``), the KL each step costs (``kl``) and
λ (``lam``), and the arm's own success and lift over plain there.

    python bench/topics/diagnose.py --test --per-topic bench/results/empath-per-topic.json \
        --json bench/results/empath-diagnosis.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch
import wordfreq
from run_io import read_run, write_outputs

from narrative_gravity.eval.lexicon import TEST_TOPICS, TUNE_TOPICS, clean_words, read_categories
from narrative_gravity.eval.prompts import split_wordlist
from narrative_gravity.eval.settings import AUTO_DEFAULTS
from narrative_gravity.models import load_tokenizer
from narrative_gravity.profiles.build import field_from_profile
from narrative_gravity.profiles.schema import Profile, load_profile


def _spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""

    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=v.__getitem__)
        out = [0.0] * len(v)
        i = 0
        while i < len(v):
            j = i
            while j + 1 < len(v) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    den = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return num / den if den else float("nan")


def diagnose(topic: str, words: tuple[str, ...], tokenizer: Any, profile_spec: dict[str, Any]) -> dict[str, Any]:
    """The measures of one topic (see the module doc)."""
    cond, held = split_wordlist(words)
    profile = Profile.from_mapping({**profile_spec, "core_semantics": list(cond)}, source="diagnosis")
    field = field_from_profile(profile, tokenizer)
    values = field.values
    pieces = [tokenizer.encode(" " + w, add_special_tokens=False) for w in held]
    one = [len(p) == 1 for p in pieces]
    reached = [bool(values[p[0]] > 0) for p in pieces]
    split_reached = [r for r, o in zip(reached, one) if not o]
    return {
        "topic": topic,
        "conditioning": len(cond),
        "held_out": len(held),
        "one_token": sum(one) / len(held),
        "reached": sum(reached) / len(held),
        "reached_split": (sum(split_reached) / len(split_reached)) if split_reached else None,
        "zipf": statistics.median(wordfreq.zipf_frequency(w, "en") for w in held),
        "field_tokens": int((values > 0).sum()),
        "field_mass_on_held": float(torch.stack([values[p[0]].clamp_min(0) for p in pieces]).sum())
        / max(float(values.clamp_min(0).sum()), 1e-9),
    }


def trace_means(run: Path, arm: str) -> dict[str, dict[str, float]]:
    """Per topic, the means of ``arm``'s trace and its success (and plain's) in the run's ``results.jsonl``."""
    cells: dict[str, dict[str, list[float]]] = {}
    for r in read_run(run)[0]:
        if r["profile"] not in (arm, "control"):
            continue
        c = cells.setdefault(r["topic"], {k: [] for k in ("mass", "mass_after", "kl", "lam", "success", "plain")})
        if r["profile"] == "control":
            c["plain"].append(r["metrics"]["topic_success"])
            continue
        tr = r.get("trace") or {}
        for key, name in (("mass", "mass"), ("mass_after", "mass_after"), ("kl", "kl"), ("strength", "lam")):
            if tr.get(key):
                c[name].append(statistics.fmean(tr[key]))
        c["success"].append(r["metrics"]["topic_success"])
    out = {}
    for topic, c in cells.items():
        means = {k: statistics.fmean(v) if v else float("nan") for k, v in c.items()}
        means["run_lift"] = means["success"] - means["plain"]
        out[topic] = means
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--test", action="store_true", help="the test topics (default: the tuning topics)")
    ap.add_argument("--model", default=None, help="generator whose tokenizer is measured (default SmolLM2)")
    ap.add_argument(
        "--profile",
        default="auto",
        help="a profile file (its core_semantics replaced per topic), or auto: the topic default",
    )
    ap.add_argument("--per-topic", type=Path, default=None, help="per_topic.py JSON with each topic's lift")
    ap.add_argument("--run", type=Path, default=None, help="an ngrav eval run whose traces are read per topic")
    ap.add_argument("--arm", default="auto", help="the arm of --run whose traces are read (default auto)")
    ap.add_argument("--json", type=Path, default=None, help="write the table here")
    args = ap.parse_args()

    lexicon = read_categories()
    tokenizer = load_tokenizer(args.model)
    spec: dict[str, Any] = (
        dict(AUTO_DEFAULTS) if args.profile == "auto" else load_profile(args.profile).model_dump(exclude_none=True)
    )
    lifts: dict[str, float] = {}
    if args.per_topic is not None:
        lifts = {t: r["difference"][0] for t, r in dict(json.loads(args.per_topic.read_text())["topics"]).items()}
    traces = trace_means(args.run, args.arm) if args.run is not None else {}
    rows = []
    for topic in TEST_TOPICS if args.test else TUNE_TOPICS:
        row = diagnose(topic, clean_words(lexicon[topic]), tokenizer, spec)
        row["lift"] = lifts.get(topic)
        if args.run is not None:
            row.update(traces.get(topic, {}))
            if row["lift"] is None:
                row["lift"] = row.get("run_lift")
        rows.append(row)
    rows.sort(key=lambda r: (r["lift"] is None, r["lift"] if r["lift"] is not None else 0.0))
    cols = ["one_token", "reached", "reached_split", "zipf", "field_tokens", "field_mass_on_held"]
    if args.run is not None:
        cols += ["mass", "mass_after", "kl", "lam"]
    lines = [f"{'topic':<16}{'lift':>7}" + "".join(f"{c:>19} " for c in cols)]
    for r in rows:
        lift = "" if r["lift"] is None else f"{r['lift']:+.3f}"
        cells = "".join(f"{'-' if r.get(c) is None else round(r[c], 3):>19} " for c in cols)
        lines.append(f"{r['topic']:<16}{lift:>7}{cells}")
    correlations = {}
    scored = [r for r in rows if r["lift"] is not None]
    if len(scored) >= 3:
        for c in cols:
            pairs = [(r[c], r["lift"]) for r in scored if r[c] is not None]
            correlations[c] = _spearman([p[0] for p in pairs], [p[1] for p in pairs])
        lines.append("Spearman with lift: " + ", ".join(f"{c} {v:+.2f}" for c, v in correlations.items()))
    write_outputs({"topics": rows, "spearman": correlations}, "\n".join(lines), args.json)


if __name__ == "__main__":
    main()
