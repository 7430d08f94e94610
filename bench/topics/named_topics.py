"""Prompts that start on their topic, for the long-text check: does plain decoding drift away from it?

The PPLM prefixes ("In summary", "The relationship", ...) name no topic, so plain decoding starts off every
topic and has nothing to drift away from. This writes the same 7 topics × 20 prefixes as ``--prompts topics``
as an ``ngrav eval`` JSONL file whose prompts first name the topic, ``"The following is about space. In
summary"``, with the same split of each word list (``split_wordlist``: conditioning half in ``topic``,
held-out half in ``heldout``). The topic's name is the only thing added, and a held-out word the lead
sentence spells (``religion`` is one) is dropped from ``heldout``, so no scoring word is in the prompt.

Usage::

    python bench/topics/named_topics.py out/named-topics.jsonl
    python bench/topics/named_topics.py --tuning out/named-topics-tune.jsonl     # for choosing settings
    VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/ngrav eval --engine vllm --prompts out/named-topics.jsonl \\
        --raw --profile auto --seeds 0-1 --max-new-tokens 256 --batch-size 20 --out out/named-long
    python bench/topics/long_texts.py out/named-long --judge-windows --json bench/results/named-long.json
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from narrative_gravity.eval.prompts import find_topics_folder, load_topics

# How each word list's name reads in a sentence; the others read as they are.
NAMES = {"legal": "the law"}


def lead(topic: str) -> str:
    """The sentence that names ``topic`` before the prefix.

    >>> lead("legal"), lead("space")
    ('The following is about the law.', 'The following is about space.')
    """
    return f"The following is about {NAMES.get(topic, topic)}."


def named_prompts(folder: Path | None = None, *, tuning: bool = False) -> list[dict[str, object]]:
    """One JSONL row per (topic, prefix) of ``--prompts topics`` (``tuning``: of ``topics-tune``), in its order
    (so indices line up)."""
    rows = []
    for p in load_topics(folder, tuning=tuning):
        sentence = lead(p.topic_name or "")
        spelled = {w.casefold() for w in re.findall(r"\w+", sentence)}
        rows.append(
            {
                "prompt": f"{sentence} {p.text}",
                "topic": list(p.topic_words),
                "heldout": [w for w in p.heldout_words if w.casefold() not in spelled],
                "topic_name": p.topic_name,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the JSONL file to write")
    ap.add_argument("--topics", type=Path, default=None, help="the topic bench folder (default: found as for `topics`)")
    ap.add_argument("--tuning", action="store_true", help="the tuning split (`topics-tune`'s words), for choosing")
    args = ap.parse_args(argv)
    rows = named_prompts(args.topics or find_topics_folder(), tuning=args.tuning)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    print(f"{len(rows)} prompts -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
