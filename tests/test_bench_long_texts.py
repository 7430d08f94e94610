"""bench/topics/long_texts.py: joining the arms of runs made with one setup."""

from __future__ import annotations

from pathlib import Path

import pytest

SETTINGS = {"prompts": "p.jsonl", "seeds": [0, 1], "max_new_tokens": 256, "model": None, "engine": "vllm"}


def _rows(*arms: str) -> list[dict]:
    return [{"profile": a, "prompt_index": i, "seed": 0, "text": f"{a} {i}"} for a in arms for i in range(3)]


def test_a_second_run_adds_its_new_arms_and_not_its_plain_rows(bench_script) -> None:
    long_texts = bench_script("topics/long_texts")
    first = _rows("control", "auto")
    added = long_texts.joined_arms(
        first, {"settings": SETTINGS}, _rows("control", "late"), {"settings": SETTINGS}, Path("b")
    )
    assert [r["profile"] for r in added] == ["late"] * 3


def test_runs_of_another_setup_are_refused_by_name(bench_script) -> None:
    long_texts = bench_script("topics/long_texts")
    other = {"settings": {**SETTINGS, "max_new_tokens": 128, "seeds": [0]}}
    with pytest.raises(SystemExit, match="differs from the first run in seeds, max_new_tokens"):
        long_texts.joined_arms(_rows("control"), {"settings": SETTINGS}, _rows("late"), other, Path("b"))
