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


def spawn_server(extra: list[str], *, env: dict[str, str] | None = None, timeout_s: float = 300.0) -> tuple[Any, str]:
    """Start ``ngrav serve`` (``extra`` are its options) on a free loopback port in a process of its own and wait
    until ``/health`` answers: ``(process, url)``. Exits with a message when it dies or is not ready in time."""
    import socket
    import subprocess
    import sys
    import time

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "narrative_gravity.cli.main", "serve", "--port", str(port), "--log-level", "warning"]
    proc = subprocess.Popen([*cmd, *extra], env=env if env is not None else dict(os.environ))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with code {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{url}/health", timeout=1, trust_env=False).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    stop_server(proc)
    raise SystemExit(f"the server was not ready after {timeout_s:g} s")


def stop_server(proc: Any, timeout_s: float = 30.0) -> None:
    """Stop a spawned server: SIGINT, then SIGKILL if it has not ended within ``timeout_s``."""
    import signal
    import subprocess

    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
