"""The eval package: metrics on hand-made texts, paired statistics, prompt sets, runs, failures and resume."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from narrative_gravity.cli.main import app
from narrative_gravity.errors import ConfigurationError
from narrative_gravity.eval import (
    METRICS,
    EvalModels,
    EvalSettings,
    MetricContext,
    ResultStore,
    Sample,
    compute_metrics,
    get_metric,
    paired_bootstrap,
    run_eval,
    split_wordlist,
    summary_line,
)
from narrative_gravity.eval.command import parse_seeds
from narrative_gravity.eval.judge import PerplexityJudge
from narrative_gravity.eval.prompts import limit_prompts, load_prompts, load_topics
from narrative_gravity.eval.report import build_summary, load_run
from narrative_gravity.eval.stats import NO_CLEAR, bootstrap_ci
from narrative_gravity.fields import NarrativeField, build_lexical_field

runner = CliRunner()
CHEAP = "topic_success,off_topic_rate,length,rep_2,distinct_2,latency_s,ttft_s,tokens_per_s,mean_kl,mean_strength"


def one(name: str, sample: Sample, ctx: MetricContext | None = None) -> float:
    return compute_metrics([sample], [name], ctx)[0][name]


# --------------------------------------------------------------------------------------------------
# metrics on hand-made texts


def test_topic_success_is_whole_word_and_case_insensitive():
    words = ("moon", "deep space")
    assert one("topic_success", Sample("p", "We saw the MOON.", score_words=words)) == 1.0
    assert one("topic_success", Sample("p", "a honeymoon in spacetime", score_words=words)) == 0.0
    assert one("topic_success", Sample("p", "into Deep  Space we go", score_words=words)) == 0.0
    assert one("topic_success", Sample("p", "into deep space we go", score_words=words)) == 1.0
    assert math.isnan(one("topic_success", Sample("p", "anything")))


def test_repetition_and_distinct_have_known_values():
    s = Sample("p", "a b a b a b", new_tokens=6)
    got = compute_metrics([s], ["rep_2", "rep_4", "distinct_1", "distinct_2", "distinct_3", "length"])[0]
    # bigrams ab ba ab ba ab: 2 unique of 5; 4-grams abab baba abab: 2 of 3; trigrams aba bab aba bab: 2 of 4
    assert got == pytest.approx(
        {"rep_2": 0.6, "rep_4": 1 / 3, "distinct_1": 2 / 6, "distinct_2": 0.4, "distinct_3": 0.5, "length": 6.0}
    )
    assert math.isnan(one("rep_4", Sample("p", "too short")))


def test_timing_and_trace_metrics_read_the_sample():
    s = Sample(
        "p",
        "x",
        new_tokens=40,
        seconds=2.0,
        latency=8.0,
        ttft=0.25,
        trace_means={"kl": 0.3, "strength": 1.5, "entropy": 2.0},
    )
    got = compute_metrics([s], ["tokens_per_s", "latency_s", "ttft_s", "mean_kl", "mean_strength", "mean_entropy"])[0]
    assert got == {
        "tokens_per_s": 20.0,
        "latency_s": 8.0,
        "ttft_s": 0.25,
        "mean_kl": 0.3,
        "mean_strength": 1.5,
        "mean_entropy": 2.0,
    }
    assert math.isnan(one("mean_kl", Sample("p", "x")))


def test_off_topic_rate_counts_negative_field_values():
    values = torch.zeros(10)
    values[5] = -1.0
    values[6] = 0.5
    field = NarrativeField(values=values)
    s = Sample("p", "t", token_ids=[5, 6, 7, 5], prompt_ids=[1, 2], field=field)
    assert one("off_topic_rate", s) == 0.5
    assert math.isnan(one("off_topic_rate", Sample("p", "t", token_ids=[1])))  # no field: undefined


def test_off_topic_rate_counts_tokens_inside_penalized_words(tiny_tokenizer):
    # A zero field: only the penalized-word spans count. Expected from the tokenizer's own offsets.
    text = "the crew watches the planet"
    enc = tiny_tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    start = text.index("crew")
    inside = [a < start + 4 and b > start for a, b in enc["offset_mapping"]]
    assert 0 < sum(inside) < len(inside)
    field = NarrativeField(values=torch.zeros(len(tiny_tokenizer)))
    s = Sample(
        "p",
        text,
        token_ids=enc["input_ids"],
        field=field,
        penalized=("crew",),
        tokenizer=tiny_tokenizer,
    )
    assert one("off_topic_rate", s) == pytest.approx(sum(inside) / len(inside))


def test_off_topic_rate_with_a_lexical_penalty(tiny_tokenizer):
    field = build_lexical_field(tiny_tokenizer, ["planet"], ["crew"])
    ids = tiny_tokenizer(" crew crew planet planet", add_special_tokens=False)["input_ids"]
    s = Sample(
        "p", " crew crew planet planet", token_ids=ids, field=field, penalized=("crew",), tokenizer=tiny_tokenizer
    )
    crew = len(tiny_tokenizer(" crew", add_special_tokens=False)["input_ids"])
    assert one("off_topic_rate", s) == pytest.approx(2 * crew / len(ids))


def test_topic_relevance_is_the_cosine_to_the_word_centroid():
    vecs = {"space": [1.0, 0.0], "orbit": [0.0, 1.0], "a text": [1.0, 0.0], "other": [0.0, -1.0]}

    def encoder(texts):
        return torch.nn.functional.normalize(torch.tensor([vecs[t] for t in texts]), dim=-1)

    ctx = MetricContext(encoder=encoder)
    words = ("space", "orbit")
    got = compute_metrics(
        [Sample("p", "a text", score_words=words), Sample("p", "other", score_words=words)], ["topic_relevance"], ctx
    )
    assert got[0]["topic_relevance"] == pytest.approx(1 / math.sqrt(2))
    assert got[1]["topic_relevance"] == pytest.approx(-1 / math.sqrt(2))
    assert math.isnan(one("topic_relevance", Sample("p", "a text"), ctx))  # no scoring words


def test_judge_perplexity_matches_a_plain_forward_pass(tiny_model):
    model, tok = tiny_model
    contexts = ["The planet", "A small moon drifts past", "The crew"]
    conts = [" moves along its orbit.", " the dark sky", " watches the galaxy core and the night."]
    longest = max(len(tok(x, add_special_tokens=False)["input_ids"]) for x in conts)
    judge = PerplexityJudge(model, tok, logits_budget=4 * len(tok) * (longest + 1) * 2)  # batches of two rows
    got = judge.perplexity(contexts, conts)
    for c, x, ppl in zip(contexts, conts, got):
        cids = tok(c, add_special_tokens=True)["input_ids"]
        xids = tok(x, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([cids + xids])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
        tgt = ids[0, 1:]
        nll = -logp.gather(-1, tgt[:, None]).squeeze(-1)[-len(xids) :].mean()
        assert ppl == pytest.approx(float(torch.exp(nll)), rel=1e-4)
    assert math.isnan(judge.perplexity(["x"], [""])[0])
    # per token: one NLL for every continuation token, the same forward pass, summing to the row's NLL
    per_token = judge.token_nll(contexts, conts)
    for c, x, row, (total, n) in zip(contexts, conts, per_token, judge.nll(contexts, conts), strict=True):
        cids = tok(c, add_special_tokens=True)["input_ids"]
        xids = tok(x, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([cids + xids])).logits[0, :-1].float(), -1)
        want = -logp.gather(-1, torch.tensor(cids + xids)[1:, None]).squeeze(-1)[-len(xids) :]
        assert row.shape == (len(xids),) == (n,)
        assert torch.allclose(row, want, atol=1e-4)
        assert float(row.sum()) == pytest.approx(total, rel=1e-6)
    assert judge.token_nll(["x"], [""])[0].numel() == 0


def test_judge_metric_uses_the_context_and_geomean(tiny_model):
    model, tok = tiny_model
    ctx = MetricContext(judge=PerplexityJudge(model, tok))
    s = Sample("The planet", " moves along its orbit.", judge_context="The planet")
    v = one("judge_ppl", s, ctx)
    assert v == pytest.approx(ctx.judge.perplexity(["The planet"], [" moves along its orbit."])[0])
    assert get_metric("judge_ppl").aggregation == "geomean" and get_metric("judge_ppl").higher_is_better is False


def test_unknown_metric_names_suggest_the_right_one():
    with pytest.raises(ConfigurationError, match="did you mean 'distinct_2'"):
        get_metric("distinct2")
    with pytest.raises(ConfigurationError, match="known metrics"):
        compute_metrics([Sample("p", "x")], ["zzz"])


def test_registry_declares_direction_and_aggregation_for_every_metric():
    required = {
        "topic_relevance", "topic_success", "off_topic_rate", "length", "rep_2", "distinct_1", "distinct_2",
        "distinct_3", "latency_s", "tokens_per_s", "ttft_s", "judge_ppl", "mean_kl", "mean_strength", "mean_entropy",
    }  # fmt: skip
    assert required <= set(METRICS)
    for m in METRICS.values():
        assert m.higher_is_better in (True, False, None) and m.aggregation in ("mean", "geomean") and m.description


# --------------------------------------------------------------------------------------------------
# paired statistics


def test_paired_bootstrap_finds_a_known_effect():
    rng = np.random.default_rng(1)
    control = rng.normal(0.0, 1.0, 200)  # large between-prompt spread ...
    treated = control + 0.3 + rng.normal(0.0, 0.2, 200)  # ... a small, consistent paired effect
    r = paired_bootstrap(control, treated, higher_is_better=True)
    assert r.low < 0.3 < r.high and r.low > 0 and r.verdict == "better" and r.n == 200
    assert paired_bootstrap(control, treated, higher_is_better=False).verdict == "worse"
    assert paired_bootstrap(control, treated, higher_is_better=None).verdict == "higher"
    _, lo, hi = bootstrap_ci(treated - control)
    assert lo == pytest.approx(r.low, abs=0.02) and hi == pytest.approx(r.high, abs=0.02)


def test_paired_bootstrap_calls_a_null_effect_no_clear_difference():
    rng = np.random.default_rng(2)
    control = rng.normal(5.0, 1.0, 150)
    treated = control + rng.normal(0.0, 0.5, 150)
    r = paired_bootstrap(control, treated, higher_is_better=True)
    assert r.low < 0 < r.high and r.verdict == NO_CLEAR


def test_paired_bootstrap_drops_incomplete_pairs_and_handles_geomean():
    r = paired_bootstrap(
        [10.0, float("nan"), 10.0, 10.0], [20.0, 5.0, 20.0, float("nan")], higher_is_better=False, how="geomean"
    )
    assert r.n == 2 and r.difference == pytest.approx(10.0) and r.verdict == "worse"
    assert paired_bootstrap([1.0], [2.0], higher_is_better=True).verdict == "too few pairs"


def test_summary_line_names_the_metrics_that_did_not_move():
    good = paired_bootstrap([0, 0, 0, 1.0], [1, 1, 1, 2.0], higher_is_better=True)
    flat = paired_bootstrap([0, 1, 0, 1.0], [1, 0, 1, 0.0], higher_is_better=True)
    info = paired_bootstrap([0, 0, 0, 0.0], [1, 1, 1, 1.0], higher_is_better=None)
    assert "every judged metric moved the right way" in summary_line("a", {"x": good, "kl": info})
    line = summary_line("a", {"x": good, "y": flat})
    assert "1 of 2" in line and "y (no clear difference)" in line


# --------------------------------------------------------------------------------------------------
# prompt sets


def test_split_wordlist_keeps_held_out_words_out_of_the_conditioning_half():
    cond, held = split_wordlist([" law", "court", "judge ", "", "Law", "jury", "verdict"])
    assert cond == ("law", "judge", "jury") and held == ("court", "verdict")  # "Law" repeats a conditioning word


def _bench(tmp_path: Path) -> Path:
    topics = tmp_path / "bench" / "topics"
    (topics / "wordlists").mkdir(parents=True)
    (topics / "prefixes.txt").write_text("In summary\n\nThis essay discusses")
    (topics / "wordlists" / "space.txt").write_text("planet\ngalaxy\norbit \nmoon\n")
    (topics / "wordlists" / "legal.txt").write_text("law\ncourt\n")
    return tmp_path / "bench"


def test_topics_prompt_set_from_the_bench_env(tmp_path, monkeypatch):
    monkeypatch.setenv("NARRATIVE_GRAVITY_BENCH", str(_bench(tmp_path)))
    ps = load_prompts("topics")
    assert [(p.topic_name, p.text) for p in ps] == [
        ("legal", "In summary"), ("legal", "This essay discusses"), ("space", "In summary"), ("space", "This essay discusses"),
    ]  # fmt: skip
    assert ps[2].topic_words == ("planet", "orbit") and ps[2].heldout_words == ("galaxy", "moon")
    assert [p.index for p in limit_prompts(ps, 2)] == [0, 2]  # one per topic


def test_tuning_split_never_touches_the_held_out_half(tmp_path, monkeypatch):
    bench = _bench(tmp_path)
    (bench / "topics" / "wordlists" / "legal.txt").write_text("law\ncourt\njudge\njury\nverdict\nappeal\n")
    monkeypatch.setenv("NARRATIVE_GRAVITY_BENCH", str(bench))
    full = {p.topic_name: p for p in load_prompts("topics")}
    tune = {p.topic_name: p for p in load_prompts("topics-tune")}
    assert full["legal"].topic_words == ("law", "judge", "verdict")
    assert tune["legal"].topic_words == ("law", "verdict") and tune["legal"].heldout_words == ("judge",)
    for name, p in tune.items():
        used = set(p.topic_words) | set(p.heldout_words)
        assert used <= set(full[name].topic_words) and not used & set(full[name].heldout_words)
    assert EvalSettings(prompts="topics-tune", profiles=("auto",)).raw_mode


def test_topics_prompt_set_missing_gives_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("NARRATIVE_GRAVITY_BENCH", str(tmp_path / "nowhere"))
    with pytest.raises(ConfigurationError, match="NARRATIVE_GRAVITY_BENCH"):
        load_prompts("topics")


def test_shipped_topics_set_never_conditions_on_a_held_out_word(monkeypatch):
    monkeypatch.delenv("NARRATIVE_GRAVITY_BENCH", raising=False)
    ps = load_topics()  # the PPLM/FUDGE data shipped with the package: no folder next to the checkout needed
    assert len(ps) == 140 and len({p.topic_name for p in ps}) == 7
    for p in ps:
        assert not {w.casefold() for w in p.heldout_words} & {w.casefold() for w in p.topic_words}


def test_shipped_topics_data_is_package_data_with_its_source_and_licence():
    from narrative_gravity.eval.topics import PACKAGED_TOPICS

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    root = Path(__file__).resolve().parents[1]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    package = root / "src" / "narrative_gravity"
    shipped = {p for g in globs["narrative_gravity"] for p in package.glob(g) if p.is_file()}
    files = {p for p in PACKAGED_TOPICS.rglob("*") if p.is_file()}
    assert len(files) == 10 and files <= shipped  # prefixes, 7 lists, README (source), LICENSE
    assert "MIT License" in (PACKAGED_TOPICS / "LICENSE").read_text()
    assert "naacl-2021-fudge-controlled-generation" in (PACKAGED_TOPICS / "README.md").read_text()


def test_jsonl_prompts_carry_topic_heldout_and_profile(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(
        json.dumps({"prompt": "A", "topic": ["orbit", " moon "], "heldout": ["galaxy"], "topic_name": "space"})
        + "\n\n"
        + json.dumps({"prompt": "B", "profile": "space"})
        + "\n"
    )
    a, b = load_prompts(f)
    assert a.topic_words == ("orbit", "moon") and a.score_words() == ("galaxy",) and a.topic_name == "space"
    assert b.profile == "space" and b.index == 1
    f.write_text(json.dumps({"prompt": "A", "topic": "orbit"}) + "\n")
    with pytest.raises(ConfigurationError, match="list of strings"):
        load_prompts(f)
    f.write_text(json.dumps({"prompt": "A", "topics": ["x"]}) + "\n")
    with pytest.raises(ConfigurationError, match="unknown keys"):
        load_prompts(f)


def test_parse_seeds():
    assert parse_seeds("3, 5-6", None) == (3, 5, 6)
    for bad in ("a", "4-2", "-1", "1,1"):
        with pytest.raises(ConfigurationError):
            parse_seeds(bad, None)
    with pytest.raises(ConfigurationError, match="disagrees"):
        parse_seeds("0,1", 3)


# --------------------------------------------------------------------------------------------------
# runs on the tiny model (no download)


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.fixture
def space_profile(tmp_path) -> Path:
    return _write(
        tmp_path / "space.yaml",
        "name: space\ncore_semantics: [planet, orbit, galaxy]\npenalize: [crew]\ngravity_strength: 3.0\n",
    )


def _settings(prompts: Path, profiles: list[Path | str], **kw) -> EvalSettings:
    base = {
        "seeds": (0, 1),
        "max_new_tokens": 6,
        "batch_size": 2,
        "raw": True,
        "judge": "none",
        "metrics": tuple(CHEAP.split(",")),
    }
    base.update(kw)
    return EvalSettings(prompts=str(prompts), profiles=tuple(str(p) for p in profiles), **base)


def test_run_eval_pairs_control_with_every_profile_and_skips_a_profile_that_does_not_fit(
    tiny_model, tmp_path, space_profile
):
    model, tok = tiny_model
    # every word of this profile needs more tokens than max_pieces allows: its field cannot be built
    bad = _write(
        tmp_path / "bad.yaml", "name: bad\ncore_semantics: [zqxjvkw]\nschedule: constant\nfield: {max_pieces: 1}\n"
    )
    prompts = _write(tmp_path / "p.txt", "The planet\nThe crew\nOur galaxy\n")
    out = tmp_path / "run"
    run_eval(
        _settings(prompts, [space_profile, bad]), out, models=EvalModels(model, tok), progress=False, write_report=False
    )
    rows, manifest, failures = load_run(out)
    summary, _ = build_summary(rows, manifest, failures)
    keys = [(r["profile"], r["prompt_index"], r["seed"]) for r in rows]
    assert len(keys) == len(set(keys)) == 2 * 3 * 2  # control and space; bad was skipped
    assert {k[0] for k in keys} == {"control", "space"}
    assert {(f["profile"], f["prompt_index"], f["seed"]) for f in failures} == {
        ("bad", i, s) for i in range(3) for s in (0, 1)
    }
    assert "FieldError" in failures[0]["error"]
    assert len(summary["failures"]) == 6 and summary["rows"] == 12
    by = {(r["profile"], r["prompt_index"], r["seed"]): r for r in rows}
    for i in range(3):
        for s in (0, 1):
            c, g = by[("control", i, s)], by[("space", i, s)]
            assert set(c["metrics_vs"]) == {"space", "bad"}
            assert c["metrics"]["mean_strength"] == 0.0 and g["metrics"]["mean_strength"] > 0
            assert len(c["trace"]["entropy"]) == c["new_tokens"]
    assert summary["comparisons"]["space"]["pairs"] == 6
    assert summary["comparisons"]["space"]["metrics"]["mean_kl"]["verdict"] == "higher"


def test_auto_profiles_and_jsonl_profile_names(tiny_model, tmp_path, space_profile):
    model, tok = tiny_model
    f = tmp_path / "p.jsonl"
    f.write_text(
        json.dumps({"prompt": "The crew", "topic": ["planet", "orbit"], "heldout": ["galaxy"], "topic_name": "space"})
        + "\n"
        + json.dumps({"prompt": "A small moon", "topic": ["telescope"], "heldout": ["star"], "topic_name": "sky"})
        + "\n"
    )
    out = tmp_path / "auto"
    run_eval(_settings(f, ["auto"], seeds=(0,)), out, models=EvalModels(model, tok), progress=False, write_report=False)
    rows = {(r["profile"], r["prompt_index"]): r for r in ResultStore(out / "results.jsonl").load()}
    assert rows[("auto", 0)]["profile_used"] == "space" and rows[("auto", 1)]["profile_used"] == "sky"
    manifest = json.loads((out / "run.json").read_text())
    assert manifest["profiles"]["auto"]["per_topic"]["space"]["core_semantics"] == ["planet", "orbit"]
    assert "galaxy" not in json.dumps(manifest["profiles"])  # held-out words never reach a profile

    f.write_text(json.dumps({"prompt": "x", "profile": "spaec"}) + "\n")
    with pytest.raises(ConfigurationError, match="did you mean 'space'"):
        run_eval(_settings(f, [space_profile]), tmp_path / "x", models=EvalModels(model, tok), progress=False)


def test_the_topic_profile_file_holds_the_auto_defaults():
    from pathlib import Path

    from narrative_gravity.eval.settings import AUTO_DEFAULTS
    from narrative_gravity.profiles.schema import Profile, load_profile

    path = Path(__file__).resolve().parents[1] / "profiles" / "topic.yaml"
    if not path.exists():
        pytest.skip("profiles/topic.yaml is not in this checkout")
    stored = load_profile(path)
    auto = Profile.from_mapping({**AUTO_DEFAULTS, "core_semantics": stored.core_semantics, "name": stored.name})
    assert stored.model_dump() == auto.model_dump()


def test_reference_baselines_and_template_arms_run_in_one_eval(tiny_model, tmp_path):
    model, tok = tiny_model
    f = _write(
        tmp_path / "p.jsonl",
        json.dumps({"prompt": "The crew", "topic": ["planet", "orbit"], "heldout": ["galaxy"], "topic_name": "space"})
        + "\n",
    )
    template = _write(tmp_path / "strong.yaml", "name: strong\ncore_semantics: [x]\nschedule: constant\n"
                      "gravity_strength: 9.0\n")  # fmt: skip
    out = tmp_path / "arms"
    specs = ["article", "weighted:4", f"auto:{template}", "auto"]
    run_eval(_settings(f, specs, seeds=(0,)), out, models=EvalModels(model, tok), progress=False, write_report=False)
    rows = {r["profile"]: r for r in ResultStore(out / "results.jsonl").load()}
    assert set(rows) == {"control", "article", "weighted-4", "strong", "auto"}
    manifest = json.loads((out / "run.json").read_text())
    strong = manifest["profiles"]["strong"]["per_topic"]["space"]
    assert strong["gravity_strength"] == 9.0 and strong["core_semantics"] == ["planet", "orbit"]
    auto = manifest["profiles"]["auto"]["per_topic"]["space"]
    assert auto["schedule"] == "thermostat" and auto["field"]["mode"] == "semantic"
    assert auto["field"]["repeat_weight"] == 0.0 and auto["thermostat"]["max_strength"] == 4.25
    assert rows["strong"]["metrics"]["mean_strength"] == 9.0
    assert rows["weighted-4"]["trace"] is None and rows["article"]["trace"] is None
    for bad in ("weighted:x", "weighted:-1"):
        with pytest.raises(ConfigurationError, match="needs a number >= 0 after the colon"):
            run_eval(_settings(f, [bad]), tmp_path / "bad", models=EvalModels(model, tok), progress=False)


def test_run_refuses_to_mix_runs(tiny_model, tmp_path, space_profile):
    model, tok = tiny_model
    prompts = _write(tmp_path / "p.txt", "The planet\n")
    out = tmp_path / "run"
    s = _settings(prompts, [space_profile], seeds=(0,))
    run_eval(s, out, models=EvalModels(model, tok), progress=False, write_report=False)
    with pytest.raises(ConfigurationError, match="--resume"):
        run_eval(s, out, models=EvalModels(model, tok), progress=False)
    other = _settings(prompts, [space_profile], seeds=(0,), max_new_tokens=7)
    with pytest.raises(ConfigurationError, match="max_new_tokens"):
        run_eval(other, out, resume=True, models=EvalModels(model, tok), progress=False)
    with pytest.raises(ConfigurationError, match="device: was 'cpu', now 'auto'"):
        run_eval(replace(s, device="auto"), out, resume=True, models=EvalModels(model, tok), progress=False)
    # a run made before --device (no device in its manifest) resumes on the CPU
    manifest = json.loads((out / "run.json").read_text())
    del manifest["settings"]["device"]
    (out / "run.json").write_text(json.dumps(manifest))
    run_eval(s, out, resume=True, models=EvalModels(model, tok), progress=False, write_report=False)


def test_result_store_drops_a_torn_last_line(tmp_path):
    store = ResultStore(tmp_path / "r.jsonl")
    store.append([{"profile": "control", "prompt_index": 0, "seed": 0}])
    with store.path.open("a") as fh:
        fh.write('{"profile": "control", "prompt_in')
    assert len(store.load(repair=True)) == 1
    store.append([{"profile": "control", "prompt_index": 1, "seed": 0}])
    assert [r["prompt_index"] for r in store.load()] == [0, 1]


def test_cli_eval_help_and_errors(tmp_path, space_profile):
    res = runner.invoke(app, ["eval", "--help"])
    assert res.exit_code == 0 and "--resume" in res.output and "auto" in res.output
    p = _write(tmp_path / "p.txt", "hi\n")
    res = runner.invoke(
        app,
        [
            "eval",
            "--prompts",
            str(p),
            "--profile",
            str(space_profile),
            "--metrics",
            "topic_sucess",
            "--out",
            str(tmp_path / "o"),
        ],
    )
    assert res.exit_code == 2 and "did you mean 'topic_success'" in res.output
    res = runner.invoke(app, ["eval", "--prompts", str(p), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "--profile" in res.output


def test_cli_run_killed_with_sigkill_resumes_every_generation_exactly_once(tiny_model, tmp_path, space_profile):
    model, tok = tiny_model
    model_dir = tmp_path / "tiny"
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    n_prompts, seeds = 8, (0, 1)
    prompts = _write(tmp_path / "p.txt", "".join(f"The planet {i}\n" for i in range(n_prompts)))
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "narrative_gravity.cli.main", "eval", "--prompts", str(prompts), "--profile", str(space_profile),
        "--model", str(model_dir), "--raw", "--seeds", "0,1", "--max-new-tokens", "6", "--batch-size", "2",
        "--judge", "none", "--metrics", CHEAP, "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    results = out / "results.jsonl"
    log = tmp_path / "first.log"
    killed = False
    with log.open("w") as err, subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err) as proc:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            if results.exists() and results.read_text().count("\n") >= 6:
                proc.send_signal(signal.SIGKILL)
                killed = True
                break
            time.sleep(0.02)
        proc.wait(timeout=60)
    assert killed, f"the run ended before it could be killed (rc={proc.returncode}): {log.read_text()[-2000:]}"
    before = results.read_bytes()
    n_before = before.count(b"\n")
    assert 6 <= n_before < 2 * n_prompts * len(seeds)

    res = subprocess.run([*cmd, "--resume"], env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    after = results.read_bytes()
    assert after.startswith(before[: before.rfind(b"\n") + 1])  # finished rows were kept, not redone
    keys = [(r["profile"], r["prompt_index"], r["seed"]) for r in map(json.loads, after.decode().splitlines())]
    expected = {(arm, i, s) for arm in ("control", "space") for i in range(n_prompts) for s in seeds}
    assert len(keys) == len(set(keys)) and set(keys) == expected
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rows"] == summary["expected_rows"] == len(expected)
    assert f"{len(expected) - n_before} to go" in res.stderr.replace("\n", " ")


# --------------------------------------------------------------------------------------------------
# real models (slow)


@pytest.mark.slow
def test_minilm_relevance_prefers_the_topic():
    from narrative_gravity.embeddings import load_minilm

    enc = load_minilm()
    v = enc(["The rocket reached orbit around the planet.", "The court ruled on the contract dispute."])
    assert v.shape == (2, 384) and torch.allclose(v.norm(dim=-1), torch.ones(2), atol=1e-5)
    ctx = MetricContext(encoder=enc)
    words = ("planet", "galaxy", "orbit", "astronaut")
    got = compute_metrics(
        [
            Sample("p", "The rocket reached orbit around the planet.", score_words=words),
            Sample("p", "The court ruled on the contract dispute.", score_words=words),
        ],
        ["topic_relevance"],
        ctx,
    )
    assert got[0]["topic_relevance"] > got[1]["topic_relevance"] + 0.2


@pytest.mark.slow
def test_gemma_judge_finds_fluent_text_more_likely():
    from narrative_gravity.eval.judge import load_judge

    judge = load_judge("gemma3-270m")
    fluent, shuffled = judge.perplexity(
        ["In summary", "In summary"],
        [
            ", the planets orbit the sun in nearly circular paths.",
            " sun circular the, planets paths nearly orbit in the.",
        ],
    )
    assert 1.0 < fluent < shuffled
