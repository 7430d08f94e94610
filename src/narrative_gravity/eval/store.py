"""The results of an evaluation run on disk: the file names, and ``results.jsonl``, which the runner appends
to and the report reads.

>>> import tempfile, pathlib
>>> store = ResultStore(pathlib.Path(tempfile.mkdtemp()) / RESULTS)
>>> store.append([{"profile": CONTROL, "prompt_index": 0, "seed": 1, "text": "..."}])
>>> [row_key(r) for r in store.load()]
[('control', 0, 1)]
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import ConfigurationError

__all__ = ["CONTROL", "FAILURES", "RESULTS", "RUN_FILE", "ResultStore", "row_key"]

CONTROL = "control"
RESULTS = "results.jsonl"
FAILURES = "failures.jsonl"
RUN_FILE = "run.json"


def row_key(row: dict[str, Any]) -> tuple[str, int, int]:
    return (str(row["profile"]), int(row["prompt_index"]), int(row["seed"]))


class ResultStore:
    """``results.jsonl``: one JSON row per generation, appended, flushed and synced batch by batch."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def load(self, *, repair: bool = False) -> list[dict[str, Any]]:
        """The complete rows (first row per key). A half-written last line is dropped (and cut off with
        ``repair``); a corrupt line in the middle raises an error that names it."""
        if not self.path.exists():
            return []
        data = self.path.read_bytes()
        lines = data.split(b"\n")
        complete, tail = lines[:-1], lines[-1]
        rows: list[dict[str, Any]] = []
        seen: set[tuple[str, int, int]] = set()
        good_bytes = 0
        for n, line in enumerate(complete, 1):
            good_bytes += len(line) + 1
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                key = row_key(row)
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                if n == len(complete) and not tail.strip():
                    good_bytes -= len(line) + 1  # a torn last line that happens to end in a newline
                    break
                raise ConfigurationError(
                    f"{self.path}:{n}: not a valid result row; fix or delete that line, then resume"
                ) from None
            if key not in seen:
                seen.add(key)
                rows.append(row)
        if repair and good_bytes < len(data):
            with self.path.open("r+b") as fh:
                fh.truncate(good_bytes)
        return rows

    def append(self, rows: Sequence[dict[str, Any]]) -> None:
        if not rows:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        payload = "".join(json.dumps(r, ensure_ascii=False, allow_nan=True) + "\n" for r in rows)
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
