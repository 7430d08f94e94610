"""Structured output on the transformers engine: one JSON-schema grammar per row, with llguidance.

:class:`GuidanceGrammars` compiles a :class:`~narrative_gravity.server.structured.ResponseFormat` into an
llguidance grammar for one tokenizer (cached by the schema), and refuses a schema it cannot compile before
the request is queued. :class:`GrammarLogitsProcessor` then constrains the rows of one ``generate`` call that
have a grammar; the others pass untouched. Each step it feeds every constrained row its newest token, has
llguidance fill all their token bitmasks at once (``LLExecutor``, in parallel threads), and masks the logits of
the whole batch in one ``masked_fill``. It runs *before* the gravity processors, so that gravity's thermostat
measures and pulls the constrained distribution: ``-inf + λ·a`` stays ``-inf``, and the pull only moves mass
among the tokens the grammar allows.

Replies are one-line JSON without ``\\u`` escapes (:data:`~narrative_gravity.server.structured.GRAMMAR_OPTIONS`):
a small model given flexible whitespace can spend its whole budget on newlines.

The bitmask packs 32 tokens per ``int32`` word (token ``32·k + j`` is bit ``j`` of word ``k``):

>>> import torch
>>> unpack_bitmask(torch.tensor([[0b101]], dtype=torch.int32), 4).tolist()
[[True, False, True, False]]
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from transformers import LogitsProcessor

from ..errors import ConfigurationError
from .structured import ResponseFormat

try:  # the `structured` extra; without it a request with `response_format` gets a 400 naming the install
    import llguidance
    import llguidance.hf  # the Hugging Face tokenizer bridge
except ImportError:  # pragma: no cover - depends on the environment
    llguidance = None  # type: ignore[assignment]

__all__ = ["GrammarLogitsProcessor", "GuidanceGrammars", "unpack_bitmask"]

_INSTALL = "pip install 'narrative-gravity[structured]'"
_BITS = (torch.arange(256)[:, None] >> torch.arange(8)) & 1  # byte value -> its 8 bits, lowest first
_BIT_TABLES: dict[torch.device, torch.Tensor] = {}


def _llguidance() -> Any:
    if llguidance is None:
        raise ConfigurationError(f"structured output on the transformers engine needs llguidance: {_INSTALL}")
    return llguidance


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[R, W]`` int32 bitmasks -> ``[R, vocab]`` bool (``True``: allowed); tokens past ``32·W`` are not allowed."""
    table = _BIT_TABLES.get(bitmask.device)
    if table is None:
        table = _BIT_TABLES[bitmask.device] = _BITS.bool().to(bitmask.device)
    # Viewed as bytes (little-endian), byte b of word k holds tokens 32·k + 8·b .. 32·k + 8·b + 7.
    allowed = table[bitmask.contiguous().view(torch.uint8).long()].reshape(bitmask.shape[0], -1)
    if allowed.shape[1] >= vocab:
        return allowed[:, :vocab]
    return torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)


