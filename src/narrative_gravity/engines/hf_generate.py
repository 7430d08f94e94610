"""Batched generation with transformers: left padding, chat templates, seeds, timing and traces.

This is the shared loop behind ``ngrav generate`` and ``ngrav compare``; gravity itself stays in the
logits processor. The vLLM engine's counterpart is :mod:`narrative_gravity.engines.vllm_generate`, reached
through :func:`vllm_engine` because it imports vLLM.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from ..errors import ConfigurationError
from ..gravity.thermo import Trace
from ..lead import lead_messages, lead_text

__all__ = [
    "ENGINES",
    "GenerationResult",
    "SamplingOptions",
    "chat_ids",
    "check_engine",
    "encode_prompts",
    "eos_token_ids",
    "generate",
    "generated_length",
    "left_pad",
    "sample_ids",
    "vllm_engine",
]

ENGINES = ("hf", "vllm")
VLLM_SETUP = "run `bash scripts/setup_vllm.sh` and use .venv-vllm/bin/ngrav, or use --engine hf"


def check_engine(engine: str) -> None:
    """Refuse an engine name other than ``hf`` (transformers) or ``vllm``.

    >>> check_engine("vllm")
    >>> check_engine("vLLM")
    Traceback (most recent call last):
    ...
    narrative_gravity.errors.ConfigurationError: --engine must be hf or vllm, got 'vLLM'
    """
    if engine not in ENGINES:
        raise ConfigurationError(f"--engine must be {' or '.join(ENGINES)}, got {engine!r}")


def vllm_engine() -> ModuleType:
    """:mod:`narrative_gravity.engines.vllm_generate`, imported now (it imports vLLM, which lives in its own
    venv); a :class:`~narrative_gravity.errors.ConfigurationError` naming the setup when vLLM is missing."""
    module = importlib.import_module("narrative_gravity.engines.vllm_generate")
    exc = module.VLLM_IMPORT_ERROR
    if exc is not None:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigurationError(f"--engine vllm needs vLLM, which is not importable here ({reason}); {VLLM_SETUP}")
    return module


@dataclass(frozen=True)
class SamplingOptions:
    """How to pick tokens. ``temperature == 0`` means greedy decoding.

    >>> SamplingOptions(temperature=0).do_sample
    False
    """

    max_new_tokens: int = 64
    top_k: int = 10
    temperature: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigurationError(f"`max_new_tokens` has to be >= 1, but is {self.max_new_tokens}")
        if self.top_k < 0:
            raise ConfigurationError(f"`top_k` has to be >= 0 (0 = no top-k), but is {self.top_k}")
        if not self.temperature >= 0:
            raise ConfigurationError(f"`temperature` has to be >= 0 (0 = greedy), but is {self.temperature}")

    @property
    def do_sample(self) -> bool:
        return self.temperature > 0

    def generate_kwargs(self) -> dict[str, Any]:
        if not self.do_sample:
            return {
                "do_sample": False,
                "max_new_tokens": self.max_new_tokens,
                "top_k": None,
                "top_p": None,
                "temperature": None,
            }
        return {
            "do_sample": True,
            "max_new_tokens": self.max_new_tokens,
            "top_k": self.top_k or None,
            "top_p": None,
            "temperature": self.temperature,
        }


@dataclass
class GenerationResult:
    """One prompt's continuation. ``seconds`` is this prompt's share of its batch's wall time."""

    prompt: str
    text: str
    new_tokens: int
    seconds: float
    token_ids: list[int]
    seed: int
    batch_seconds: float
    trace: dict[str, list[float]] | None = None
    trace_means: dict[str, float] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "prompt": self.prompt,
            "text": self.text,
            "new_tokens": self.new_tokens,
            "seconds": round(self.seconds, 4),
            "batch_seconds": round(self.batch_seconds, 4),
            "seed": self.seed,
        }
        if self.trace_means is not None:
            out["thermo"] = {k: round(v, 5) for k, v in self.trace_means.items()}
        out.update(self.extra)
        return out


def encode_prompts(
    tokenizer: Any, prompts: Sequence[str], *, raw: bool, lead: str | Sequence[str | None] | None = None
) -> list[list[int]]:
    """Token ids per prompt: the chat template as a user turn, or plain text with ``raw``.

    ``lead``: a topic sentence the model reads first (:mod:`narrative_gravity.lead`), one for every prompt or
    one per prompt: before the text with ``raw``, else as a system message.
    """
    leads = [lead] * len(prompts) if lead is None or isinstance(lead, str) else list(lead)
    if len(leads) != len(prompts):
        raise ValueError(f"{len(leads)} leads for {len(prompts)} prompts")
    if raw:
        enc = tokenizer([lead_text(p, s) for p, s in zip(prompts, leads, strict=True)], add_special_tokens=True)
        return [list(ids) for ids in enc["input_ids"]]
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigurationError(
            "this model's tokenizer has no chat template; pass --raw (raw=True) for plain continuation"
        )
    return [
        chat_ids(tokenizer, lead_messages([{"role": "user", "content": p}], s))
        for p, s in zip(prompts, leads, strict=True)
    ]


def chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` in the tokenizer's chat template, ready for the assistant's turn.

    The template writes its own special tokens, so none are added on top. The caller checks that the
    tokenizer has a template.
    """
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def left_pad(batch: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token-id lists into ``(input_ids, attention_mask)`` for decoder-only generation.

    >>> ids, mask = left_pad([[5, 6], [7]], pad_id=0)
    >>> ids.tolist(), mask.tolist()
    ([[5, 6], [0, 7]], [[1, 1], [0, 1]])
    """
    width = max(len(ids) for ids in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, row in enumerate(batch):
        ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row) :] = 1
    return ids, mask


ProcessorFactory = Callable[[int, Trace | None], Any]


def generate(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    *,
    options: SamplingOptions = SamplingOptions(),
    processor_factory: ProcessorFactory | None = None,
    raw: bool = False,
    batch_size: int = 8,
    record_trace: bool = False,
    progress: Callable[[int], None] | None = None,
    lead: str | None = None,
) -> list[GenerationResult]:
    """Generate a continuation for every prompt, ``batch_size`` prompts at a time (left-padded).

    ``processor_factory(max_new_tokens, trace)`` returns a logits processor for one batch, or ``None`` for
    plain decoding. Each batch is seeded with ``options.seed`` so a run is reproducible. ``lead``: a topic
    sentence the model reads before every prompt (:func:`narrative_gravity.lead.lead_sentence`).
    """
    if batch_size < 1:
        raise ConfigurationError(f"`batch_size` has to be >= 1, but is {batch_size}")
    if not prompts:
        return []
    encoded = encode_prompts(tokenizer, prompts, raw=raw, lead=lead)
    results: list[GenerationResult] = []
    for start in range(0, len(prompts), batch_size):
        chunk = encoded[start : start + batch_size]
        trace = Trace() if record_trace else None
        processor = processor_factory(options.max_new_tokens, trace) if processor_factory else None
        t0 = time.perf_counter()
        rows = sample_ids(model, tokenizer, chunk, options, [processor] if processor is not None else [])
        elapsed = time.perf_counter() - t0
        lengths = [len(row) for row in rows]
        traces = trace.to_numpy() if trace is not None and len(trace) else None
        means = trace.means(lengths) if trace is not None and len(trace) else None
        for i, (toks, n) in enumerate(zip(rows, lengths, strict=True)):
            results.append(
                GenerationResult(
                    prompt=prompts[start + i],
                    text=tokenizer.decode(toks, skip_special_tokens=True),
                    new_tokens=n,
                    seconds=elapsed / len(chunk),
                    token_ids=toks,
                    seed=options.seed,
                    batch_seconds=elapsed,
                    trace={k: v[i, :n].tolist() for k, v in traces.items()} if traces else None,
                    trace_means=means[i] if means else None,
                )
            )
        if progress is not None:
            progress(len(chunk))
    return results


def sample_ids(
    model: Any, tokenizer: Any, batch: list[list[int]], options: SamplingOptions, processors: Sequence[Any] = ()
) -> list[list[int]]:
    """Continue token-id prompts in one left-padded ``model.generate`` call, seeded with ``options.seed``.

    Returns each row's new tokens, cut after its first end-of-sequence token (:func:`generated_length`).
    ``processors`` are the batch's logits processors, in order; none for plain decoding.
    """
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos_ids = eos_token_ids(model, tokenizer)
    device = next(model.parameters()).device
    ids, mask = left_pad(batch, pad_id)
    torch.manual_seed(options.seed)
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            logits_processor=list(processors) or None,
            pad_token_id=pad_id,
            **options.generate_kwargs(),
        )
    rows = out[:, ids.shape[1] :].cpu().tolist()
    return [row[: generated_length(row, eos_ids)] for row in rows]


def eos_token_ids(model: Any, tokenizer: Any) -> set[int]:
    """Every end-of-sequence id of the model's generation config and of the tokenizer."""
    ids: set[int] = set()
    cfg = getattr(model, "generation_config", None)
    for value in (getattr(cfg, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


def generated_length(row: list[int], eos_ids: set[int]) -> int:
    """Tokens generated up to and including the first end-of-sequence token.

    >>> generated_length([4, 9, 2, 2], {2}), generated_length([4, 9], {2})
    (3, 2)
    """
    for i, tok in enumerate(row):
        if tok in eos_ids:
            return i + 1
    return len(row)
