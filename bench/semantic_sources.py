"""Which token embeddings make the better semantic field: MiniLM or the generator's own input embeddings?

For each of the seven PPLM topic word lists (``/work/shared/bench/topics/wordlists/*.txt``, lines stripped,
blank lines dropped) the lines are split alternately: even lines (0, 2, …) condition the field, odd lines
are held out. A field is built from the conditioning half with each source on the generator's tokenizer
(SmolLM2 by default), and we report:

- ``recall``: the share of held-out words (not also in the conditioning half) whose single-token
  after-a-space form (``" planet"``) gets a positive field value; words without such a form are skipped;
- ``pos``: how many tokens are positive in total (a precision proxy: fewer is more precise at equal recall).

Three settings per source: the defaults of :func:`~narrative_gravity.fields.build_semantic_field`
(``z >= 3``, at most 300 tokens), and fixed budgets of the top 300 and 1000 tokens (no z threshold) so that
both sources are compared at the same number of positive tokens. The lexical field (the conditioning
words' surface forms) is the baseline.

Run::

    python bench/semantic_sources.py --json bench/semantic_sources.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

WORDLISTS = Path("/work/shared/bench/topics/wordlists")
BUDGETS = (300, 1000)


def split_list(path: Path) -> tuple[list[str], list[str]]:
    lines = [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines()]
    lines = [ln for ln in lines if ln]
    cond, held = lines[0::2], lines[1::2]
    seen = {w.casefold() for w in cond}
    return cond, [w for w in held if w.casefold() not in seen]


def single_token_ids(tokenizer: Any, words: list[str]) -> dict[str, int]:
    out = {}
    for w, ids in zip(words, tokenizer([" " + w for w in words], add_special_tokens=False)["input_ids"]):
        if len(ids) == 1:
            out[w] = ids[0]
    return out


def recall(values: torch.Tensor, targets: dict[str, int]) -> float:
    if not targets:
        return float("nan")
    return sum(float(values[i]) > 0 for i in targets.values()) / len(targets)


def budget_values(z: torch.Tensor, k: int) -> torch.Tensor:
    """1 on the ``k`` tokens with the highest z-score, 0 elsewhere (no threshold)."""
    v = torch.zeros_like(z)
    v[torch.topk(z, k).indices] = 1.0
    return v


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="generator (default: smollm2)")
    ap.add_argument("--wordlists", type=Path, default=WORDLISTS)
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args(argv)

    from narrative_gravity.fields import build_lexical_field, build_semantic_field, semantic_scores
    from narrative_gravity.models import load_model

    console = Console(stderr=True)
    model, tok = load_model(args.model)
    rows = []
    for path in sorted(args.wordlists.glob("*.txt")):
        cond, held = split_list(path)
        targets = single_token_ids(tok, held)
        row: dict[str, Any] = {"topic": path.stem, "cond": len(cond), "held": len(held), "held_1tok": len(targets)}
        lex = build_lexical_field(tok, cond, name=path.stem)
        row["lexical"] = {"recall": recall(lex.values, targets), "pos": int((lex.values > 0).sum())}
        for source in ("lm", "minilm"):
            t0 = time.perf_counter()
            field = build_semantic_field(tok, cond, source=source, model=model, name=path.stem)
            z = semantic_scores(tok, cond, source=source, model=model)
            res = {"recall": recall(field.values, targets), "pos": int((field.values > 0).sum())}
            for k in BUDGETS:
                res[f"recall@{k}"] = recall(budget_values(z, k), targets)
            res["seconds"] = round(time.perf_counter() - t0, 2)
            row[source] = res
        rows.append(row)
        console.log(f"{path.stem}: done")

    def pct(x: float) -> str:
        return "n/a" if x != x else f"{100 * x:.0f}%"

    header = ["topic", "cond / held (1-token)", "lexical", "lm (defaults)", "minilm (defaults)"]
    for k in BUDGETS:
        header += [f"lm @{k}", f"minilm @{k}"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        cells = [
            r["topic"],
            f"{r['cond']} / {r['held']} ({r['held_1tok']})",
            f"{pct(r['lexical']['recall'])} ({r['lexical']['pos']})",
            f"{pct(r['lm']['recall'])} ({r['lm']['pos']})",
            f"{pct(r['minilm']['recall'])} ({r['minilm']['pos']})",
        ]
        for k in BUDGETS:
            cells += [pct(r["lm"][f"recall@{k}"]), pct(r["minilm"][f"recall@{k}"])]
        lines.append("| " + " | ".join(cells) + " |")
    total = sum(r["held_1tok"] for r in rows)

    def micro(key: str, sub: str) -> float:
        return sum(r[key][sub] * r["held_1tok"] for r in rows if r["held_1tok"]) / max(total, 1)

    cells = ["**all** (micro)", f"({total})"]
    cells += [pct(micro(s, "recall")) for s in ("lexical", "lm", "minilm")]
    for k in BUDGETS:
        cells += [pct(micro("lm", f"recall@{k}")), pct(micro("minilm", f"recall@{k}"))]
    lines.append("| " + " | ".join(cells) + " |")
    print("\n".join(lines))
    print(
        "\ncells: held-out recall (positive tokens in the field); @k: recall when the k tokens with the highest z are positive"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
