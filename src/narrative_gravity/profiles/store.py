"""The profile store: named profiles kept as numbered, immutable snapshots (a small "configuration centre").

Every change is a new snapshot ``1, 2, 3, ...`` with an ISO-8601 UTC timestamp and an optional message; the head is
the highest numbered snapshot. History is never rewritten: :meth:`ProfileStore.rollback` writes a *new* snapshot
equal to an old one.

**The live version** is the one served to requests that name no version. Without a live pointer (``live.json``) it
is the head, so stores written before pointers existed keep working. :meth:`ProfileStore.stage` stores a version
that is *not* live (it writes the pointer first when there is none); :meth:`ProfileStore.promote` moves the
pointer. :meth:`ProfileStore.set` and :meth:`ProfileStore.rollback` store a new version *and* make it live, as they
always did, which leaves nothing staged (older staged versions stay in the history and can still be promoted by
number). Versions newer than the live one are *staged*.

**Rollout** (``rollout.json``, :class:`~narrative_gravity.profiles.rollout.RolloutConfig`): per name, the share of requests
that get a shadow run without gravity, and an optional split of the traffic to a second version. Every change gets
the next revision number and a line in ``rollout-history.jsonl``. What the server records per arm goes to
``arms.jsonl`` (:class:`~narrative_gravity.profiles.armlog.ArmLog`).

Layout on disk::

    ROOT/                            see default_store_root()
      space/                         one folder per profile name
        .lock                        writers flock it while they pick and publish the next version
        000001.json                  {"format": 1, "version": 1, "created": "...Z", "message": ..., "profile": {...}}
        000002.json
        000003.json                  a staged version (newer than the live one)
        .000004.json.tmp-k2j8        an unpublished write (ignored by readers, removed by the next writer)
        live.json                    {"format": 1, "version": 2, "updated": "...Z", "message": ...}; absent: head is live
        live-history.jsonl           one line per move of the live pointer
        rollout.json                 {"format": 1, "revision": 1, "updated": ..., "message": ..., "rollout": {...}}
        rollout-history.jsonl        every rollout revision, one line each
        arms.jsonl, arms.1.jsonl     per-request records of the server, size-bounded (see armlog.py)

How a write stays safe:

- The snapshot is written to a temp file in the same folder, flushed and ``fsync``-ed, then published with
  ``os.replace`` (atomic) and the folder is ``fsync``-ed. Readers see the old head or the complete new one, never a
  partial file, even when the writer is SIGKILLed halfway; a killed writer leaves at most a dot-named temp file.
- Writers hold an exclusive ``fcntl.flock`` on ``NAME/.lock`` while they choose the next number and publish it, so
  concurrent writers (processes or threads) get contiguous versions with no gaps or duplicates. The kernel drops the
  lock when a writer dies, so a killed writer never blocks the next one.
- Readers take no lock: snapshot files are never modified or removed once published. ``live.json`` and
  ``rollout.json`` are replaced atomically, under the same lock. Readers list the snapshots first and read the
  pointer second, and a writer that stages a version writes the pointer before it publishes the snapshot, so a
  reader never takes a staged version for the live one.

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
>>> store.stage("space", {"core_semantics": ["orbit", "planet"], "gravity_strength": 4.0})
4
>>> store.live_version("space"), store.staged("space"), store.get("space").gravity_strength
(3, [4], 1.5)
>>> store.promote("space")
4
>>> store.live_version("space"), store.staged("space")
(4, [])
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

from ..errors import ProfileError, StoreError
from .armlog import ARMS_LOG, ArmLog
from .rollout import RolloutConfig, RolloutError
from .schema import Profile

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "ENV_VAR",
    "Change",
    "LiveMove",
    "ProfileInfo",
    "ProfileStore",
    "RolloutState",
    "RouteInfo",
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
_LIVE = "live.json"
_LIVE_HISTORY = "live-history.jsonl"
_ROLLOUT = "rollout.json"
_ROLLOUT_HISTORY = "rollout-history.jsonl"
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
    live: int | None = None
    """The live version (served when a request names none); ``None`` when it cannot be read."""
    staged: tuple[int, ...] = ()
    """Versions newer than the live one."""


@dataclasses.dataclass(frozen=True)
class LiveMove:
    """One move of the live pointer: to ``version`` from ``previous`` (``None``: the head was live)."""

    version: int
    previous: int | None
    updated: str
    message: str | None


@dataclasses.dataclass(frozen=True)
class RolloutState:
    """A profile's rollout config with its revision (0: never set)."""

    revision: int
    updated: str
    message: str | None
    config: RolloutConfig


