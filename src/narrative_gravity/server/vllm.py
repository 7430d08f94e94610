"""The vLLM backend of the server: ``ngrav serve --engine vllm``.

Each batch of rows becomes vLLM requests on one in-process engine (``vllm.LLM`` with
:class:`~narrative_gravity.engines.vllm.NarrativeGravityVLLMLogitsProcessor`), so gravity rides inside vLLM's
own batch with a profile per request (``SamplingParams.extra_args["gravity"]``), and the math is the same
:func:`~narrative_gravity.gravity.tilt.apply_gravity` as everywhere else. The engine is stepped in the worker
thread; every step's new tokens go to the scheduler, and a cancelled row is aborted in the engine.

vLLM schedules prefill and decode itself, so rows do not advance in lockstep: a step reports ``None`` for
a row that produced no token in it. The vLLM processor keeps no per-row trace, so rows report their token
count but no narrative mass or KL.

vLLM lives in its own environment (``bash scripts/setup_vllm.sh``); this module imports it only in
:meth:`VLLMBackend.load`.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

from ..errors import ConfigurationError
from ..profile import Profile
from .backend import GenerationRow, RowStats, TokenCallback, TokenizerText

__all__ = ["VLLMBackend"]

log = logging.getLogger("narrative_gravity.server")

PROCESSOR = "narrative_gravity.engines.vllm:NarrativeGravityVLLMLogitsProcessor"
_IDS = itertools.count()


class VLLMBackend(TokenizerText):
    """The server's engine on vLLM (see the module doc).

    Args:
        llm: a ``vllm.LLM`` built with :data:`PROCESSOR` among its ``logits_processors``.
        model_id: the name clients send as ``model``.
    """

    name = "vllm"

    def __init__(self, llm: Any, *, model_id: str) -> None:
        if not model_id:
            raise ConfigurationError("`model_id` is empty; give the name clients send as `model`")
        self.llm = llm
        self.engine = llm.llm_engine
        self.tokenizer = llm.get_tokenizer()
        self.model_id = model_id
        cfg = llm.llm_engine.model_config
        self.max_context = int(cfg.max_model_len)
        self.vocab_size = int(cfg.get_vocab_size())
        self.eos_ids = frozenset(i for i in (self.tokenizer.eos_token_id,) if i is not None)
        self._lock = threading.Lock()

    @classmethod
    def load(
        cls,
        name: str | os.PathLike[str] | None = None,
        *,
        device: str = "cpu",
        max_num_seqs: int = 32,
        max_model_len: int = 2048,
        kv_cache_mb: int = 1024,
    ) -> VLLMBackend:
        """Start an in-process vLLM engine on a model (a name, a HF folder or a ``.gguf`` file, as ``--model``)."""
        try:
            from vllm import LLM
        except ImportError as exc:
            raise ConfigurationError(
                f"engine 'vllm' needs vLLM, which is not importable here ({exc}); run `bash scripts/setup_vllm.sh` "
                "and start the server with .venv-vllm/bin/ngrav serve --engine vllm, or use --engine hf"
            ) from None
        from ..models import DEFAULT_MODEL, hf_folder

        if device not in ("cpu", "auto", "cuda"):
            raise ConfigurationError(f"engine 'vllm' picks its own device; got --device {device!r}, use cpu or cuda")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # keep the engine in this process
        folder = hf_folder(name)
        llm = LLM(
            model=str(folder),
            dtype="float32",
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            kv_cache_memory_bytes=kv_cache_mb * 2**20,
            enforce_eager=True,
            logits_processors=[PROCESSOR],
            seed=0,
        )
        return cls(llm, model_id=str(name) if name is not None else DEFAULT_MODEL)

    # ------------------------------------------------------------------------------------------- gravity

    def prepare(self, profile: Profile) -> None:
        """Reject what the vLLM processor cannot run (thermostat, stages, LM-embedding fields) before queueing."""
        from ..engines.vllm import profile_from_extra_args

        profile_from_extra_args({"gravity": profile.model_dump(exclude_none=True)})

    # ------------------------------------------------------------------------------------------- generation

    def _params(self, row: GenerationRow) -> Any:
        from vllm import SamplingParams

        s = row.sampling
        extra = None
        if row.gravity is not None:
            extra = {"gravity": row.gravity.profile.model_dump(exclude_none=True)}
        return SamplingParams(
            max_tokens=row.max_tokens,
            temperature=0.0 if s.greedy else s.temperature,
            top_p=s.top_p,
            top_k=s.top_k if s.top_k > 0 else 0,
            seed=None if s.greedy else s.seed,
            extra_args=extra,
        )

    def generate(self, rows: Sequence[GenerationRow], on_tokens: TokenCallback) -> list[RowStats]:
        if not rows:
            return []
        from vllm.inputs import TokensPrompt

        with self._lock:  # one batch at a time on the engine (the scheduler already runs one)
            batch = next(_IDS)
            ids = [f"ngrav-{batch}-{i}" for i in range(len(rows))]
            index = {rid: i for i, rid in enumerate(ids)}
            seen = [0] * len(rows)
            live: set[str] = set()
            try:
                for rid, row in zip(ids, rows):
                    self.engine.add_request(rid, TokensPrompt(prompt_token_ids=list(row.prompt_ids)), self._params(row))
                    live.add(rid)
                while self.engine.has_unfinished_requests():
                    gone = [rid for rid in live if rows[index[rid]].cancelled]
                    if gone:
                        self.engine.abort_request(gone)
                        live.difference_update(gone)
                        if not live:
                            break
                    fresh: list[list[int]] = [[] for _ in rows]
                    for out in self.engine.step():
                        i = index.get(out.request_id)
                        if i is None:
                            continue
                        tokens = list(out.outputs[0].token_ids)
                        fresh[i] = tokens[seen[i] :]  # one per step, unless speculative decoding is on
                        seen[i] = len(tokens)
                        if out.finished:
                            live.discard(out.request_id)
                    for j in range(max(map(len, fresh))):
                        on_tokens([f[j] if j < len(f) else None for f in fresh])
            finally:
                if live:
                    self.engine.abort_request(list(live))
        return [RowStats(new_tokens=n) for n in seen]
