"""The topic sentence: a line the model reads before the prompt and the output never shows.

A pull of ``e^{λ·a}`` cannot lift a word the model gives a hundredth of the probability of another: after a
neutral prefix ("The relationship"), an instruct model writes abstract prose, and animal or clothing words
stay out of reach. A profile's ``lead`` lets the model read the topic first. In plain continuation the
sentence goes before the prompt's text; in chat it is a system message (joined to the conversation's own
system message, if it has one). The response, the trace and every score see only the user's prompt and what
the model wrote.

>>> join_words(["antelope", "camel", "human"])
'antelope, camel and human'
>>> lead_text("The relationship", "The following is about camels.")
'The following is about camels. The relationship'
>>> lead_messages([{"role": "user", "content": "hi"}], "Write about camels.")
[{'role': 'system', 'content': 'Write about camels.'}, {'role': 'user', 'content': 'hi'}]
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, TypeVar

import torch

from .embeddings import encode
from .text import has_unspaced_script, lead_messages, lead_text

if TYPE_CHECKING:
    from .profiles.blocks import Lead
    from .profiles.schema import Profile

__all__ = [
    "CHAT_LEAD",
    "RAW_LEAD",
    "central_words",
    "join_words",
    "lead_messages",
    "lead_sentence",
    "lead_text",
    "reading_profile",
    "reads_lead",
]

_P = TypeVar("_P", bound="Profile | None")

RAW_LEAD = "The following is about {words}."
CHAT_LEAD = "Write about {words}."


def join_words(words: Sequence[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``; words of scripts without spaces are joined with ``、``.

    >>> join_words(["orbit"]), join_words(["orbit", "planet"]), join_words(["二分", "查找"])
    ('orbit', 'orbit and planet', '二分、查找')
    """
    words = list(words)
    if any(has_unspaced_script(w) for w in words):
        return "、".join(words)
    if len(words) <= 2:
        return " and ".join(words)
    return ", ".join(words[:-1]) + " and " + words[-1]


def central_words(words: Sequence[str], k: int) -> list[str]:
    """The ``k`` words nearest the MiniLM centroid of all ``words``, most central first.

    A profile's words in any order give the same choice; ties keep the profile's order. Words of scripts
    without spaces, which MiniLM does not read, and lists of at most ``k`` words keep the profile's order.
    """
    words = list(dict.fromkeys(words))
    if len(words) <= k or any(has_unspaced_script(w) for w in words):
        return words[:k]
    return list(_central(tuple(sorted(words)), k, tuple(words)))


@lru_cache(maxsize=1024)
def _central(key: tuple[str, ...], k: int, words: tuple[str, ...]) -> tuple[str, ...]:
    vectors = encode(list(key))
    centre = torch.nn.functional.normalize(vectors.mean(0), dim=0)
    score = {w: float(s) for w, s in zip(key, (vectors @ centre).tolist(), strict=True)}
    ranked = sorted(words, key=lambda w: -score[w])  # stable: ties keep the profile's order
    return tuple(ranked[:k])


def lead_sentence(profile: Profile | None, *, raw: bool) -> str | None:
    """The profile's topic sentence for plain continuation (``raw``) or chat, or ``None`` without ``lead``.

    >>> from narrative_gravity.profiles.schema import Profile
    >>> lead_sentence(Profile(core_semantics=["orbit", "planet"], lead={}), raw=True)
    'The following is about orbit and planet.'
    >>> lead_sentence(Profile(core_semantics=["orbit"], lead={"text": "Now: {words}!"}), raw=False)
    'Now: orbit!'
    >>> lead_sentence(Profile(core_semantics=["orbit"], require=["comet", "moon"],
    ...                       lead={"text": "It mentions {required}."}), raw=True)
    'It mentions comet and moon.'
    >>> lead_sentence(Profile(core_semantics=["orbit"]), raw=True)  # the topic default reads one
    'The following is about orbit.'
    >>> lead_sentence(Profile(core_semantics=["orbit", "planet", "galaxy"]), raw=False)  # and three in chat
    'Write about orbit, planet and galaxy.'
    >>> lead_sentence(Profile(core_semantics=["orbit"], lead=False), raw=True) is None
    True
    """
    lead = _lead_in_mode(profile, raw=raw)
    if lead is None:
        return None
    template = lead.text if lead.text is not None else (RAW_LEAD if raw else CHAT_LEAD)
    if "{words}" in template:
        words = profile.core_semantics
        chosen = central_words(words, lead.words) if lead.pick == "central" else list(words[: lead.words])
        template = template.replace("{words}", join_words([w.replace("_", " ") for w in chosen]))  # binary search
    if "{required}" in template and profile.require is not None:  # the schema refuses it without `require`
        template = template.replace("{required}", join_words(profile.require.words))
    return template


