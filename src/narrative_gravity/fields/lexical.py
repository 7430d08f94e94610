"""Lexical fields: turn word lists into a :class:`NarrativeField` for any Hugging Face tokenizer.

A word reaches the model through several *surface forms*: after a space (``" planet"``, written
``Ġplanet`` by byte-level BPE and ``▁planet`` by SentencePiece), glued to what precedes it
(``"planet"`` after a quote or a newline, and the only form in CJK text), and in case variants
(``" Planet"``). Each form is a token-id sequence. Single-token forms get a value in ``values``; for
multi-token forms the first piece gets a weaker value and every later piece is pulled only once the
pieces before it were generated (the field's continuation table).

Surface forms are checked against the tokenizer: a form that contains the unknown token or a special
token, or that does not decode back to the word, is dropped; a word with no form left is reported
with the reason in :class:`WordReport`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..errors import ConfigurationError, FieldError, VocabularyError
from ..gravity.field import NarrativeField, WordReport, merge_fields
from ..text import expand_tracked, word_list

__all__ = ["build_lexical_field", "reach", "surface_forms", "weighted_lexical_field"]

# Anchors put in front of a word to get its after-a-space form: encode("a planet") minus encode("a").
_ANCHORS = ("a", "The", "x", "0", ".")
# Scripts written without spaces and without case: no case variants for words that contain them.
_CJK = re.compile(
    "[\u1100-\u11ff\u2e80-\u2fdf\u3000-\u30ff\u3100-\u31ff\u3400-\u4dbf\u4e00-\u9fff"
    "\ua960-\ua97f\uac00-\ud7ff\uf900-\ufaff\uff00-\uffef\U00020000-\U0003134f]"
)
PENALIZE_WINS = "also listed in penalize; penalize wins"


def surface_forms(tokenizer: Any, word: str) -> list[tuple[int, ...]]:
    """Every distinct token-id sequence that writes ``word`` in running text.

    After-a-space forms come first, then glued forms, each for the case variants (as given, lower,
    first letter upper; none for CJK words). Forms with the unknown token or special tokens, and forms
    that do not decode back to the word, are left out. The word is taken literally (no ``_`` split).
    """
    word = " ".join(str(word).split())
    if not word:
        return []
    return [f.ids for f in _Tokenizer(tokenizer).analyze([word])[0].forms]


def reach(tokenizer: Any, words: Iterable[str], *, max_pieces: int | None = None) -> tuple[list[str], list[str]]:
    """Split ``words`` (stripped, in order) into ``(reachable, unreachable)`` for this tokenizer.

    A word is reachable when at least one surface form encodes without the unknown token or special
    tokens and decodes back to the word (and, if ``max_pieces`` is given, has at most that many
    tokens). Blank words are unreachable.
    """
    if max_pieces is not None and max_pieces < 1:
        raise FieldError(f"max_pieces must be >= 1, got {max_pieces}")
    stripped = [" ".join(str(w).split()) for w in word_list(words, "words")]
    todo = list(dict.fromkeys(w for w in stripped if w))
    ok: dict[str, bool] = {}
    for w, a in zip(todo, _Tokenizer(tokenizer).analyze(todo)):
        ok[w] = any(max_pieces is None or len(f.ids) <= max_pieces for f in a.forms)
    reachable = [w for w in stripped if ok.get(w, False)]
    unreachable = [w for w in stripped if not ok.get(w, False)]
    return reachable, unreachable


def build_lexical_field(
    tokenizer: Any,
    core: Iterable[str],
    penalize: Iterable[str] = (),
    *,
    vocab_size: int | None = None,
    glued_weight: float = 0.5,
    first_piece_weight: float = 0.5,
    max_pieces: int = 8,
    name: str = "lexical",
) -> NarrativeField:
    """Build a field that pulls toward the ``core`` words and away from the ``penalize`` words.

    Words go through :func:`expand_keywords` first. For each surface form of a core word: a
    single-token form gets ``+1`` (``glued_weight`` if glued); a multi-token form gives its first
    piece ``first_piece_weight`` (times ``glued_weight`` if glued; nothing if the piece is only
    whitespace) and puts each later piece in the continuation table with ``+1`` after the pieces
    before it. A penalize word gets ``-1`` on its single-token forms and on the continuation pieces
    of its multi-token forms (not on their first piece). Positive values combine with ``max``; a
    negative value on a token always wins, and so does a penalize word over the same core word.

    Raises :class:`FieldError` when an argument is out of range or no core word is usable, and
    :class:`VocabularyError` when ``vocab_size`` is too small for the tokenizer's ids.
    """
    vocab_size = _check_knobs(tokenizer, vocab_size, glued_weight, first_piece_weight, max_pieces)
    core_words, pen_words, unusable = _expanded(core, penalize)
    tk = _Tokenizer(tokenizer)
    forms = _usable_forms(tk, list(dict.fromkeys(core_words + pen_words)), max_pieces, unusable)
    positive, negative = _signed_forms(core_words, pen_words, forms, unusable)
    used = {w: [tuple(tk.pieces(f.ids)) for f in fs] for w, fs in forms.items() if w not in unusable}
    if not positive:
        details = "; ".join(f"{w!r}: {unusable.get(w, 'not usable')}" for w in core_words)
        raise FieldError(
            f"none of the core words can be used with this tokenizer ({details}). Fix: check the spelling, "
            f"drop or split long compounds, raise max_pieces (now {max_pieces}), remove the words from "
            "penalize, and build the field with the tokenizer of the model you generate with"
        )
    too_big = sorted({i for _, f in positive + negative for i in f.ids if i >= vocab_size})
    if too_big:
        raise VocabularyError(
            f"token ids {too_big[:10]} are outside vocab_size={vocab_size}; leave vocab_size unset "
            f"(len(tokenizer) = {len(tokenizer)}) or pass the model's vocabulary size"
        )
    pos, neg, cont = _pulls(tk, positive, negative, glued_weight, first_piece_weight)
    values = torch.zeros(vocab_size, dtype=torch.float32)
    if pos:
        ids = torch.tensor(list(pos), dtype=torch.long)
        values[ids] = torch.tensor(list(pos.values()), dtype=torch.float32)
    if neg:
        values[torch.tensor(sorted(neg), dtype=torch.long)] = -1.0
    prefixes = next_ids = next_values = None
    if cont:
        keys = sorted(cont, key=lambda k: (len(k[0]), k[0], k[1]))
        width = max(len(p) for p, _ in keys)
        prefixes = torch.tensor([[-1] * (width - len(p)) + list(p) for p, _ in keys], dtype=torch.long)
        next_ids = torch.tensor([n for _, n in keys], dtype=torch.long)
        next_values = torch.tensor([cont[k] for k in keys], dtype=torch.float32)
    report = WordReport(used=used, unusable=unusable)
    return NarrativeField(
        values=values, prefixes=prefixes, next_ids=next_ids, next_values=next_values, report=report, name=name
    )


def _check_knobs(
    tokenizer: Any, vocab_size: int | None, glued_weight: float, first_piece_weight: float, max_pieces: int
) -> int:
    """The field's width (``len(tokenizer)`` by default), after checking every knob of :func:`build_lexical_field`."""
    for label, w in (("glued_weight", glued_weight), ("first_piece_weight", first_piece_weight)):
        if not isinstance(w, (int, float)) or isinstance(w, bool) or not math.isfinite(w) or not 0 <= w <= 1:
            raise FieldError(f"{label} must be a number in [0, 1], got {w!r}")
    if isinstance(max_pieces, bool) or not isinstance(max_pieces, int) or max_pieces < 1:
        raise FieldError(f"max_pieces must be an integer >= 1, got {max_pieces!r}")
    if vocab_size is None:
        vocab_size = len(tokenizer)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise FieldError(f"vocab_size must be a positive integer, got {vocab_size!r}")
    return vocab_size


