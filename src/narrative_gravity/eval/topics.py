"""What every prompt set builds on: :class:`EvalPrompt`, the split of a word list into a conditioning and a
held-out half, the shared bench folder with its prefixes, and the PPLM/FUDGE topic set itself
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
    "TOPICS",
    "TOPICS_TUNE",
    "TOPIC_SETS",
    "EvalPrompt",
    "find_topics_folder",
    "load_topics",
    "read_prefixes",
    "split_wordlist",
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


def _repo_roots() -> list[Path]:
    roots = []
    here = Path(__file__).resolve()
    for start in (here.parent, Path.cwd().resolve()):
        for p in (start, *start.parents):
            if (p / "pyproject.toml").exists():
                roots.append(p)
                break
    return list(dict.fromkeys(roots))


def find_topics_folder() -> Path:
    """The ``topics`` bench folder: ``$NARRATIVE_GRAVITY_BENCH`` (the bench folder or its ``topics`` folder),
    else ``shared/bench/topics`` next to the repository."""
    tried: list[Path] = []
    env = os.environ.get(BENCH_ENV)
    if env:
        base = Path(env).expanduser()
        candidates = [base / "topics", base]
    else:
        candidates = [root.parent / "shared" / "bench" / "topics" for root in _repo_roots()]
    for c in candidates:
        tried.append(c)
        if (c / "prefixes.txt").is_file() and (c / "wordlists").is_dir():
            return c
    where = ", ".join(str(t) for t in tried) or "(no repository root found)"
    raise ConfigurationError(
        f"the `topics` prompt set needs the shared bench folder (prefixes.txt and wordlists/); looked in {where}. "
        f"Set {BENCH_ENV} to the bench folder (the one that holds topics/), or pass --prompts FILE"
    )


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
    lists = sorted((root / "wordlists").glob("*.txt"))
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
