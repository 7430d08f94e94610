"""The shortlist head (engines/shortlist.py) on a tiny seeded random Llama: exactness, what is never written, and
the errors of a bad list or profile."""

from __future__ import annotations

import copy
import gzip
import json
from typing import Any

import numpy as np
import pytest
import torch
import transformers

from narrative_gravity.engines.hf_generate import generate_with_profile, profile_head_plan
from narrative_gravity.engines.options import GenerationOptions
from narrative_gravity.engines.shortlist import (
    FrequencyList,
    ShortlistHead,
    head_plan,
    load_frequency_list,
    narrative_support,
    shortlist_head,
    tokenizer_fingerprint,
)
from narrative_gravity.errors import ConfigurationError, ProfileError, VocabularyError
from narrative_gravity.profiles.build import program_from_profile
from narrative_gravity.profiles.schema import Profile

PROMPTS = ["The planet", "A star moves", "Every orbit of the moon"]


@pytest.fixture(scope="module")
def tied_model(tiny_model: tuple[Any, Any]) -> tuple[Any, Any]:
    """The tiny Llama with its head tied to its input embeddings (as SmolLM2 and Gemma have it)."""
    _, tokenizer = tiny_model
    config = copy.deepcopy(tiny_model[0].config)
    config.tie_word_embeddings = True
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(config).eval()
    model.tie_weights()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model, tokenizer


@pytest.fixture(scope="module")
def list_file(tiny_model: tuple[Any, Any], tmp_path_factory: pytest.TempPathFactory) -> str:
    """A frequency list for the tiny tokenizer: ids in a seeded random order."""
    model, tokenizer = tiny_model
    vocab = model.config.vocab_size
    ids = np.random.default_rng(0).permutation(vocab)
    freq = FrequencyList(ids=ids, vocab_size=vocab, fingerprint=tokenizer_fingerprint(tokenizer), model="tiny")
    return str(freq.save(tmp_path_factory.mktemp("lists") / "tiny.json.gz"))


def _profile(list_file: str | None, shortlist: int | None = None, **extra: Any) -> Profile:
    data: dict[str, Any] = {"core_semantics": ["planet", "orbit"], "schedule": "constant", "gravity_strength": 2.0}
    if shortlist is not None:
        data["prune"] = {"head": {"shortlist": shortlist, "file": list_file, **extra}}
    return Profile.from_mapping(data)


