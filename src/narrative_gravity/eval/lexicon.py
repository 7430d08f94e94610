"""The ``empath`` topic sets: 50 subject categories of the Empath lexicon × the 20 PPLM prefixes.

The `empath` package (``pip install --no-deps empath==0.89``) ships ``data/categories.tsv``: one category a
line, its name and then its words, tab-separated, the words ordered by similarity to the category. Only that
file is read. The package is never imported: its ``__init__`` imports ``requests`` and its client calls a
web service.

**Topics.** :data:`EMPATH_TOPICS` is fixed. Rule: a category is in if its name is a subject (a field, an
institution, an activity, a class of things or a place), never a feeling, mood, trait, attitude, quality or
bare action; 50 such categories were picked by hand, from the names and word lists only, before any run.
So ``joy``, ``anger``, ``pride``, ``optimism``, ``aggression``, ``cold``, ``kill`` and the like are out.

**Split.** Sorted by name, the topics at even positions (0, 2, 4, …) are the tuning set (``empath-tune``)
and those at odd positions the test set (``empath``), 25 each. Settings are chosen on the tuning set only.

**Words.** In each category, entries that are not one lowercase ASCII word (``in-law``, ``911``, ``3d``,
``worst_part``) are dropped, and so are repeats; the rest go through
:func:`~narrative_gravity.eval.prompts.split_wordlist` (even positions condition, odd positions are held
out and only score). Every word is a single word, so held-out success (whole word, case-insensitive) counts
it the way it counts the words of the PPLM lists.

>>> len(EMPATH_TOPICS), len(TUNE_TOPICS), len(TEST_TOPICS)
(50, 25, 25)
>>> TUNE_TOPICS[:3], TEST_TOPICS[:3]
(('air_travel', 'animal', 'banking'), ('alcohol', 'art', 'beach'))
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from ..errors import ConfigurationError
from .topics import EvalPrompt, find_topics_folder, read_prefixes, split_wordlist

__all__ = [
    "EMPATH_INSTALL",
    "EMPATH_TOPICS",
    "TEST_TOPICS",
    "TUNE_TOPICS",
    "clean_words",
    "empath_categories_path",
    "load_empath",
    "read_categories",
    "split_topics",
]

EMPATH_INSTALL = "pip install --no-deps empath==0.89"

# Subjects, not feelings (see the module doc); listed by name.
EMPATH_TOPICS: tuple[str, ...] = (
    "air_travel", "alcohol", "animal", "art", "banking", "beach", "business", "car", "clothing", "college",
    "computer", "cooking", "crime", "dance", "economics", "exercise", "farming", "fashion", "fire", "furniture",
    "government", "health", "hiking", "internet", "journalism", "law", "medieval", "military", "money", "music",
    "ocean", "office", "philosophy", "plant", "politics", "prison", "programming", "real_estate", "religion",
    "restaurant", "royalty", "sailing", "school", "science", "shopping", "sports", "vehicle", "weapon", "weather",
    "wedding",
)  # fmt: skip

_WORD = re.compile(r"[a-z]+")


def split_topics(names: Iterable[str] = EMPATH_TOPICS) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(tuning, test)``: the names sorted, even positions for tuning, odd positions for test.

    >>> split_topics(["law", "art", "music", "dance", "ocean"])
    (('art', 'law', 'ocean'), ('dance', 'music'))
    """
    ordered = sorted(set(names))
    return tuple(ordered[0::2]), tuple(ordered[1::2])


TUNE_TOPICS, TEST_TOPICS = split_topics()


def clean_words(words: Iterable[str]) -> tuple[str, ...]:
    """The entries that are one lowercase ASCII word, stripped and without repeats, in their order.

    >>> clean_words(["law", " court", "in-law", "911", "3d", "worst_part", "law", "Jury"])
    ('law', 'court')
    """
    return tuple(dict.fromkeys(w for w in (w.strip() for w in words) if _WORD.fullmatch(w)))


def empath_categories_path() -> Path:
    """``data/categories.tsv`` of the installed `empath` package, found without importing it."""
    spec = importlib.util.find_spec("empath")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = Path(folder) / "data" / "categories.tsv"
        if path.is_file():
            return path
    what = "is not installed" if spec is None else "has no data/categories.tsv"
    raise ConfigurationError(
        f"the `empath` prompt sets read the lexicon of the `empath` package, which {what}; "
        f"install it with `{EMPATH_INSTALL}`"
    )


def read_categories(path: str | os.PathLike[str] | None = None) -> dict[str, tuple[str, ...]]:
    """Every category of ``categories.tsv`` (default: :func:`empath_categories_path`): name → its words, as given."""
    path = Path(path) if path is not None else empath_categories_path()
    out: dict[str, tuple[str, ...]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        name, *words = line.split("\t")
        if name.strip():
            out[name.strip()] = tuple(words)
    return out


def load_empath(
    folder: str | os.PathLike[str] | None = None,
    *,
    tuning: bool = False,
    categories: str | os.PathLike[str] | None = None,
    topics: Sequence[str] | None = None,
) -> list[EvalPrompt]:
    """Every prefix × every test topic (``tuning=True``: tuning topic), topics by name, prefixes in file order.

    ``folder`` is the ``topics`` bench folder whose ``prefixes.txt`` is used (default:
    :func:`~narrative_gravity.eval.prompts.find_topics_folder`); ``categories`` the lexicon file (default:
    the installed package's); ``topics`` replaces the test or tuning topics (for tests).
    """
    lexicon = read_categories(categories)
    names = list(topics) if topics is not None else list(TUNE_TOPICS if tuning else TEST_TOPICS)
    missing = [n for n in names if n not in lexicon]
    if missing:
        raise ConfigurationError(
            f"the Empath lexicon has no categories {missing}; the `empath` sets are built on empath 0.89: "
            f"`{EMPATH_INSTALL}`"
        )
    root = Path(folder) if folder is not None else find_topics_folder()
    prefixes = read_prefixes(root)
    if not prefixes:
        raise ConfigurationError(f"{root / 'prefixes.txt'} has no prefixes")
    out: list[EvalPrompt] = []
    for name in names:
        cond, held = split_wordlist(clean_words(lexicon[name]))
        if not cond or not held:
            raise ConfigurationError(
                f"Empath category {name!r}: needs at least two words (one to condition on, one held out)"
            )
        for prefix in prefixes:
            out.append(EvalPrompt(len(out), prefix, name, cond, held))
    return out
