"""Do two ``ngrav eval`` runs write the same texts? Per arm, how many (prompt, seed) continuations are the same
token for token, over the keys both runs hold; for those that differ, the first step where they part.

A change that should not move decoding (a faster kernel, a refactor) shows here as every text the same; a
change that moves λ by a rounding step shows as a few texts parting late.

Usage::

    python bench/topics/same_texts.py RUN_A RUN_B [--json OUT]

>>> a = [{"profile": "auto", "prompt_index": 0, "seed": 0, "token_ids": [1, 2, 3]}]
>>> b = [{"profile": "auto", "prompt_index": 0, "seed": 0, "token_ids": [1, 2, 4]}]
>>> compare(a, b)["auto"]
{'keys': 1, 'same': 0, 'first_difference': [2]}
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def rows(run: Path) -> list[dict[str, Any]]:
    """The rows of ``run/results.jsonl``."""
    path = run / "results.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path} does not exist; give the --out folder of an `ngrav eval` run")
    with path.open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def compare(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per arm: keys in both runs, how many have the same token ids, and where the others first differ."""
    key = lambda r: (r["profile"], r["prompt_index"], r["seed"])  # noqa: E731
    theirs = {key(r): r["token_ids"] for r in b}
    out: dict[str, dict[str, Any]] = {}
    for r in a:
        other = theirs.get(key(r))
        if other is None:
            continue
        arm = out.setdefault(r["profile"], {"keys": 0, "same": 0, "first_difference": []})
        arm["keys"] += 1
        mine = r["token_ids"]
        if mine == other:
            arm["same"] += 1
        else:
            k = next((i for i, (x, y) in enumerate(zip(mine, other)) if x != y), min(len(mine), len(other)))
            arm["first_difference"].append(k)
    for arm in out.values():
        arm["first_difference"].sort()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_a", type=Path)
    ap.add_argument("run_b", type=Path)
    ap.add_argument("--json", type=Path, default=None, help="write the comparison here")
    args = ap.parse_args(argv)
    result = compare(rows(args.run_a), rows(args.run_b))
    if not result:
        print("the runs share no (profile, prompt, seed) keys", file=sys.stderr)
        return 1
    for arm, r in sorted(result.items()):
        parted = r["first_difference"]
        where = f"; the others part at steps {parted}" if parted else ""
        print(f"{arm}: {r['same']} of {r['keys']} texts the same{where}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
