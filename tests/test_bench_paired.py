"""bench/topics/paired.py: two arms of one eval run, paired on (prompt, seed)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "topics"


def _module():
    sys.path.insert(0, str(BENCH))  # the script imports run_io from its own folder
    try:
        spec = importlib.util.spec_from_file_location("paired", BENCH / "paired.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


def _row(arm: str, prompt: int, seed: int, topic: str, success: float) -> dict:
    return {"profile": arm, "prompt_index": prompt, "seed": seed, "topic": topic, "metrics": {"topic_success": success}}


def test_pairs_only_shared_texts_and_reads_the_direction() -> None:
    paired = _module()
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
