"""Prompts as token ids, the same for every engine: the chat template or plain text, the topic sentence, padding
and where a generated row ends.

>>> ids, mask = left_pad([[5, 6], [7]], pad_id=0)
>>> ids.tolist(), mask.tolist()
([[5, 6], [0, 7]], [[1, 1], [0, 1]])
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import ConfigurationError
from ..lead import lead_messages, lead_text
from ..text import chat_ids

__all__ = [
    "NEXT_TURN",
    "PLAIN_FRAME",
    "chat_ids",
    "encode_prompts",
    "eos_token_ids",
    "generated_length",
    "left_pad",
    "plain_frame",
    "until_next_turn",
]


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


# A chat frame for base models, which have no chat template of their own: the system message as a paragraph,
# then "User: …" and "Assistant: …" lines. A base model goes on to write the next "User:" line itself, so an
# answer ends where one starts (:func:`until_next_turn`).
PLAIN_FRAME = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}\n\n"
    "{% elif m['role'] == 'user' %}User: {{ m['content'] }}\n{% else %}Assistant: {{ m['content'] }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)
NEXT_TURN = "\nUser:"


def plain_frame(tokenizer: Any) -> Any:
    """A copy of ``tokenizer`` that writes chats in :data:`PLAIN_FRAME` (the caller's tokenizer is untouched)."""
    framed = copy.copy(tokenizer)
    framed.chat_template = PLAIN_FRAME
    return framed


def until_next_turn(tokenizer: Any, ids: list[int], marker: str = NEXT_TURN) -> list[int]:
    r"""``ids`` up to the token where the decoded text starts ``marker`` (the model writing the user's next
    turn), or all of them.

    >>> class Chars:  # a tokenizer whose tokens are characters
    ...     def decode(self, ids, skip_special_tokens=True):
    ...         return "".join(map(chr, ids))
    >>> "".join(map(chr, until_next_turn(Chars(), [ord(c) for c in "Hi!\nUser: more"])))
    'Hi!'
    """
    text = tokenizer.decode(ids, skip_special_tokens=True)
    at = text.find(marker)
    if at < 0:
        return ids
    lo, hi = 0, len(ids)  # the fewest tokens whose text reaches the marker's first character
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.decode(ids[:mid], skip_special_tokens=True)) > at:
            hi = mid
        else:
            lo = mid + 1
    return ids[: max(lo - 1, 0)]


def left_pad(batch: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token-id lists into ``(input_ids, attention_mask)`` for decoder-only generation."""
    width = max(len(ids) for ids in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, row in enumerate(batch):
        ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row) :] = 1
    return ids, mask


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
