"""One options object for every way of generating: the budget, how tokens are picked, and how the run goes.

The CLI, the server, the library and the evaluation build a :class:`GenerationOptions` once and hand it down;
each engine reads what it needs from it. It is validated where it is made, so an engine never meets a bad value.

>>> opts = GenerationOptions(max_new_tokens=80, temperature=0)
>>> opts.greedy, opts.replace(seed=3).seed
(True, 3)
>>> GenerationOptions(engine="vLLM")
Traceback (most recent call last):
...
narrative_gravity.errors.ConfigurationError: --engine must be hf or vllm, got 'vLLM'
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigurationError

__all__ = ["ENGINES", "GREEDY_BELOW", "GenerationOptions", "check_device_for", "check_engine"]

ENGINES = ("hf", "vllm")
GREEDY_BELOW = 1e-5
"""A temperature below this decodes greedily (dividing logits by less would overflow)."""


def check_engine(engine: str) -> None:
    """Refuse an engine name other than ``hf`` (transformers) or ``vllm``.

    >>> check_engine("vllm")
    """
    if engine not in ENGINES:
        raise ConfigurationError(f"--engine must be {' or '.join(ENGINES)}, got {engine!r}")


def check_device_for(engine: str, device: str) -> None:
    """Refuse a device that is not a name, or any but ``cpu`` with the vLLM engine (vLLM places the model itself).
    Whether this machine has it is :func:`narrative_gravity.models.resolve_device`'s to say.

    >>> check_device_for("vllm", "cuda")
    Traceback (most recent call last):
    ...
    narrative_gravity.errors.ConfigurationError: --device is for the transformers engine; vLLM places the model on its own device (drop --device)
    """
    if not isinstance(device, str) or not device.strip():
        raise ConfigurationError(f"`device` has to be a name such as 'cpu', 'cuda' or 'auto', but is {device!r}")
    if engine == "vllm" and device != "cpu":
        raise ConfigurationError(
            "--device is for the transformers engine; vLLM places the model on its own device (drop --device)"
        )


def _whole(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigurationError(f"`{name}` has to be a whole number >= {low}, but is {value!r}")


@dataclass(frozen=True)
class GenerationOptions:
    """How to generate.

    Args:
        max_new_tokens: the token budget of each text.
        top_k: sample from the ``k`` most likely tokens (``0`` = no top-k).
        temperature: ``0`` (below ``1e-5``) decodes greedily.
        top_p: nucleus sampling (``1.0`` = off).
        seed: each batch (or each request) is seeded from it, so a run is reproducible.
        raw: plain continuation (``True``), the chat template (``False``), or ``None``: the chat template when the
            tokenizer has one.
        batch_size: prompts per ``generate`` call (on vLLM, requests sent at once).
        trace: record entropy, narrative mass, KL and λ per token.
        engine: ``hf`` (transformers) or ``vllm``.
        device: where the transformers engine runs (``cpu``, ``cuda``, ``cuda:N``, ``mps`` or ``auto``).
    """

    max_new_tokens: int = 64
    top_k: int = 10
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    raw: bool | None = False
    batch_size: int = 8
    trace: bool = False
    engine: str = "hf"
    device: str = "cpu"

    def __post_init__(self) -> None:
        _whole("max_new_tokens", self.max_new_tokens, 1)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigurationError(f"`top_k` has to be >= 0 (0 = no top-k), but is {self.top_k}")
        if isinstance(self.temperature, bool) or not self.temperature >= 0:
            raise ConfigurationError(f"`temperature` has to be >= 0 (0 = greedy), but is {self.temperature}")
        if isinstance(self.top_p, bool) or not 0 < self.top_p <= 1:
            raise ConfigurationError(f"`top_p` has to be in (0, 1] (1 = off), but is {self.top_p}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigurationError(f"`seed` has to be a whole number, but is {self.seed!r}")
        if self.raw not in (True, False, None):
            raise ConfigurationError(
                f"`raw` has to be True, False or None (whichever the tokenizer has), not {self.raw!r}"
            )
        _whole("batch_size", self.batch_size, 1)
        check_engine(self.engine)
        check_device_for(self.engine, self.device)

    @property
    def greedy(self) -> bool:
        """Whether tokens are picked greedily (``temperature`` below :data:`GREEDY_BELOW`)."""
        return self.temperature < GREEDY_BELOW

    def replace(self, **changes: Any) -> GenerationOptions:
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)

    def chat_template(self, tokenizer: Any) -> bool:
        """Whether prompts go through ``tokenizer``'s chat template (``raw=None``: when it has one)."""
        if self.raw is None:
            return bool(getattr(tokenizer, "chat_template", None))
        return not self.raw

    def generate_kwargs(self) -> dict[str, Any]:
        """The sampling arguments of a transformers ``model.generate`` call.

        >>> GenerationOptions(top_k=0).generate_kwargs()["top_k"] is None
        True
        """
        if self.greedy:
            return {"do_sample": False, "max_new_tokens": self.max_new_tokens, "top_k": None, "top_p": None,
                    "temperature": None}  # fmt: skip
        return {
            "do_sample": True,
            "max_new_tokens": self.max_new_tokens,
            "top_k": self.top_k or None,
            "top_p": None if self.top_p >= 1.0 else self.top_p,
            "temperature": self.temperature,
        }
