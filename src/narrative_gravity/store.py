"""The profile store: named profiles kept as numbered, immutable snapshots (a small "configuration centre").

Every change is a new snapshot ``1, 2, 3, ...`` with an ISO-8601 UTC timestamp and an optional message; the head is
the highest numbered snapshot. History is never rewritten: :meth:`ProfileStore.rollback` writes a *new* snapshot
equal to an old one.

Layout on disk::

    ROOT/                            see default_store_root()
      space/                         one folder per profile name
        .lock                        writers flock it while they pick and publish the next version
        000001.json                  {"format": 1, "version": 1, "created": "...Z", "message": ..., "profile": {...}}
        000002.json
        .000003.json.tmp-k2j8        an unpublished write (ignored by readers, removed by the next writer)

How a write stays safe:

- The snapshot is written to a temp file in the same folder, flushed and ``fsync``-ed, then published with
  ``os.replace`` (atomic) and the folder is ``fsync``-ed. Readers see the old head or the complete new one, never a
  partial file, even when the writer is SIGKILLed halfway; a killed writer leaves at most a dot-named temp file.
- Writers hold an exclusive ``fcntl.flock`` on ``NAME/.lock`` while they choose the next number and publish it, so
  concurrent writers (processes or threads) get contiguous versions with no gaps or duplicates. The kernel drops the
  lock when a writer dies, so a killed writer never blocks the next one.
- Readers take no lock: snapshot files are never modified or removed once published.

The stored profile is the full validated profile (defaults filled in), so a version means the same settings even if
a default changes later. Its ``name`` is always the store name.

>>> import tempfile
>>> tmp = tempfile.TemporaryDirectory()
>>> store = ProfileStore(tmp.name)
>>> store.set("space", {"core_semantics": ["orbit", "planet"]}, message="first cut")
1
>>> store.set("space", {"core_semantics": ["orbit", "planet"], "gravity_strength": 2.0})
2
>>> store.get("space").gravity_strength, store.get("space", version=1).gravity_strength
(2.0, 1.5)
>>> store.rollback("space", to=1)
3
>>> [(s.version, s.message) for s in store.history("space")]
[(1, 'first cut'), (2, None), (3, 'rollback to 1')]
>>> store.changes("space", 1, 2)
[Change(key='gravity_strength', old=1.5, new=2.0, kind='changed')]
>>> store.get("spcae")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
narrative_gravity.errors.StoreError: no profile named 'spcae'; did you mean 'space'? ...
>>> tmp.cleanup()
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import difflib
import json
import os
import re
import tempfile
import threading
from collections.abc import Iterable, Iterator, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from .errors import ProfileError, StoreError
from .profile import Profile

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "ENV_VAR",
    "Change",
    "ProfileInfo",
    "ProfileStore",
    "Snapshot",
    "SnapshotInfo",
    "StoreDamagedError",
    "default_store_root",
]

ENV_VAR = "NARRATIVE_GRAVITY_STORE"
"""Environment variable that chooses the store folder."""

FORMAT = 1
"""Version of the snapshot file format; readers refuse newer formats instead of guessing."""

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_SNAPSHOT_RE = re.compile(r"([0-9]{1,12})\.json")
_TMP_MARK = ".tmp-"
_LOCK = ".lock"
_LIST_AT_MOST = 20


def default_store_root() -> Path:
    """``$NARRATIVE_GRAVITY_STORE``, else ``$XDG_DATA_HOME/narrative-gravity/profiles``, else
    ``~/.local/share/narrative-gravity/profiles``.

    A data folder, not a cache folder: snapshots are the only copy of a profile's history and must not be evicted.

    >>> import os
    >>> os.environ[ENV_VAR] = "/srv/ngrav/profiles"
    >>> str(default_store_root())
    '/srv/ngrav/profiles'
    >>> del os.environ[ENV_VAR]
    """
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_DATA_HOME")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".local" / "share"
    return base / "narrative-gravity" / "profiles"


class StoreDamagedError(StoreError):
    """The store itself is at fault: a snapshot cannot be read or no longer validates, or a write failed.

    Unlike other :class:`~narrative_gravity.errors.StoreError` s, nothing the caller asked for was wrong.
    """


@dataclasses.dataclass(frozen=True)
class SnapshotInfo:
    """One entry of a profile's history."""

    version: int
    created: str
    """ISO-8601 UTC timestamp, e.g. ``2025-05-01T12:00:00.123456Z``."""
    message: str | None


@dataclasses.dataclass(frozen=True)
class Snapshot(SnapshotInfo):
    """A snapshot with its validated profile."""

    profile: Profile

    def info(self) -> SnapshotInfo:
        return SnapshotInfo(self.version, self.created, self.message)


