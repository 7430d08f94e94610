"""CLI error paths and help: fast, no model needed."""

from __future__ import annotations

import importlib.util
import json

import pytest
from typer.testing import CliRunner

from narrative_gravity.cli.common import read_prompts
from narrative_gravity.cli.main import app

runner = CliRunner()


def test_help_lists_commands():
    res = runner.invoke(app, ["--help"])
    assert res.exit_code == 0
    for cmd in ("generate", "compare", "inspect", "reach", "eval", "serve", "prune-context", "plan", "chat"):
        assert cmd in res.output


def test_short_help_and_version():
    import narrative_gravity as ng

    assert runner.invoke(app, ["compare", "-h"]).output == runner.invoke(app, ["compare", "--help"]).output
    assert "--held-out" in runner.invoke(app, ["compare", "-h"]).output
    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0 and res.output.strip() == f"narrative-gravity {ng.__version__}"


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
    assert read_prompts(p) == ["one", " two "]


def test_negative_max_new_tokens_is_rejected(tmp_path):
    p = tmp_path / "p.txt"
    p.write_text("x\n")
    res = runner.invoke(
        app, ["generate", "--prompts", str(p), "--no-gravity", "--max-new-tokens", "-3", "--output", "o.jsonl"]
    )
    assert res.exit_code == 2
    assert "max-new-tokens" in res.output


# --------------------------------------------------------------------------------------------------
# every user mistake: one line naming the problem, exit code 2, no traceback, before a model loads


def _one_line_error(res, *needles):
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and (res.exception is None or isinstance(res.exception, SystemExit))
    assert res.output.strip().startswith("error:") or "Error" in res.output, res.output
    for needle in needles:
        assert needle in res.output, (needle, res.output)


@pytest.fixture()
def prompts(tmp_path):
    p = tmp_path / "p.txt"
    p.write_text("hello\n")
    return p


def test_prompts_that_are_not_utf8_or_a_folder(tmp_path, prompts):
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\xe9\n".encode("latin-1"))
    chunks = tmp_path / "c.jsonl"
    chunks.write_bytes(b'{"text": "caf\xe9"}\n')
    out = str(tmp_path / "o.jsonl")
    for path, needle in ((latin, "not UTF-8"), (tmp_path, "is a folder")):
        _one_line_error(
            runner.invoke(app, ["generate", "--prompts", str(path), "--no-gravity", "--output", out]), needle
        )
        _one_line_error(
            runner.invoke(app, ["eval", "--prompts", str(path), "--profile", "auto", "--out", str(tmp_path / "r")]),
            needle,
        )
    _one_line_error(
        runner.invoke(app, ["prune-context", "--question", "q", "--documents", str(chunks), "--count", "words"]),
        "not UTF-8",
    )


def test_missing_model_path_and_fake_gguf(tmp_path, prompts):
    fake = tmp_path / "model.gguf"
    fake.write_text("not a model")
    out = str(tmp_path / "o.jsonl")
    for model, needle in ((str(tmp_path / "missing"), "neither a known name"), (str(fake), "not a GGUF file")):
        _one_line_error(
            runner.invoke(
                app, ["generate", "--prompts", str(prompts), "--no-gravity", "--output", out, "--model", model]
            ),
            needle,
        )
        _one_line_error(runner.invoke(app, ["serve", "--model", model, "--store", str(tmp_path / "s")]), needle)
        _one_line_error(runner.invoke(app, ["chat", "--model", model], input="hi\n"), needle)


