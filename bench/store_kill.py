"""SIGKILL a profile-store writer at random moments while a reader keeps reading; count corrupt reads (must be 0).

Each round forks a child that runs ``ProfileStore.set`` in a tight loop, lets it run for a random 5-50 ms while the
parent reads the head snapshot as fast as it can, then SIGKILLs the child. A kill that leaves a temp file behind
landed in the middle of a write ("torn"). At the end the history must be contiguous and every snapshot must parse.

    python bench/store_kill.py --kills 200
    python bench/store_kill.py --kills 50 --root /tmp/ngrav-kill --keep
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from narrative_gravity.profiles.store import ProfileStore

NAME = "kill-loop"


def numbered(i: int) -> dict[str, object]:
    """Profile number ``i``: its words and message both carry ``i``, so a reader can check they belong together."""
    return {"core_semantics": [f"w{i}", "orbit"], "gravity_strength": (i % 200) / 10}


def writer(root: str, start: int) -> None:
    store = ProfileStore(root)
    i = start
    while True:
        store.set(NAME, numbered(i), message=f"i={i}")
        i += 1


def torn_files(root: Path) -> int:
    return sum(1 for n in os.listdir(root / NAME) if n.startswith(".") and ".tmp-" in n)


def run(root: Path, kills: int, seed: int = 0, min_ms: float = 5.0, max_ms: float = 50.0) -> dict[str, object]:
    ctx = multiprocessing.get_context("fork")
    store = ProfileStore(root)
    store.set(NAME, numbered(0), message="i=0")
    rng = random.Random(seed)
    reads = corrupt = torn = backwards = 0
    errors: list[str] = []
    last = 0
    t0 = time.perf_counter()
    for k in range(kills):
        proc = ctx.Process(target=writer, args=(str(root), (k + 1) * 1_000_000), daemon=True)
        proc.start()
        until = time.monotonic() + rng.uniform(min_ms, max_ms) / 1000
        while time.monotonic() < until:
            try:
                snap = store.snapshot(NAME)
                if snap.message != f"i={snap.profile.core_semantics[0][1:]}":
                    raise ValueError(f"version {snap.version}: message {snap.message!r} does not match its profile")
            except Exception as exc:  # count every failure: that is the point of the benchmark
                corrupt += 1
                errors.append(repr(exc))
            else:
                backwards += snap.version < last
                last = max(last, snap.version)
            reads += 1
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        if proc.exitcode != -signal.SIGKILL:
            errors.append(f"writer {k} exited with {proc.exitcode} before it was killed")
        torn += torn_files(root) > 0
    seconds = time.perf_counter() - t0
    versions = store.versions(NAME)
    damaged = 0
    for v in versions:  # read and validate every snapshot
        try:
            store.snapshot(NAME, v)
        except Exception as exc:
            damaged += 1
            errors.append(repr(exc))
    next_version = store.set(NAME, numbered(1), message="i=1")  # a writer after the kills still works and sweeps
    return {
        "kills": kills,
        "torn_kills": torn,
        "reads": reads,
        "corrupt_reads": corrupt,
        "head_went_backwards": backwards,
        "history_length": len(versions),
        "damaged_snapshots": damaged,
        "history_contiguous": versions == list(range(1, len(versions) + 1)),
        "next_set_version": next_version,
        "temp_files_after_next_set": torn_files(root),
        "seconds": round(seconds, 2),
        "errors": errors[:5],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=200, help="number of SIGKILLs (default 200)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", type=Path, default=None, help="store folder (default: a fresh temp folder)")
    parser.add_argument("--keep", action="store_true", help="keep the temp store folder")
    args = parser.parse_args()
    if args.kills < 1:
        parser.error(f"--kills must be at least 1, but is {args.kills}")
    root = args.root if args.root is not None else Path(tempfile.mkdtemp(prefix="ngrav-kill-"))
    try:
        stats = run(root, args.kills, seed=args.seed)
    finally:
        if args.root is None and not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        elif args.root is None:
            print(f"store kept in {root}")
    for key, value in stats.items():
        print(f"{key:>26}: {value}")
    ok = (
        stats["corrupt_reads"] == 0
        and stats["head_went_backwards"] == 0
        and stats["damaged_snapshots"] == 0
        and stats["history_contiguous"]
        and stats["next_set_version"] == stats["history_length"] + 1
        and stats["temp_files_after_next_set"] == 0
        and not stats["errors"]
    )
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