@dataclasses.dataclass(frozen=True)
class ProfileInfo:
    """A stored profile and its head snapshot. Versions are contiguous, so ``version`` is also the count."""

    name: str
    version: int
    created: str
    message: str | None
    error: str | None = None
    """Why the head snapshot cannot be read (then ``created`` is ``""``); ``None`` for a readable profile."""


@dataclasses.dataclass(frozen=True)
class Change:
    """One key that differs between two snapshots. ``key`` is dotted for nested settings (``phases.strict``)."""

    key: str
    old: Any
    new: Any
    kind: Literal["added", "removed", "changed"]


class ProfileStore:
    """Named profiles with numbered snapshots under ``root`` (default: :func:`default_store_root`).

    Reads never lock and never see a partial write; writes are atomic and serialized per profile name.
    """

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        self.root = Path(root).expanduser() if root is not None else default_store_root()
        if self.root.exists() and not self.root.is_dir():
            raise StoreError(f"profile store {str(self.root)!r} is a file, not a folder; choose another --store")

    def __repr__(self) -> str:
        return f"ProfileStore({str(self.root)!r})"

    # ----------------------------------------------------------------------------------------------- reading

    def names(self) -> builtins.list[str]:
        """Sorted names of the profiles that have at least one snapshot."""
        return sorted(self.heads())

    def heads(self) -> dict[str, int]:
        """``{name: head version}`` for every stored profile: one folder listing per profile, no file is read.

        This is the cheap change detector for hot reload: poll it, and reload a profile when its number grows.
        """
        try:
            entries = builtins.list(os.scandir(self.root))
        except (FileNotFoundError, NotADirectoryError):
            return {}
        heads = {}
        for entry in entries:
            if _NAME_RE.fullmatch(entry.name) and entry.is_dir():
                versions = _scan(Path(entry.path))
                if versions:
                    heads[entry.name] = versions[-1]
        return heads

    def head_version(self, name: str) -> int:
        """The newest version of ``name``, or 0 while the store has none (cheap: one folder listing)."""
        versions = _scan(self._dir(name))
        return versions[-1] if versions else 0

    def versions(self, name: str) -> builtins.list[int]:
        """All versions of ``name``, oldest first. Raises :class:`StoreError` for an unknown name."""
        return self._versions(name)

    def snapshot(self, name: str, version: int | None = None) -> Snapshot:
        """The snapshot ``version`` of ``name`` (default: the head), with its metadata."""
        versions = self._versions(name)
        return self._read(name, self._pick(name, version, versions))

    def get(self, name: str, version: int | None = None) -> Profile:
        """The profile ``name`` at ``version`` (default: the head)."""
        return self.snapshot(name, version).profile

    def history(self, name: str) -> builtins.list[SnapshotInfo]:
        """Every snapshot of ``name``, oldest first. Each one is read and validated."""
        return [self._read(name, v).info() for v in self._versions(name)]

    def diff(self, name: str, a: int, b: int, *, context: int = 3) -> str:
        """A unified diff of the profile JSON from version ``a`` to ``b``; ``""`` when they are equal."""
        sa, sb = self.snapshot(name, a), self.snapshot(name, b)
        return "".join(
            difflib.unified_diff(
                _pretty(sa.profile).splitlines(keepends=True),
                _pretty(sb.profile).splitlines(keepends=True),
                fromfile=f"{name}@{sa.version}",
                tofile=f"{name}@{sb.version}",
                n=context,
            )
        )

    def changes(self, name: str, a: int, b: int) -> builtins.list[Change]:
        """The keys that differ from version ``a`` to ``b``; lists are compared whole."""
        old = _flatten(self.get(name, a).model_dump(mode="json"))
        new = _flatten(self.get(name, b).model_dump(mode="json"))
        out = []
        for key in [*old, *(k for k in new if k not in old)]:
            if key not in new:
                out.append(Change(key, old[key], None, "removed"))
            elif key not in old:
                out.append(Change(key, None, new[key], "added"))
            elif old[key] != new[key]:
                out.append(Change(key, old[key], new[key], "changed"))
        return out

    def watch(
        self,
        names: Iterable[str] | None = None,
        *,
        interval: float = 1.0,
        stop: threading.Event | None = None,
    ) -> Iterator[tuple[str, int]]:
        """Yield ``(name, head version)`` for every profile now, then again whenever a head changes.

        Polls :meth:`heads` (or :meth:`head_version` for the given ``names``) every ``interval`` seconds until
        ``stop`` is set. A watched name that is not stored yet reports 0 first and its first version later.
        """
        if interval <= 0:
            raise StoreError(f"watch interval must be > 0 seconds, but is {interval}")
        wanted = None if names is None else builtins.list(names)
        stop = stop if stop is not None else threading.Event()
        seen: dict[str, int] = {}
        while True:
            current = self.heads() if wanted is None else {n: self.head_version(n) for n in wanted}
            for name, version in sorted(current.items()):
                if seen.get(name) != version:
                    seen[name] = version
                    yield name, version
            if stop.wait(interval):
                return

    # ----------------------------------------------------------------------------------------------- writing

    def set(self, name: str, profile: Profile | Mapping[str, Any], message: str | None = None) -> int:
        """Validate ``profile`` and store it as the next version of ``name``; returns the new version number.

        Invalid profiles raise :class:`~narrative_gravity.errors.ProfileError` (naming the key) and write nothing.
        """
        directory = self._dir(name)
        if message is not None and not isinstance(message, str):
            raise StoreError(f"snapshot message must be text, but is {type(message).__name__}")
        if isinstance(profile, Profile):
            data: Any = profile.model_dump(mode="json")
        elif isinstance(profile, Mapping):
            data = dict(profile)
        else:
            data = profile  # from_mapping names the wrong type
        validated = Profile.from_mapping(data, source=f"profile {name!r}").model_copy(update={"name": name})
        return self._publish(directory, validated, message)

    def rollback(self, name: str, to: int) -> int:
        """Store version ``to`` again as a new version (message ``rollback to N``); returns the new version."""
        old = self.snapshot(name, to)
        return self._publish(self._dir(name), old.profile, f"rollback to {old.version}")

    def list(self) -> builtins.list[ProfileInfo]:
        """Every stored profile with its head snapshot, sorted by name.

        A profile whose head snapshot cannot be read is still listed, with ``error`` saying why, so that one
        damaged file does not hide the others.
        """
        out = []
        for name, head in sorted(self.heads().items()):
            try:
                snap = self._read(name, head)
            except StoreError as exc:
                out.append(ProfileInfo(name, head, "", None, error=str(exc)))
                continue
            out.append(ProfileInfo(name, snap.version, snap.created, snap.message))
        return out

    # ----------------------------------------------------------------------------------------------- internals

    def _dir(self, name: str) -> Path:
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
            raise StoreError(
                f"profile name {name!r} is not allowed; use 1-128 letters, digits, '-', '_' or '.', "
                "starting with a letter or digit (e.g. 'binary-search.v2')"
            )
        return self.root / name

    def _versions(self, name: str) -> builtins.list[int]:
        versions = _scan(self._dir(name))
        if not versions:
            raise self._unknown(name)
        return versions

    def _unknown(self, name: str) -> StoreError:
        names = self.names()
        if not names:
            return StoreError(
                f"no profile named {name!r}; the store {str(self.root)!r} is empty; "
                f"add one with `ngrav profile set {name} FILE`"
            )
        guess = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
        hint = f"did you mean {guess[0]!r}? " if guess else ""
        shown = ", ".join(names[:_LIST_AT_MOST]) + (
            f" and {len(names) - _LIST_AT_MOST} more" if len(names) > _LIST_AT_MOST else ""
        )
        return StoreError(f"no profile named {name!r}; {hint}stored profiles: {shown}")

    @staticmethod
    def _pick(name: str, version: int | None, versions: builtins.list[int]) -> int:
        if version is None:
            return versions[-1]
        if isinstance(version, bool) or not isinstance(version, int):
            raise StoreError(f"version must be a whole number, but is {version!r}")
        if version not in versions:
            raise StoreError(f"profile {name!r} has no version {version}; it has versions {_ranges(versions)}")
        return version

    def _read(self, name: str, version: int) -> Snapshot:
        path = self._dir(name) / _file_name(version)
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise StoreDamagedError(f"cannot read snapshot {str(path)!r}: {exc.strerror or exc}") from None
        try:
            doc = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise _corrupt(path, f"it is not valid JSON ({exc})") from None
        if not isinstance(doc, dict):
            raise _corrupt(path, "its root is not an object")
        if isinstance(doc.get("format"), int) and doc["format"] > FORMAT:
            raise StoreDamagedError(
                f"snapshot {str(path)!r} has format {doc['format']}, newer than this narrative-gravity "
                f"understands ({FORMAT}); upgrade narrative-gravity"
            )
        if doc.get("version") != version:
            raise _corrupt(path, f"it says version {doc.get('version')!r} but its file name says {version}")
        created, message = doc.get("created"), doc.get("message")
        if not isinstance(created, str) or not (message is None or isinstance(message, str)):
            raise _corrupt(path, "`created` must be text and `message` text or null")
        try:
            profile = Profile.from_mapping(doc.get("profile"), source=str(path))
        except ProfileError as exc:
            raise StoreDamagedError(
                f"snapshot {str(path)!r} no longer validates (written by another narrative-gravity version?): {exc}"
            ) from None
        return Snapshot(version, created, message, profile)

    def _publish(self, directory: Path, profile: Profile, message: str | None) -> int:
        body = profile.model_dump(mode="json")
        _encode({"message": message, "profile": body}, directory.name)  # a profile JSON cannot hold: no folder made
        _ensure_dir(directory)
        try:
            return self._publish_locked(directory, body, message)
        except OSError as exc:
            raise StoreDamagedError(
                f"cannot write profile {directory.name!r} in {str(self.root)!r}: {exc.strerror or exc}; "
                "check that the folder is writable and the disk is not full"
            ) from None

    @staticmethod
    def _publish_locked(directory: Path, body: dict[str, Any], message: str | None) -> int:
        with _locked(directory):
            _sweep(directory)
            versions = _scan(directory)
            version = versions[-1] + 1 if versions else 1
            doc = {"format": FORMAT, "version": version, "created": _now(), "message": message, "profile": body}
            data = _encode(doc, directory.name)
            final = directory / _file_name(version)
            fd, tmp = tempfile.mkstemp(prefix=f".{final.name}{_TMP_MARK}", dir=directory)
            try:
                with os.fdopen(fd, "wb") as fh:
                    fh.write(data)
                    fh.flush()
                    os.fsync(fh.fileno())
                if final.exists():  # only possible if someone writes without the lock
                    raise StoreError(f"snapshot {str(final)!r} appeared while locked; is another tool writing here?")
                os.replace(tmp, final)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            _fsync_dir(directory)
        return version


