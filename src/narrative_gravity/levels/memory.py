"""Multi-turn topic memory: each turn's core topic, decayed into the next turn's field.

A turn's topic is the count of its content words (the user's words count 1, the answer's ``answer_weight``),
scaled so its top word weighs 1, top ``max_words`` kept. The memory is ``m ← decay·m + topic``; words whose
weight falls below ``min_weight`` are forgotten. :meth:`TopicMemory.words` gives the weights scaled to a
maximum of 1, and :meth:`TopicMemory.field` turns them into a lexical field whose values are the weights
(one :func:`~narrative_gravity.fields.build_lexical_field` per word, combined with ``max``).

>>> m = TopicMemory(decay=0.5)
>>> _ = m.update("Tell me about the planet Mars.", "Mars is a cold planet.")
>>> [(w, round(x, 3)) for w, x in m.words().items()]  # planet, mars: 1 + 0.5; cold: 0.5; top scaled to 1
[('mars', 1.0), ('planet', 1.0), ('cold', 0.333)]
>>> _ = m.update("And its moons?")
>>> [(w, round(x, 3)) for w, x in m.words().items()]
[('moons', 1.0), ('mars', 0.5), ('planet', 0.5), ('cold', 0.167)]
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

import torch

from ..engines.hf import NarrativeGravityLogitsProcessor
from ..engines.options import GenerationOptions
from ..engines.prompts import chat_ids, eos_token_ids
from ..errors import ConfigurationError
from ..fields import NarrativeField
from ..fields.lexical import weighted_lexical_field
from ..gravity.controllers import ConstantController
from ..gravity.field import merge_fields
from ..gravity.kernel import Program
from ..profiles.build import controller_from_profile, field_from_profile
from ..text import STOPWORDS, content_words, word_set

__all__ = ["CHAT_OPTIONS", "Conversation", "TopicMemory", "merge_fields", "weighted_lexical_field"]

# chatty words that say nothing about the topic of a turn
_CHAT_WORDS = word_set(
    "tell please thanks thank hello hi hey okay sure great good nice sorry help let's can't don't i'm it's "
    "that's what's there's you're ask asked asking"
)


class TopicMemory:
    """The decayed topic words of a conversation (see the module doc).

    Args:
        decay: how much of the memory survives a turn, in ``[0, 1)``.
        max_words: the most words a turn's topic and the memory keep.
        answer_weight: weight of the answer's words against the user's.
        min_weight: memory weights below this are dropped.
    """

    def __init__(
        self,
        *,
        decay: float = 0.5,
        max_words: int = 12,
        answer_weight: float = 0.5,
        min_weight: float = 0.05,
        stopwords: frozenset[str] = STOPWORDS | _CHAT_WORDS,
    ) -> None:
        if not 0 <= decay < 1:
            raise ConfigurationError(f"`decay` has to be in [0, 1), but is {decay!r}")
        if not isinstance(max_words, int) or isinstance(max_words, bool) or max_words < 1:
            raise ConfigurationError(f"`max_words` has to be a positive integer, but is {max_words!r}")
        if not 0 <= answer_weight <= 1:
            raise ConfigurationError(f"`answer_weight` has to be in [0, 1], but is {answer_weight!r}")
        if not 0 <= min_weight < 1:
            raise ConfigurationError(f"`min_weight` has to be in [0, 1), but is {min_weight!r}")
        self.decay = float(decay)
        self.max_words = max_words
        self.answer_weight = float(answer_weight)
        self.min_weight = float(min_weight)
        self.stopwords = stopwords
        self.raw: dict[str, float] = {}
        self.turns = 0

    def topic(self, turn_text: str, answer: str | None = None) -> dict[str, float]:
        """The topic of one turn: content-word counts, the top word scaled to 1, top ``max_words``."""
        counts: Counter[str] = Counter()
        for w in content_words(turn_text, stopwords=self.stopwords):
            counts[w] += 1.0
        if answer:
            for w in content_words(answer, stopwords=self.stopwords):
                counts[w] += self.answer_weight
        if not counts:
            return {}
        top = max(counts.values())
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[: self.max_words]
        return {w: c / top for w, c in ranked}

    def _mixed(self, topic: Mapping[str, float]) -> dict[str, float]:
        mixed = {w: self.decay * x for w, x in self.raw.items()}
        for w, x in topic.items():
            mixed[w] = mixed.get(w, 0.0) + x
        kept = sorted(((w, x) for w, x in mixed.items() if x >= self.min_weight), key=lambda kv: (-kv[1], kv[0]))
        return dict(kept[: self.max_words])

    def update(self, turn_text: str, answer: str | None = None) -> dict[str, float]:
        """Decay the memory and add this turn's topic; returns :meth:`words`."""
        self.raw = self._mixed(self.topic(turn_text, answer))
        self.turns += 1
        return self.words()

    def preview(self, turn_text: str) -> dict[str, float]:
        """What :meth:`words` would be after a turn of ``turn_text`` (no answer yet); the memory is unchanged."""
        return _scaled(self._mixed(self.topic(turn_text)))

    def words(self) -> dict[str, float]:
        """The remembered words, heaviest first, scaled so the heaviest weighs 1."""
        return _scaled(self.raw)

    def field(self, tokenizer: Any, turn_text: str | None = None, **kwargs: Any) -> NarrativeField | None:
        """The field for the next turn (``turn_text``: the user's new message, counted as in :meth:`preview`);
        ``None`` while nothing is remembered or no word is reachable."""
        weights = self.preview(turn_text) if turn_text else self.words()
        if not weights:
            return None
        return weighted_lexical_field(tokenizer, weights, **kwargs)

    def reset(self) -> None:
        self.raw = {}
        self.turns = 0


