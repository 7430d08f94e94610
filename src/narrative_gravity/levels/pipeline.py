"""One request, every level: prune the retrieved passages, remember the conversation, plan, then decode.

A chat request may carry retrieved passages: in a ``documents`` list (strings, or ``{"id", "text"}``
objects), or inside its messages as ``<document id="...">...</document>`` blocks. The profile switches each
level on, each with defaults (:class:`~narrative_gravity.profiles.schema.ContextLevel`, ``ConversationLevel``,
``PlanLevel``):

1. **context** (``context:``): the passages are pruned to a token budget for the question (the last user
   message) and its narrative (:func:`~narrative_gravity.levels.context.prune_context`); every passage gets a
   decision with its reason. Without ``context`` every passage is kept, in order.
2. **memory** (``conversation:``): the content words of the earlier turns, decayed turn by turn
   (:class:`~narrative_gravity.levels.memory.TopicMemory`), become the profile's ``memory`` for this answer.
3. **plan** (``plan:``): outline drafts are written by the same engine (``draft``), scored, and the best one's
   sections become the profile's ``stages``.

The kept passages are put into the last user message with one fixed template (:data:`CONTEXT_TEMPLATE`);
then the engine decodes with gravity from the prepared profile. :func:`prepare` does the levels for any
engine (it is handed a ``draft`` function for the plan); :func:`stage_report` tells, after decoding, which
of the plan's stages the text reached.

>>> msgs, docs = split_documents([{"role": "user", "content": 'Q? <document id="a">Alpha.</document>'}])
>>> msgs, [(d.id, d.text) for d in docs]
([{'role': 'user', 'content': 'Q?'}], [('a', 'Alpha.')])
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigurationError
from ..eval.metrics import contains_any
from ..profiles.schema import Profile
from .context import PruneSettings, count_tokens, narrative_text, prune_context
from .memory import TopicMemory
from .plan import outline_prompt, score_outlines, select_outlines, stages_from_outline
from .token_encoder import token_encoder

__all__ = [
    "CONTEXT_TEMPLATE",
    "Passage",
    "Prepared",
    "needs_pipeline",
    "parse_documents",
    "prepare",
    "split_documents",
    "stage_report",
]

CONTEXT_TEMPLATE = (
    "Answer the question using the context.\n\nContext:\n{context}\n\nQuestion: {question}\n"
    "Answer in one or two sentences."
)
"""The last user message once passages are in it (the template of the context-pruning benchmark)."""

_DOCUMENT = re.compile(r"<document(?:\s+id\s*=\s*\"([^\"]*)\")?\s*>(.*?)</document>", re.DOTALL | re.IGNORECASE)
_MAX_PASSAGES = 256

Draft = Callable[[list[str], int], list[str]]
"""``draft(prompts, max_tokens) -> texts``: the engine writes outline drafts for the plan level (sampled,
without gravity); each prompt is a user message to put through the chat template."""


@dataclass(frozen=True)
class Passage:
    """One retrieved passage."""

    id: str
    text: str


@dataclass
class Prepared:
    """What the engine decodes: the messages (passages in the last user message), the profile (memory and
    stages filled in), and what each level did (``report``, JSON-ready)."""

    messages: list[dict[str, str]]
    profile: Profile | None
    report: dict[str, Any] = field(default_factory=dict)
    stages: list[dict[str, Any]] | None = None


def parse_documents(documents: Any, *, param: str = "documents") -> list[Passage]:
    """``documents`` as passages: a list of strings or of ``{"id", "text"}`` objects (ids default to their
    position). Raises :class:`~narrative_gravity.errors.ConfigurationError` naming the bad entry."""
    if documents is None:
        return []
    if not isinstance(documents, list):
        raise ConfigurationError(
            f'`{param}` must be a list of strings or of {{"id", "text"}} objects, but is {type(documents).__name__}'
        )
    if len(documents) > _MAX_PASSAGES:
        raise ConfigurationError(f"`{param}` has {len(documents)} passages, more than {_MAX_PASSAGES}; send fewer")
    out = []
    for i, d in enumerate(documents):
        if isinstance(d, str):
            text, pid = d, str(i)
        elif isinstance(d, Mapping) and isinstance(d.get("text"), str) and set(d) <= {"id", "text"}:
            text, pid = d["text"], str(d.get("id", i))
        else:
            raise ConfigurationError(
                f"`{param}[{i}]` must be a string or an object with a string `text` (and optionally an `id`)"
            )
        if not text.strip():
            raise ConfigurationError(f"`{param}[{i}]` is empty; leave it out or give its text")
        out.append(Passage(pid, text.strip()))
    ids = [p.id for p in out]
    dupes = sorted({x for x in ids if ids.count(x) > 1})
    if dupes:
        raise ConfigurationError(f"`{param}` has passages with the same id {dupes[:5]}; give each passage its own id")
    return out


def split_documents(messages: Sequence[Mapping[str, str]]) -> tuple[list[dict[str, str]], list[Passage]]:
    """Take the ``<document id="...">...</document>`` blocks out of the messages: ``(messages, passages)``.

    A block without an id gets ``m<message>-<k>``; a message left empty keeps an empty content.
    """
    out, passages = [], []
    for i, msg in enumerate(messages):
        content = msg.get("content") or ""
        found = list(_DOCUMENT.finditer(content))
        for k, m in enumerate(found):
            text = m.group(2).strip()
            if text:
                passages.append(Passage(m.group(1) or f"m{i}-{k}", text))
        cleaned = _DOCUMENT.sub("", content).strip() if found else content
        out.append({**msg, "content": cleaned})
    return out, passages


def needs_pipeline(profile: Profile | None, passages: Sequence[Passage], messages: Sequence[Mapping[str, str]]) -> bool:
    """Whether a request takes the pipeline: it has passages, or its profile switches on a level that applies."""
    if passages:
        return True
    if profile is None:
        return False
    earlier = sum(1 for m in messages if m.get("role") == "user") > 1
    return profile.plan is not None or (profile.conversation is not None and earlier)


def _question(messages: Sequence[Mapping[str, str]]) -> tuple[int, str]:
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "user":
            return i, messages[i].get("content") or ""
    raise ConfigurationError("the conversation has no user message to answer; end it with one")


def prepare(
    messages: Sequence[Mapping[str, str]],
    passages: Sequence[Passage],
    profile: Profile | None,
    *,
    tokenizer: Any,
    encoder: Any = None,
    draft: Draft | None = None,
) -> Prepared:
    """Run the levels the profile switches on (see the module doc) and return what the engine decodes.

    Args:
        messages: the conversation (``{"role", "content"}``), passages already split out.
        passages: the retrieved passages (:func:`parse_documents`, :func:`split_documents`).
        profile: the request's profile, or ``None`` (no gravity: passages are kept whole, nothing else runs).
        tokenizer: the generator's tokenizer, to count passage tokens.
        encoder: ``texts -> [n, d]`` unit rows for pruning and outline scores; by default the context level's
            ``encoder`` (the token table, or MiniLM) for passages and MiniLM for outlines.
        draft: the engine's outline writer, needed when the profile has ``plan``.
    """
    msgs = [dict(m) for m in messages]
    q_index, question = _question(msgs)
    report: dict[str, Any] = {}
    if passages:
        context, report["context"] = _context_level(question, passages, profile, tokenizer, encoder)
        msgs[q_index] = {**msgs[q_index], "content": CONTEXT_TEMPLATE.format(context=context, question=question)}
    if profile is None:
        return Prepared(msgs, None, report)
    update: dict[str, Any] = {}
    if profile.conversation is not None:
        words = _memory_level(msgs[:q_index], question, profile)
        report["memory"] = {"words": {w: round(x, 4) for w, x in words.items()}, "turns": len(_turns(msgs[:q_index]))}
        if words:
            merged = dict(profile.memory or {})
            for w, x in words.items():
                merged[w] = max(merged.get(w, 0.0), x)
            update["memory"] = merged
    stages = None
    if profile.plan is not None and not profile.stages:
        if draft is None:
            raise ConfigurationError("this profile plans (`plan:`), so the engine must write drafts: pass draft=")
        stages, report["plan"] = _plan_level(question, profile, draft, encoder)
        update["stages"] = stages
    prepared = Profile.from_mapping({**profile.model_dump(exclude_none=True), **update}) if update else profile
    return Prepared(msgs, prepared, report, stages)


def _context_level(
    question: str, passages: Sequence[Passage], profile: Profile | None, tokenizer: Any, encoder: Any
) -> tuple[str, dict[str, Any]]:
    chunks = [{"id": p.id, "text": p.text} for p in passages]
    level = profile.context if profile is not None else None
    if level is None:
        tokens = count_tokens([p.text for p in passages], tokenizer)
        kept = [{"id": p.id, "tokens": n} for p, n in zip(passages, tokens)]
        info = {"pruned": False, "tokens_total": sum(tokens), "tokens_kept": sum(tokens), "kept": kept, "dropped": []}
        return "\n\n".join(p.text for p in passages), info
    used = "given" if encoder is not None else level.encoder if tokenizer is not None else "minilm"
    if used == "tokens":
        encoder = token_encoder(tokenizer)
    total = sum(count_tokens([p.text for p in passages], tokenizer))
    budgets = [b for b in (level.budget_tokens, int(level.budget_share * total) if level.budget_share else None) if b]
    budget = max(1, min(budgets))
    res = prune_context(
        question,
        chunks,
        budget,
        profile=profile,
        tokenizer=tokenizer,
        encoder=encoder,
        settings=PruneSettings.of(level),
    )
    info = {
        "pruned": True,
        "encoder": used,
        "budget_tokens": budget,
        "tokens_total": res.tokens_total,
        "tokens_kept": res.tokens_kept,
        "kept": [{"id": d.id, "tokens": d.tokens, "score": round(d.score, 4), "rank": d.rank} for d in res.kept],
        "dropped": [
            {"id": d.id, "tokens": d.tokens, "score": round(d.score, 4), "reason": d.reason} for d in res.dropped
        ],
    }
    return res.context(), info


def _turns(messages: Sequence[Mapping[str, str]]) -> list[tuple[str, str | None]]:
    """``(user, answer)`` pairs of the earlier turns (an answer is the assistant message after the user's)."""
    pairs: list[tuple[str, str | None]] = []
    for m in messages:
        if m.get("role") == "user":
            pairs.append((m.get("content") or "", None))
        elif m.get("role") == "assistant" and pairs and pairs[-1][1] is None:
            pairs[-1] = (pairs[-1][0], m.get("content") or "")
    return pairs


def _memory_level(earlier: Sequence[Mapping[str, str]], question: str, profile: Profile) -> dict[str, float]:
    level = profile.conversation
    memory = TopicMemory(decay=level.decay, max_words=level.max_words, answer_weight=level.answer_weight)
    for user, answer in _turns(earlier):
        memory.update(user, answer)
    if not memory.turns:
        return {}
    return memory.preview(question)


def _plan_level(
    question: str, profile: Profile, draft: Draft, encoder: Any
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    level = profile.plan
    texts = draft([outline_prompt(question, level.sections)] * level.drafts, level.outline_tokens)
    scored = score_outlines(
        question, texts, sections=level.sections, narrative=narrative_text(profile), encoder=encoder
    )
    best = select_outlines(scored, 1, encoder=encoder)[0]
    parsed = stages_from_outline(best, words_per_stage=level.words_per_stage, extra_words=profile.keywords()[:3])
    stages = [{"name": s.name, "core_semantics": list(s.core_semantics)} for s in parsed]
    info = {
        "drafts": len(texts),
        "outline": best.sections,
        "score": round(best.score, 4),
        "stages": stages,
    }
    return stages, info


def stage_report(stages: Sequence[Mapping[str, Any]] | None, text: str) -> list[dict[str, Any]]:
    """Per stage of the plan, the words of it that ``text`` holds (whole words, case-insensitive), and whether
    the text reached it (it holds one of its words).

    >>> stage_report([{"name": "a", "core_semantics": ["orbit", "moon"]}], "The Moon rises.")
    [{'name': 'a', 'reached': True, 'words': ['moon']}]
    """

    out = []
    for s in stages or ():
        words = [w for w in s["core_semantics"] if contains_any(text, [w])]
        out.append({"name": s["name"], "reached": bool(words), "words": words})
    return out
