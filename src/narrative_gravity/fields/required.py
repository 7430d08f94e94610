"""Build a :class:`~narrative_gravity.gravity.require.Requirement` (words a text must contain) for a tokenizer.

Each word's surface forms come from the lexical builder (after a space, glued, case variants; see
:mod:`narrative_gravity.fields.lexical`). The forms written after a space are the ones pulled and forced,
so a forced word never glues onto the word before it; a word in a script written without spaces (Chinese,
Japanese) uses every form and counts as soon as it is written. The vocabulary tables (which tokens
continue a word, which end a clause) are read once per tokenizer from its decoded tokens and kept (for
the eight most recent tokenizers).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import FieldError
from ..gravity.require import Requirement
from ..text import has_unspaced_script
from .lexical import _Tokenizer

__all__ = ["RequirementOptions", "build_requirement", "token_tables"]

_BREAK_CHARS = frozenset(".!?;:,\n")
_SENTENCE_CHARS = frozenset(".!?\n")


class _TokenizerKey:
    """Hashable by identity and size, so the tables of one tokenizer object are built once."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.key = (id(tokenizer), len(tokenizer))

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _TokenizerKey) and other.tokenizer is self.tokenizer and other.key == self.key


def token_tables(
    tokenizer: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, ...], torch.Tensor]:
    """``(glue, breaks, sentence, stops, joins)`` of ``tokenizer``: ``[V]`` bool tables of the tokens that
    continue the word before them (their text starts with a letter or digit, or is part of a character), of
    the tokens that end a clause or a line, and of those that end a sentence or a line; the special token ids
    (end of sequence and the other control tokens); and the tokens that end inside a word (their text ends
    with a letter or digit)."""
    return _token_tables(_TokenizerKey(tokenizer))


@functools.lru_cache(maxsize=8)
def _token_tables(
    key: _TokenizerKey,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, ...], torch.Tensor]:
    tok = key.tokenizer
    vocab = len(tok)
    texts = tok.batch_decode([[i] for i in range(vocab)], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    special = set(getattr(tok, "all_special_ids", None) or ())
    added = getattr(tok, "added_tokens_decoder", None) or {}
    special.update(i for i, t in added.items() if getattr(t, "special", False))
    glue = torch.zeros(vocab, dtype=torch.bool)
    joins = torch.zeros(vocab, dtype=torch.bool)
    breaks = torch.zeros(vocab, dtype=torch.bool)
    sentence = torch.zeros(vocab, dtype=torch.bool)
    for i, text in enumerate(texts):
        if i in special or not text:
            continue
        first = text[0]
        glue[i] = first == "\ufffd" or (first.isalnum() and not has_unspaced_script(first))
        last = text[-1]
        joins[i] = last == "\ufffd" or (last.isalnum() and not has_unspaced_script(last))
        stripped = text.rstrip(" \t")
        breaks[i] = bool(stripped) and (stripped[-1] in _BREAK_CHARS or "\n" in text)
        sentence[i] = bool(stripped) and (stripped[-1] in _SENTENCE_CHARS or "\n" in text)
    return glue, breaks, sentence, tuple(sorted(i for i in special if 0 <= i < vocab)), joins


@dataclass(frozen=True)
class RequirementOptions:
    """How a requirement pulls and forces its words (a profile's ``require`` block, all but ``words``).

    See :class:`~narrative_gravity.gravity.require.Requirement`, which checks them when it is built.
    """

    # the defaults are the kernel's, defined once there
    strength: float = Requirement.strength
    curve: float = Requirement.curve
    force: bool = Requirement.force
    slack: int = Requirement.slack
    window: int = Requirement.window
    spread: bool = Requirement.spread


def build_requirement(
    tokenizer: Any,
    words: Iterable[str],
    options: RequirementOptions = RequirementOptions(),
    *,
    stops: Sequence[int] | None = None,
    max_pieces: int = 16,
) -> Requirement:
    """The :class:`~narrative_gravity.gravity.require.Requirement` of ``words`` for ``tokenizer``.

    ``options`` (:class:`RequirementOptions`): how the words are pulled and forced. ``stops`` are the ids that
    end the text (default: the tokenizer's special tokens, end of sequence among them); they are masked while a
    word is missing.

    Raises:
        FieldError: a word is blank, or no form of it can be written by this tokenizer in at most
            ``max_pieces`` tokens (the message names the word and the reason).
    """
    cleaned = [" ".join(str(w).split()) for w in words]
    if not cleaned:
        raise FieldError("`require` needs at least one word")
    if any(not w for w in cleaned):
        raise FieldError("`require` holds a blank word; remove it")
    unique = list(dict.fromkeys(cleaned))
    analyses = _Tokenizer(tokenizer).analyze(unique)
    forms: list[tuple[tuple[int, ...], ...]] = []
    starts: list[tuple[tuple[int, ...], ...]] = []
    boundary: list[bool] = []
    for word, a in zip(unique, analyses):
        usable = [f for f in a.forms if len(f.ids) <= max_pieces]
        if not usable:
            why = a.reason or f"every form needs more than {max_pieces} tokens"
            raise FieldError(f"required word {word!r} cannot be written with this tokenizer: {why}")
        unspaced = has_unspaced_script(word)
        st = [f.ids for f in usable if f.spaced or unspaced]
        if not st:
            st = [f.ids for f in usable]
        forms.append(tuple(dict.fromkeys(f.ids for f in usable)))
        starts.append(tuple(dict.fromkeys(st)))
        boundary.append(not unspaced)
    glue, breaks, sentence, special, joins = token_tables(tokenizer)
    capital = tuple(tuple(tokenizer.decode(list(f)).lstrip()[:1].isupper() for f in st) for st in starts)
    return Requirement(
        words=tuple(unique),
        forms=tuple(forms),
        starts=tuple(starts),
        boundary=tuple(boundary),
        glue=glue,
        joins=joins,
        breaks=breaks,
        sentence=sentence,
        capital=capital,
        stops=tuple(special if stops is None else stops),
        strength=float(options.strength),
        curve=float(options.curve),
        force=bool(options.force),
        slack=int(options.slack),
        window=int(options.window),
        spread=bool(options.spread),
    )
