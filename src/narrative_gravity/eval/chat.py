"""The chat sets of ``ngrav eval``: neutral requests in the chat template, one topic pulled per prompt.

A user who wants a model to stay on a topic in chat has a free alternative to any pull: name the topic in a
system message. The chat sets measure gravity against that, on requests that name no topic at all, so that
whatever topic the answer takes comes from the method:

- ``chat-topics`` / ``chat-topics-tune``: the seven PPLM topics (test words / tuning split, as ``topics`` and
  ``topics-tune``) × :data:`CHAT_REQUESTS`;
- ``chat-empath`` / ``chat-empath-tune``: the 25 Empath test / tuning topics (as ``empath`` and
  ``empath-tune``) × :data:`CHAT_REQUESTS`.

The words are split exactly as in the plain-continuation sets: the conditioning half builds the pull (and
names the topic in the ``ask`` arm's system message), the held-out half only scores. The requests were
written before any run and are fixed. Each topic takes them in its own rotation (of ``T`` topics and ``N``
requests, topic ``t`` starts at request ``t·N // T``), so ``--limit-prompts`` keeps every request in use about
equally often.

A prompt's ``description`` ("a text about space") scores topic relevance independently of every word list:
it names the topic, which no profile and no system message is given.

>>> len(CHAT_REQUESTS), CHAT_REQUESTS[0]
(20, 'Tell me about your weekend.')
>>> from narrative_gravity.eval.topics import EvalPrompt
>>> base = [EvalPrompt(0, "In summary", "space", ("orbit",), ("moon",)),
...         EvalPrompt(1, "The connection", "space", ("orbit",), ("moon",)),
...         EvalPrompt(2, "In summary", "air_travel", ("plane",), ("pilot",))]
>>> ps = chat_prompts(base, requests=("A?", "B?", "C?"))
>>> [(p.index, p.text, p.topic_name) for p in ps]
[(0, 'A?', 'space'), (1, 'B?', 'space'), (2, 'C?', 'space'), (3, 'B?', 'air_travel'), (4, 'C?', 'air_travel'), (5, 'A?', 'air_travel')]
>>> ps[3].topic_words, ps[3].heldout_words, ps[3].description
(('plane',), ('pilot',), 'a text about air travel')
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import ConfigurationError
from .lexicon import load_empath
from .topics import CHAT_TOPIC_SETS, EMPATH_TUNE, TOPIC_SETS, TOPICS, TOPICS_TUNE, EvalPrompt, load_topics

__all__ = ["CHAT_REQUESTS", "CHAT_SETS", "chat_prompts", "description", "load_chat"]

# The topic set each chat set draws its topics and word splits from.
CHAT_SETS: dict[str, str] = dict(zip(CHAT_TOPIC_SETS, TOPIC_SETS, strict=True))

# Neutral, open requests: none names or implies a topic. Fixed before any run; never tuned.
CHAT_REQUESTS: tuple[str, ...] = (
    "Tell me about your weekend.",
    "Write a short story.",
    "Describe a place you like.",
    "What did you learn recently?",
    "Write a letter to a friend.",
    "Tell me something interesting.",
    "Describe your ideal day.",
    "Write a short poem.",
    "What is something you would like to change?",
    "Tell me about a person you admire.",
    "Give me some advice.",
    "Describe a memorable event.",
    "Write a diary entry for today.",
    "What makes a good day at work?",
    "Tell me a story about a journey.",
    "Explain something you find fascinating.",
    "Describe what you see out of the window.",
    "Write the opening of a speech.",
    "What are you looking forward to?",
    "Share a thought about the future.",
)


def description(topic_name: str) -> str:
    """The sentence that scores topic relevance apart from every word list.

    >>> description("real_estate")
    'a text about real estate'
    """
    return f"a text about {topic_name.replace('_', ' ')}"


def chat_prompts(base: Sequence[EvalPrompt], requests: Sequence[str] = CHAT_REQUESTS) -> list[EvalPrompt]:
    """Every request × every topic of ``base`` (a topic set: its topics in order of first appearance, each
    with its word split), each topic in its own rotation of the requests (see the module doc)."""
    if not requests:
        raise ConfigurationError("a chat set needs at least one request")
    topics: dict[str, EvalPrompt] = {}
    for p in base:
        if p.topic_name is None:
            raise ConfigurationError(f"prompt {p.index} of the topic set has no topic name")
        topics.setdefault(p.topic_name, p)
    out: list[EvalPrompt] = []
    n = len(requests)
    for t, (name, p) in enumerate(topics.items()):
        start = t * n // len(topics)
        for j in range(n):
            out.append(
                EvalPrompt(
                    len(out),
                    requests[(start + j) % n],
                    name,
                    p.topic_words,
                    p.heldout_words,
                    description=description(name),
                )
            )
    return out


def load_chat(name: str) -> list[EvalPrompt]:
    """The chat set ``name`` (one of :data:`CHAT_SETS`)."""
    if name not in CHAT_SETS:
        raise ConfigurationError(f"unknown chat set {name!r}; choose one of {', '.join(CHAT_SETS)}")
    source = CHAT_SETS[name]
    if source in (TOPICS, TOPICS_TUNE):
        base = load_topics(tuning=source == TOPICS_TUNE)
    else:
        base = load_empath(tuning=source == EMPATH_TUNE)
    return chat_prompts(base)
