"""The field of a sentence's contrast (narrative_gravity.fields.contrast), on the tiny random Llama."""

from __future__ import annotations

import pytest
import torch

from narrative_gravity.errors import ConfigurationError
from narrative_gravity.fields.contrast import CONTRAST_STARTS, build_contrast_field, sentence_contrast
from narrative_gravity.fields.semantic import vocab_of
from narrative_gravity.lead import lead_text, reading_profile
from narrative_gravity.profiles.build import field_from_profile
from narrative_gravity.profiles.schema import Profile
from servers import with_chat_template

SENTENCE = "The following is about planets and stars."


def test_at_the_first_position_the_contrast_is_the_two_contexts_log_probabilities(tiny_model):
    model, tok = tiny_model
    got = sentence_contrast(model, tok, SENTENCE, raw=True, positions=1)
    want = torch.zeros(model.config.vocab_size)
    with torch.no_grad():
        for start in CONTRAST_STARTS:
            ask = tok(lead_text(start, SENTENCE), return_tensors="pt")["input_ids"]
            plain = tok(start, return_tensors="pt")["input_ids"]
            want += torch.log_softmax(model(ask).logits[0, -1], -1) - torch.log_softmax(model(plain).logits[0, -1], -1)
    torch.testing.assert_close(got, want / len(CONTRAST_STARTS), atol=1e-4, rtol=1e-4)


def test_the_field_holds_the_top_whole_words_and_leaves_the_callers_random_state(tiny_model):
    model, tok = tiny_model
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    field = build_contrast_field(model, tok, SENTENCE, raw=True, top=12, positions=6)
    assert torch.equal(torch.random.get_rng_state(), before)
    on = torch.nonzero(field.values).flatten()
    assert 0 < on.numel() <= 12
    vocab = vocab_of(tok, field.vocab_size)
    assert bool(vocab.spaced[on].all()) and bool(vocab.valid[on].all())
    values = field.values[on]
    assert float(values.max()) == pytest.approx(1.0) and float(values.min()) >= 0.2 - 1e-6
    contrast = sentence_contrast(model, tok, SENTENCE, raw=True, positions=6)
    outside = vocab.spaced & vocab.valid & (field.values == 0)
    assert float(contrast[on].min()) >= float(contrast[outside].max())  # the best ones, no others
    again = build_contrast_field(model, tok, SENTENCE, raw=True, top=12, positions=6)
    assert torch.equal(field.values, again.values)  # seeded: the same field every time


def test_a_profile_reads_its_sentences_contrast_where_the_lead_asks(tiny_model):
    model, tok = tiny_model
    chat_tok = with_chat_template(tok)
    profile = Profile(core_semantics=["planet", "star", "moon"], lead={"chat": {"contrast": 20}})
    read = reading_profile(profile, raw=False)
    assert read.field.contrast is not None
    assert read.field.contrast.sentence == "Write about planet, star and moon." and read.field.contrast.top == 20
    assert reading_profile(profile, raw=True).field.contrast is None  # plain continuation's lead has none
    plain = field_from_profile(reading_profile(profile, raw=True), chat_tok)
    field = field_from_profile(read, chat_tok, model=model)
    assert field_from_profile(read, chat_tok, model=model) is field  # built once
    assert bool((field.values >= plain.values).all())  # max of the two
    assert int((field.values > 0).sum()) > int((plain.values > 0).sum())


def test_a_contrast_without_the_model_or_a_chat_template_says_what_to_do(tiny_model):
    model, tok = tiny_model
    read = reading_profile(Profile(core_semantics=["planet"], lead={"contrast": 20}), raw=False)
    with pytest.raises(ConfigurationError, match="pass model="):
        field_from_profile(read, tok)
    with pytest.raises(ConfigurationError, match="no chat template"):
        field_from_profile(read, tok, model=model)