def test_a_device_the_machine_lacks_is_named_before_anything_loads(tmp_path, prompts):
    import torch

    gen = ["generate", "--prompts", str(prompts), "--no-gravity", "--output", str(tmp_path / "o.jsonl")]
    serve = ["serve", "--store", str(tmp_path / "s")]
    evaluate = ["eval", "--prompts", "topics", "--profile", "auto", "--out", str(tmp_path / "e")]
    _one_line_error(runner.invoke(app, [*gen, "--device", "tpu"]), "unknown device 'tpu'", "cuda:N", "auto")
    _one_line_error(runner.invoke(app, [*serve, "--device", "tpu"]), "unknown device 'tpu'")
    _one_line_error(runner.invoke(app, [*evaluate, "--device", "tpu"]), "unknown device 'tpu'", "cuda:N")
    _one_line_error(runner.invoke(app, [*evaluate, "--device", "cuda", "--engine", "vllm"]), "transformers engine")
    _one_line_error(runner.invoke(app, [*gen, "--device", "xla"]), "'xla' is not supported")
    _one_line_error(runner.invoke(app, [*gen, "--device", "cuda", "--engine", "vllm"]), "transformers engine")
    if not torch.cuda.is_available():
        for args in ([*gen, "--device", "cuda:1"], [*serve, "--device", "cuda"], [*evaluate, "--device", "cuda"]):
            _one_line_error(runner.invoke(app, args), "no usable CUDA GPU", "--device cpu")
    for made in ("o.jsonl", "s", "e"):
        assert not (tmp_path / made).exists(), made  # nothing was made


def test_output_paths_are_checked_before_generating(tmp_path, prompts):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for output, needle in ((a_file / "o.jsonl", "is a file, not a folder"), (tmp_path, "is a folder")):
        res = runner.invoke(
            app, ["generate", "--prompts", str(prompts), "--no-gravity", "--output", str(output), "--model", "/nope"]
        )
        _one_line_error(res, needle, str(output))  # reported before the (missing) model is even looked at
    res = runner.invoke(app, ["eval", "--prompts", str(prompts), "--profile", "auto", "--out", str(a_file)])
    _one_line_error(res, "--out", "is a file")


def test_debug_shows_the_traceback(tmp_path, prompts):
    args = ["generate", "--prompts", str(prompts), "--no-gravity", "--output", str(tmp_path / "o"), "--model", "/x"]
    assert "Traceback" not in runner.invoke(app, args).output
    res = runner.invoke(app, ["--debug", *args])
    assert res.exit_code == 2 and "Traceback" in res.output and "ModelNotFoundError" in res.output


def test_temperature_must_be_finite(prompts):
    for value in ("inf", "nan"):
        res = runner.invoke(
            app,
            ["generate", "--prompts", str(prompts), "--no-gravity", "--output", "o", "--temperature", value],
            env={"COLUMNS": "300"},
        )
        assert res.exit_code == 2 and "--temperature" in res.output, res.output
        assert value == "nan" or "finite" in res.output, res.output


def test_profile_with_unencodable_words(tmp_path, prompts):
    prof = tmp_path / "p.json"
    prof.write_text('{"core_semantics": ["\\ud800"]}')
    res = runner.invoke(app, ["generate", "--prompts", str(prompts), "--profile", str(prof), "--output", "o"])
    _one_line_error(res, "core_semantics.0", "cannot be encoded")


# --------------------------------------------------------------------------------------------------
# with the tiny model saved as a local folder


@pytest.fixture(scope="module")
def tiny_folder(tiny_model, tmp_path_factory):
    model, tokenizer = tiny_model
    folder = tmp_path_factory.mktemp("tiny-model")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_chat_skips_input_that_is_not_utf8(tiny_folder):
    res = runner.invoke(
        app, ["chat", "--model", str(tiny_folder), "--max-new-tokens", "3"], input=b"caf\xe9\nThe planet\n\n"
    )
    assert res.exit_code == 0, res.output
    assert "line 1 is not UTF-8" in res.output and res.output.count("assistant:") == 1
    assert "Traceback" not in res.output


