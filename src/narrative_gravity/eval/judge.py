"""Judge perplexity: how fluent a continuation is under a different model than the generator.

The judge reads ``context + continuation`` (its own tokenizer; the context with its BOS token) and we average
the negative log-likelihood over the continuation's tokens only; perplexity is ``exp`` of that mean. Rows are
left-padded into batches with explicit position ids, and only the last positions' logits are computed, so a
large vocabulary (Gemma 3: 262k) stays within a fixed memory budget.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import ConfigurationError
from ..models import load_model

__all__ = ["DEFAULT_JUDGE", "PerplexityJudge", "load_judge"]

DEFAULT_JUDGE = "gemma3-270m"


class PerplexityJudge:
    """``judge.perplexity(contexts, continuations) -> list[float]`` (NaN for an empty continuation).

    Args:
        model: a causal LM (any ``AutoModelForCausalLM``) in eval mode.
        tokenizer: its tokenizer.
        name: a label for reports.
        max_length: longest ``context + continuation`` in judge tokens; longer contexts are cut from the left.
        logits_budget: bytes of float32 logits one forward pass may hold; sets the batch size.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        name: str = "judge",
        max_length: int = 1024,
        logits_budget: int = 256 * 2**20,
    ) -> None:
        if max_length < 2:
            raise ConfigurationError(f"`max_length` has to be >= 2, but is {max_length}")
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.max_length = max_length
        self.logits_budget = logits_budget
        out = model.get_output_embeddings()
        self.vocab = int(out.weight.shape[0]) if out is not None else int(model.config.vocab_size)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id = int(pad) if pad is not None else 0

    def _pairs(self, contexts: Sequence[str], continuations: Sequence[str]) -> list[tuple[list[int], int]]:
        ctx = self.tokenizer(list(contexts), add_special_tokens=True)["input_ids"]
        cont = self.tokenizer(list(continuations), add_special_tokens=False)["input_ids"]
        out = []
        for c, x in zip(ctx, cont, strict=True):
            x = list(x)[: self.max_length - 1]
            c = list(c)[-(self.max_length - len(x)) :] if c else []
            out.append((c + x, len(x)))
        return out

    def nll(self, contexts: Sequence[str], continuations: Sequence[str]) -> list[tuple[float, int]]:
        """``(summed NLL in nats, scored tokens)`` per row; the first token of a row without context is not scored."""
        return [(float(t.sum()), int(t.numel())) for t in self.token_nll(contexts, continuations)]

    def token_nll(self, contexts: Sequence[str], continuations: Sequence[str]) -> list[torch.Tensor]:
        """The NLL (nats) of each scored continuation token, per row: a ``[n]`` float tensor for the last ``n``
        tokens of the continuation as the judge tokenizes it (``add_special_tokens=False``); all of them, but
        the first where the row has no context. Empty for an empty continuation."""
        if len(contexts) != len(continuations):
            raise ConfigurationError(f"got {len(contexts)} contexts but {len(continuations)} continuations")
        pairs = self._pairs(contexts, continuations)
        results: list[torch.Tensor] = [torch.zeros(0)] * len(pairs)
        order = sorted(range(len(pairs)), key=lambda i: len(pairs[i][0]))
        device = next(self.model.parameters()).device
        longest = max((n for _, n in pairs), default=1)
        rows_fit = max(1, self.logits_budget // (4 * self.vocab * (longest + 1)))
        start = 0
        while start < len(order):
            idx = order[start : start + rows_fit]
            start += len(idx)
            idx = [i for i in idx if pairs[i][1] > 0 and len(pairs[i][0]) >= 2]
            if not idx:
                continue
            width = max(len(pairs[i][0]) for i in idx)
            keep = min(width - 1, max(pairs[i][1] for i in idx))
            ids = torch.full((len(idx), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(idx), width), dtype=torch.long)
            for r, i in enumerate(idx):
                seq = pairs[i][0]
                ids[r, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
                mask[r, width - len(seq) :] = 1
            pos = (mask.cumsum(-1) - 1).clamp_min(0)
            with torch.inference_mode():
                logits = self.model(
                    input_ids=ids.to(device),
                    attention_mask=mask.to(device),
                    position_ids=pos.to(device),
                    logits_to_keep=keep + 1,
                ).logits
            # logits[:, j] predicts the token at position width - keep - 1 + j + 1
            pred = logits[:, :-1].float()
            target = ids[:, width - keep :].to(pred.device)
            logp = torch.log_softmax(pred, dim=-1).gather(-1, target[..., None]).squeeze(-1).cpu()
            for r, i in enumerate(idx):
                n = min(pairs[i][1], len(pairs[i][0]) - 1)
                results[i] = -logp[r, keep - n :]
        return results

    def perplexity(self, contexts: Sequence[str], continuations: Sequence[str]) -> list[float]:
        """``exp(mean NLL)`` of each continuation given its context; NaN when nothing could be scored."""
        return [math.exp(s / n) if n > 0 else float("nan") for s, n in self.nll(contexts, continuations)]


def load_judge(name_or_path: str | None = DEFAULT_JUDGE, *, device: str = "cpu") -> PerplexityJudge:
    """Load the judge model with :func:`~narrative_gravity.models.load_model` (``gemma3-270m`` by default) on
    ``device``."""

    model, tokenizer = load_model(name_or_path or DEFAULT_JUDGE, device=device)
    return PerplexityJudge(model, tokenizer, name=str(name_or_path or DEFAULT_JUDGE))
