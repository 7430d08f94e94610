"""bench/topics/named_topics.py: prompts that name their topic, in the order and split of ``--prompts topics``."""

from __future__ import annotations

import json
from pathlib import Path

from narrative_gravity.eval.prompts import load_prompts, load_topics


def _bench(tmp_path: Path) -> Path:
    (tmp_path / "wordlists").mkdir(parents=True)
    (tmp_path / "prefixes.txt").write_text("In summary\nThe relationship\n", encoding="utf-8")
    # "religion" sits at an odd position: held out, and spelled by the lead sentence
    (tmp_path / "wordlists" / "religion.txt").write_text("church\nreligion\nprayer\nfaith\ngod\n", encoding="utf-8")
    (tmp_path / "wordlists" / "legal.txt").write_text("court\njudge\nlaw\nlawyer\n", encoding="utf-8")
    return tmp_path


def test_the_file_loads_as_an_eval_set_aligned_with_the_topics(bench_script, tmp_path: Path) -> None:
    mod = bench_script("topics/named_topics")
    bench = _bench(tmp_path / "bench")
    out = tmp_path / "named.jsonl"
    assert mod.main([str(out), "--topics", str(bench)]) == 0
    named = load_prompts(out)
    plain = load_topics(bench)
    assert [p.index for p in named] == [p.index for p in plain]
    for n, p in zip(named, plain, strict=True):
        assert n.text == f"{mod.lead(p.topic_name)} {p.text}"
        assert n.topic_name == p.topic_name and n.topic_words == p.topic_words
        assert set(n.heldout_words) <= set(p.heldout_words)
        spelled = {w.casefold().strip(".") for w in n.text.split()}
        assert not spelled & {w.casefold() for w in n.heldout_words}
    religion = next(n for n in named if n.topic_name == "religion")
    assert religion.heldout_words == ("faith",)  # "religion" dropped: the prompt spells it
    legal = next(n for n in named if n.topic_name == "legal")
    assert legal.text.startswith("The following is about the law.") and legal.heldout_words == ("judge", "lawyer")
    assert all(json.loads(line)["prompt"] for line in out.read_text(encoding="utf-8").splitlines())
