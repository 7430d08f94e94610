"""A real uvicorn server on a loopback port, for the server tests (transformers and vLLM engines), run with the
same uvicorn settings (timeouts included) as ``ngrav serve``."""

from __future__ import annotations

import copy
import socket
import threading
import time
from typing import Any

import httpx
import openai
import uvicorn

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def with_chat_template(tokenizer: Any) -> Any:
    """A copy of a (tiny) tokenizer with a plain chat template; the session-wide tokenizer stays as it is."""
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


class RunningServer:
    """uvicorn in a background thread on a free loopback port."""

    def __init__(self, app: Any, config: Any = None) -> None:
        from narrative_gravity.server import ServerConfig
        from narrative_gravity.server.connections import uvicorn_config

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = app
        self.server = uvicorn.Server(
            uvicorn_config(app, config if config is not None else ServerConfig(), log_level="warning", lifespan="on")
        )
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)

    def client(self, api_key: str = "unused", **kwargs: Any) -> Any:
        http = httpx.Client(trust_env=False, timeout=60)
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, http_client=http, **kwargs)

    def http(self) -> Any:
        return httpx.Client(base_url=self.url, trust_env=False, timeout=60)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)