@dataclasses.dataclass(frozen=True)
class RouteInfo:
    """What the server needs per request, read cheaply: the head, the live version and the rollout config."""

    head: int
    live: int
    rollout: RolloutConfig | None
    revision: int = 0


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
        self._docs: dict[Path, tuple[tuple[int, int, int, int], Any]] = {}  # path -> (stat key, parsed doc)
        self._docs_lock = threading.Lock()

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
        """The snapshot ``version`` of ``name`` (default: the live version), with its metadata."""
        versions = self._versions(name)
        if version is None:
            version = self._live(name, versions)
        return self._read(name, self._pick(name, version, versions))

    def get(self, name: str, version: int | None = None) -> Profile:
        """The profile ``name`` at ``version`` (default: the live version)."""
        return self.snapshot(name, version).profile

    def live_version(self, name: str) -> int:
        """The version served when a request names none: the live pointer, or the head when there is none."""
        return self._live(name, self._versions(name))

    def staged(self, name: str) -> builtins.list[int]:
        """Versions newer than the live one (stored with :meth:`stage`, not promoted yet)."""
        versions = self._versions(name)
        live = self._live(name, versions)
        return [v for v in versions if v > live]

    def live_history(self, name: str) -> builtins.list[LiveMove]:
        """Every move of the live pointer, oldest first (empty while the head has always been live)."""
        self._versions(name)
        out = []
        for doc in _read_lines(self._dir(name) / _LIVE_HISTORY):
            with contextlib.suppress(KeyError, TypeError, ValueError):
                out.append(LiveMove(int(doc["version"]), doc.get("previous"), str(doc["updated"]), doc.get("message")))
        return out

    def route_info(self, name: str) -> RouteInfo:
        """Head, live version and rollout of ``name`` for one request: one folder listing and two ``stat`` calls
        (files are parsed again only when they change). ``head`` is 0 for a name that is not stored."""
        versions = _scan(self._dir(name))
        if not versions:
            return RouteInfo(0, 0, None)
        live = self._live(name, versions)
        state = self._rollout_doc(name)
        if state is None or state.config.empty:
            return RouteInfo(versions[-1], live, None, state.revision if state else 0)
        split = state.config.split
        if split is not None and split.version not in versions:  # only a hand-edited file can say so
            raise StoreDamagedError(
                f"the rollout config of {name!r} splits to version {split.version}, which is not stored; set it again "
                f"with `ngrav profile rollout {name} ...`"
            )
        return RouteInfo(versions[-1], live, state.config, state.revision)

    def rollout(self, name: str) -> RolloutState:
        """The rollout config of ``name`` (revision 0 and the empty config when none was ever set)."""
        self._versions(name)
        state = self._rollout_doc(name)
        return state if state is not None else RolloutState(0, "", None, RolloutConfig())

    def rollout_history(self, name: str) -> builtins.list[RolloutState]:
        """Every rollout revision of ``name``, oldest first."""
        self._versions(name)
        out = []
        for doc in _read_lines(self._dir(name) / _ROLLOUT_HISTORY):
            with contextlib.suppress(KeyError, TypeError, ValueError, RolloutError):
                out.append(_rollout_state(doc))
        return out

    def arms_log(self, name: str) -> ArmLog:
        """Where the server records what each arm of ``name`` did (:mod:`~narrative_gravity.profiles.armlog`)."""
        return ArmLog(self._dir(name) / ARMS_LOG)

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
        """Yield ``(name, head version)`` for every profile now, then again whenever a head changes (a new snapshot;
        a promotion moves no head: read :meth:`route_info` or :meth:`live_version` for the live version).

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
        """Validate ``profile`` and store it as the next version of ``name``, live at once; returns the version.

        Invalid profiles raise :class:`~narrative_gravity.errors.ProfileError` (naming the key) and write nothing.
        """
        return self._publish(self._dir(name), self._validated(name, profile, message), message, live=True)

    def stage(self, name: str, profile: Profile | Mapping[str, Any], message: str | None = None) -> int:
        """Store ``profile`` as the next version of ``name`` *without* making it live; returns the version.

        Requests that name no version keep getting the live version until :meth:`promote`. ``name`` must have a
        live version already (store the first one with :meth:`set`).
        """
        validated = self._validated(name, profile, message)
        if not _scan(self._dir(name)):
            raise StoreError(
                f"profile {name!r} has no live version to keep serving; store its first version with "
                f"`ngrav profile set {name} FILE`, then stage the next ones"
            )
        return self._publish(self._dir(name), validated, message, live=False)

    def promote(
        self, name: str, version: int | None = None, message: str | None = None, *, expect_live: int | None = None
    ) -> int:
        """Make ``version`` (default: the newest staged version) the live version of ``name``; returns it.

        Any stored version may be promoted, an older one too; the snapshots are not touched. With
        ``expect_live``, the pointer moves only if the live version is still that one (a check that ran against
        it still holds); otherwise :class:`StoreError` says what changed.
        """
        _check_message(message)
        with self._writing(name) as (directory, versions):
            # a damaged pointer is repaired by promoting a named version
            live = self._live_or_none(name, versions) if version is not None and expect_live is None else None
            if live is None and (version is None or expect_live is not None):
                live = self._live(name, versions)
            if expect_live is not None and live != expect_live:
                raise StoreError(
                    f"the live version of {name!r} changed from {expect_live} to {live} meanwhile; nothing was "
                    "promoted; run the promotion again against the new live version"
                )
            if version is None:
                if live is not None and versions[-1] <= live:
                    raise StoreError(
                        f"nothing is staged for {name!r}: its live version {live} is the newest; stage one with "
                        f"`ngrav profile stage {name} FILE`, or name a version with --version"
                    )
                version = versions[-1]
            version = self._pick(name, version, versions)
            self._read(name, version)  # never point at a snapshot that cannot be read
            self._move_live(directory, version, live, message or f"promote {version}")
        return version

    def rollback(self, name: str, to: int) -> int:
        """Store version ``to`` again as a new, live version (message ``rollback to N``); returns the new version.

        The live pointer moves to the new version, so nothing is staged afterwards; staged versions stay in the
        history and can still be promoted by number.
        """
        old = self.snapshot(name, to)
        return self._publish(self._dir(name), old.profile, f"rollback to {old.version}", live=True)

    def set_rollout(
        self, name: str, config: RolloutConfig | Mapping[str, Any] | None, message: str | None = None
    ) -> RolloutState:
        """Validate ``config`` against ``name``'s versions and store it as the next rollout revision.

        ``None`` (or an empty mapping) clears the rollout: no shadow, no split. A split must name a stored
        version other than the live one.
        """
        _check_message(message)
        if config is None:
            config = RolloutConfig()
        elif not isinstance(config, RolloutConfig):
            config = RolloutConfig.from_mapping(dict(config) if isinstance(config, Mapping) else config)
        with self._writing(name) as (directory, versions):
            config.check_versions(name, versions, self._live(name, versions))
            current = self._rollout_doc(name)
            state = RolloutState((current.revision if current else 0) + 1, _now(), message, config)
            doc = {"format": FORMAT, "revision": state.revision, "updated": state.updated, "message": message}
            doc["rollout"] = config.model_dump(mode="json", exclude_defaults=True)
            _write_atomic(directory, _ROLLOUT, _encode(doc, name))
            _append_line(directory / _ROLLOUT_HISTORY, doc)
        return state

    def list(self) -> builtins.list[ProfileInfo]:
        """Every stored profile with its head snapshot, sorted by name.

        A profile whose head snapshot cannot be read is still listed, with ``error`` saying why, so that one
        damaged file does not hide the others.
        """
        out = []
        for name, head in sorted(self.heads().items()):
            try:
                live: int | None = self._live(name, _scan(self._dir(name)))
            except StoreError:
                live = None
            staged = tuple(range(live + 1, head + 1)) if live is not None else ()
            try:
                snap = self._read(name, head)
            except StoreError as exc:
                out.append(ProfileInfo(name, head, "", None, error=str(exc), live=live, staged=staged))
                continue
            out.append(ProfileInfo(name, snap.version, snap.created, snap.message, live=live, staged=staged))
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

    @staticmethod
    def _validated(name: str, profile: Profile | Mapping[str, Any], message: str | None) -> Profile:
        _check_message(message, "snapshot message")
        if isinstance(profile, Profile):
            data: Any = profile.model_dump(mode="json")
        elif isinstance(profile, Mapping):
            data = dict(profile)
        else:
            data = profile  # from_mapping names the wrong type
        return Profile.from_mapping(data, source=f"profile {name!r}").model_copy(update={"name": name})

    def _live(self, name: str, versions: builtins.list[int]) -> int:
        """The live version given the listed ``versions`` (list first, then read the pointer: see the module doc)."""
        path = self._dir(name) / _LIVE
        doc = self._doc(path)
        if doc is None:
            return versions[-1]
        version = doc.get("version") if isinstance(doc, dict) else None
        if isinstance(version, bool) or not isinstance(version, int) or version not in versions:
            raise StoreDamagedError(
                f"the live pointer {str(path)!r} is damaged: it names version {version!r}, but the profile has "
                f"versions {_ranges(versions)}; point it at a version with `ngrav profile promote {name} --version V "
                "--no-check`, or delete the file to make the newest version live"
            )
        return version

    def _live_or_none(self, name: str, versions: builtins.list[int]) -> int | None:
        try:
            return self._live(name, versions)
        except StoreDamagedError:
            return None

    def _rollout_doc(self, name: str) -> RolloutState | None:
        path = self._dir(name) / _ROLLOUT
        doc = self._doc(path)
        if doc is None:
            return None
        try:
            return _rollout_state(doc)
        except (KeyError, TypeError, ValueError) as exc:
            raise StoreDamagedError(
                f"the rollout config {str(path)!r} is damaged ({exc}); set it again with `ngrav profile rollout "
                f"{name} ...`, or delete the file to turn the rollout off"
            ) from None

    def _doc(self, path: Path) -> Any:
        """The JSON document at ``path`` (``None`` when absent), parsed again only when its ``stat`` changes."""
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise StoreDamagedError(f"cannot read {str(path)!r}: {exc.strerror or exc}") from None
        key = (st.st_ino, st.st_dev, st.st_mtime_ns, st.st_size)
        with self._docs_lock:
            hit = self._docs.get(path)
        if hit is not None and hit[0] == key:
            return hit[1]
        try:
            doc = json.loads(path.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise StoreDamagedError(
                f"{str(path)!r} cannot be read ({exc}); the store writes it atomically, so something else changed "
                "it; restore it from a backup or delete it"
            ) from None
        if isinstance(doc, dict) and isinstance(doc.get("format"), int) and doc["format"] > FORMAT:
            raise StoreDamagedError(
                f"{str(path)!r} has format {doc['format']}, newer than this narrative-gravity understands ({FORMAT}); "
                "upgrade narrative-gravity"
            )
        with self._docs_lock:
            self._docs[path] = (key, doc)
        return doc

    def _move_live(self, directory: Path, version: int, previous: int | None, message: str | None) -> None:
        """Point the live pointer at ``version`` (under the lock) and note the move."""
        doc = {"format": FORMAT, "version": version, "updated": _now(), "message": message}
        _write_atomic(directory, _LIVE, _encode(doc, directory.name))
        _append_line(directory / _LIVE_HISTORY, {**doc, "previous": previous})

    @contextlib.contextmanager
    def _writing(self, name: str) -> Iterator[tuple[Path, builtins.list[int]]]:
        """``(folder, versions)`` of an existing ``name``, under its lock, unpublished writes swept away; an
        ``OSError`` inside becomes the store's "cannot write" error."""
        directory = self._dir(name)
        self._versions(name)
        try:
            with _locked(directory):
                _sweep(directory)
                yield directory, _scan(directory)
        except OSError as exc:
            raise self._write_failed(name, exc) from None

    def _write_failed(self, name: str, exc: OSError) -> StoreDamagedError:
        return StoreDamagedError(
            f"cannot write profile {name!r} in {str(self.root)!r}: {exc.strerror or exc}; "
            "check that the folder is writable and the disk is not full"
        )

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

    def _publish(self, directory: Path, profile: Profile, message: str | None, *, live: bool) -> int:
        body = profile.model_dump(mode="json")
        _encode({"message": message, "profile": body}, directory.name)  # a profile JSON cannot hold: no folder made
        _ensure_dir(directory)
        try:
            return self._publish_locked(directory, body, message, live=live)
        except OSError as exc:
            raise self._write_failed(directory.name, exc) from None

    def _publish_locked(self, directory: Path, body: dict[str, Any], message: str | None, *, live: bool) -> int:
        """Publish the next snapshot. ``live``: move an existing pointer to it (no pointer: the head is live
        anyway). Not ``live`` (staging): write the pointer at the current head first, if there is none."""
        with _locked(directory):
            _sweep(directory)
            versions = _scan(directory)
            version = versions[-1] + 1 if versions else 1
            has_pointer = (directory / _LIVE).exists()
            if not live and not has_pointer:
                self._move_live(directory, versions[-1], None, f"live before staging {version}")
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
            if live and has_pointer:
                self._move_live(directory, version, self._live_or_none(directory.name, versions), message)
        return version


