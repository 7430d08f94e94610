"""What every prompt set builds on: :class:`EvalPrompt`, the split of a word list into a conditioning and a
held-out half, the topic folder with its prefixes (shipped with the package), and the PPLM/FUDGE topic set itself
(:mod:`.prompts`, :mod:`.lexicon` and :mod:`.chat` read them).

>>> split_wordlist(["planet ", "galaxy", "", "orbit", "Planet", "moon"])
(('planet', 'orbit', 'moon'), ('galaxy',))
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigurationError

__all__ = [
    "BENCH_ENV",
    "BUILT_IN_SETS",
    "CHAT_TOPIC_SETS",
    "EMPATH",
    "EMPATH_TUNE",
    "PACKAGED_TOPICS",
    "TOPICS",
    "TOPICS_TUNE",
    "TOPIC_SETS",
    "EvalPrompt",
    "find_topics_folder",
    "load_topics",
    "read_prefixes",
    "split_wordlist",
    "topic_wordlists",
]

BENCH_ENV = "NARRATIVE_GRAVITY_BENCH"


@dataclass(frozen=True)
class EvalPrompt:
    """One prompt of an eval set. ``index`` is its position in the full set and keys its results."""

    index: int
    text: str
    topic_name: str | None = None
    topic_words: tuple[str, ...] = ()
    heldout_words: tuple[str, ...] = ()
    profile: str | None = None
    required: tuple[str, ...] = ()
    description: str | None = None  # a sentence that scores relevance apart from every word list (chat sets)

    def score_words(self) -> tuple[str, ...]:
        """The words that score topic relevance and success: held-out words if any, else the topic words."""
        return self.heldout_words or self.topic_words


def split_wordlist(lines: Sequence[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(conditioning, heldout)``: the words at even (0, 2, 4, …) and odd positions of the stripped, non-blank
    lines; a held-out word that also conditions (case-insensitively) is dropped, so no scoring word is ever given
    to a profile."""
    words = [w.strip() for w in lines]
    words = [w for w in words if w]
    cond = tuple(dict.fromkeys(words[0::2]))
    seen = {w.casefold() for w in cond}
    held: dict[str, None] = {}
    for w in words[1::2]:
        if w.casefold() not in seen:
            held.setdefault(w, None)
    return cond, tuple(held)


#: The protocol's data shipped with the package (``data/topics/README.md``: source and licence).
PACKAGED_TOPICS = Path(__file__).resolve().parent / "data" / "topics"


def find_topics_folder() -> Path:
    """The ``topics`` folder: ``$NARRATIVE_GRAVITY_BENCH`` (a bench folder that holds ``topics/``, or the
    ``topics`` folder itself) when it is set, else the PPLM/FUDGE data shipped with the package.

    >>> find_topics_folder() == PACKAGED_TOPICS or BENCH_ENV in os.environ
    True
    """
    env = os.environ.get(BENCH_ENV)
    if not env:
        return PACKAGED_TOPICS
    base = Path(env).expanduser()
    for c in (base / "topics", base):
        if (c / "prefixes.txt").is_file() and (c / "wordlists").is_dir():
            return c
    raise ConfigurationError(
        f"{BENCH_ENV}={env} holds no topic set: expected prefixes.txt and wordlists/*.txt in {base / 'topics'} or "
        f"{base}. Unset {BENCH_ENV} to use the PPLM/FUDGE set shipped with the package"
    )


def topic_wordlists(folder: str | os.PathLike[str] | None = None) -> list[Path]:
    """The word list files of a topic set (default: :func:`find_topics_folder`), sorted by name.

    >>> [p.stem for p in topic_wordlists(PACKAGED_TOPICS)]
    ['computers', 'legal', 'military', 'politics', 'religion', 'science', 'space']
    """
    root = Path(folder) if folder is not None else find_topics_folder()
    return sorted((root / "wordlists").glob("*.txt"))


def read_prefixes(root: Path) -> list[str]:
    """The prefixes of the topic protocol: the stripped, non-blank lines of ``root/prefixes.txt``, in order."""
    prefixes = [p.strip() for p in (root / "prefixes.txt").read_text(encoding="utf-8").splitlines()]
    return [p for p in prefixes if p]


TOPICS = "topics"
TOPICS_TUNE = "topics-tune"
EMPATH = "empath"
EMPATH_TUNE = "empath-tune"
# The built-in topic sets: named, not files, and continued without the chat template unless --chat is given.
TOPIC_SETS = (TOPICS, TOPICS_TUNE, EMPATH, EMPATH_TUNE)
# The same topics and word splits under neutral chat requests (:mod:`~narrative_gravity.eval.chat`).
CHAT_TOPIC_SETS = tuple(f"chat-{name}" for name in TOPIC_SETS)
BUILT_IN_SETS = TOPIC_SETS + CHAT_TOPIC_SETS


def load_topics(folder: str | os.PathLike[str] | None = None, *, tuning: bool = False) -> list[EvalPrompt]:
    """The PPLM/FUDGE protocol: every prefix × every topic (topics sorted by name, prefixes in file order).

    ``tuning=True`` gives the tuning split (see the module doc): the conditioning half split in two again.
    """
    root = Path(folder) if folder is not None else find_topics_folder()
    prefixes = read_prefixes(root)
    lists = topic_wordlists(root)
    if not prefixes or not lists:
        raise ConfigurationError(f"{root} has no prefixes or no word lists; expected prefixes.txt and wordlists/*.txt")
    out: list[EvalPrompt] = []
    for path in lists:
        cond, held = split_wordlist(path.read_text(encoding="utf-8").splitlines())
        if tuning:
            cond, held = split_wordlist(list(cond))
        if not cond or not held:
            raise ConfigurationError(f"{path}: needs at least two words (one to condition on, one held out)")
        for prefix in prefixes:
            out.append(EvalPrompt(len(out), prefix, path.stem, cond, held))
    return out