def reads_lead(profile: Profile | None, *, raw: bool) -> bool:
    """Whether ``profile`` has a topic sentence for plain continuation (``raw``) or chat.

    >>> from narrative_gravity.profiles.schema import Profile
    >>> p = Profile(core_semantics=["orbit"])  # the topic default reads one in both modes
    >>> reads_lead(p, raw=True), reads_lead(p, raw=False), reads_lead(None, raw=True)
    (True, True, False)
    >>> reads_lead(Profile(core_semantics=["orbit"], lead={"chat": False}), raw=False)
    False
    """
    return _lead_in_mode(profile, raw=raw) is not None


def _lead_in_mode(profile: Profile | None, *, raw: bool) -> Lead | None:
    lead = profile.lead if profile is not None else None
    return lead.in_mode(raw=raw) if lead else None


def reading_profile(profile: _P, *, raw: bool) -> _P:
    """The profile to pull with where its topic sentence is read (plain continuation with ``raw``, else chat):
    the thermostat's ``kl_budget`` is the lead's (``lead.kl_budget``) where the profile sets no budget of its
    own, and with ``lead.contrast`` the sentence's contrast joins the field (``field.contrast``); ``profile``
    itself where no sentence is read in that mode, and for ``None`` (plain decoding).

    Every path that puts the sentence before the prompt (``ngrav generate``, ``compare``, ``eval``, the server,
    :func:`narrative_gravity.engines.hf_generate.generate` with ``lead``) pulls with this profile; a path that cannot
    (a processor in a ``generate`` call of your own) pulls with the profile as it is.

    >>> from narrative_gravity.profiles.schema import Profile
    >>> p = Profile(core_semantics=["orbit"])  # the topic default: lead {words: 1, kl_budget: 0.05, ...}
    >>> read = reading_profile(p, raw=True).thermostat
    >>> p.thermostat.kl_budget, read.kl_budget, read.kl_budget_steps, read.late_kl_budget
    (None, 0.05, 128, 0.3)
    >>> reading_profile(p, raw=False).thermostat.kl_budget  # in chat: the lead's budget
    0.05
    >>> r = Profile(core_semantics=["orbit"], lead={"chat": {"words": 3, "kl_budget": 0.12}})
    >>> reading_profile(r, raw=False).thermostat.kl_budget  # a budget of its own in chat
    0.12
    >>> chat = reading_profile(p, raw=False).field.contrast  # and the 300 words its message makes likelier
    >>> chat.sentence, chat.top, reading_profile(p, raw=True).field.contrast
    ('Write about orbit.', 300, None)
    >>> q = Profile(core_semantics=["orbit"], lead={"chat": False})
    >>> reading_profile(q, raw=False) is q  # no sentence in chat: the pull as without one
    True
    >>> reading_profile(None, raw=True) is None
    True
    """
    lead = _lead_in_mode(profile, raw=raw)
    if lead is None:
        return profile
    update = {}
    if lead.kl_budget is not None and profile.thermostat.kl_budget is None:  # the thermostat's own budget wins
        budget = {
            "kl_budget": lead.kl_budget,
            "kl_budget_steps": lead.kl_budget_steps,
            "late_kl_budget": lead.late_kl_budget,
        }
        update["thermostat"] = profile.thermostat.model_copy(update=budget)
    if lead.contrast and profile.field.contrast is None:  # the sentence's own contrast joins the field
        contrast = {"sentence": lead_sentence(profile, raw=raw), "raw": raw, "top": lead.contrast}
        update["field"] = type(profile.field).model_validate({**profile.field.model_dump(), "contrast": contrast})
    return profile.model_copy(update=update) if update else profile
