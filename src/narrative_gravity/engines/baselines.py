"""Reference methods that benchmarks compare against. They are baselines, not the product.

- :class:`ArticleGravityLogitsProcessor`: a faithful replica of the popular blog-post "narrative gravity"
  processor, flaws included, so benchmarks measure what users actually ran.
- :class:`WeightedDecodingLogitsProcessor`: weighted decoding (the keyword-boost baseline of the PPLM and
  FUDGE papers): a constant bonus on the single-token forms of a word list, vectorized.

>>> import torch
>>> class Tok:  # a stand-in tokenizer: "a" is token 1, " a" is token 2, "bc" needs two tokens
...     def encode(self, text, add_special_tokens=False):
...         return {"a": [1], " a": [2], "bc": [3, 4], " bc": [5, 4]}[text]
>>> proc = WeightedDecodingLogitsProcessor(Tok(), ["a", "bc"], 2.0)
>>> proc.token_ids.tolist()
[1, 2]
>>> proc(torch.tensor([[0]]), torch.zeros(1, 6)).tolist()
[[0.0, 2.0, 2.0, 0.0, 0.0, 0.0]]
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from transformers import LogitsProcessor

from ..errors import VocabularyError

__all__ = ["ArticleGravityLogitsProcessor", "WeightedDecodingLogitsProcessor", "single_token_forms"]


class ArticleGravityLogitsProcessor(LogitsProcessor):
    """Replica of the blog-post "narrative gravity" ``LogitsProcessor``, kept only for benchmarks.

    It reproduces the original's behaviour exactly, including its known flaws:

    - **raw-word lookup**: each keyword is looked up with ``tokenizer.convert_tokens_to_ids(word)``, which
      only finds a word that is itself one vocabulary piece, and then only its glued form (``planet``, not
      the ``Ġplanet`` that follows a space in running text). Words that are not one piece come back as the
      unknown-token id (or ``None``) and are silently skipped; ``binary_search`` is never split;
    - **Python loops**: the strength is added token by token, row by row
      (``for i in range(B): for tid in core_ids: scores[i, tid] += strength``);
    - **in place**: the input ``scores`` tensor is modified and returned;
    - **stateful counter**: ``self.step`` counts calls, not generated tokens, and is never reset, so a
      second ``generate`` call (or beam search) continues where the first stopped. The full strength is
      used while ``step < decay_after_steps``, half of it afterwards.

    Use :class:`~narrative_gravity.engines.hf.NarrativeGravityLogitsProcessor` for real work.
    """

    def __init__(
        self,
        tokenizer: Any,
        core_semantics: Iterable[str],
        gravity_strength: float = 1.2,
        penalize: Iterable[str] | None = (),
        decay_after_steps: int = 50,
    ) -> None:
        unk = getattr(tokenizer, "unk_token_id", None)

        def lookup(words: Iterable[str]) -> list[int]:
            ids = []
            for word in words:
                tid = tokenizer.convert_tokens_to_ids(word)
                if tid is None or tid == unk:
                    continue
                ids.append(int(tid))
            return ids

        self.core_ids = lookup(core_semantics)
        self.penalize_ids = lookup(penalize or ())
        self.gravity_strength = gravity_strength
        self.decay_after_steps = decay_after_steps
        self.step = 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.step += 1
        strength = self.gravity_strength if self.step < self.decay_after_steps else self.gravity_strength * 0.5
        for i in range(scores.shape[0]):
            for tid in self.core_ids:
                scores[i, tid] += strength
            for tid in self.penalize_ids:
                scores[i, tid] -= strength
        return scores


def single_token_forms(tokenizer: Any, words: Iterable[str]) -> list[int]:
    """The ids of the words' forms, after a space and glued, that the tokenizer writes as exactly one token.

    Sorted, without duplicates.
    """
    ids: set[int] = set()
    for w in words:
        for text in (" " + w, w):
            enc = tokenizer.encode(text, add_special_tokens=False)
            if len(enc) == 1:
                ids.add(int(enc[0]))
    return sorted(ids)


class WeightedDecodingLogitsProcessor(LogitsProcessor):
    """Weighted decoding (the PPLM / FUDGE keyword baseline): ``scores + strength`` on the words' single tokens.

    The single-token forms of each word, with and without a leading space as the tokenizer writes them
    (``tokenizer.encode(" " + w)`` and ``tokenizer.encode(w)``, kept when exactly one token), get
    ``strength`` added to their logits at every step. The bias row is built once per vocabulary width,
    dtype and device; each call is one ``scores + bias`` and returns a new tensor.
    """

    def __init__(self, tokenizer: Any, words: Iterable[str], strength: float) -> None:
        self.token_ids = torch.tensor(single_token_forms(tokenizer, words), dtype=torch.long)
        self.strength = float(strength)
        self._bias: tuple[tuple[int, torch.dtype, str], torch.Tensor] | None = None

    def _bias_for(self, scores: torch.Tensor) -> torch.Tensor:
        key = (scores.shape[-1], scores.dtype, str(scores.device))
        if self._bias is None or self._bias[0] != key:
            width = scores.shape[-1]
            too_big = self.token_ids[self.token_ids >= width]
            if too_big.numel():
                raise VocabularyError(
                    f"the logits have {width} columns but the word ids include {too_big.tolist()[:10]}; build the "
                    "processor with the tokenizer of the model you generate with"
                )
            bias = torch.zeros(width, dtype=scores.dtype)
            bias[self.token_ids] = self.strength
            self._bias = (key, bias.to(scores.device))
        return self._bias[1]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return scores + self._bias_for(scores)
