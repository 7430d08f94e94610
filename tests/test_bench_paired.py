"""bench/topics/paired.py: two arms of one eval run, paired on (prompt, seed)."""

from __future__ import annotations

import pytest


def _row(arm: str, prompt: int, seed: int, topic: str, success: float) -> dict:
    return {"profile": arm, "prompt_index": prompt, "seed": seed, "topic": topic, "metrics": {"topic_success": success}}


def test_pairs_only_shared_texts_and_reads_the_direction(bench_script) -> None:
    paired = bench_script("topics/paired")
    rows = [_row("auto", i, 0, "animal" if i < 20 else "ocean", 0.0) for i in range(40)]
    rows += [_row("lead", i, 0, "animal" if i < 20 else "ocean", 1.0 if i < 20 else 0.0) for i in range(40)]
    rows += [_row("lead", 99, 0, "animal", 1.0)]  # no auto text to pair with: left out
    out = paired.compare(rows, "auto", "lead", "topic_success")
    assert out["n"] == 40 and out["diff"] == pytest.approx(0.5)
    assert out["ci"][0] > 0 and out["verdict"] == "better"
    assert out["topics"]["animal"]["diff"] == 1.0 and out["topics"]["ocean"]["diff"] == 0.0
    assert (out["topics_ahead"], out["topics_behind"]) == (1, 0)
    back = paired.compare(rows, "lead", "auto", "topic_success")
    assert back["diff"] == pytest.approx(-0.5) and back["verdict"] == "worse"
    with pytest.raises(SystemExit, match="share no"):
        paired.compare(rows, "auto", "plain", "topic_success")