def _scaled(weights: Mapping[str, float]) -> dict[str, float]:
    if not weights:
        return {}
    top = max(weights.values())
    return {w: x / top for w, x in weights.items()}


CHAT_OPTIONS = GenerationOptions(max_new_tokens=96, temperature=0.0)
"""How a :class:`Conversation` answers unless told otherwise: greedy, up to 96 tokens."""


class Conversation:
    """A chat whose every answer is pulled toward the conversation's remembered topic (and a profile's field).

    ``say(user_text)`` builds the field from the memory (with the new message previewed), merges it with the
    profile's field when a profile is given, generates the answer with the chat template over the last
    ``history_turns`` exchanges, then updates the memory with the message and the answer. ``options``: the
    budget and sampling of each answer (each turn is seeded with ``options.seed`` plus the turns so far).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        profile: Any = None,
        memory: TopicMemory | None = None,
        strength: float | None = None,
        options: GenerationOptions = CHAT_OPTIONS,
        system: str | None = None,
        history_turns: int = 4,
    ) -> None:
        if history_turns < 0:
            raise ConfigurationError(f"`history_turns` has to be >= 0, but is {history_turns}")
        self.model = model
        self.tokenizer = tokenizer
        self.profile = profile
        self.memory = memory if memory is not None else TopicMemory()
        self.strength = strength
        self.options = options
        self.system = system
        self.history_turns = history_turns
        self.history: list[dict[str, str]] = []
        self.last_field: NarrativeField | None = None

    def _field(self, user_text: str) -> NarrativeField | None:
        """The profile's field with the memory's words as its ``memory`` key (the path both engines take),
        or the memory's field alone without a profile."""
        weights = self.memory.preview(user_text) or None
        if self.profile is not None:
            profile = self.profile.model_copy(update={"memory": weights})
            return field_from_profile(profile, self.tokenizer, model=self.model)
        return weighted_lexical_field(self.tokenizer, weights) if weights else None

    def _controller(self) -> Any:
        if self.strength is not None:
            return ConstantController(self.strength)
        if self.profile is not None:
            return controller_from_profile(self.profile)
        return ConstantController(1.5)

    def _prompt_ids(self, user_text: str) -> list[int]:
        keep = self.history[-2 * self.history_turns :] if self.history_turns else []
        messages = ([{"role": "system", "content": self.system}] if self.system else []) + [
            *keep,
            {"role": "user", "content": user_text},
        ]
        if getattr(self.tokenizer, "chat_template", None):
            return chat_ids(self.tokenizer, messages)
        # plain transcript for models without a chat template
        text = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages) + "Assistant:"
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def say(self, user_text: str) -> str:
        """Answer ``user_text``, remember the exchange, and return the answer."""

        if not isinstance(user_text, str) or not user_text.strip():
            raise ConfigurationError("`user_text` has to be a non-empty string")
        field = self._field(user_text)
        self.last_field = field
        ids = torch.tensor([self._prompt_ids(user_text)], dtype=torch.long)
        processor = (
            NarrativeGravityLogitsProcessor(
                Program(field, prune_threshold=getattr(self.profile, "prune_threshold", None)),
                self._controller(),
                max_new_tokens=self.options.max_new_tokens,
            )
            if field is not None
            else None
        )
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        torch.manual_seed(self.options.seed + len(self.history))
        device = next(self.model.parameters()).device
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids.to(device),
                attention_mask=torch.ones_like(ids).to(device),
                logits_processor=[processor] if processor is not None else None,
                pad_token_id=pad,
                **self.options.generate_kwargs(),
            )
        gen = out[0, ids.shape[1] :].tolist()
        eos = eos_token_ids(self.model, self.tokenizer)
        gen = next((gen[:i] for i, t in enumerate(gen) if t in eos), gen)
        answer = self.tokenizer.decode(gen, skip_special_tokens=True).strip()
        self.history += [{"role": "user", "content": user_text}, {"role": "assistant", "content": answer}]
        self.memory.update(user_text, answer)
        return answer
