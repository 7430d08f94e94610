"""Plain-text helpers shared by context pruning, planning and topic memory: words, a light stemmer, stopwords.

>>> content_words("Binary search halves the sorted array at every step.")
['binary', 'search', 'halves', 'sorted', 'array', 'step']
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

from .errors import FieldError

__all__ = [
    "STOPWORDS",
    "chat_ids",
    "content_words",
    "expand_keywords",
    "expand_tracked",
    "has_unspaced_script",
    "lead_messages",
    "lead_text",
    "ngrams",
    "stem",
    "unencodable",
    "units",
    "word_list",
    "word_set",
    "words",
]


def word_set(text: str) -> frozenset[str]:
    """The whitespace-separated words of ``text`` as a set (for writing word lists)."""
    return frozenset(text.split())


# A compact English stopword list (function words, auxiliaries, and words that carry no topic).
STOPWORDS = word_set(
    """
a about above after again against all almost also although always am among an and another any anyone
anything are around as at away back be became because become been before being below between both but by
can cannot could did do does doing done down during each either else enough even ever every few for from
further get gets getting give given go goes going gone got had has have having he her here hers herself
him himself his how however i if in into is it its itself just know last least less let like made make
many may me might more most much must my myself near need never new next no nor not now of off often on
once one only or other others our ours ourselves out over own per perhaps put quite rather really said
same say says see seem seemed seems several shall she should since so some something still such take
than that the their theirs them themselves then there these they thing things this those though three
through thus to today too two under until up upon us use used using very want was way we well were what
whatever when where whether which while who whom whose why will with within without would yes yet you your
yours yourself yourselves according told tell write writes written explain describe outline point points
answer question questions
"""
)

_WORD = re.compile(r"[A-Za-z][A-Za-z'\-]*[A-Za-z]|[A-Za-z]")
_SUFFIXES = ("ations", "ation", "ments", "ment", "ings", "ing", "edly", "ed", "ly")


def words(text: str) -> list[str]:
    """Lower-cased words (letters, inner apostrophes and hyphens), possessive ``'s`` removed.

    >>> words("DeVos's vote, 51-50: confirmed!")
    ['devos', 'vote', 'confirmed']
    """
    out = []
    for w in _WORD.findall(text):
        w = w.lower()
        if w.endswith("'s"):
            w = w[:-2]
        out.append(w.strip("'-"))
    return [w for w in out if w]


# Scripts written without spaces between words: CJK radicals, punctuation and ideographs, kana, fullwidth forms.
_UNSPACED = "\u2e80-\u303f\u3040-\u30ff\u3100-\u312f\u3190-\u31ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff00-\uffef"
_UNIT = re.compile(rf"[{_UNSPACED}\U00020000-\U0002fa1f]|[^\s{_UNSPACED}\U00020000-\U0002fa1f]+")


_UNSPACED_CHAR = re.compile(rf"[{_UNSPACED}\U00020000-\U0002fa1f]")


def has_unspaced_script(text: str) -> bool:
    """Whether ``text`` has characters of a script written without spaces (Chinese, Japanese).

    >>> has_unspaced_script("二分查找"), has_unspaced_script("binary search")
    (True, False)
    """
    return _UNSPACED_CHAR.search(text) is not None


def units(text: str) -> list[str]:
    """The text's units for n-gram metrics: whitespace-separated words, and each character of a script written
    without spaces (Chinese, Japanese), so that ``distinct-n`` and ``rep-n`` read those texts too.

    >>> units("Binary search halves it.")
    ['Binary', 'search', 'halves', 'it.']
    >>> units("二分查找 is fast")
    ['二', '分', '查', '找', 'is', 'fast']
    """
    return _UNIT.findall(text)


def ngrams(text: str, n: int) -> list[tuple[str, ...]]:
    """The text's n-grams of :func:`units`.

    >>> ngrams("每一步都减半", 2)[:2]
    [('每', '一'), ('一', '步')]
    """
    u = units(text)
    return [tuple(u[i : i + n]) for i in range(len(u) - n + 1)]


def stem(word: str) -> str:
    """A light suffix stripper, enough for BM25 to match inflections (not a linguistic stemmer).

    >>> [stem(w) for w in ("confirmed", "confirmation", "votes", "voting", "stories", "stopped")]
    ['confirm', 'confirm', 'vot', 'vot', 'story', 'stop']
    """
    w = word.lower()
    if len(w) > 4 and w.endswith("ies"):
        w = w[:-3] + "y"
    elif len(w) > 3 and w.endswith("s") and not w.endswith(("ss", "us", "is")):
        w = w[:-1]
    for suf in _SUFFIXES:
        if w.endswith(suf) and len(w) - len(suf) >= 3:
            w = w[: -len(suf)]
            break
    if len(w) > 3 and w.endswith("e"):
        w = w[:-1]
    if len(w) > 3 and w[-1] == w[-2] and w[-1] not in "aeiouls":
        w = w[:-1]
    return w


def content_words(text: str, *, stopwords: frozenset[str] = STOPWORDS, min_length: int = 3) -> list[str]:
    """Words that can carry a topic: no stopwords, at least ``min_length`` letters.

    >>> content_words("The planet moves along its orbit around the Sun.")
    ['planet', 'moves', 'along', 'orbit', 'sun']
    """
    return [w for w in words(text) if len(w) >= min_length and w not in stopwords]


def expand_keywords(words: Iterable[str]) -> list[str]:
    """Split ``snake_case`` compounds into their words and keep the phrase; strip, drop empties, dedupe.

    Runs of whitespace inside a phrase become one space. A single string counts as one word.

    >>> expand_keywords(["binary_search", " planet ", "planet", "", "deep  space"])
    ['binary', 'search', 'binary search', 'planet', 'deep space']
    """
    out: list[str] = []
    for _raw, expanded in expand_tracked(word_list(words, "words")):
        out.extend(expanded)
    return list(dict.fromkeys(out))


def word_list(words: Iterable[str] | str, label: str) -> list[str]:
    """``words`` as a list of strings (a single string is one word); ``label`` names them in the error."""
    if isinstance(words, str):
        return [words]
    try:
        return [str(w) for w in words]
    except TypeError as exc:
        raise FieldError(f"{label} must be an iterable of strings, got {type(words).__name__}") from exc


def expand_tracked(words: Sequence[str]) -> list[tuple[str, list[str]]]:
    """For each raw word, the words it expands to (empty list when nothing is left)."""
    out = []
    for raw in words:
        parts = [" ".join(p.split()) for p in raw.split("_")]
        parts = [p for p in parts if p]
        expanded = list(parts)
        if len(parts) > 1:
            expanded.append(" ".join(parts))
        out.append((raw, expanded))
    return out


def unencodable(data: Any, path: str = "") -> str | None:
    """The dotted path of the first string (or key) in ``data`` that UTF-8 cannot encode, else ``None``.

    >>> unencodable({"a": ["ok", "\\ud800"]})
    'a.1'
    >>> unencodable({"a": "fine"}) is None
    True
    """
    stack: list[tuple[str, Any]] = [(path, data)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return where or "body"
        elif isinstance(value, dict):
            items = list(value.items())
            for key, item in reversed(items):
                child = f"{where}.{key}" if where else str(key)
                if isinstance(key, str) and unencodable(key) is not None:
                    return (where + "." if where else "") + repr(key)
                stack.append((child, item))
        elif isinstance(value, (list, tuple)):
            for i in reversed(range(len(value))):
                stack.append((f"{where}.{i}" if where else str(i), value[i]))
    return None


def lead_text(prompt: str, sentence: str | None) -> str:
    """``prompt`` for plain continuation with ``sentence`` before it (a space between, unless ``prompt`` starts
    with white space); ``prompt`` itself without one."""
    if not sentence:
        return prompt
    return sentence + prompt if prompt[:1].isspace() else f"{sentence} {prompt}"


def lead_messages(messages: list[dict[str, str]], sentence: str | None) -> list[dict[str, str]]:
    """Chat ``messages`` with ``sentence`` as the system message, or before the first system message's text;
    a new list (the caller's is untouched), or ``messages`` itself without a sentence."""
    if not sentence:
        return messages
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0])
        first["content"] = f"{sentence}\n\n{first.get('content', '')}".rstrip()
        return [first, *messages[1:]]
    return [{"role": "system", "content": sentence}, *messages]


def chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` in the tokenizer's chat template, ready for the assistant's turn.

    The template writes its own special tokens, so none are added on top. The caller checks that the
    tokenizer has a template.
    """
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