def test_generate_writes_each_batch_as_it_finishes(tiny_folder, tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    prompts = tmp_path / "p.txt"
    total = 400
    prompts.write_text("".join(f"The planet {i}\n" for i in range(total)))
    out = tmp_path / "o.jsonl"
    cmd = [sys.executable, "-m", "narrative_gravity.cli.main", "generate", "--prompts", str(prompts), "--no-gravity"]
    cmd += ["--output", str(out), "--model", str(tiny_folder), "--batch-size", "1", "--max-new-tokens", "4", "--raw"]
    # a shell that starts the tests in the background hands its children SIGINT ignored; undo that
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=os.environ.copy(),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 120
        while (not out.exists() or out.read_text().count("\n") < 2) and time.monotonic() < deadline:
            assert proc.poll() is None, "generate ended early"
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    lines = out.read_text().splitlines()
    assert 2 <= len(lines) < total  # interrupted, and what was finished is kept
    rows = [json.loads(line) for line in lines]
    assert [r["prompt"] for r in rows] == [f"The planet {i}" for i in range(len(rows))]


# --------------------------------------------------------------------------------------------------
# --engine vllm: checked before anything loads; vLLM itself lives in .venv-vllm (see tests/test_vllm.py)

_HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.skipif(_HAS_VLLM, reason="vLLM is installed here; tests/test_vllm.py runs the engine")
def test_engine_vllm_without_vllm_names_the_setup(tmp_path, prompts):
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"core_semantics": ["planet"]}))
    gen = ["generate", "--prompts", str(prompts), "--profile", str(prof), "--output", str(tmp_path / "o.jsonl")]
    ev = ["eval", "--prompts", str(prompts), "--profile", str(prof), "--out", str(tmp_path / "run")]
    for args in (gen, ev):
        res = runner.invoke(app, [*args, "--engine", "vllm"], env={"COLUMNS": "300"})
        _one_line_error(res, "--engine vllm needs vLLM", "bash scripts/setup_vllm.sh", ".venv-vllm/bin/ngrav")
        assert len(res.output.strip().splitlines()) == 1, res.output
    assert not (tmp_path / "o.jsonl").exists() and not (tmp_path / "run").exists()


def test_engine_vllm_refuses_python_baselines_before_loading(tmp_path, prompts):
    out = tmp_path / "run"
    for spec, arm in (("weighted:4", "weighted-4"), ("article", "article")):
        args = ["eval", "--prompts", "topics", "--profile", "auto", "--profile", spec, "--out", str(out)]
        res = runner.invoke(
            app, [*args, "--engine", "vllm", "--model", str(tmp_path / "no-model-here")], env={"COLUMNS": "300"}
        )
        # the model path does not exist: the arm is refused before any model is even looked up
        _one_line_error(res, f"--profile {spec!r}", f"`{arm}`", "--engine hf")
    assert not out.exists()


def test_unknown_engine_is_refused(tmp_path, prompts):
    for cmd in (["generate", "--output", str(tmp_path / "o"), "--no-gravity"], ["eval", "--profile", "auto"]):
        args = [*cmd, "--prompts", str(prompts), "--engine", "tgi"]
        res = runner.invoke(app, [*args, *(["--out", str(tmp_path / "r")] if cmd[0] == "eval" else [])])
        _one_line_error(res, "--engine must be hf or vllm", "'tgi'")


def test_reach_topics_reads_the_shipped_word_lists(tiny_folder, monkeypatch):
    monkeypatch.delenv("NARRATIVE_GRAVITY_BENCH", raising=False)
    res = runner.invoke(app, ["reach", "--topics", "--model", str(tiny_folder)], terminal_width=200)
    assert res.exit_code in (0, 1), res.output  # 1: some list under 99% reachable on this tiny tokenizer
    for topic in ("computers", "legal", "military", "politics", "religion", "science", "space"):
        assert topic in res.output


def test_reach_without_lists_or_topics_says_what_to_give():
    res = runner.invoke(app, ["reach"])
    assert res.exit_code == 2 and "--topics" in res.output


def test_the_command_line_loads_without_torch():
    """`ngrav --help` stays fast: building the app imports no torch or transformers (each command imports them)."""
    import subprocess
    import sys

    code = "import sys, narrative_gravity.cli.main; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"the CLI imports {out.strip()} at start-up; import it inside the command"
