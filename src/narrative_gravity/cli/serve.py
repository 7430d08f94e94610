"""``ngrav serve``: the OpenAI-compatible server with a ``gravity`` field per request (the ``server`` extra)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from .common import DEVICE_HELP, FLAG, MODEL_HELP, check_model, check_output, fail, guarded

__all__ = ["app"]

app = typer.Typer(rich_markup_mode="rich")


_ModelOpt = Annotated[str | None, typer.Option("--model", rich_help_panel="Model and engine", help=MODEL_HELP)]
_DeviceOpt = Annotated[str, typer.Option("--device", rich_help_panel="Model and engine", help=DEVICE_HELP)]
_HostOpt = Annotated[
    str, typer.Option("--host", rich_help_panel="Server", help="interface to bind; keep 127.0.0.1 unless you set a key")
]
_PortOpt = Annotated[int, typer.Option("--port", rich_help_panel="Server", min=0, max=65535, help="TCP port")]
_ApiKeyOpt = Annotated[
    str | None,
    typer.Option(
        "--api-key",
        rich_help_panel="Security",
        envvar="NGRAV_API_KEY",
        help="require `Authorization: Bearer KEY` (prefer the env var)",
    ),
]
_StoreOpt = Annotated[
    Path | None,
    typer.Option("--store", rich_help_panel="Server", envvar="NARRATIVE_GRAVITY_STORE", help="profile store folder"),
]
_EngineOpt = Annotated[
    str,
    typer.Option(
        "--engine",
        rich_help_panel="Model and engine",
        help="hf (embedded transformers) or vllm (in-process vLLM; its own venv)",
    ),
]
_MaxBatchSizeOpt = Annotated[
    int, typer.Option("--max-batch-size", rich_help_panel="Batching", min=1, help="rows per generate call")
]
_BatchWindowMsOpt = Annotated[
    float, typer.Option("--batch-window-ms", rich_help_panel="Batching", min=0.0, help="how long a batch waits to fill")
]
_MaxQueueOpt = Annotated[
    int, typer.Option("--max-queue", rich_help_panel="Batching", min=1, help="rows that may wait; more get 429")
]
_MaxTokensLimitOpt = Annotated[
    int, typer.Option("--max-tokens-limit", rich_help_panel="Request limits", min=1, help="largest max_tokens")
]
_MaxPromptTokensOpt = Annotated[
    int, typer.Option("--max-prompt-tokens", rich_help_panel="Request limits", min=1, help="longest prompt (tokens)")
]
_MaxBodyBytesOpt = Annotated[
    int, typer.Option("--max-body-bytes", rich_help_panel="Request limits", min=1, help="largest request body")
]
_InlineGravityOpt = Annotated[
    bool,
    typer.Option(
        "--inline-gravity/--no-inline-gravity",
        metavar=FLAG,
        rich_help_panel="Security",
        help="accept inline profiles, or stored ones only",
    ),
]
_InsecureNoAuthOpt = Annotated[
    bool,
    typer.Option(
        "--insecure-no-auth",
        metavar=FLAG,
        rich_help_panel="Security",
        help="allow a non-loopback --host without an API key",
    ),
]
_MaxStagesOpt = Annotated[
    int, typer.Option("--max-stages", rich_help_panel="Profile limits", min=1, help="most `stages` of one profile")
]
_MaxWordsPerListOpt = Annotated[
    int,
    typer.Option(
        "--max-words-per-list", rich_help_panel="Profile limits", min=1, help="most words in one word list of a profile"
    ),
]
_MaxWordsOpt = Annotated[
    int, typer.Option("--max-words", rich_help_panel="Profile limits", min=1, help="most words of one profile, in all")
]
_MaxSemanticTopKOpt = Annotated[
    int,
    typer.Option(
        "--max-semantic-top-k",
        rich_help_panel="Profile limits",
        min=1,
        help="largest field.semantic_top_k / thermostat.candidates",
    ),
]
_MaxNeighboursOpt = Annotated[
    int,
    typer.Option(
        "--max-neighbours", rich_help_panel="Profile limits", min=1, help="largest field.neighbours of a profile"
    ),
]
_MaxSemanticCacheEntriesOpt = Annotated[
    int,
    typer.Option(
        "--max-semantic-cache-entries",
        rich_help_panel="Profile limits",
        min=1,
        help="semantic fields kept in the disk cache (LRU)",
    ),
]
_PrefillTokensOpt = Annotated[
    int,
    typer.Option(
        "--prefill-tokens",
        rich_help_panel="vLLM engine",
        min=0,
        help="vLLM: new prompt tokens joining the batch per step (0: no limit)",
    ),
]
_ReadTimeoutOpt = Annotated[
    float,
    typer.Option(
        "--read-timeout",
        rich_help_panel="Request limits",
        min=0.001,
        help="seconds for request headers, or between body pieces",
    ),
]
_WriteTimeoutOpt = Annotated[
    float,
    typer.Option(
        "--write-timeout",
        rich_help_panel="Request limits",
        min=0.001,
        help="seconds a client may leave a response unread",
    ),
]
_LogLevelOpt = Annotated[
    str, typer.Option("--log-level", rich_help_panel="Server", help="debug, info, warning or error")
]


@app.command()
def serve(
    model: _ModelOpt = None,
    host: _HostOpt = "127.0.0.1",
    port: _PortOpt = 8000,
    api_key: _ApiKeyOpt = None,
    store: _StoreOpt = None,
    engine: _EngineOpt = "hf",
    device: _DeviceOpt = "cpu",
    max_batch_size: _MaxBatchSizeOpt = 8,
    batch_window_ms: _BatchWindowMsOpt = 20.0,
    max_queue: _MaxQueueOpt = 64,
    max_tokens_limit: _MaxTokensLimitOpt = 1024,
    max_prompt_tokens: _MaxPromptTokensOpt = 4096,
    max_body_bytes: _MaxBodyBytesOpt = 1_000_000,
    inline_gravity: _InlineGravityOpt = True,
    insecure_no_auth: _InsecureNoAuthOpt = False,
    max_stages: _MaxStagesOpt = 16,
    max_words_per_list: _MaxWordsPerListOpt = 256,
    max_words: _MaxWordsOpt = 1024,
    max_semantic_top_k: _MaxSemanticTopKOpt = 5000,
    max_neighbours: _MaxNeighboursOpt = 500,
    max_semantic_cache_entries: _MaxSemanticCacheEntriesOpt = 256,
    prefill_tokens: _PrefillTokensOpt = 512,
    read_timeout: _ReadTimeoutOpt = 30.0,
    write_timeout: _WriteTimeoutOpt = 60.0,
    log_level: _LogLevelOpt = "info",
) -> None:
    """Serve an OpenAI-compatible API (chat, completions, streaming) with a `gravity` field per request.

    Needs the server extra: pip install 'narrative-gravity\\[server]'. See docs/server.md.

    Examples:

        ngrav serve --port 8000

        NGRAV_API_KEY=secret ngrav serve --host 0.0.0.0 --store /srv/ngrav/profiles

    Limits on what one request may make the server build (stages, words, semantic field size, disk cache) and
    the connection timeouts are described in docs/server.md.
    """

    if api_key is None and os.environ.get("NGRAV_API_KEY") == "":
        api_key = ""  # set but empty: refused below, never read as "no key"
    if log_level.lower() not in ("debug", "info", "warning", "error"):
        fail(f"--log-level must be debug, info, warning or error, got {log_level!r}")

    def run() -> None:
        from .. import server  # FastAPI and torch: not for --help

        config = server.ServerConfig(
            host=host,
            port=port,
            api_key=api_key,
            max_batch_size=max_batch_size,
            batch_window_ms=batch_window_ms,
            prefill_tokens=prefill_tokens,
            max_queue=max_queue,
            max_tokens_limit=max_tokens_limit,
            max_prompt_tokens=max_prompt_tokens,
            max_body_bytes=max_body_bytes,
            allow_inline_gravity=inline_gravity,
            insecure_no_auth=insecure_no_auth,
            max_stages=max_stages,
            max_words_per_list=max_words_per_list,
            max_words=max_words,
            max_semantic_top_k=max_semantic_top_k,
            max_neighbours=max_neighbours,
            max_semantic_cache_entries=max_semantic_cache_entries,
            read_timeout_s=read_timeout,
            write_timeout_s=write_timeout,
        )
        if store is not None:
            check_output(store, "--store", folder=True)
        if engine == "hf":
            check_model(model)
        server.serve(config, model=model, engine=engine, device=device, store=store, log_level=log_level)

    guarded(run)
