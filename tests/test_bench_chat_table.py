"""bench/chat/chat_table.py: arms against `ask`, paired on (prompt, seed), and the success-against-fluency plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def _row(arm: str, prompt: int, success: float, ppl: float) -> dict:
    metrics = {"topic_success": success, "judge_ppl": ppl, "distinct_1": 0.7, "distinct_3": 0.9, "length": 80.0}
    metrics |= {"description_relevance": 0.2, "mean_kl": 0.02 if arm == "pull" else 0.0}
    return {
        "profile": arm,
        "prompt_index": prompt,
        "seed": 0,
        "prompt": f"request {prompt % 5}",
        "batch_size": 1,
        "batch_s": 1.0,
        "new_tokens": 80,
        "metrics": metrics,
    }


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """40 prompts: `ask` succeeds on a quarter at perplexity 10, `pull` on half at 11, plain on none at 10."""
    rows = [_row("control", i, 0.0, 10.0) for i in range(40)]
    rows += [_row("ask", i, float(i % 4 == 0), 10.0) for i in range(40)]
    rows += [_row("pull", i, float(i % 2 == 0), 11.0) for i in range(40)]
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "results.jsonl").write_text("\n".join(json.dumps(r) for r in rows), encoding="utf-8")
    return folder


def test_ratios_are_against_ask(bench_script, run: Path) -> None:
    chat_table = bench_script("chat/chat_table")
    rows = {r["arm"]: r for r in chat_table.table(chat_table.load([run]))}
    assert rows["pull"]["success"] == pytest.approx(0.5)
    assert rows["pull"]["success_ratio_vs_base"] == pytest.approx(2.0)
    assert rows["pull"]["success_diff_vs_base"] == pytest.approx(0.25)
    assert rows["pull"]["ppl_median_ratio"] == pytest.approx(1.1)
    assert rows["control"]["success_ratio_vs_base"] == 0.0


def test_plots_runs_and_stored_tables(bench_script, run: Path, tmp_path: Path) -> None:
    chat_table = bench_script("chat/chat_table")
    stored, png = tmp_path / "t.json", tmp_path / "f.png"
    assert chat_table.main([str(run), "--json", str(stored), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    again = tmp_path / "g.png"
    assert chat_table.main(["--tables", str(stored), "--plot", str(again), "--x", "mean"]) == 0
    assert again.stat().st_size > 10_000
    with pytest.raises(SystemExit):  # tables are only plotted
        chat_table.main(["--tables", str(stored)])
    named = tmp_path / "n.png"
    assert chat_table.main(["--tables", str(stored), "--plot", str(named), "--label", "pull=the default"]) == 0
    assert named.read_bytes() != png.read_bytes()  # the same table and axes, another label
    with pytest.raises(SystemExit):  # a label names its arm
        chat_table.main(["--tables", str(stored), "--plot", str(named), "--label", "the default"])
