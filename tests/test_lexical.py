"""Tests for narrative_gravity.fields.lexical: word lists -> NarrativeField for any tokenizer."""

from __future__ import annotations

import math
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from narrative_gravity.errors import FieldError, VocabularyError
from narrative_gravity.eval.topics import PACKAGED_TOPICS
from narrative_gravity.fields import (
    NarrativeField,
    build_lexical_field,
    expand_keywords,
    reach,
    surface_forms,
)
from narrative_gravity.fields.lexical import PENALIZE_WINS

WORDLISTS = PACKAGED_TOPICS / "wordlists"  # the topic protocol's lists, shipped with the package


def enc(tok: Any, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def one(tok: Any, text: str) -> int:
    ids = enc(tok, text)
    assert len(ids) == 1, f"test precondition: {text!r} should be one token, got {tok.convert_ids_to_tokens(ids)}"
    return ids[0]


def step(field: NarrativeField, *rows: list[int]) -> torch.Tensor:
    """The field for the next token after each row (rows of equal length)."""
    out = field.for_step(torch.tensor(list(rows), dtype=torch.long))
    return out if out.dim() == 2 else out.expand(len(rows), -1)


# ------------------------------------------------------------------------------------------------
# expand_keywords


def test_expand_keywords_splits_compounds_and_keeps_phrase() -> None:
    assert expand_keywords(["binary_search"]) == ["binary", "search", "binary search"]


def test_expand_keywords_strips_drops_empties_and_dedupes_in_order() -> None:
    got = expand_keywords(["  planet ", "", "   ", "orbit", "planet", "_", "deep__space_", "deep  space"])
    assert got == ["planet", "orbit", "deep", "space", "deep space"]


def test_expand_keywords_single_string_is_one_word() -> None:
    assert expand_keywords("star_ship") == ["star", "ship", "star ship"]


# ------------------------------------------------------------------------------------------------
# surface_forms on the tiny tokenizers


def test_surface_forms_bpe_space_and_glued(tiny_tokenizer: Any) -> None:
    forms = surface_forms(tiny_tokenizer, "planet")
    assert (one(tiny_tokenizer, " planet"),) == forms[0]  # the after-a-space form comes first
    assert (one(tiny_tokenizer, "planet"),) in forms
    assert tuple(enc(tiny_tokenizer, " Planet")) in forms  # case variant, several pieces
    assert len(set(forms)) == len(forms)
    for f in forms:
        assert tiny_tokenizer.decode(list(f)).lstrip(" ") in {"planet", "Planet"}


def test_surface_forms_drop_special_and_unknown(tiny_tokenizer: Any, tiny_sp_tokenizer: Any) -> None:
    assert surface_forms(tiny_tokenizer, "<|endoftext|>") == []
    assert surface_forms(tiny_sp_tokenizer, "zebra") == []  # 'z' is not in the Unigram vocabulary
    assert surface_forms(tiny_tokenizer, "   ") == []
    unk = tiny_sp_tokenizer.unk_token_id
    for w in ["Planet", "planet", "astronomer", "Moonlight"]:  # capitals are mostly unknown there
        assert all(unk not in f for f in surface_forms(tiny_sp_tokenizer, w))


def test_surface_forms_sentencepiece_dummy_prefix(tiny_sp_tokenizer: Any) -> None:
    # With a dummy prefix, "planet" and " planet" are both '▁planet': one form.
    forms = surface_forms(tiny_sp_tokenizer, "planet")
    assert forms == [(one(tiny_sp_tokenizer, "planet"),)]
    assert tiny_sp_tokenizer.convert_ids_to_tokens(list(forms[0])) == ["▁planet"]


# ------------------------------------------------------------------------------------------------
# build_lexical_field: values


def test_single_token_word_gets_plus_one(tiny_tokenizer: Any) -> None:
    f = build_lexical_field(tiny_tokenizer, ["planet"])
    sp = one(tiny_tokenizer, " planet")
    assert f.values[sp].item() == 1.0
    assert f.vocab_size == len(tiny_tokenizer)
    assert f.values.dtype == torch.float32
    assert f.name == "lexical"
    # nothing else gets +1 from a one-word list whose other forms are glued or multi-token
    assert (f.values == 1.0).nonzero().flatten().tolist() == [sp]


def test_glued_single_token_form_gets_glued_weight(tiny_tokenizer: Any) -> None:
    glued = one(tiny_tokenizer, "planet")
    assert build_lexical_field(tiny_tokenizer, ["planet"]).values[glued].item() == 0.5
    f = build_lexical_field(tiny_tokenizer, ["planet"], glued_weight=0.2)
    assert f.values[glued].item() == pytest.approx(0.2)
    assert f.values[one(tiny_tokenizer, " planet")].item() == 1.0
    f0 = build_lexical_field(tiny_tokenizer, ["planet"], glued_weight=0.0)
    assert f0.values[glued].item() == 0.0


def test_multi_token_word_first_piece_and_continuations(tiny_tokenizer: Any) -> None:
    moon, l_, ight = enc(tiny_tokenizer, " moonlight")
    sun = one(tiny_tokenizer, " sun")
    the = one(tiny_tokenizer, " the")
    assert enc(tiny_tokenizer, " sunlight") == [sun, l_, ight]  # shares the later pieces
    f = build_lexical_field(tiny_tokenizer, ["moonlight"], first_piece_weight=0.3)
    assert f.values[moon].item() == pytest.approx(0.3)
    assert f.values[l_].item() == 0.0 and f.values[ight].item() == 0.0
    out = step(f, [the, moon], [the, sun], [moon, l_], [sun, l_], [the, the])
    assert out[0, l_].item() == 1.0  # 'l' after ' moon'
    assert out[1, l_].item() == 0.0  # not after ' sun'
    assert out[2, ight].item() == 1.0  # 'ight' after ' moon' 'l'
    assert out[3, ight].item() == 0.0  # not after ' sun' 'l': the whole prefix must match
    assert out[4, l_].item() == 0.0 and out[4, ight].item() == 0.0
    assert out[4, moon].item() == pytest.approx(0.3)


def test_glued_multi_token_first_piece_is_scaled(tiny_tokenizer: Any) -> None:
    glued = enc(tiny_tokenizer, "moonlight")
    assert len(glued) > 1 and glued[0] != enc(tiny_tokenizer, " moonlight")[0]
    f = build_lexical_field(tiny_tokenizer, ["moonlight"], first_piece_weight=0.8, glued_weight=0.5)
    assert f.values[glued[0]].item() == pytest.approx(0.4)
    out = step(f, glued[:-1])
    assert out[0, glued[-1]].item() == 1.0


def test_whitespace_only_first_piece_gets_no_pull(tiny_sp_tokenizer: Any) -> None:
    pieces = tiny_sp_tokenizer.convert_ids_to_tokens(enc(tiny_sp_tokenizer, "astronomer"))
    assert pieces[0] == "▁"
    ids = enc(tiny_sp_tokenizer, "astronomer")
    f = build_lexical_field(tiny_sp_tokenizer, ["astronomer"])
    assert f.values[ids[0]].item() == 0.0  # pulling the bare space would pull every word
    assert step(f, [ids[0]])[0, ids[1]].item() == 1.0


def test_positive_contributions_combine_with_max(tiny_tokenizer: Any) -> None:
    moon = enc(tiny_tokenizer, " moonlight")[0]
    assert enc(tiny_tokenizer, " moon") == [moon]
    f = build_lexical_field(tiny_tokenizer, ["moonlight", "moon"])
    assert f.values[moon].item() == 1.0


def test_penalize_single_token_is_minus_one(tiny_tokenizer: Any) -> None:
    f = build_lexical_field(tiny_tokenizer, ["planet"], ["orbit"])
    assert f.values[one(tiny_tokenizer, " orbit")].item() == -1.0
    assert f.values[one(tiny_tokenizer, "orbit")].item() == -1.0
    assert f.values[one(tiny_tokenizer, " planet")].item() == 1.0
    assert "orbit" in f.report.used and "orbit" not in f.report.unusable


def test_penalize_multi_token_blocks_completion_not_first_piece(tiny_tokenizer: Any) -> None:
    moon, l_, ight = enc(tiny_tokenizer, " moonlight")
    f = build_lexical_field(tiny_tokenizer, ["planet"], ["moonlight"])
    assert f.values[moon].item() == 0.0
    out = step(f, [moon, moon], [moon, l_], [l_, l_])
    assert out[0, l_].item() == -1.0
    assert out[1, ight].item() == -1.0
    assert out[2, ight].item() == 0.0


def test_penalize_overrides_core(tiny_tokenizer: Any) -> None:
    f = build_lexical_field(tiny_tokenizer, ["planet", "orbit"], ["orbit"])
    assert f.values[one(tiny_tokenizer, " orbit")].item() == -1.0
    assert f.report.unusable["orbit"] == PENALIZE_WINS
    assert "orbit" not in f.report.used and "planet" in f.report.used
    # token level: a core word's first piece that a penalize word owns is -1
    moon = enc(tiny_tokenizer, " moonlight")[0]
    g = build_lexical_field(tiny_tokenizer, ["moonlight"], ["moon"])
    assert g.values[moon].item() == -1.0
    assert "moonlight" in g.report.used and "moon" in g.report.used


def test_penalized_token_is_not_pulled_as_continuation(tiny_tokenizer: Any) -> None:
    # phrase "moon planet" pulls ' planet' after ' moon'; penalizing "planet" must win there too.
    moon, planet = one(tiny_tokenizer, " moon"), one(tiny_tokenizer, " planet")
    f = build_lexical_field(tiny_tokenizer, ["moon_planet"], ["planet"])
    assert "planet" in f.report.unusable and "moon planet" in f.report.used
    assert step(f, [moon])[0, planet].item() == -1.0


def test_continuation_table_layout(tiny_tokenizer: Any) -> None:
    f = build_lexical_field(tiny_tokenizer, ["moonlight", "astronomer", "Moonlight"], ["sunlight"])
    assert f.has_continuations
    assert f.prefixes.dtype == torch.long and f.next_ids.dtype == torch.long
    assert f.next_values.dtype == torch.float32
    e, width = f.prefixes.shape
    assert f.next_ids.shape == (e,) and f.next_values.shape == (e,)
    assert (f.prefixes[:, -1] >= 0).all()  # right-aligned
    for row in f.prefixes.tolist():  # left-padded with -1 only
        k = sum(1 for x in row if x < 0)
        assert all(x == -1 for x in row[:k]) and all(x >= 0 for x in row[k:])
    assert width == max(sum(1 for x in row if x >= 0) for row in f.prefixes.tolist())
    entries = list(zip(map(tuple, f.prefixes.tolist()), f.next_ids.tolist(), f.next_values.tolist()))
    assert len(set(entries)) == len(entries)
    assert set(f.next_values.tolist()) <= {-1.0, 1.0}


def test_no_multi_token_forms_means_no_table(tiny_sp_tokenizer: Any) -> None:
    f = build_lexical_field(tiny_sp_tokenizer, ["planet"])
    assert f.prefixes is None and f.next_ids is None and f.next_values is None
    assert f.values[one(tiny_sp_tokenizer, "planet")].item() == 1.0


def test_vocab_size_argument(tiny_tokenizer: Any) -> None:
    f = build_lexical_field(tiny_tokenizer, ["planet"], vocab_size=len(tiny_tokenizer) + 64)
    assert f.vocab_size == len(tiny_tokenizer) + 64
    with pytest.raises(VocabularyError, match="outside vocab_size=10"):
        build_lexical_field(tiny_tokenizer, ["planet"], vocab_size=10)


def test_deterministic(tiny_tokenizer: Any) -> None:
    a = build_lexical_field(tiny_tokenizer, ["moonlight", "planet", "astronomer"], ["sunlight"])
    b = build_lexical_field(tiny_tokenizer, ["moonlight", "planet", "astronomer"], ["sunlight"])
    assert torch.equal(a.values, b.values) and torch.equal(a.prefixes, b.prefixes)
    assert torch.equal(a.next_ids, b.next_ids) and torch.equal(a.next_values, b.next_values)
    assert a.report == b.report


# ------------------------------------------------------------------------------------------------
# report and errors


def test_report_lists_forms_and_reasons(tiny_sp_tokenizer: Any, tiny_tokenizer: Any) -> None:
    f = build_lexical_field(
        tiny_sp_tokenizer, ["planet", "zebra", "  ", "<s>", "astronomer", "orbit"], ["orbit"], max_pieces=4
    )
    r = f.report
    assert r.used == {"planet": [("▁planet",)]}
    assert r.unusable["zebra"] == "every surface form contains the unknown token"
    assert r.unusable["  "] == "empty after stripping"
    assert r.unusable["<s>"] == "every surface form contains a special token (<s>)"
    assert re.fullmatch(r"needs \d+ tokens, more than max_pieces=4", r.unusable["astronomer"])
    assert r.unusable["orbit"] == PENALIZE_WINS
    assert r.n_used == 1 and r.n_unusable == 5
    g = build_lexical_field(tiny_tokenizer, ["planet", "<|endoftext|>", "_"])
    assert g.report.unusable["<|endoftext|>"] == "every surface form contains a special token (<|endoftext|>)"
    assert "_" in g.report.unusable
    assert g.report.used["planet"][0] == ("Ġplanet",)


def test_no_usable_core_word_raises(tiny_sp_tokenizer: Any) -> None:
    with pytest.raises(FieldError, match=r"zebra.*unknown token.*Fix"):
        build_lexical_field(tiny_sp_tokenizer, ["zebra", "<s>"])
    with pytest.raises(FieldError, match="penalize wins"):
        build_lexical_field(tiny_sp_tokenizer, ["planet"], ["planet"])
    with pytest.raises(FieldError, match="no core word"):
        build_lexical_field(tiny_sp_tokenizer, ["", "  "])
    with pytest.raises(FieldError, match="no core word"):
        build_lexical_field(tiny_sp_tokenizer, [])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"glued_weight": 1.5}, "glued_weight"),
        ({"glued_weight": -0.1}, "glued_weight"),
        ({"glued_weight": math.nan}, "glued_weight"),
        ({"first_piece_weight": 2.0}, "first_piece_weight"),
        ({"max_pieces": 0}, "max_pieces"),
        ({"max_pieces": 2.5}, "max_pieces"),
        ({"vocab_size": 0}, "vocab_size"),
    ],
)
def test_bad_arguments_raise(tiny_tokenizer: Any, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(FieldError, match=message):
        build_lexical_field(tiny_tokenizer, ["planet"], **kwargs)


def test_reach_tiny(tiny_tokenizer: Any, tiny_sp_tokenizer: Any) -> None:
    assert reach(tiny_tokenizer, ["planet", " 二分 ", "<|endoftext|>", ""]) == (
        ["planet", "二分"],
        ["<|endoftext|>", ""],
    )
    assert reach(tiny_sp_tokenizer, ["planet", "二分", "zebra"]) == (["planet"], ["二分", "zebra"])
    assert reach(tiny_tokenizer, ["starship"], max_pieces=2) == ([], ["starship"])


# ------------------------------------------------------------------------------------------------
# property: any word list gives a well-formed field

_WORD = st.text(alphabet=st.sampled_from([*"planetorbitgalxyPOGmunsh_ -", "二", "分", "查", "é", "🪐"]), max_size=12)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(core=st.lists(_WORD, min_size=1, max_size=6), penalize=st.lists(_WORD, max_size=3))
def test_random_word_lists_give_valid_fields(tiny_tokenizer: Any, core: list[str], penalize: list[str]) -> None:
    try:
        f = build_lexical_field(tiny_tokenizer, core, penalize)
    except FieldError as exc:
        assert "core word" in str(exc)
        return
    assert f.values.shape == (len(tiny_tokenizer),)
    assert float(f.values.min()) >= -1.0 and float(f.values.max()) <= 1.0
    if f.has_continuations:
        assert ((f.next_values == 1.0) | (f.next_values == -1.0)).all()
        # histories that end in every prefix of the table, plus one that ends in none
        hist = torch.cat([f.prefixes.clamp(min=0), torch.zeros(1, f.max_prefix_len, dtype=torch.long)])
        out = f.for_step(hist)
        assert float(out.min()) >= -1.0 and float(out.max()) <= 1.0
    assert not set(f.report.used) & set(f.report.unusable)
    for w in expand_keywords(core):
        assert w in f.report.used or w in f.report.unusable


# ------------------------------------------------------------------------------------------------
# real tokenizers (slow)


@pytest.fixture(scope="module")
def smollm2() -> Any:
    from narrative_gravity.models import load_tokenizer

    return load_tokenizer("smollm2")


@pytest.fixture(scope="module")
def gemma() -> Any:
    from narrative_gravity.models import load_tokenizer

    return load_tokenizer("gemma3-270m")


@pytest.mark.slow
def test_smollm2_single_token_and_compound(smollm2: Any) -> None:
    planet = one(smollm2, " planet")
    f = build_lexical_field(smollm2, ["planet", "binary_search"])
    assert f.values[planet].item() == 1.0
    binary, search = one(smollm2, " binary"), one(smollm2, " search")
    assert f.values[binary].item() == 1.0 and f.values[search].item() == 1.0
    assert {"binary", "search", "binary search"} <= set(f.report.used)
    assert ("Ġbinary", "Ġsearch") in f.report.used["binary search"]
    assert f.vocab_size == len(smollm2)


@pytest.mark.slow
def test_gemma_cjk_pieces_and_continuations(gemma: Any) -> None:
    word = "二分查找"
    glued = enc(gemma, word)
    spaced = enc(gemma, "a " + word)[len(enc(gemma, "a")) :]
    assert gemma.convert_ids_to_tokens(glued) == ["二", "分", "查找"]
    assert gemma.convert_ids_to_tokens(spaced) == ["▁二", "分", "查找"]
    assert set(surface_forms(gemma, word)) == {tuple(glued), tuple(spaced)}
    f = build_lexical_field(gemma, [word])
    assert sorted(f.report.used[word]) == sorted([("二", "分", "查找"), ("▁二", "分", "查找")])
    er, fen, chazhao = glued
    sp_er = spaced[0]
    other = one(gemma, " planet")
    assert f.values[sp_er].item() == pytest.approx(0.5)  # first piece, space form
    assert f.values[er].item() == pytest.approx(0.25)  # first piece, glued form
    assert f.values[fen].item() == 0.0 and f.values[chazhao].item() == 0.0
    out = step(f, [other, er], [other, sp_er], [other, other], [er, fen], [sp_er, fen], [other, fen])
    assert out[0, fen].item() == 1.0 and out[1, fen].item() == 1.0
    assert out[2, fen].item() == 0.0
    assert out[0, chazhao].item() == 0.0  # '查找' needs '二' '分' first
    assert out[3, chazhao].item() == 1.0 and out[4, chazhao].item() == 1.0
    assert out[5, chazhao].item() == 0.0


@pytest.mark.slow
def test_gemma_english_word_with_metaspace(gemma: Any) -> None:
    f = build_lexical_field(gemma, ["planet"], ["war"])
    planet = one(gemma, " planet")
    assert gemma.convert_ids_to_tokens([planet]) == ["▁planet"]
    assert f.values[planet].item() == 1.0
    assert f.values[one(gemma, "planet")].item() == 0.5
    assert f.values[one(gemma, " war")].item() == -1.0
    assert ("▁planet",) in f.report.used["planet"]
    assert f.vocab_size == len(gemma) == 262144


@pytest.mark.slow
def test_gemma_build_time_200_words(gemma: Any) -> None:
    words: list[str] = []
    for i in range(1000, len(gemma)):
        piece = gemma.convert_ids_to_tokens(i)
        if piece.startswith("▁") and piece[1:].isalpha() and len(piece) > 5:
            words.append(piece[1:])
            if len(words) == 200:
                break
    words += ["二分查找", "binary_search", "star_ship"]
    start = time.perf_counter()
    f = build_lexical_field(gemma, words, ["war", "battle"])
    elapsed = time.perf_counter() - start
    assert f.report.n_used >= 200
    assert elapsed < 3.0, f"building a 200-word field on Gemma took {elapsed:.2f} s"


def _wordlists() -> list[Path]:
    return sorted(WORDLISTS.glob("*.txt"))


@pytest.mark.slow
def test_bench_wordlists_reachable_in_smollm2(smollm2: Any) -> None:
    paths = _wordlists()
    assert len(paths) == 7, f"expected 7 word lists in {WORDLISTS}, found {[p.name for p in paths]}"
    for path in paths:
        words = [w.strip() for w in path.read_text(encoding="utf-8").splitlines() if w.strip()]
        reachable, unreachable = reach(smollm2, words)
        assert len(reachable) + len(unreachable) == len(words)
        assert len(reachable) >= 0.99 * len(words), f"{path.name}: unreachable {unreachable}"