def _expanded(core: Iterable[str], penalize: Iterable[str]) -> tuple[list[str], list[str], dict[str, str]]:
    """The core and penalize words after :func:`expand_keywords`, and why the raw words that left nothing are
    unusable; at least one core word is required."""
    core_tracked = expand_tracked(word_list(core, "core"))
    pen_tracked = expand_tracked(word_list(penalize, "penalize"))
    unusable: dict[str, str] = {}
    for raw, expanded in [*core_tracked, *pen_tracked]:
        if not expanded:
            unusable[raw] = "empty after stripping" if "_" not in raw else "empty after splitting on '_' and stripping"
    core_words = list(dict.fromkeys(w for _, ex in core_tracked for w in ex))
    pen_words = list(dict.fromkeys(w for _, ex in pen_tracked for w in ex))
    if not core_words:
        given = [raw for raw, _ in core_tracked]
        raise FieldError(f"no core word to build the field from (got {given!r}); pass at least one non-empty word")
    return core_words, pen_words, unusable


def _usable_forms(
    tk: _Tokenizer, words: list[str], max_pieces: int, unusable: dict[str, str]
) -> dict[str, list[_Form]]:
    """Each word's surface forms of at most ``max_pieces`` tokens; a word with none goes to ``unusable``."""
    forms: dict[str, list[_Form]] = {}
    for w, a in zip(words, tk.analyze(words)):
        fitting = [f for f in a.forms if len(f.ids) <= max_pieces]
        if a.reason is not None:
            unusable[w] = a.reason
        elif not fitting:
            need = min(len(f.ids) for f in a.forms)
            unusable[w] = f"needs {need} tokens, more than max_pieces={max_pieces}"
        else:
            forms[w] = fitting
    return forms


