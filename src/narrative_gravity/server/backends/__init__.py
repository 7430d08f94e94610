"""The server's engines behind one interface (:mod:`.base`): the embedded transformers engine (:mod:`.hf`) and an
in-process vLLM engine (:mod:`.vllm`); :func:`make_backend` picks one for ``ngrav serve --engine``."""

from __future__ import annotations

from typing import Any

from ...errors import ConfigurationError
from .base import ENGINES, Backend
from .hf import HFBackend

__all__ = ["make_backend"]


def make_backend(engine: str, model: str | None = None, *, device: str = "cpu", **options: Any) -> Backend:
    """The backend for ``--engine``: ``hf`` (embedded transformers) or ``vllm`` (an in-process vLLM engine).

    ``options`` go to :meth:`VLLMBackend.load <narrative_gravity.server.backends.vllm.VLLMBackend.load>` (``max_num_seqs``,
    ``max_model_len``, ``kv_cache_mb``); the transformers engine takes none.
    """
    if engine == "hf":
        if options:
            raise ConfigurationError(f"options {sorted(options)} apply to --engine vllm only")
        return HFBackend.load(model, device=device)
    if engine == "vllm":
        from .vllm import VLLMBackend  # imports vLLM where it is installed: only for --engine vllm

        return VLLMBackend.load(model, device=device, **options)
    raise ConfigurationError(f"unknown engine {engine!r}; use one of: {', '.join(ENGINES)}")
