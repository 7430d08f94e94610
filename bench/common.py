"""What several benchmarks share: the binary-search prompts and profile, machine facts, and writing results.

Imported by the scripts in this folder (``python bench/NAME.py`` puts the folder on ``sys.path``).
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PROFILE = REPO / "profiles" / "binary_search.json"

# Prompts on the default profile's narrative; batches cycle through them.
PROMPTS = [
    "Write a Python function that performs binary search on a sorted array and returns the index.",
    "Explain how binary search finds a target value in a sorted list.",
    "Implement an iterative binary search in Python with comments.",
    "What is the time complexity of binary search, and why?",
    "Write a recursive binary search function for an array of integers.",
    "Describe the loop invariant of the binary search algorithm.",
    "Show how to find the first position of a target in a sorted array.",
    "Write a function that returns where a target should be inserted in a sorted array.",
]


def machine(torch_threads: int | None = None) -> dict[str, Any]:
    """Platform, CPU count and (when given) torch's intra-op threads, for the results file."""
    out: dict[str, Any] = {"platform": platform.platform(), "cpus": os.cpu_count()}
    if torch_threads is not None:
        out["torch_threads"] = torch_threads
    return out


def write_json(path: str | os.PathLike[str] | None, result: dict[str, Any]) -> None:
    """Write ``result`` as indented UTF-8 JSON at ``path`` (nothing when ``path`` is ``None``)."""
    if path:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=2, ensure_ascii=False)