@pytest.mark.parametrize("which", ["separate", "tied"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_whole_vocabulary_shortlist_matches_the_full_head(
    tiny_model: tuple[Any, Any], tied_model: tuple[Any, Any], list_file: str, which: str, temperature: float
) -> None:
    model, tokenizer = tiny_model if which == "separate" else tied_model
    vocab = model.config.vocab_size
    opts = GenerationOptions(max_new_tokens=12, temperature=temperature, top_k=0, raw=True, batch_size=2, seed=3)
    full = generate_with_profile(model, tokenizer, PROMPTS, _profile(None), opts)
    short = generate_with_profile(model, tokenizer, PROMPTS, _profile(list_file, vocab), opts)
    assert [r.token_ids for r in short] == [r.token_ids for r in full]
    assert all(r.extra["shortlist"]["size"] == vocab for r in short)
    assert model.get_output_embeddings().__class__ is torch.nn.Linear  # the head is put back


def test_shortlist_head_logits_equal_the_full_head_on_its_rows(tied_model: tuple[Any, Any]) -> None:
    model, _ = tied_model
    head = model.get_output_embeddings()
    ids = torch.tensor([0, 5, 7, 100, 399])
    hidden = torch.randn(2, 3, head.in_features)
    out = ShortlistHead(head, ids)(hidden)
    full = head(hidden)
    torch.testing.assert_close(out[..., ids], full[..., ids])
    rest = torch.ones(full.shape[-1], dtype=torch.bool)
    rest[ids] = False
    assert torch.isneginf(out[..., rest]).all()


@pytest.mark.parametrize("which", ["separate", "tied"])
def test_tokens_outside_the_shortlist_are_never_sampled(
    tiny_model: tuple[Any, Any], tied_model: tuple[Any, Any], list_file: str, which: str
) -> None:
    model, tokenizer = tiny_model if which == "separate" else tied_model
    profile = _profile(list_file, 256)
    plan = profile_head_plan(model, tokenizer, profile)
    inside = set(plan.ids().tolist())
    assert len(inside) < model.config.vocab_size  # some tokens really are left out
    opts = GenerationOptions(max_new_tokens=40, temperature=2.0, top_k=0, raw=True, batch_size=3, seed=0)
    out = generate_with_profile(model, tokenizer, PROMPTS * 2, profile, opts)
    written = {t for r in out for t in r.token_ids}
    assert written <= inside
    assert len(written) > 20  # a hot sampler visited many tokens


def test_required_words_and_field_support_are_inside(tiny_model: tuple[Any, Any], list_file: str) -> None:
    model, tokenizer = tiny_model
    profile = Profile.from_mapping(
        {
            "core_semantics": ["galaxy"],
            "schedule": "constant",
            "require": ["comet", "night"],
            "stages": [{"name": "a", "core_semantics": ["moon"]}, {"name": "b", "core_semantics": ["station"]}],
            "prune": {"head": {"shortlist": 256, "file": list_file}},
        }
    )
    plan = profile_head_plan(model, tokenizer, profile)
    inside = set(plan.ids().tolist())
    program = program_from_profile(profile, tokenizer, model=model)
    assert set(narrative_support(program).tolist()) <= inside
    for word in ("comet", "night", "moon", "station", "galaxy"):
        for text in (word, " " + word):
            assert set(tokenizer.encode(text, add_special_tokens=False)) <= inside, word
    assert tokenizer.eos_token_id in inside
    frequent = set(plan.frequent[0].tolist())
    assert not set(narrative_support(program).tolist()) <= frequent  # the support added what the list left out


def test_audit_records_the_mass_outside(tiny_model: tuple[Any, Any], list_file: str) -> None:
    model, tokenizer = tiny_model
    vocab = model.config.vocab_size
    opts = GenerationOptions(max_new_tokens=10, raw=True, batch_size=3, seed=0)
    full = generate_with_profile(model, tokenizer, PROMPTS, _profile(list_file, vocab, audit=1.0), opts)
    assert all(r.extra["shortlist"]["audited_steps"] == r.new_tokens for r in full)
    assert max(c for r in full for c in r.extra["shortlist"]["cut_masses"]) < 1e-5
    half = generate_with_profile(model, tokenizer, PROMPTS, _profile(list_file, 256, audit=0.5), opts)
    masses = [c for r in half for c in r.extra["shortlist"]["cut_masses"]]
    assert all(r.extra["shortlist"]["audited_steps"] == (r.new_tokens + 1) // 2 for r in half)
    assert min(masses) > 0 and max(masses) < 1
    off = generate_with_profile(model, tokenizer, PROMPTS, _profile(list_file, 256), opts)
    assert "cut_mass_mean" not in off[0].extra["shortlist"]
    # The audit only reads: the texts are the same with it and without it.
    assert [r.token_ids for r in half] == [r.token_ids for r in off]


def test_a_head_is_put_back_after_an_error(tiny_model: tuple[Any, Any], list_file: str) -> None:
    model, tokenizer = tiny_model
    head = model.get_output_embeddings()
    plan = head_plan(model, tokenizer, shortlist=256, file=list_file)
    with pytest.raises(RuntimeError), shortlist_head(model, plan) as short:
        assert model.get_output_embeddings() is short
        raise RuntimeError("boom")
    assert model.get_output_embeddings() is head


# ------------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    ("head", "message"),
    [
        ({"shortlist": 0}, "prune.head.shortlist` (got 0)"),
        ({"shortlist": "32768"}, "write it without quotes"),
        ({"shortlist": True}, "is a boolean"),
        ({}, "`prune.head.shortlist`: Field required"),
        ({"shortlist": 4096, "audit": 1.5}, "prune.head.audit` (got 1.5)"),
        ({"shortlst": 4096}, "did you mean `shortlist`?"),
    ],
)
def test_bad_profile_keys_are_clear_errors(head: dict[str, Any], message: str) -> None:
    with pytest.raises(ProfileError, match=None) as err:
        Profile.from_mapping({"core_semantics": ["x"], "prune": {"head": head}})
    assert message in str(err.value)


def test_a_list_for_another_vocabulary_is_refused(
    tiny_model: tuple[Any, Any], tiny_sp_tokenizer: Any, tmp_path: Any
) -> None:
    model, tokenizer = tiny_model
    other = FrequencyList(
        ids=np.arange(len(tiny_sp_tokenizer)),
        vocab_size=len(tiny_sp_tokenizer),
        fingerprint=tokenizer_fingerprint(tiny_sp_tokenizer),
        model="other",
    ).save(tmp_path / "other.json")
    with pytest.raises(VocabularyError, match="built for another vocabulary"):
        head_plan(model, tokenizer, shortlist=256, file=str(other))
    # The same size of vocabulary, another tokenizer: the fingerprint tells them apart.
    same_size = FrequencyList(
        ids=np.arange(model.config.vocab_size), vocab_size=model.config.vocab_size, fingerprint="0" * 16
    ).save(tmp_path / "same.json")
    with pytest.raises(VocabularyError, match="built for another vocabulary"):
        head_plan(model, tokenizer, shortlist=256, file=str(same_size))


def test_damaged_lists_are_clear_errors(tmp_path: Any) -> None:
    base = {"format": "narrative-gravity shortlist 1", "vocab_size": 10, "fingerprint": "x", "ids": [1, 2, 3]}
    cases = {
        "range.json": ({**base, "ids": [1, 2, 12, -1]}, VocabularyError, r"token ids \[-1, 12\] are outside"),
        "repeat.json": ({**base, "ids": [1, 1]}, ConfigurationError, "repeats token ids"),
        "format.json": ({**base, "format": "x"}, ConfigurationError, "is not a `narrative-gravity shortlist 1`"),
        "missing.json": ({k: v for k, v in base.items() if k != "vocab_size"}, ConfigurationError, "vocab_size"),
    }
    for name, (data, kind, message) in cases.items():
        path = tmp_path / name
        path.write_text(json.dumps(data))
        with pytest.raises(kind, match=message):
            load_frequency_list(path)
    (tmp_path / "junk.json.gz").write_bytes(gzip.compress(b"{not json"))
    with pytest.raises(ConfigurationError, match="not a readable shortlist"):
        load_frequency_list(tmp_path / "junk.json.gz")
    with pytest.raises(ConfigurationError, match="does not exist"):
        load_frequency_list(tmp_path / "nowhere.json")


def test_a_shortlist_longer_than_the_list_is_refused(tiny_model: tuple[Any, Any], tmp_path: Any) -> None:
    model, tokenizer = tiny_model
    short = FrequencyList(
        ids=np.arange(300), vocab_size=model.config.vocab_size, fingerprint=tokenizer_fingerprint(tokenizer)
    ).save(tmp_path / "short.json")
    with pytest.raises(ConfigurationError, match="ranks only 300 tokens"):
        head_plan(model, tokenizer, shortlist=350, file=str(short))


def test_no_packaged_list_for_an_unknown_vocabulary(tiny_model: tuple[Any, Any]) -> None:
    model, tokenizer = tiny_model
    with pytest.raises(ConfigurationError, match="no packaged frequency list fits"):
        head_plan(model, tokenizer, shortlist=256)


def test_the_server_backend_reports_the_shortlist(tiny_backend: Any, list_file: str) -> None:
    """A batch whose rows all ask for prune.head runs the shortlist; its stats carry the size and the audit."""
    from narrative_gravity.server.backends.base import ResolvedGravity
    from narrative_gravity.server.responses import cut_summary
    from narrative_gravity.server.scheduler import Job

    profile = _profile(list_file, 256, audit=1.0)
    tiny_backend.prepare(profile)
    gravity = ResolvedGravity(profile, "inline", "short")
    job = Job()
    for seed in (0, 1):
        job.add(
            prompt_ids=tiny_backend.encode_text("The planet"),
            options=GenerationOptions(max_new_tokens=8, top_k=0, seed=seed),
            gravity=gravity,
        )
    steps: list[list[int]] = []
    stats = tiny_backend.generate(job.rows, lambda tokens, *_: steps.append(list(tokens)))
    plan = profile_head_plan(tiny_backend.model, tiny_backend.tokenizer, profile)
    inside = set(plan.ids().tolist())
    assert all(t in inside for s in steps for t in s)
    assert all(s.shortlist["size"] == plan.size and s.shortlist["audited_steps"] == s.new_tokens for s in stats)
    assert cut_summary(stats[0].shortlist["cut_masses"])["audited_steps"] == stats[0].new_tokens
    assert tiny_backend.model.get_output_embeddings().__class__ is torch.nn.Linear


def test_a_frequency_list_ranks_what_the_model_samples(tiny_model: tuple[Any, Any], tmp_path: Any) -> None:
    from narrative_gravity.engines.shortlist_build import FrequencyRun, build_frequency_list

    model, tokenizer = tiny_model
    run = FrequencyRun(prompts=6, new_tokens=5, batch_size=4, keep=50, seed=2)
    seen: list[int] = []
    freq = build_frequency_list(model, tokenizer, model_name="tiny", run=run, progress=seen.append)
    assert seen == [4, 2] and freq.ids.size == 50 and len(set(freq.ids.tolist())) == 50
    assert freq.meta["prompts"] == 6 and freq.meta["sampled_tokens"] > 0
    assert (
        0 < freq.counts.sum() <= freq.meta["sampled_tokens"]
        and (freq.counts > 0).sum() <= freq.meta["distinct_sampled"]
    )
    assert freq.counts[0] > 0, "the best-ranked token is one the model sampled"
    again = build_frequency_list(model, tokenizer, model_name="tiny", run=run)
    assert np.array_equal(again.ids, freq.ids)  # seeded: the same list
    loaded = load_frequency_list(freq.save(tmp_path / "l.json.gz"))
    assert np.array_equal(loaded.ids, freq.ids)