class GuidanceGrammars:
    """llguidance grammars for one tokenizer, compiled once per schema (least recently used ones dropped).

    Args:
        tokenizer: a fast Hugging Face tokenizer.
        vocab_size: the width of the model's logits (ids past the tokenizer's own are never allowed).
        eos_ids: the tokens that end a reply; once the JSON value is complete only these are allowed.
        cache_size: how many compiled schemas to keep.
    """

    def __init__(self, tokenizer: Any, *, vocab_size: int, eos_ids: Iterable[int], cache_size: int = 256) -> None:
        if cache_size < 1:
            raise ConfigurationError(f"`cache_size` has to be >= 1, but is {cache_size}")
        eos = sorted(set(eos_ids))
        if not eos:
            raise ConfigurationError("structured output needs an end-of-sequence token to end the reply; set one")
        llg = _llguidance()
        self._llg = llg
        try:
            self.tokenizer = llg.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        except ValueError as exc:  # a slow (Python) tokenizer
            raise ConfigurationError(f"structured output needs a fast tokenizer: {exc}") from None
        self.vocab_size = vocab_size
        self.words = (self.tokenizer.vocab_size + 31) // 32  # int32 words in one row's bitmask
        self.executor = llg.LLExecutor()
        self.cache_size = cache_size
        self._cache: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def grammar(self, fmt: ResponseFormat) -> str:
        """The compiled grammar of ``fmt``; raises ``ValueError`` naming what llguidance cannot compile."""
        with self._lock:
            cached = self._cache.get(fmt.key)
            if cached is not None:
                self._cache.move_to_end(fmt.key)
                return cached
        matcher_cls = self._llg.LLMatcher
        try:
            grammar = matcher_cls.grammar_from_json_schema(fmt.grammar_schema())
        except ValueError as exc:
            raise ValueError(f"the schema cannot be read: {exc}") from None
        is_error, messages = matcher_cls.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise ValueError(f"{messages[0] if messages else 'the grammar is invalid'}; simplify or fix the schema")
        with self._lock:
            self._cache[fmt.key] = grammar
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return grammar

    def matcher(self, fmt: ResponseFormat) -> Any:
        """A fresh ``llguidance.LLMatcher`` for one reply that must match ``fmt``."""
        matcher = self._llg.LLMatcher(self.tokenizer, self.grammar(fmt))
        if matcher.is_error():  # pragma: no cover - grammar() validated it
            raise ValueError(f"the schema cannot be used: {matcher.get_error()}")
        return matcher


class GrammarLogitsProcessor(LogitsProcessor):
    """Allow each constrained row only the tokens its grammar accepts next; rows without one pass untouched.

    Args:
        grammars: the compiled grammars of the engine's tokenizer.
        formats: one :class:`ResponseFormat` or ``None`` per batch row.
        prompt_width: the (left-padded) prompt length, so the step comes from ``input_ids``.

    A row whose matcher rejects a token (the batch fed it padding after the row ended) is released: from then on
    it is not masked, so a finished row never becomes all ``-inf``.
    """

    def __init__(self, grammars: GuidanceGrammars, formats: Sequence[ResponseFormat | None], prompt_width: int) -> None:
        self.grammars = grammars
        self.rows = [i for i, f in enumerate(formats) if f is not None]
        self.matchers = [grammars.matcher(formats[i]) for i in self.rows]  # type: ignore[arg-type]
        self.prompt_width = prompt_width
        self.index = torch.tensor(self.rows, dtype=torch.long)
        self.bitmask = torch.full((len(self.rows), grammars.words), -1, dtype=torch.int32)
        self.released = [False] * len(self.rows)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if not self.rows:
            return scores
        executor = self.grammars.executor
        if input_ids.shape[-1] > self.prompt_width:  # feed each row the token chosen at the previous step
            last = input_ids[self.index.to(input_ids.device), -1].tolist()
            live = [j for j, gone in enumerate(self.released) if not gone]
            accepted = executor.consume_token_par([(self.matchers[j], last[j]) for j in live])
            for j, ok in zip(live, accepted):
                if not ok:
                    self.released[j] = True
        live = [j for j, gone in enumerate(self.released) if not gone]
        self.bitmask.fill_(-1)
        if live:
            executor.unsafe_compute_mask_ptr(
                [(self.matchers[j], j) for j in live],
                self.bitmask.data_ptr(),
                self.bitmask.shape[1] * 4,
                self.bitmask.shape[0],
            )
        banned = ~unpack_bitmask(self.bitmask.to(scores.device), scores.shape[-1])
        if len(self.rows) == scores.shape[0]:
            return scores.masked_fill(banned, float("-inf"))
        index = self.index.to(scores.device)
        out = scores.clone()
        out[index] = scores[index].masked_fill(banned, float("-inf"))
        return out
