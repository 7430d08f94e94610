"""The arm log of a profile: one JSON line per finished request (or shadow), appended by the server and read by
``ngrav profile report``, so the report works without the server.

The log lives in the profile's store folder (``NAME/arms.jsonl``) and is bounded: when a line would take the file
past ``max_bytes``, the file becomes ``arms.1.jsonl`` (replacing the older one) and a new one starts, so a
profile keeps at most ``2 × max_bytes`` of records, the newest ones. Appends take an exclusive ``flock`` on the
file, so several server processes may share a store. Lines are not ``fsync``-ed: a crash may lose the last few
records (they are telemetry, not configuration), and a torn last line is skipped when reading.

>>> import tempfile, pathlib
>>> log = ArmLog(pathlib.Path(tempfile.mkdtemp()) / "arms.jsonl", max_bytes=140)
>>> for i in range(5):
...     log.append({"arm": "live", "i": i, "pad": "x" * 40})
>>> [r["i"] for r in log.read()]  # the oldest records were rotated out
[2, 3, 4]
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = ["ARMS_LOG", "DEFAULT_MAX_BYTES", "ArmLog"]

ARMS_LOG = "arms.jsonl"
DEFAULT_MAX_BYTES = 8 * 1024 * 1024
"""Per file; with the rotated file a profile keeps at most twice this (about 50 000 records)."""


class ArmLog:
    """Append-only, size-bounded JSONL at ``path`` (the rotated file is ``path`` with ``.1`` before ``.jsonl``)."""

    def __init__(self, path: str | os.PathLike[str], *, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_bytes < 1:
            raise ValueError(f"`max_bytes` has to be >= 1, but is {max_bytes}")
        self.path = Path(path)
        self.rotated = self.path.with_name(self.path.name.removesuffix(".jsonl") + ".1.jsonl")
        self.max_bytes = max_bytes

    def append(self, record: dict[str, Any]) -> None:
        """Append one record (one line); rotates first when the line would pass ``max_bytes``."""
        line = (json.dumps(record, ensure_ascii=False, allow_nan=False, separators=(",", ":")) + "\n").encode()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(8):  # another process may rotate between our open and our lock: then reopen
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                if fcntl is not None:
                    fcntl.flock(fd, fcntl.LOCK_EX)
                try:
                    current = os.stat(self.path)
                except FileNotFoundError:
                    continue
                mine = os.fstat(fd)
                if (mine.st_ino, mine.st_dev) != (current.st_ino, current.st_dev):
                    continue  # rotated under us
                if mine.st_size > 0 and mine.st_size + len(line) > self.max_bytes:
                    os.replace(self.path, self.rotated)
                    continue  # write into a fresh file
                os.write(fd, line)
                return
            finally:
                os.close(fd)

    def read(self) -> list[dict[str, Any]]:
        """Every readable record, oldest first; lines that are not JSON objects (a torn last line) are skipped."""
        out: list[dict[str, Any]] = []
        for path in (self.rotated, self.path):
            with contextlib.suppress(FileNotFoundError):
                for raw in path.read_bytes().splitlines():
                    try:
                        rec = json.loads(raw)
                    except (UnicodeDecodeError, json.JSONDecodeError):
                        continue
                    if isinstance(rec, dict):
                        out.append(rec)
        return out
