"""The README's Python examples run as written: every ```python block marked ``<!-- runnable -->`` runs, in order,
in one namespace (a later block may use what an earlier one made), on the real default model."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
_BLOCK = re.compile(r"<!-- runnable -->\s*\n```python\n(.*?)\n```", re.DOTALL)


def runnable_blocks(text: str) -> list[str]:
    """The code of each ```python block right after a ``<!-- runnable -->`` line."""
    return _BLOCK.findall(text)


def test_the_readme_marks_its_first_example_runnable() -> None:
    blocks = runnable_blocks(README.read_text(encoding="utf-8"))
    assert len(blocks) >= 2
    first = blocks[0]
    assert first.splitlines()[0] == "import narrative_gravity as ng"  # one import line
    assert "ng.generate(" in first and "ng.processor(" in blocks[1]


@pytest.mark.slow
def test_the_readme_python_examples_run(capsys: pytest.CaptureFixture[str]) -> None:
    namespace: dict[str, object] = {"__name__": "readme"}
    for i, code in enumerate(runnable_blocks(README.read_text(encoding="utf-8"))):
        exec(compile(code, f"README.md block {i + 1}", "exec"), namespace)
    printed = capsys.readouterr().out
    result = namespace["result"]
    assert result.text and result.text in printed and result.new_tokens > 0
    assert set(result.trace_means) >= {"entropy", "kl", "strength"}
    assert namespace["trace"].means()  # the processor measured the call of one's own
    assert namespace["lead"] == "Write about algorithm."
