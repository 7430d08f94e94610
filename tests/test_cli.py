"""CLI error paths and help: fast, no model needed."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from narrative_gravity.cli import _read_prompts, app

runner = CliRunner()


def test_help_lists_commands():
    res = runner.invoke(app, ["--help"])
    assert res.exit_code == 0
    for cmd in ("generate", "compare", "inspect", "reach", "eval", "serve", "prune-context", "plan", "chat"):
        assert cmd in res.output


def test_generate_needs_profile_or_no_gravity(tmp_path):
    p = tmp_path / "p.txt"
    p.write_text("hello\n")
    res = runner.invoke(app, ["generate", "--prompts", str(p), "--output", str(tmp_path / "o.jsonl")])
    assert res.exit_code == 2
    assert "--profile" in res.output and "--no-gravity" in res.output


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("not json\n", "not valid JSON"),
        (json.dumps({"text": "x"}) + "\n", "string `prompt` field"),
        ("\n\n", "has no prompts"),
    ],
)
def test_bad_jsonl_prompt_files_name_the_line(tmp_path, content, message):
    p = tmp_path / "p.jsonl"
    p.write_text(content)
    res = runner.invoke(app, ["generate", "--prompts", str(p), "--no-gravity", "--output", str(tmp_path / "o.jsonl")])
    assert res.exit_code == 2
    assert message in res.output


def test_missing_prompt_file(tmp_path):
    res = runner.invoke(app, ["generate", "--prompts", str(tmp_path / "nope.txt"), "--no-gravity", "--output", "o"])
    assert res.exit_code == 2 and "does not exist" in res.output


def test_bad_profile_is_reported_with_the_key(tmp_path):
    prof = tmp_path / "bad.json"
    prof.write_text(json.dumps({"core_semantics": ["x"], "gravity_strenght": 2}))
    p = tmp_path / "p.txt"
    p.write_text("hello\n")
    res = runner.invoke(app, ["generate", "--prompts", str(p), "--profile", str(prof), "--output", "o.jsonl"])
    assert res.exit_code == 2
    assert "gravity_strenght" in res.output and "gravity_strength" in res.output


def test_txt_prompts_skip_blank_lines(tmp_path):
    p = tmp_path / "p.txt"
    p.write_text("one\n\n two \n")
    assert _read_prompts(p) == ["one", " two "]


def test_negative_max_new_tokens_is_rejected(tmp_path):
    p = tmp_path / "p.txt"
    p.write_text("x\n")
    res = runner.invoke(
        app, ["generate", "--prompts", str(p), "--no-gravity", "--max-new-tokens", "-3", "--output", "o.jsonl"]
    )
    assert res.exit_code == 2
    assert "max-new-tokens" in res.output
