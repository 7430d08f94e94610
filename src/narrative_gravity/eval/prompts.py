"""Prompt sets for ``ngrav eval``: a text file, JSONL, the PPLM/FUDGE topic protocol (``topics``) or the
Empath topic sets (``empath``, ``empath-tune``; see :mod:`~narrative_gravity.eval.lexicon`).

A JSONL line is an object with a string ``prompt`` and, optionally:

- ``topic``: a list of topic words. ``--profile auto`` builds a profile from them, and they score topic
  relevance and success when ``heldout`` is absent;
- ``heldout``: a list of words used only for scoring (never given to a profile);
- ``topic_name``: a label for per-topic tables;
- ``profile``: the name of one of the given profiles; the prompt is then run with that profile only;
- ``require``: words the continuation must contain. Every profile with a ``require`` block runs the prompt
  with these words in place of the block's own (its other settings stay), and the ``required_inclusion``
  metric scores every arm, plain decoding included, by the share of them the text holds.

``topics`` reads ``prefixes.txt`` and ``wordlists/<topic>.txt`` from the folder shipped with the package
(``eval/data/topics``, or ``$NARRATIVE_GRAVITY_BENCH``) and splits each
word list deterministically: after stripping each line and dropping blank ones, the words at even positions
(0, 2, 4, …) are the conditioning half and the words at odd positions the held-out half. A held-out word that
also appears in the conditioning half (case-insensitively) is dropped, so no scoring word is ever given to
the profile.

``topics-tune`` is the tuning split, for choosing settings without touching the held-out half: the same
prompts, but the *conditioning* half is split again the same way (its even positions condition, its odd
positions score). The held-out half of ``topics`` appears nowhere in it.

``empath`` and ``empath-tune`` are the test and tuning topics of :mod:`~narrative_gravity.eval.lexicon`
(subject categories of the Empath lexicon) × the same prefixes, each word list split by :func:`split_wordlist`.
All four built-in sets (:data:`TOPIC_SETS`) are plain continuations by default. ``chat-topics``,
``chat-topics-tune``, ``chat-empath`` and ``chat-empath-tune`` (:data:`CHAT_TOPIC_SETS`) put the same topics and
word splits under neutral chat requests, in the chat template (:mod:`~narrative_gravity.eval.chat`).

>>> split_wordlist(["planet ", "galaxy", "", "orbit", "Planet", "moon"])
(('planet', 'orbit', 'moon'), ('galaxy',))
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from ..errors import ConfigurationError
from .chat import load_chat
from .lexicon import load_empath
from .topics import (
    BENCH_ENV,
    BUILT_IN_SETS,
    CHAT_TOPIC_SETS,
    EMPATH,
    EMPATH_TUNE,
    TOPIC_SETS,
    TOPICS,
    TOPICS_TUNE,
    EvalPrompt,
    find_topics_folder,
    load_topics,
    read_prefixes,
    split_wordlist,
)

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
    "limit_prompts",
    "load_prompts",
    "load_topics",
    "read_prefixes",
    "split_wordlist",
]


def _words(value: object, where: str, key: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(w, str) for w in value):
        raise ConfigurationError(f'{where}: `{key}` must be a list of strings, e.g. ["orbit", "planet"]')
    return tuple(dict.fromkeys(w.strip() for w in value if w.strip()))


def load_prompts(source: str | os.PathLike[str]) -> list[EvalPrompt]:
    """Load a built-in set (``topics``, ``topics-tune``, ``empath``, ``empath-tune``, and each of them under
    chat requests: ``chat-topics`` …), a ``.jsonl`` file (see the module doc) or a text file with one prompt
    per line."""
    if str(source) in (TOPICS, TOPICS_TUNE):
        return load_topics(tuning=str(source) == TOPICS_TUNE)
    if str(source) in (EMPATH, EMPATH_TUNE):
        return load_empath(tuning=str(source) == EMPATH_TUNE)
    if str(source) in CHAT_TOPIC_SETS:
        return load_chat(str(source))
    path = Path(source)
    if not path.is_file():
        raise ConfigurationError(
            f"prompt file {str(path)!r} does not exist; pass a .txt or .jsonl file, `topics` or `empath`"
        )
    lines = path.read_text(encoding="utf-8").splitlines()
    out: list[EvalPrompt] = []
    if path.suffix.lower() == ".jsonl":
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigurationError(f"{where}: not valid JSON ({exc.msg}); each line must be an object") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
                raise ConfigurationError(f"{where}: each line must be a JSON object with a non-empty string `prompt`")
            unknown = sorted(set(row) - {"prompt", "topic", "heldout", "topic_name", "profile", "require"})
            if unknown:
                raise ConfigurationError(
                    f"{where}: unknown keys {unknown}; allowed: prompt, topic, heldout, topic_name, profile, require"
                )
            for key in ("topic_name", "profile"):
                if row.get(key) is not None and not isinstance(row[key], str):
                    raise ConfigurationError(f"{where}: `{key}` must be a string")
            out.append(
                EvalPrompt(
                    len(out),
                    row["prompt"],
                    row.get("topic_name"),
                    _words(row.get("topic"), where, "topic"),
                    _words(row.get("heldout"), where, "heldout"),
                    row.get("profile"),
                    _words(row.get("require"), where, "require"),
                )
            )
    else:
        out = [EvalPrompt(i, line) for i, line in enumerate(ln for ln in lines if ln.strip())]
    if not out:
        raise ConfigurationError(f"prompt file {str(path)!r} has no prompts")
    return out


def limit_prompts(prompts: Sequence[EvalPrompt], limit: int | None) -> list[EvalPrompt]:
    """Keep ``limit`` prompts spread over the topics: round-robin over topic groups, each in file order.

    Indices are kept, so results of a limited run line up with the full set.

    >>> ps = [EvalPrompt(i, f"p{i}", "ab"[i // 3]) for i in range(6)]
    >>> [p.index for p in limit_prompts(ps, 4)]
    [0, 1, 3, 4]
    """
    if limit is None or limit >= len(prompts):
        return list(prompts)
    if limit < 1:
        raise ConfigurationError(f"`limit_prompts` has to be >= 1, but is {limit}")
    groups: dict[str | None, list[EvalPrompt]] = {}
    for p in prompts:
        groups.setdefault(p.topic_name, []).append(p)
    picked: list[EvalPrompt] = []
    depth = 0
    while len(picked) < limit:
        for g in groups.values():
            if depth < len(g) and len(picked) < limit:
                picked.append(g[depth])
        depth += 1
    return sorted(picked, key=lambda p: p.index)
