"""Multi-turn topic memory: decay, fields from weights, and a scripted three-turn conversation."""

from __future__ import annotations

import pytest
import torch

from narrative_gravity.engines.options import GenerationOptions
from narrative_gravity.errors import ConfigurationError
from narrative_gravity.fields import NarrativeField
from narrative_gravity.fields.lexical import surface_forms
from narrative_gravity.levels.memory import Conversation, TopicMemory, merge_fields, weighted_lexical_field

TURNS = [
    "Tell me about the planet and its orbit.",
    "How big is the galaxy around the planet?",
    "Which rocket reaches the galaxy?",
]


def test_scripted_three_turns_decay_old_topics():
    m = TopicMemory(decay=0.5)
    m.update(TURNS[0], "The planet follows an orbit.")
    w1 = dict(m.raw)
    m.update(TURNS[1])
    w2 = dict(m.raw)
    m.update(TURNS[2])
    w3 = dict(m.raw)
    assert w1["orbit"] > w2["orbit"] > w3["orbit"] > 0  # never mentioned again: halves every turn
    assert w3["orbit"] == pytest.approx(w1["orbit"] / 4)
    assert w2["planet"] > w2["orbit"]  # mentioned again in turn 2
    assert "rocket" not in w2 and "rocket" in w3
    assert next(iter(m.words())) == "galaxy"  # turns 2 and 3
    assert m.turns == 3


def test_topic_weights_user_words_above_answer_words():
    m = TopicMemory(answer_weight=0.25)
    topic = m.topic("planet", "comet comet")
    assert topic["planet"] == 1.0 and topic["comet"] == 0.5


def test_memory_forgets_light_words_and_caps_its_size():
    m = TopicMemory(decay=0.1, min_weight=0.05, max_words=3)
    m.update("planet orbit galaxy rocket comet")
    assert len(m.raw) == 3
    m.update("telescope")
    m.update("mirror")
    assert set(m.raw) == {"mirror", "telescope"}  # the first turn fell below min_weight


def test_preview_does_not_change_the_memory():
    m = TopicMemory()
    m.update("planet orbit")
    before = dict(m.raw)
    assert "galaxy" in m.preview("galaxy")
    assert m.raw == before and m.turns == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"decay": 1.0}, "decay"), ({"max_words": 0}, "max_words"), ({"answer_weight": 2}, "answer_weight")],
)
def test_memory_validation(kwargs, message):
    with pytest.raises(ConfigurationError, match=message):
        TopicMemory(**kwargs)


def test_weighted_field_uses_the_weights(tiny_tokenizer):
    tok = tiny_tokenizer
    f = weighted_lexical_field(tok, {"planet": 1.0, "galaxy": 0.25, "zzzzqqqq\u2603": 0.5})
    planet = surface_forms(tok, "planet")[0][0]
    galaxy = surface_forms(tok, "galaxy")[0][0]
    assert f.values[planet] == 1.0
    assert f.values[galaxy] == 0.25
    assert f.values.max() == 1.0
    with pytest.raises(ConfigurationError, match="weights"):
        weighted_lexical_field(tok, {"planet": 1.5})


def test_merge_fields_max_and_negative_wins():
    a = NarrativeField(values=torch.tensor([0.5, 0.0, 1.0]))
    b = NarrativeField(values=torch.tensor([0.2, 0.7, -1.0, 0.3]))
    assert merge_fields([a, b]).values.tolist() == pytest.approx([0.5, 0.7, -1.0, 0.3])


def test_conversation_three_turns_on_a_tiny_model(tiny_model):
    model, tok = tiny_model
    conv = Conversation(
        model, tok, options=GenerationOptions(max_new_tokens=6, temperature=0), memory=TopicMemory(decay=0.5)
    )
    answers = [conv.say(t) for t in TURNS]
    assert all(isinstance(a, str) for a in answers)
    assert len(conv.history) == 6 and conv.memory.turns == 3
    # turn 3's field still pulls the planet of turn 1, through the decayed memory
    planet = surface_forms(tok, "planet")[0][0]
    rocket = surface_forms(tok, "rocket")[0][0]
    assert 0 < conv.last_field.values[planet] < 1.0
    assert conv.last_field.values[rocket] > 0
    with pytest.raises(ConfigurationError):
        conv.say("  ")


def test_conversation_with_a_profile_keeps_its_penalties(tiny_model):
    from narrative_gravity.profiles.schema import Profile

    model, tok = tiny_model
    prof = Profile(core_semantics=["orbit"], penalize=["comet"], schedule="constant")
    conv = Conversation(model, tok, profile=prof, options=GenerationOptions(max_new_tokens=4, temperature=0))
    conv.say("the comet and the planet")
    comet = surface_forms(tok, "comet")[0]
    assert len(comet) > 1 or conv.last_field.values[comet[0]] == -1.0
    orbit = surface_forms(tok, "orbit")[0][0]
    assert conv.last_field.values[orbit] == 1.0


@pytest.mark.slow
def test_real_model_three_turn_conversation():
    from narrative_gravity.models import load_model

    model, tok = load_model()
    conv = Conversation(model, tok, options=GenerationOptions(max_new_tokens=40, temperature=0))
    turns = ["What is the orbit of Mars like?", "How long is a year there?", "Could people live there one day?"]
    answers = [conv.say(t) for t in turns]
    assert all(a.strip() for a in answers)
    words = conv.memory.words()
    assert "mars" in words  # the topic of turn 1 is still remembered after turn 3
    mars = surface_forms(tok, "Mars")[0]
    assert conv.last_field.values[mars[0]] > 0