# --------------------------------------------------------------------------------------------------- helpers


def _encode(doc: dict[str, Any], name: str) -> bytes:
    """The snapshot file's bytes; infinite numbers and text UTF-8 cannot hold raise :class:`StoreError`."""
    try:
        return (json.dumps(doc, indent=2, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")
    except ValueError as exc:  # UnicodeEncodeError is a ValueError too
        why = "it holds text that is not valid Unicode (a lone surrogate?)" if isinstance(exc, UnicodeError) else exc
        raise StoreError(f"profile {name!r} cannot be stored as JSON: {why}; fix the profile") from None


def _file_name(version: int) -> str:
    return f"{version:06d}.json"


def _scan(directory: Path) -> list[int]:
    """Published versions in ``directory``, sorted; temp files, the lock and strangers are ignored."""
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    # ``000001.json`` only: a stray ``1.json`` must not shadow or duplicate version 1.
    return sorted(v for n in names if (m := _SNAPSHOT_RE.fullmatch(n)) and n == _file_name(v := int(m.group(1))))


def _sweep(directory: Path) -> None:
    """Remove temp files of killed writers. Only called under the lock, when no live writer has a temp file."""
    for n in os.listdir(directory):
        if n.startswith(".") and _TMP_MARK in n:
            with contextlib.suppress(OSError):
                os.unlink(directory / n)


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    if fcntl is None:  # pragma: no cover - Windows
        raise StoreError("the profile store needs POSIX file locks (fcntl); it runs on Linux and macOS")
    fd = os.open(directory / _LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the only descriptor releases the lock


def _ensure_dir(directory: Path) -> None:
    if directory.is_dir():
        return
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StoreDamagedError(f"cannot create the profile folder {str(directory)!r}: {exc.strerror or exc}") from None
    _fsync_dir(directory.parent)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms that cannot open folders
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - file systems without directory fsync
        pass
    finally:
        os.close(fd)


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _corrupt(path: Path, why: str) -> StoreError:
    return StoreDamagedError(
        f"snapshot {str(path)!r} is damaged: {why}; the store never writes such a file, so something else changed "
        "it; restore it from a backup or move it out of the folder"
    )


def _pretty(profile: Profile) -> str:
    return json.dumps(profile.model_dump(mode="json"), indent=2, ensure_ascii=False) + "\n"


def _flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _ranges(versions: Iterable[int]) -> str:
    """``[1, 2, 3, 5]`` → ``'1-3, 5'``.

    >>> _ranges([1, 2, 3, 5, 7, 8])
    '1-3, 5, 7-8'
    """
    spans: list[list[int]] = []
    for v in sorted(versions):
        if spans and v == spans[-1][1] + 1:
            spans[-1][1] = v
        else:
            spans.append([v, v])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
