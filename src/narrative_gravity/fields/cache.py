"""Where semantic fields keep what they computed: ``<cache dir>/semantic``, one file per token matrix or field,
written atomically and evicted least recently used first.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..errors import FieldError
from ..models import resolve_cache_dir

__all__ = ["FIELD_CACHE_ENTRIES", "evict", "load", "resolve_semantic_cache", "save", "set_field_cache_limit", "touch"]

FIELD_CACHE_ENTRIES = 512
"""Built semantic fields kept on disk; :func:`set_field_cache_limit` changes it."""


def resolve_semantic_cache(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """``<cache dir>/semantic``; the cache dir defaults to :func:`narrative_gravity.models.resolve_cache_dir`."""

    return resolve_cache_dir(cache_dir) / "semantic"


def touch(path: Path) -> None:
    """Mark a cache file as used now (its modification time orders the evictions)."""
    with contextlib.suppress(OSError):
        os.utime(path)


def evict(folder: Path, entries: int, *, keep: Path) -> None:
    """Remove the least recently used ``.pt`` files of ``folder`` beyond ``entries``; never ``keep``."""
    try:
        files = [(e.stat().st_mtime_ns, e.path) for e in os.scandir(folder) if e.name.endswith(".pt")]
    except OSError:
        return
    if len(files) <= entries:
        return
    files.sort()
    for _, name in files[: len(files) - entries]:
        if name != str(keep):
            with contextlib.suppress(OSError):
                os.unlink(name)


def load(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # a torn or foreign file: rebuild it
        return None


def save(path: Path, data: dict[str, Any]) -> None:
    """Write atomically (temporary file + rename), so concurrent builders never see a torn file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
        os.close(fd)
        try:
            torch.save(data, tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError:
        pass  # a read-only cache only costs a rebuild next time


def set_field_cache_limit(entries: int) -> None:
    """Keep at most ``entries`` built fields on disk (``ngrav serve --max-semantic-cache-entries``).

    >>> set_field_cache_limit(0)
    Traceback (most recent call last):
    ...
    narrative_gravity.errors.FieldError: the semantic field cache needs room for >= 1 entries, but got 0
    """
    global FIELD_CACHE_ENTRIES
    if isinstance(entries, bool) or not isinstance(entries, int) or entries < 1:
        raise FieldError(f"the semantic field cache needs room for >= 1 entries, but got {entries!r}")
    FIELD_CACHE_ENTRIES = entries
