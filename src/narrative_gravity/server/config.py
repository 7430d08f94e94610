"""Server settings and limits, validated once at start-up.

>>> ServerConfig().host
'127.0.0.1'
>>> ServerConfig(max_batch_size=0)
Traceback (most recent call last):
...
narrative_gravity.errors.ConfigurationError: `max_batch_size` has to be >= 1, but is 0
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigurationError

__all__ = ["LOOPBACK_HOSTS", "ServerConfig"]

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "localhost"})


@dataclass(frozen=True)
class ServerConfig:
    """Where to listen, who may call, and how much one request or the whole queue may ask for.

    Args:
        host: interface to bind; loopback unless you mean to expose the server (then set ``api_key``).
        port: TCP port.
        api_key: when set, every route but ``/health`` needs ``Authorization: Bearer <api_key>``.
        max_batch_size: rows (prompts × ``n``) run together in one ``model.generate`` call.
        batch_window_ms: how long the scheduler waits for more rows after the first one arrives.
        max_queue: rows that may wait for a batch; more get ``429``.
        max_tokens_limit: the largest ``max_tokens`` a request may ask for.
        default_max_tokens: ``max_tokens`` of a chat request that gives none, capped at ``max_tokens_limit``
            (completions default to 16, as in OpenAI's API).
        max_prompt_tokens: the longest prompt, in tokens.
        max_body_bytes: the largest request body; larger bodies get ``413`` before they are read.
        max_choices: the most rows one request may ask for (``n`` × prompts).
        allow_inline_gravity: accept inline profile mappings in ``gravity``; switch it off on a shared server so
            that clients can use only the stored profiles (every new inline profile builds and caches a field).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_batch_size: int = 8
    batch_window_ms: float = 20.0
    max_queue: int = 64
    max_tokens_limit: int = 1024
    default_max_tokens: int = 256
    max_prompt_tokens: int = 4096
    max_body_bytes: int = 1_000_000
    max_choices: int = 8
    allow_inline_gravity: bool = True

    def __post_init__(self) -> None:
        for name in (
            "max_batch_size",
            "max_queue",
            "max_tokens_limit",
            "default_max_tokens",
            "max_prompt_tokens",
            "max_body_bytes",
            "max_choices",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigurationError(f"`{name}` has to be >= 1, but is {value!r}")
        if not 0 <= self.port <= 65535:
            raise ConfigurationError(f"`port` has to be in [0, 65535], but is {self.port}")
        if not 0.0 <= self.batch_window_ms <= 10_000:
            raise ConfigurationError(
                f"`batch_window_ms` has to be in [0, 10000], but is {self.batch_window_ms}; 5-50 ms is typical"
            )
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigurationError("`api_key` is empty; give a non-empty key, or none to switch auth off")

    @property
    def is_loopback(self) -> bool:
        return self.host in LOOPBACK_HOSTS
