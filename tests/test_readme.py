"""The README a newcomer reads: short, with tables that fit, and Python examples that run as written. Every
```python block marked ``<!-- runnable -->`` in README.md and docs/*.md runs on its own, in a fresh namespace (no
block leans on another), on the real default model."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
_BLOCK = re.compile(r"<!-- runnable -->\s*\n```python\n(.*?)\n```", re.DOTALL)


def runnable_blocks(text: str) -> list[str]:
    """The code of each ```python block right after a ``<!-- runnable -->`` line."""
    return _BLOCK.findall(text)


def _documents() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def test_the_readme_is_short_and_its_tables_fit() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text) <= 12_000, f"README.md has {len(text)} characters; keep it to 12,000 (move detail to docs/)"
    long = [c[:60] for line in text.splitlines() if line.startswith("|") for c in line.strip("|").split(" | ")]
    long = [c for c in long if len(c) > 300]
    assert not long, f"table cells over 300 characters: {long}"


def test_the_readme_example_is_one_import_and_prints_its_result() -> None:
    blocks = runnable_blocks(README.read_text(encoding="utf-8"))
    assert blocks, "README.md needs a runnable example"
    first = blocks[0]
    imports = [line for line in first.splitlines() if line.startswith(("import ", "from "))]
    assert imports == ["import narrative_gravity as ng"]  # one import line, the public API
    assert "ng.generate(" in first and "print(" in first
    python = runnable_blocks((ROOT / "docs" / "python.md").read_text(encoding="utf-8"))
    assert any("ng.processor(" in code for code in python)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("doc", "index"),
    [(p.relative_to(ROOT).as_posix(), i) for p in _documents() for i in range(len(runnable_blocks(p.read_text())))],
)
def test_runnable_python_blocks_run_on_their_own(doc: str, index: int, capsys: pytest.CaptureFixture[str]) -> None:
    code = runnable_blocks((ROOT / doc).read_text(encoding="utf-8"))[index]
    namespace: dict[str, object] = {"__name__": "readme"}
    exec(compile(code, f"{doc} block {index + 1}", "exec"), namespace)
    printed = capsys.readouterr().out
    assert printed.strip(), "a runnable example prints its result"
    if doc == "README.md" and index == 0:
        result = namespace["result"]
        assert result.text and result.text in printed and result.new_tokens > 0
        assert set(result.trace_means) >= {"entropy", "kl", "strength"}