# --------------------------------------------------------------------------------------------------- helpers


def _encode(doc: dict[str, Any], name: str) -> bytes:
    """The snapshot file's bytes; infinite numbers and text UTF-8 cannot hold raise :class:`StoreError`."""
    try:
        return (json.dumps(doc, indent=2, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")
    except ValueError as exc:  # UnicodeEncodeError is a ValueError too
        why = "it holds text that is not valid Unicode (a lone surrogate?)" if isinstance(exc, UnicodeError) else exc
        raise StoreError(f"profile {name!r} cannot be stored as JSON: {why}; fix the profile") from None


def _write_atomic(directory: Path, name: str, data: bytes) -> None:
    """Replace ``directory/name`` with ``data`` atomically (temp file, ``fsync``, ``os.replace``); under the lock."""
    fd, tmp = tempfile.mkstemp(prefix=f".{name}{_TMP_MARK}", dir=directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, directory / name)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)


def _append_line(path: Path, doc: dict[str, Any]) -> None:
    """Append one JSON line and ``fsync`` it (history files; only written under the lock)."""
    with path.open("a", encoding="utf-8") as fh:
        fh.write(json.dumps(doc, ensure_ascii=False, allow_nan=False) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def _read_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a history file, skipping a torn last line."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return []
    out = []
    for line in raw.splitlines():
        with contextlib.suppress(UnicodeDecodeError, json.JSONDecodeError):
            doc = json.loads(line)
            if isinstance(doc, dict):
                out.append(doc)
    return out


def _rollout_state(doc: Any) -> RolloutState:
    if not isinstance(doc, dict):
        raise TypeError("its root is not an object")
    revision, updated, message = doc["revision"], doc["updated"], doc.get("message")
    if isinstance(revision, bool) or not isinstance(revision, int) or not isinstance(updated, str):
        raise ValueError("`revision` must be a whole number and `updated` text")
    return RolloutState(revision, updated, message, RolloutConfig.from_mapping(doc.get("rollout") or {}))


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


def _check_message(message: Any, what: str = "message") -> None:
    """A version's or a change's message is text or ``None``."""
    if message is not None and not isinstance(message, str):
        raise StoreError(f"{what} must be text, but is {type(message).__name__}")


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