def _signed_forms(
    core_words: list[str], pen_words: list[str], forms: dict[str, list[_Form]], unusable: dict[str, str]
) -> tuple[list[tuple[str, _Form]], list[tuple[str, _Form]]]:
    """The forms that pull and the forms that push away; a word both core and penalized is penalized only."""
    pen_keys = {w.casefold() for w in pen_words}
    positive: list[tuple[str, _Form]] = []
    for w in core_words:
        if w not in forms:
            continue
        if w.casefold() in pen_keys:
            unusable[w] = PENALIZE_WINS
            continue
        positive.extend((w, f) for f in forms[w])
    negative = [(w, f) for w in pen_words if w in forms for f in forms[w]]
    return positive, negative


def _pulls(
    tk: _Tokenizer,
    positive: list[tuple[str, _Form]],
    negative: list[tuple[str, _Form]],
    glued_weight: float,
    first_piece_weight: float,
) -> tuple[dict[int, float], set[int], dict[tuple[tuple[int, ...], int], float]]:
    """Token values (positive, combined with max), penalized tokens, and the continuation table."""
    # a whitespace-only first piece gets nothing
    firsts = sorted({f.ids[0] for _, f in positive if len(f.ids) > 1})
    blank = {i for i, s in zip(firsts, tk.decode([(i,) for i in firsts])) if not s.strip()}
    pos: dict[int, float] = {}
    cont: dict[tuple[tuple[int, ...], int], float] = {}
    for _, f in positive:
        scale = 1.0 if f.spaced else float(glued_weight)
        if len(f.ids) == 1:
            weight, tid = scale, f.ids[0]
        else:
            weight, tid = (0.0 if f.ids[0] in blank else float(first_piece_weight) * scale), f.ids[0]
            for j in range(1, len(f.ids)):
                cont.setdefault((f.ids[:j], f.ids[j]), 1.0)
        if weight > pos.get(tid, 0.0):
            pos[tid] = weight
    neg: set[int] = set()
    for _, f in negative:
        if len(f.ids) == 1:
            neg.add(f.ids[0])
        else:
            for j in range(1, len(f.ids)):
                cont[(f.ids[:j], f.ids[j])] = -1.0  # overrides a positive entry with the same key
    # A token penalized everywhere is not pulled in any context either.
    cont = {k: v for k, v in cont.items() if v < 0 or k[1] not in neg}
    # Prefixes are matched right-aligned, so an entry whose prefix ends with a shorter entry's prefix
    # (same next piece) fires together with it: drop it when it adds the same value again, or when
    # the shorter one is a penalty (which must win).
    cont = {
        (p, n): v
        for (p, n), v in cont.items()
        if not any((s := cont.get((p[j:], n))) is not None and (s == v or s < 0) for j in range(1, len(p)))
    }
    return pos, neg, cont


# --------------------------------------------------------------------------------------------------
# internals


@dataclass(frozen=True)
class _Form:
    ids: tuple[int, ...]
    spaced: bool  # written after a space (else glued to what precedes it)


@dataclass(frozen=True)
class _Analysis:
    forms: list[_Form]
    reason: str | None  # why no form is valid (None when `forms` is not empty)


def _case_variants(word: str) -> list[str]:
    if _CJK.search(word):
        return [word]
    return list(dict.fromkeys([word, word.lower(), word[:1].upper() + word[1:]]))


