"""Reports of an eval run, from synthetic results (no model): summary, Markdown, HTML, and a real browser render."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from narrative_gravity.eval import ResultStore, export_markdown, write_reports
from narrative_gravity.eval.store import RUN_FILE

CHROMIUM = Path("/usr/bin/chromium")


def _trace(rng: np.random.Generator, n: int, lam: float) -> dict[str, list[float]]:
    return {
        "entropy": list(rng.uniform(1, 3, n)),
        "mass": list(rng.uniform(0, 0.2, n)),
        "mass_after": list(rng.uniform(0, 0.2, n) + lam / 10),
        "kl": [lam / 20] * n,
        "strength": [lam] * n,
    }


def make_run(folder: Path, *, n_prompts: int = 12, seeds: tuple[int, ...] = (0, 1)) -> Path:
    """A finished run with a clear effect on topic success and relevance and none on length."""
    rng = np.random.default_rng(0)
    topics = ("space", "legal")
    rows = []
    for i in range(n_prompts):
        topic = topics[i % 2]
        for s in seeds:
            base = {
                "topic_success": float(rng.random() < 0.2),
                "topic_relevance": float(rng.uniform(0.1, 0.3)),
                "off_topic_rate": 0.0,
                "length": 40.0,
                "distinct_2": float(rng.uniform(0.8, 1.0)),
                "judge_ppl": float(rng.uniform(20, 40)),
                "tokens_per_s": float(rng.uniform(50, 60)),
                "mean_kl": 0.0,
                "mean_strength": 0.0,
            }
            grav = dict(base)
            grav.update(
                topic_success=1.0,
                topic_relevance=base["topic_relevance"] + 0.2,
                judge_ppl=base["judge_ppl"] * 1.3,
                mean_kl=0.4,
                mean_strength=2.0,
            )
            common = {"prompt_index": i, "seed": s, "topic": topic, "prompt": f"Prefix {i} <b>&", "new_tokens": 40}
            rows.append(
                {
                    **common,
                    "profile": "control",
                    "text": "plain text",
                    "batch_size": 2,
                    "batch_s": 1.0,
                    "metric_s": 0.1,
                    "metrics": base,
                    "metrics_vs": {"auto": base},
                    "trace": _trace(rng, 40, 0.0),
                }
            )
            rows.append(
                {
                    **common,
                    "profile": "auto",
                    "profile_used": topic,
                    "text": f"{topic} text",
                    "batch_size": 2,
                    "batch_s": 1.1,
                    "metric_s": 0.1,
                    "metrics": grav,
                    "trace": _trace(rng, 40, 2.0),
                }
            )
    folder.mkdir(parents=True, exist_ok=True)
    ResultStore(folder / "results.jsonl").append(rows)
    manifest = {
        "settings": {"prompts": "topics", "profiles": ["auto"], "seeds": list(seeds), "max_new_tokens": 40},
        "arms": ["control", "auto"],
        "prompts": [{"index": i, "text": f"Prefix {i}"} for i in range(n_prompts)],
    }
    (folder / RUN_FILE).write_text(json.dumps(manifest))
    return folder


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    d = make_run(tmp_path_factory.mktemp("report") / "run")
    write_reports(d)
    return d


def test_summary_has_paired_verdicts_and_a_summary_line(run_dir):
    s = json.loads((run_dir / "summary.json").read_text())
    comp = s["comparisons"]["auto"]["metrics"]
    assert s["comparisons"]["auto"]["pairs"] == 24 and s["rows"] == s["expected_rows"] == 48
    assert comp["topic_success"]["verdict"] == "better" and comp["topic_relevance"]["verdict"] == "better"
    assert comp["judge_ppl"]["verdict"] == "worse" and comp["length"]["verdict"] == "no clear difference"
    assert comp["mean_kl"]["verdict"] == "higher"  # reported, not judged
    line = s["summary_lines"][0]
    assert line.startswith("auto vs control:") and "judge_ppl (worse)" in line and "mean_kl" not in line
    assert set(s["topics"]) == {"space", "legal"} and s["topics"]["space"]["auto"]["topic_success"] == 1.0
    assert s["plots"] == {"metrics": "metrics.png", "pareto": "pareto.png", "traces": "traces.png"}


def test_markdown_references_the_plots_relatively(run_dir, tmp_path):
    md = (run_dir / "report.md").read_text()
    assert "| topic_success | ↑ |" in md and "![pareto](pareto.png)" in md
    for name in ("metrics", "pareto", "traces"):
        assert (run_dir / f"{name}.png").stat().st_size > 5000
    out = export_markdown(run_dir, tmp_path / "docs" / "smoke.md", preamble="Ran: `ngrav eval ...`")
    text = out.read_text()
    assert "![traces](smoke-traces.png)" in text and (tmp_path / "docs" / "smoke-traces.png").exists()
    assert text.startswith("# smoke\n\nRan: `ngrav eval ...`")


def test_html_is_self_contained(run_dir):
    page = (run_dir / "report.html").read_text()
    images = re.findall(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'", page)
    assert len(images) == 3 and all(base64.b64decode(b)[:8] == b"\x89PNG\r\n\x1a\n" for b in images)
    assert "Prefix 0 &lt;b&gt;&amp;" in page  # text is escaped
    assert not re.search(r"(src|href)=['\"](?!data:)", page)  # nothing to fetch


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs /usr/bin/chromium (Debian package `chromium`)")
def test_html_report_renders_in_a_headless_browser(run_dir, tmp_path):
    from matplotlib.image import imread

    shot = tmp_path / "shot.png"
    cmd = [
        str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}", "--window-size=1200,2000",
        (run_dir / "report.html").resolve().as_uri(),
    ]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert shot.exists(), f"chromium wrote no screenshot (rc={res.returncode}): {res.stderr[-2000:]}"
    assert shot.stat().st_size > 20_000
    img = imread(shot)
    assert img.shape[0] == 2000 and img.shape[1] == 1200
    rgb = img[..., :3].reshape(-1, 3)
    assert float(rgb.std()) > 0.05  # not a blank page
    colours = np.unique((rgb * 255).astype(np.uint8), axis=0)
    assert len(colours) > 50  # text, tables and embedded plots, not a single colour
    shutil.rmtree(tmp_path / "profile", ignore_errors=True)
