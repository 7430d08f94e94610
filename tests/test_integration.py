"""Integration tests on the real default model (SmolLM2-135M-Instruct). Slow: they run a real transformer."""

from __future__ import annotations

import json

import pytest
import torch

from narrative_gravity.compare import compare_runs, summarize
from narrative_gravity.engines.hf import processor_from_profile
from narrative_gravity.engines.hf_generate import generate
from narrative_gravity.engines.options import GenerationOptions
from narrative_gravity.gravity.thermo import Trace
from narrative_gravity.models import load_model, resolve_cache_dir
from narrative_gravity.profiles.build import field_from_profile
from narrative_gravity.profiles.schema import Profile, load_profile

pytestmark = pytest.mark.slow

PROFILE_PATH = "profiles/binary_search.json"
PROMPT = "Write a binary search in Java and explain its time complexity."


@pytest.fixture(scope="module")
def smollm2():
    return load_model()


@pytest.fixture(scope="module")
def profile() -> Profile:
    return load_profile(PROFILE_PATH)


def test_default_model_is_cached_as_safetensors(smollm2):
    model, tok = smollm2
    assert type(model).__name__ == "LlamaForCausalLM"
    assert len(tok) == model.config.vocab_size == 49152
    assert tok.padding_side == "left"
    cached = list((resolve_cache_dir() / "models").glob("*/model.safetensors"))
    assert cached, "the de-quantized copy was not written to the cache"


def test_greedy_results_do_not_depend_on_batch_size(smollm2, profile):
    model, tok = smollm2
    prompts = ["Explain recursion.", "Binary search needs a sorted array because", "Name three sorting algorithms."]
    opts = GenerationOptions(max_new_tokens=24, temperature=0)

    def factory(budget, trace):
        return processor_from_profile(profile, tok, max_new_tokens=budget, trace=trace)

    one = generate(model, tok, prompts, opts.replace(batch_size=1), processor_factory=factory)
    three = generate(model, tok, prompts, opts.replace(batch_size=3), processor_factory=factory)
    assert [r.text for r in one] == [r.text for r in three]
    assert all(r.new_tokens > 0 for r in three)


def test_measure_only_control_is_plain_decoding(smollm2, profile):
    model, tok = smollm2
    opts = GenerationOptions(max_new_tokens=20, temperature=1.0, top_k=10, seed=3)
    plain = generate(model, tok, [PROMPT], opts)
    measured = generate(
        model,
        tok,
        [PROMPT],
        opts.replace(trace=True),
        processor_factory=lambda b, t: processor_from_profile(
            profile, tok, max_new_tokens=b, trace=t, measure_only=True
        ),
    )
    assert plain[0].token_ids == measured[0].token_ids
    assert measured[0].trace_means["kl"] == pytest.approx(0.0, abs=1e-6)
    assert measured[0].trace_means["entropy"] > 0


def test_gravity_raises_the_narrative_token_rate(smollm2, profile):
    # the pull alone: the classic constant lexical pull and no topic sentence (the chat default's sentence turns
    # the text by prompt and holds the pull to 0.05 nats a step, so this rate is not its measure)
    model, tok = smollm2
    pull = Profile.from_mapping(
        {**profile.model_dump(exclude={"field", "thermostat", "lead"}), "schedule": "constant", "lead": False}
    )
    rows = compare_runs(model, tok, pull, PROMPT, GenerationOptions(max_new_tokens=32), seeds=3)
    summary = summarize(rows)
    diff = summary["narrative_rate"]["difference"][0]
    assert diff > 0, summary["narrative_rate"]
    assert summary["kl"]["gravity"][0] > 0
    assert summary["penalized_hits"]["gravity"][0] == 0


def test_penalized_word_is_pushed_away(smollm2):
    model, tok = smollm2
    prompt = "My favourite evening out is dinner at a"
    prof = Profile(core_semantics=["park"], penalize=["restaurant"], gravity_strength=6.0, schedule="constant")
    opts = GenerationOptions(max_new_tokens=12, temperature=0, raw=True)
    plain = generate(model, tok, [prompt], opts)[0]
    pulled = generate(
        model, tok, [prompt], opts,
        processor_factory=lambda b, t: processor_from_profile(prof, tok, max_new_tokens=b, trace=t),
    )[0]  # fmt: skip
    assert "restaurant" in plain.text.lower()
    assert "restaurant" not in pulled.text.lower()


def test_trace_records_every_step(smollm2, profile):
    model, tok = smollm2
    profile = Profile.from_mapping({**profile.model_dump(exclude={"field", "thermostat"}), "schedule": "phases"})
    trace = Trace()
    proc = processor_from_profile(profile, tok, max_new_tokens=16, trace=trace)
    ids = tok(PROMPT, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=16, min_new_tokens=16, do_sample=False, logits_processor=[proc])
    assert out.shape[1] - ids["input_ids"].shape[1] == 16
    data = trace.to_numpy()
    assert data["strength"].shape == (1, 16)
    assert (data["kl"] >= 0).all()
    # explore phase (first 20% of the budget) pulls at half the profile strength
    assert data["strength"][0, 0] == pytest.approx(profile.gravity_strength * 0.5)
    field = field_from_profile(profile, tok)
    assert (data["mass_after"] >= data["mass"] - 1e-6).all(), "a positive pull must not lower the narrative mass"
    assert field.report.n_used >= 4


def test_cli_generate_writes_jsonl(smollm2, tmp_path):
    from typer.testing import CliRunner

    from narrative_gravity.cli.main import app

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Explain binary search."}) + "\n" + json.dumps({"prompt": "Hi"}) + "\n")
    out = tmp_path / "out.jsonl"
    args = ["generate", "--prompts", str(prompts), "--profile", PROFILE_PATH, "--max-new-tokens", "8",
            "--temperature", "0", "--batch-size", "2", "--trace", "--output", str(out), "--device", "auto"]  # fmt: skip
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["Explain binary search.", "Hi"]
    for r in rows:
        assert {"prompt", "text", "new_tokens", "seconds", "thermo"} <= set(r)
        assert 0 < r["new_tokens"] <= 8 and r["seconds"] > 0 and r["gravity"] is True


def test_cli_compare_prints_table_and_plot(smollm2, tmp_path):
    from typer.testing import CliRunner

    from narrative_gravity.cli.main import app

    plot, js = tmp_path / "t.png", tmp_path / "c.json"
    args = ["compare", "--profile", PROFILE_PATH, "--prompt", PROMPT, "--samples", "2", "--max-new-tokens", "12",
            "--plot", str(plot), "--output", str(js), "--held-out", "sorted,index", "--description", "code that searches"]  # fmt: skip
    res = CliRunner().invoke(app, args, env={"COLUMNS": "160"})
    assert res.exit_code == 0, res.output
    head = res.output.index("held-out words (independent of the pull): control")
    assert "paired difference" in res.output[head:].splitlines()[0]
    assert head < res.output.index("prompt: ")  # the independent measure leads, before the texts
    for label in ("narrative-token rate", "penalized-word hits", "distinct-2", "mean entropy", "mean KL", "tokens/s"):
        assert label in res.output
    bad_args = ["compare", "--profile", PROFILE_PATH, "--prompt", PROMPT, "--samples", "1", "--held-out", "array"]
    bad = CliRunner().invoke(app, bad_args, env={"COLUMNS": "160"})
    assert bad.exit_code != 0 and "held-out word 'array'" in bad.output  # the profile names it
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    payload = json.loads(js.read_text())
    assert len(payload["runs"]) == 2 and set(payload["summary"]) >= {"narrative_rate", "kl", "held_out_words"}
