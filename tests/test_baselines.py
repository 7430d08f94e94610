"""Baselines: the blog-post replica keeps its flaws; weighted decoding adds exactly λ, vectorized."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from narrative_gravity.engines.baselines import (
    ArticleGravityLogitsProcessor,
    WeightedDecodingLogitsProcessor,
    single_token_forms,
)
from narrative_gravity.errors import VocabularyError

# ---------------------------------------------------------------------------------------------------
# ArticleGravityLogitsProcessor


def test_article_finds_only_glued_single_pieces(tiny_tokenizer: Any) -> None:
    tok = tiny_tokenizer
    proc = ArticleGravityLogitsProcessor(tok, ["planet", "moon", "telescope"], penalize=["orbit", "zebra"])
    # "planet" is a glued vocabulary piece; " planet" (Ġplanet) is a different id that the article never finds.
    assert proc.core_ids == [tok.convert_tokens_to_ids("planet")]
    assert tok.convert_tokens_to_ids("Ġplanet") not in proc.core_ids
    # "moon" and "telescope" are not single glued pieces: looked up as None and skipped silently.
    assert proc.penalize_ids == [tok.convert_tokens_to_ids("orbit")]


def test_article_loops_in_place_with_decay(tiny_tokenizer: Any) -> None:
    tok = tiny_tokenizer
    proc = ArticleGravityLogitsProcessor(tok, ["planet"], gravity_strength=2.0, penalize=["orbit"], decay_after_steps=3)
    core, pen = proc.core_ids[0], proc.penalize_ids[0]
    ids = torch.zeros(2, 4, dtype=torch.long)
    expected = []
    for _ in range(4):
        scores = torch.zeros(2, len(tok))
        out = proc(ids, scores)
        assert out is scores  # modified in place and returned
        expected.append(float(out[1, core]))
        assert torch.equal(out[:, pen], -out[:, core])
        assert torch.count_nonzero(out) == 4
    # step counts calls: full strength on steps 1-2, half from step 3 (= decay_after_steps) on.
    assert expected == [2.0, 2.0, 1.0, 1.0]
    assert proc.step == 4


def test_article_counter_is_never_reset(tiny_tokenizer: Any) -> None:
    proc = ArticleGravityLogitsProcessor(tiny_tokenizer, ["planet"], gravity_strength=1.0, decay_after_steps=2)
    ids = torch.zeros(1, 3, dtype=torch.long)
    for _ in range(2):
        proc(ids, torch.zeros(1, len(tiny_tokenizer)))
    # a "new generation" (shorter input) still sees the decayed strength: the known flaw is kept.
    out = proc(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, len(tiny_tokenizer)))
    assert float(out[0, proc.core_ids[0]]) == 0.5


def test_article_skips_the_unknown_token_id() -> None:
    class Tok:
        unk_token_id = 0

        def convert_tokens_to_ids(self, word: str) -> int:
            return {"planet": 7}.get(word, 0)

    proc = ArticleGravityLogitsProcessor(Tok(), ["planet", "binary_search"], penalize=["recipe"])
    assert proc.core_ids == [7]
    assert proc.penalize_ids == []


@pytest.mark.slow
def test_article_on_smollm2_finds_glued_planet_not_spaced() -> None:
    from narrative_gravity.models import load_tokenizer

    tok = load_tokenizer()
    spaced = tok.encode(" planet", add_special_tokens=False)
    glued = tok.encode("planet", add_special_tokens=False)
    assert len(spaced) == 1 and len(glued) == 1 and spaced != glued
    proc = ArticleGravityLogitsProcessor(tok, ["planet", "binary_search"], penalize=["restaurant", "movie"])
    assert proc.core_ids == glued  # the glued piece only; binary_search is not one piece and is skipped
    assert spaced[0] not in proc.core_ids
    # "restaurant" has no glued single piece on SmolLM2 (only " restaurant"): skipped.
    assert proc.penalize_ids == tok.encode("movie", add_special_tokens=False)


# ---------------------------------------------------------------------------------------------------
# WeightedDecodingLogitsProcessor


def test_weighted_decoding_adds_exactly_lambda(tiny_tokenizer: Any) -> None:
    tok = tiny_tokenizer
    words = ["planet", "moon", "telescope"]
    lam = 1.75
    proc = WeightedDecodingLogitsProcessor(tok, words, lam)
    # planet: " planet" and "planet" are single tokens; moon: only " moon"; telescope: neither.
    want = sorted(
        {
            tok.convert_tokens_to_ids("Ġplanet"),
            tok.convert_tokens_to_ids("planet"),
            tok.convert_tokens_to_ids("Ġmoon"),
        }
    )
    assert proc.token_ids.tolist() == want

    torch.manual_seed(0)
    scores = torch.randn(3, len(tok))
    before = scores.clone()
    ids = torch.zeros(3, 5, dtype=torch.long)
    out = proc(ids, scores)
    assert torch.equal(scores, before)  # input not modified
    assert out is not scores
    diff = out - before
    mask = torch.zeros(len(tok), dtype=torch.bool)
    mask[want] = True
    assert torch.allclose(diff[:, mask], torch.full((3, len(want)), lam))
    assert torch.count_nonzero(diff[:, ~mask]) == 0


def test_weighted_decoding_keeps_minus_inf_and_dtype(tiny_tokenizer: Any) -> None:
    proc = WeightedDecodingLogitsProcessor(tiny_tokenizer, ["planet"], 2.0)
    scores = torch.zeros(1, len(tiny_tokenizer), dtype=torch.float64)
    scores[0, proc.token_ids[0]] = float("-inf")
    out = proc(torch.zeros(1, 1, dtype=torch.long), scores)
    assert out.dtype == torch.float64
    assert out[0, proc.token_ids[0]] == float("-inf")
    assert out[0, proc.token_ids[1]] == 2.0


def test_weighted_decoding_rejects_narrow_logits(tiny_tokenizer: Any) -> None:
    proc = WeightedDecodingLogitsProcessor(tiny_tokenizer, ["planet"], 1.0)
    with pytest.raises(VocabularyError, match="columns"):
        proc(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 10))


def test_single_token_forms_dedupes(tiny_tokenizer: Any) -> None:
    assert single_token_forms(tiny_tokenizer, ["planet", "planet", "zebra"]) == sorted(
        {tiny_tokenizer.convert_tokens_to_ids("Ġplanet"), tiny_tokenizer.convert_tokens_to_ids("planet")}
    )
