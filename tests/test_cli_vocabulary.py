"""One vocabulary across the ``ngrav`` commands: a flag means one thing everywhere, hidden old spellings included.

A flag's meaning is its parameter's name (an old spelling kept as a hidden alias is named ``<name>_alias``), whether
it is a switch, and whether it takes a number or a text/path (a flag that may repeat, as ``eval --profile``, still
means the same as where it is given once). A hidden option whose help starts
``renamed:`` only ends an old command line with an error naming the new flag, so it gives its flag no meaning.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from narrative_gravity.cli.main import app

runner = CliRunner()


def _commands(cmd: Any, path: tuple[str, ...] = ()) -> list[tuple[str, Any]]:
    if hasattr(cmd, "commands"):
        return [leaf for name, sub in cmd.commands.items() for leaf in _commands(sub, (*path, name))]
    return [(" ".join(path), cmd)]


def _kind(param: Any) -> str:
    if param.is_flag:
        return "switch"
    annotation = param.type_descriptor.annotation
    args = getattr(annotation, "__args__", ())
    numeric = annotation in (int, float) or any(a in (int, float) for a in args)
    return "number" if numeric else "text"


def _meaning(param: Any) -> tuple[str, str]:
    return param.name.removesuffix("_alias"), _kind(param)


def meanings(root: Any) -> dict[str, dict[tuple[str, str], list[str]]]:
    """flag -> meaning -> the commands that give the flag that meaning (leaf commands, hidden options included)."""
    found: dict[str, dict[tuple[str, str], list[str]]] = defaultdict(lambda: defaultdict(list))
    for name, cmd in _commands(root):
        for param in cmd.params:
            if param.param_type_name != "option" or (param.help or "").startswith("renamed:"):
                continue
            for flag in (*param.opts, *param.secondary_opts):
                found[flag][_meaning(param)].append(name)
    return found


def clashes(root: Any) -> list[str]:
    return [
        f"{flag}: " + "; ".join(f"{m} in {', '.join(cmds)}" for m, cmds in by.items())
        for flag, by in sorted(meanings(root).items())
        if len(by) > 1
    ]


def test_one_flag_one_meaning():
    assert clashes(typer.main.get_command(app)) == []


def test_the_check_catches_a_clash():
    """Two commands giving --seeds a count and a list (as compare and eval did) is reported."""
    demo = typer.Typer()

    @demo.command()
    def one(seeds: int = typer.Option(3, "--seeds")) -> None: ...

    @demo.command()
    def two(seeds: str = typer.Option("0-4", "--seeds")) -> None: ...

    assert [c.split(":")[0] for c in clashes(typer.main.get_command(demo))] == ["--seeds"]


# One default per shared option; a command that needs another says why in its help.
DEFAULTS = {"--max-new-tokens": 80, "--top-k": 10, "--seed": 0, "--engine": "hf", "--device": "cpu"}
EXCEPTIONS = {("eval", "--max-new-tokens"): 60, ("profile promote", "--max-new-tokens"): 60, ("plan", "--max-new-tokens"): 128}  # fmt: skip


def test_one_default_per_option():
    wrong = []
    for name, cmd in _commands(typer.main.get_command(app)):
        for param in cmd.params:
            for flag in param.opts:
                if flag in DEFAULTS:
                    want = EXCEPTIONS.get((name, flag), DEFAULTS[flag])
                    if param.default != want:
                        wrong.append(f"{name} {flag}: {param.default!r}, want {want!r}")
                    if (name, flag) in EXCEPTIONS and str(want) not in (param.help or ""):
                        wrong.append(f"{name} {flag}: the help must say why the default is {want}")
    assert wrong == []


def test_switches_show_no_value():
    for name, cmd in _commands(typer.main.get_command(app)):
        for param in cmd.params:
            if getattr(param, "is_flag", False) and not param.hidden:
                assert param.metavar == "", f"{name} {param.opts}: a switch must not show <bool>"


def test_serve_groups_its_options():
    cmd = typer.main.get_command(app).commands["serve"]
    panels = {p.rich_help_panel for p in cmd.params if p.param_type_name == "option" and p.name != "help"}
    assert None not in panels and {"Server", "Model and engine", "vLLM engine"} <= panels


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["compare", "--profile", "p.json", "--prompt", "x", "--seeds", "8"], "--seeds is now --samples N"),
        (["shortlist", "build", "--output", "x.json", "--prompts", "10"], "--prompts is now --num-prompts"),
        (["profile", "report", "space", "--json"], "--json is now --format json"),
    ],
)
def test_renamed_flags_name_the_new_one(args, needle, tmp_path, monkeypatch):
    monkeypatch.setenv("NARRATIVE_GRAVITY_STORE", str(tmp_path / "store"))
    res = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert res.exit_code == 2
    assert needle in res.output


def test_old_spellings_still_parse(tmp_path):
    """--chunks and --json PATH reach the same check as --documents and --output (here: a missing file)."""
    missing = str(tmp_path / "nope.jsonl")
    for flag in ("--documents", "--chunks"):
        res = runner.invoke(app, ["prune-context", "--question", "q", flag, missing, "--count", "words"])
        assert res.exit_code == 2 and "--documents" in res.output and "does not exist" in res.output
    folder = tmp_path / "a-folder"
    folder.mkdir()
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "x"}\n')
    for flag in ("--output", "--json"):
        res = runner.invoke(app, ["prune-context", "--question", "q", "--documents", str(path), flag, str(folder)])
        assert res.exit_code == 2 and "--output" in res.output and "is a folder" in res.output
    both = ["prune-context", "--question", "q", "--documents", str(path), "--chunks", str(path)]
    res = runner.invoke(app, both)
    assert res.exit_code == 2 and "old spelling of --documents" in res.output


def test_help_hides_old_spellings():
    out = runner.invoke(app, ["prune-context", "-h"], env={"COLUMNS": "200"}).output
    assert "--documents" in out and "--chunks" not in out and "--json" not in out
    lines = runner.invoke(app, ["generate", "-h"], env={"COLUMNS": "200"}).output.splitlines()
    # typer's own -h/--help option still shows <bool>; every switch of ours shows no value
    assert [line for line in lines if "<bool>" in line and "--help" not in line and "-h " not in line] == []


def test_docs_use_the_new_spellings():
    root = Path(__file__).resolve().parents[1]
    texts = [root / "README.md", *(root / "docs").glob("*.md"), *(root / "scripts").glob("*.sh")]
    old = ("ngrav compare", "--seeds"), ("ngrav prune-context", "--chunks"), ("ngrav shortlist build", "--out ")
    for path in texts:
        for line in path.read_text(encoding="utf-8").splitlines():
            for command, flag in old:
                assert not (command in line and flag in line), f"{path.name}: {line.strip()}"
