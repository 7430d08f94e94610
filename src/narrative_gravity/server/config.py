"""Server settings and limits, validated once at start-up.

>>> ServerConfig().host
'127.0.0.1'
>>> ServerConfig(max_batch_size=0)
Traceback (most recent call last):
...
narrative_gravity.errors.ConfigurationError: `max_batch_size` has to be >= 1, but is 0
>>> ServerConfig(host="0.0.0.0")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
narrative_gravity.errors.ConfigurationError: refusing to listen on 0.0.0.0 without an API key: ...
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
        insecure_no_auth: allow a non-loopback ``host`` without ``api_key`` (a warning is printed on every start).
        max_stages: the most ``stages`` one profile may declare (each builds a full-vocabulary field).
        max_words_per_list: the most words in one list of a profile (``core_semantics``, ``penalize``, a stage's).
        max_words: the most words of one profile, all lists together.
        max_semantic_top_k: the largest ``field.semantic_top_k`` and ``thermostat.candidates`` a profile may ask for.
        max_neighbours: the largest ``field.neighbours`` a profile may ask for (each neighbour word builds a
            lexical field; a profile may not change ``field.neighbours_vocabulary``, whose every value embeds
            and caches a new word list).
        max_semantic_cache_entries: semantic fields kept in the disk cache (least recently used are removed).
        prefill_tokens: on the vLLM engine, the most new prompt tokens that join the running batch per engine
            step (at least one request joins each step). A burst of requests then prefills over a few steps
            and the first ones stream at once, instead of everyone waiting for one long prefill. 0: no limit.
        read_timeout_s: seconds a client may take to send its request headers, or between two pieces of its body.
        write_timeout_s: seconds a client may leave a response piece unread before the connection is dropped.
        keep_alive_s: seconds an idle keep-alive connection stays open.
        preload_encoder: load the MiniLM sentence encoder while the server starts (about a second, once per
            process), so that the first request whose topic sentence picks its words with it (the topic default
            in plain continuation) does not wait for the load while the requests beside it run.
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
    insecure_no_auth: bool = False
    max_stages: int = 16
    max_words_per_list: int = 256
    max_words: int = 1024
    max_semantic_top_k: int = 5000
    max_neighbours: int = 500
    max_semantic_cache_entries: int = 256
    prefill_tokens: int = 512
    read_timeout_s: float = 30.0
    write_timeout_s: float = 60.0
    keep_alive_s: float = 5.0
    preload_encoder: bool = True

    def __post_init__(self) -> None:
        for name in (
            "max_batch_size",
            "max_queue",
            "max_tokens_limit",
            "default_max_tokens",
            "max_prompt_tokens",
            "max_body_bytes",
            "max_choices",
            "max_stages",
            "max_words_per_list",
            "max_words",
            "max_semantic_top_k",
            "max_neighbours",
            "max_semantic_cache_entries",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigurationError(f"`{name}` has to be >= 1, but is {value!r}")
        if isinstance(self.prefill_tokens, bool) or not isinstance(self.prefill_tokens, int) or self.prefill_tokens < 0:
            raise ConfigurationError(f"`prefill_tokens` has to be >= 0 (0: no limit), but is {self.prefill_tokens!r}")
        if not 0 <= self.port <= 65535:
            raise ConfigurationError(f"`port` has to be in [0, 65535], but is {self.port}")
        if not 0.0 <= self.batch_window_ms <= 10_000:
            raise ConfigurationError(
                f"`batch_window_ms` has to be in [0, 10000], but is {self.batch_window_ms}; 5-50 ms is typical"
            )
        for name in ("read_timeout_s", "write_timeout_s", "keep_alive_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 3600:
                raise ConfigurationError(f"`{name}` has to be in (0, 3600] seconds, but is {value!r}")
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigurationError(
                "the API key is empty (is NGRAV_API_KEY set to an empty string?); set a non-empty key, "
                "or unset it to serve without auth on loopback"
            )
        if not self.is_loopback and self.api_key is None and not self.insecure_no_auth:
            raise ConfigurationError(
                f"refusing to listen on {self.host} without an API key: anyone who can reach it could generate and "
                "change profiles; set NGRAV_API_KEY (or --api-key), or pass --insecure-no-auth if that is intended"
            )

    @property
    def is_loopback(self) -> bool:
        return self.host in LOOPBACK_HOSTS