class _Tokenizer:
    """Batched encode/decode helpers and the ids a surface form must not contain."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.unk: int | None = getattr(tokenizer, "unk_token_id", None)
        special = set(getattr(tokenizer, "all_special_ids", None) or ())
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        special.update(i for i, t in added.items() if getattr(t, "special", False))
        self.special = frozenset(special)

    def encode(self, texts: list[str]) -> list[tuple[int, ...]]:
        if not texts:
            return []
        return [tuple(int(i) for i in ids) for ids in self.tok(texts, add_special_tokens=False)["input_ids"]]

    def decode(self, seqs: list[tuple[int, ...]]) -> list[str]:
        if not seqs:
            return []
        return self.tok.batch_decode(
            [list(s) for s in seqs], skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

    def pieces(self, ids: tuple[int, ...]) -> list[str]:
        return [str(p) for p in self.tok.convert_ids_to_tokens(list(ids))]

    def spaced_forms(self, texts: list[str]) -> list[tuple[int, ...]]:
        """The ids of ``" " + text`` in running text, for each text (see the anchor note at the top)."""
        out: dict[int, tuple[int, ...]] = {}
        pending = list(range(len(texts)))
        for anchor in _ANCHORS:
            if not pending:
                break
            a_ids = self.encode([anchor])[0]
            if not a_ids:
                continue
            still = []
            for i, ids in zip(pending, self.encode([f"{anchor} {texts[i]}" for i in pending])):
                if len(ids) > len(a_ids) and ids[: len(a_ids)] == a_ids:
                    out[i] = ids[len(a_ids) :]
                else:
                    still.append(i)
            pending = still
        for i, ids in zip(pending, self.encode([" " + texts[i] for i in pending])):
            out[i] = ids
        return [out[i] for i in range(len(texts))]

    def analyze(self, words: list[str]) -> list[_Analysis]:
        """The valid surface forms of each (non-empty, stripped) word, or why it has none."""
        flat = [(wi, v) for wi, w in enumerate(words) for v in _case_variants(w)]
        texts = [v for _, v in flat]
        spaced = self.spaced_forms(texts)
        glued = self.encode(texts)
        # candidates per word: ids -> (spaced, text); the same ids as both spaced and glued count as spaced
        cands: list[dict[tuple[int, ...], tuple[bool, str]]] = [{} for _ in words]
        for (wi, v), ids in zip(flat, spaced):
            cands[wi].setdefault(ids, (True, v))
        for (wi, v), ids in zip(flat, glued):
            cands[wi].setdefault(ids, (False, v))
        rejected: list[list[str]] = [[] for _ in words]
        to_check: list[tuple[int, tuple[int, ...], bool, str]] = []
        for wi, cs in enumerate(cands):
            for ids, (sp, v) in cs.items():
                if not ids:
                    rejected[wi].append("empty")
                elif self.unk is not None and self.unk in ids:
                    rejected[wi].append("unk")
                elif any(i in self.special for i in ids):
                    rejected[wi].append(
                        "special:" + next(p for i, p in zip(ids, self.pieces(ids)) if i in self.special)
                    )
                else:
                    to_check.append((wi, ids, sp, v))
        decoded = self.decode([ids for _, ids, _, _ in to_check])
        forms: list[list[_Form]] = [[] for _ in words]
        mismatch: list[tuple[str, str] | None] = [None for _ in words]
        for (wi, ids, sp, v), d in zip(to_check, decoded):
            if d in (v, " " + v):
                forms[wi].append(_Form(ids, sp))
            elif mismatch[wi] is None:
                mismatch[wi] = (v, d)
        out = []
        for wi in range(len(words)):
            fs = sorted(forms[wi], key=lambda f: not f.spaced)  # stable: spaced first, variant order kept
            out.append(_Analysis(fs, None if fs else _reason(rejected[wi], mismatch[wi])))
        return out


def _reason(rejected: list[str], mismatch: tuple[str, str] | None) -> str:
    if mismatch is not None:
        v, d = mismatch
        return f"no surface form decodes back to the word ({v!r} decodes to {d!r})"
    kinds = {r.split(":", 1)[0] for r in rejected}
    specials = sorted({r.split(":", 1)[1] for r in rejected if r.startswith("special:")})
    if kinds == {"unk"}:
        return "every surface form contains the unknown token"
    if kinds == {"special"}:
        return f"every surface form contains a special token ({', '.join(specials)})"
    if kinds == {"empty"}:
        return "the tokenizer encodes it to no tokens"
    return "every surface form contains the unknown token or a special token, or encodes to nothing"


def weighted_lexical_field(
    tokenizer: Any, weights: Mapping[str, float], *, name: str = "memory", **kwargs: Any
) -> NarrativeField | None:
    """A lexical field whose value for each word's forms is the word's weight (in ``(0, 1]``).

    Unreachable words are skipped; ``None`` when none is left. ``kwargs`` go to ``build_lexical_field``.
    """
    bad = {w: x for w, x in weights.items() if not 0 < x <= 1}
    if bad:
        raise ConfigurationError(f"word weights have to be in (0, 1], but got {bad!r}")
    ok, _ = reach(tokenizer, list(weights), max_pieces=kwargs.get("max_pieces", 8))
    if not ok:
        return None
    parts = []
    for w in dict.fromkeys(ok):
        f = build_lexical_field(tokenizer, [w], name=w, **kwargs)
        x = float(weights[w])
        nv = None if f.next_values is None else f.next_values * x
        parts.append(replace(f, values=f.values * x, next_values=nv))
    return merge_fields(parts, name=name)
