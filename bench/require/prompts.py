"""Prompt sets for the required-words benchmark: topic prefixes, each with two of its topic's words to contain.

    python bench/require/prompts.py test --pairs 1 --out out/require-test.jsonl   # the PPLM seven (held-out words)
    python bench/require/prompts.py tune --out out/require-tune.jsonl   # five Empath tuning topics

Each prompt is a topic prefix as in the topic benchmark: its ``topic`` is the conditioning half of the topic's
word list (what ``--profile auto`` and ``auto:TEMPLATE`` build the topic default from) and its ``heldout`` the
other half. The rule for the required words, fixed before any run: from the *held-out* half, keep single
lowercase words of at least four letters, order them by the SHA-256 of ``topic:word`` and take the first
``2 × pairs``; each pair is required of every prefix (its ``require``). The test set of docs/benchmarks.md is the
PPLM seven × 20 prefixes × one pair (``--pairs 1``: 140 prompts, 280 required words); the tuning set is the first
five ``empath-tune`` topics × 20 prefixes × one pair (100 prompts), so no test word or test topic is tuned on.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
from pathlib import Path

from narrative_gravity.eval.lexicon import TUNE_TOPICS, clean_words, read_categories
from narrative_gravity.eval.prompts import find_topics_folder, read_prefixes, split_wordlist

WORD = re.compile(r"[a-z]{4,}")


def pick(topic: str, heldout: list[str], n: int) -> list[str]:
    """The ``n`` words of the rule above (fewer if the list is short)."""
    words = [w for w in dict.fromkeys(heldout) if WORD.fullmatch(w)]
    return sorted(words, key=lambda w: hashlib.sha256(f"{topic}:{w}".encode()).hexdigest())[:n]


def prompt_set(which: str, pairs: int) -> list[dict[str, object]]:
    root = find_topics_folder()
    prefixes = read_prefixes(root)
    if which == "test":
        lists = {p.stem: p.read_text(encoding="utf-8").splitlines() for p in sorted((root / "wordlists").glob("*.txt"))}
    else:
        lexicon = read_categories()
        lists = {name: clean_words(lexicon[name]) for name in list(TUNE_TOPICS)[:5]}
    rows = []
    for topic, lines in lists.items():
        cond, held = split_wordlist(lines)
        words = pick(topic, list(held), 2 * pairs)
        for k in range(0, len(words) - 1, 2):
            pair = words[k : k + 2]
            rows += [
                {"prompt": p, "topic_name": topic, "topic": list(cond), "heldout": list(held), "require": pair}
                for p in prefixes
            ]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("which", choices=["test", "tune"])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--pairs", type=int, default=None, help="word pairs per topic (default 1)")
    args = ap.parse_args()
    pairs = args.pairs if args.pairs is not None else 1
    rows = prompt_set(args.which, pairs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    pairs_seen = sorted({(r["topic_name"], "+".join(r["require"])) for r in rows})
    print(f"{len(rows)} prompts, {len(pairs_seen)} word pairs -> {args.out}")
    for topic, pair in pairs_seen:
        print(f"  {topic}: {pair}")


if __name__ == "__main__":
    main()
