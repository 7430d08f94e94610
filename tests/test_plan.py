"""Plan-level pruning: outline parsing and scoring, stages, and the staged logits processor (tiny model)."""

from __future__ import annotations

import pytest
import torch

import narrative_gravity.levels.write as write_mod
from narrative_gravity.engines.hf import NarrativeGravityLogitsProcessor
from narrative_gravity.errors import ConfigurationError
from narrative_gravity.fields import NarrativeField
from narrative_gravity.fields.lexical import surface_forms
from narrative_gravity.gravity.kernel import Program
from narrative_gravity.gravity.stages import StagePlan
from narrative_gravity.levels.plan import Outline, parse_outline, score_outlines, select_outlines, stages_from_outline
from narrative_gravity.levels.ranking import hashing_encoder
from narrative_gravity.levels.write import PLAN_OPTIONS, PlanSettings, plan_then_write, staged_processor
from narrative_gravity.profiles.build import parse_stages

ENC = hashing_encoder(256)


@pytest.fixture(autouse=True)
def _private_cache(request, monkeypatch, tmp_path_factory):
    """plan_then_write builds a semantic field by default: the tiny model's stay out of the user's cache (the
    real model's tests keep it, with the converted model in it)."""
    if request.node.get_closest_marker("slow") is None:
        monkeypatch.setenv("NARRATIVE_GRAVITY_CACHE", str(tmp_path_factory.getbasetemp() / "ngcache"))


# --------------------------------------------------------------------------------------------------
# outlines


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1. Lenses\n2) Mirrors\n3. Space", ["Lenses", "Mirrors", "Space"]),
        ("Plan:\n- Lenses\n* Mirrors\n• Space", ["Lenses", "Mirrors", "Space"]),
        ("Lenses\n\nMirrors", ["Lenses", "Mirrors"]),
        ("1. **Lenses**:\n2. Mirrors\n3. Space\n4. Extra", ["Lenses", "Mirrors", "Space"]),
    ],
)
def test_parse_outline(text, expected):
    assert parse_outline(text, 3) == expected


def test_on_topic_outline_scores_higher_than_an_off_topic_one():
    prompt = "Write about the planet orbit and the telescope."
    good = "1. planet orbit around the sun\n2. telescope lens and mirror\n3. planet seen through the telescope"
    bad = "1. bake a cake\n2. whisk the eggs\n3. serve with cream"
    a, b = score_outlines(prompt, [good, bad], encoder=ENC)
    assert a.fit > b.fit
    assert a.score > b.score
    assert a.completeness == b.completeness == 1.0


def test_duplicate_sections_are_penalized():
    prompt = "planet orbit telescope"
    dup = "1. planet orbit\n2. planet orbit\n3. planet orbit"
    varied = "1. planet orbit\n2. telescope orbit\n3. planet telescope"
    d, v = score_outlines(prompt, [dup, varied], encoder=ENC)
    assert d.duplicates == 1.0 and v.duplicates == 0.0
    assert v.score > d.score


def test_incomplete_outline_loses_score_and_drafts_report_distinctness():
    prompt = "planet orbit"
    full = "1. planet orbit\n2. orbit speed\n3. planet size"
    short = "1. planet orbit"
    f, s = score_outlines(prompt, [full, short], encoder=ENC)
    assert s.completeness == pytest.approx(1 / 3)
    assert f.score > s.score
    assert 0.0 <= f.distinct <= 2.0


def test_select_outlines_keeps_the_best_then_a_different_one():
    mk = lambda secs, score: Outline("\n".join(secs), secs, 0, 0, 0, 1, 0, score)  # noqa: E731
    a = mk(["planet orbit"], 0.9)
    a2 = mk(["planet orbit"], 0.85)
    b = mk(["telescope mirror"], 0.8)
    assert select_outlines([b, a, a2], 1) == [a]
    assert select_outlines([b, a, a2], 2, encoder=ENC) == [a, b]
    with pytest.raises(ConfigurationError):
        select_outlines([a], 0)


def test_stages_from_outline_drop_boilerplate_and_add_extra_words():
    stages = stages_from_outline(
        ["Introduction: the planet orbit", "Main telescope mirrors", "Conclusion"], extra_words=["space"]
    )
    assert [s.core_semantics for s in stages] == [
        ["planet", "orbit", "space"],
        ["telescope", "mirrors", "space"],
        ["space"],
    ]
    assert sum(s.share for s in stages) == pytest.approx(1.0)
    with pytest.raises(ConfigurationError, match="content word"):
        stages_from_outline(["Introduction", "Conclusion"])


# --------------------------------------------------------------------------------------------------
# stages by hand


def test_parse_stages_fills_missing_shares():
    st = parse_stages([{"core_semantics": ["a"], "share": 0.5}, {"core_semantics": ["b"]}, {"core_semantics": ["c"]}])
    assert [s.share for s in st] == [0.5, 0.25, 0.25]
    assert [s.name for s in st] == ["stage 1", "stage 2", "stage 3"]


@pytest.mark.parametrize(
    ("stages", "message"),
    [
        ([], "non-empty list"),
        ([{"core_semantics": []}], "core_semantics"),
        ([{"core_semantics": "planet"}], "core_semantics"),
        ([{"core_semantics": ["a"], "share": 0}], "share"),
        ([{"core_semantics": ["a"], "share": 0.7}, {"core_semantics": ["b"], "share": 0.6}], "more than 1"),
        ([{"core_semantics": ["a"], "share": 1.0}, {"core_semantics": ["b"]}], "leave nothing"),
        ([{"core_semantics": ["a"], "shares": 0.5}], "unknown keys"),
    ],
)
def test_parse_stages_errors(stages, message):
    with pytest.raises(ConfigurationError, match=message):
        parse_stages(stages)


# --------------------------------------------------------------------------------------------------
# the staged processor


def _tok_id(tok, word):
    return next(f[0] for f in surface_forms(tok, word) if len(f) == 1)


def _proc(tok, shares=(0.5, 0.5), max_new_tokens=8, **kw):
    stages = [
        {"name": "p", "core_semantics": ["planet"], "share": shares[0]},
        {"name": "g", "core_semantics": ["galaxy"], "share": shares[1]},
    ]
    return staged_processor(tok, stages, max_new_tokens=max_new_tokens, strength=2.0, **kw)


def test_stage_advances_when_its_words_are_written(tiny_tokenizer):
    tok = tiny_tokenizer
    proc = _proc(tok, max_new_tokens=100)
    planet, galaxy = _tok_id(tok, "planet"), _tok_id(tok, "galaxy")
    v = len(tok)
    prompt = torch.tensor([[5, 6, 7]])
    out = proc(prompt, torch.zeros(1, v))
    assert proc.stage.tolist() == [0]
    assert out[0, planet] == 2.0 and out[0, galaxy] == 0.0
    out = proc(torch.cat([prompt, torch.tensor([[planet]])], dim=1), torch.zeros(1, v))
    assert proc.stage.tolist() == [1]
    assert out[0, galaxy] == 2.0 and out[0, planet] == 0.0
    # the last stage stays
    out = proc(torch.tensor([[5, 6, 7, planet, galaxy]]), torch.zeros(1, v))
    assert proc.stage.tolist() == [1]


def test_stage_advances_when_its_share_is_spent(tiny_tokenizer):
    tok = tiny_tokenizer
    proc = _proc(tok, shares=(0.25, 0.75), max_new_tokens=8)  # stage 0 ends after 2 tokens
    v = len(tok)
    ids = torch.tensor([[5, 6, 7]])
    stages = []
    for _ in range(4):
        proc(ids, torch.zeros(1, v))
        stages.append(proc.stage.item())
        ids = torch.cat([ids, torch.tensor([[9]])], dim=1)
    assert stages == [0, 0, 1, 1]


def test_rows_move_independently_and_scores_are_not_modified(tiny_tokenizer):
    tok = tiny_tokenizer
    proc = _proc(tok, max_new_tokens=100)
    planet = _tok_id(tok, "planet")
    v = len(tok)
    prompt = torch.tensor([[5, 6], [5, 6]])
    proc(prompt, torch.zeros(2, v))
    scores = torch.randn(2, v)
    before = scores.clone()
    proc(torch.cat([prompt, torch.tensor([[planet], [9]])], dim=1), scores)
    assert proc.stage.tolist() == [1, 0]
    assert torch.equal(scores, before)


def test_new_generation_resets_the_stages(tiny_tokenizer):
    tok = tiny_tokenizer
    proc = _proc(tok, max_new_tokens=100)
    planet = _tok_id(tok, "planet")
    v = len(tok)
    proc(torch.tensor([[5]]), torch.zeros(1, v))
    proc(torch.tensor([[5, planet]]), torch.zeros(1, v))
    assert proc.stage.tolist() == [1]
    proc(torch.tensor([[1, 2, 3, 4, 5, 6]]), torch.zeros(1, v))  # not one longer: a new generation
    assert proc.stage.tolist() == [0]


def test_the_pull_goes_through_apply_gravity(tiny_tokenizer, monkeypatch):
    calls = []
    import narrative_gravity.gravity.kernel as kernel_mod

    real = kernel_mod.apply_gravity

    def spy(logits, field, strength, mask=None, support=None, **kwargs):
        calls.append(field.shape)
        return real(logits, field, strength, mask, support, **kwargs)

    monkeypatch.setattr(kernel_mod, "apply_gravity", spy)
    proc = _proc(tiny_tokenizer)
    proc(torch.tensor([[5, 6], [7, 8]]), torch.zeros(2, len(tiny_tokenizer)))
    assert len(calls) == 1 and calls[0][0] == 2  # one call for the batch (the field on its support)


def test_a_base_field_stays_under_every_stage(tiny_tokenizer):
    tok = tiny_tokenizer
    v = len(tok)
    planet, galaxy = _tok_id(tok, "planet"), _tok_id(tok, "galaxy")
    base_values = torch.zeros(v)
    base_values[9], base_values[galaxy] = 0.8, 0.4  # 9: a base-only token
    base_values[10] = -1.0  # a penalty in the base is not kept (only the stage's own penalties win)
    proc = _proc(tok, max_new_tokens=100, base=NarrativeField(values=base_values), base_weight=0.5)
    prompt = torch.tensor([[5, 6, 7]])
    out = proc(prompt, torch.zeros(1, v))
    # stage 0: planet from the stage, token 9 and galaxy from the base at half weight
    assert out[0, planet] == 2.0 and out[0, 9] == pytest.approx(0.8) and out[0, galaxy] == pytest.approx(0.4)
    assert out[0, 10] == 0.0
    out = proc(torch.cat([prompt, torch.tensor([[planet]])], dim=1), torch.zeros(1, v))
    # stage 1: galaxy is the stage's own word now; the base still pulls token 9
    assert out[0, galaxy] == 2.0 and out[0, 9] == pytest.approx(0.8) and out[0, planet] == 0.0


def test_repeat_weight_moves_the_pull_off_written_stage_words(tiny_tokenizer):
    tok = tiny_tokenizer
    v = len(tok)
    stages = [{"core_semantics": ["planet", "orbit"]}]
    planet, orbit = _tok_id(tok, "planet"), _tok_id(tok, "orbit")
    prompt = torch.tensor([[planet, 6], [5, 6]])  # row 0 has the word in its prompt: that does not count
    for weight, expected in ((1.0, 2.0), (0.25, 0.5), (0.0, 0.0)):
        proc = staged_processor(tok, stages, max_new_tokens=100, strength=2.0, cover_fraction=1.0, repeat_weight=weight)
        out = proc(prompt, torch.zeros(2, v))
        assert out[:, planet].tolist() == [2.0, 2.0]
        out = proc(torch.cat([prompt, torch.tensor([[9], [planet]])], dim=1), torch.zeros(2, v))
        assert out[0, planet] == 2.0 and out[1, planet] == expected  # only the row that wrote it
        assert out[:, orbit].tolist() == [2.0, 2.0]  # the stage's other word keeps its pull
    with pytest.raises(ConfigurationError, match="repeat_weight"):
        staged_processor(tok, stages, max_new_tokens=4, repeat_weight=1.5)


def test_multi_token_words_continue_per_stage(tiny_tokenizer):
    tok = tiny_tokenizer
    proc = staged_processor(
        tok, [{"core_semantics": ["telescope"]}, {"core_semantics": ["galaxy"]}], max_new_tokens=100, strength=1.0
    )
    first, second = surface_forms(tok, "telescope")[0][:2]
    v = len(tok)
    proc(torch.tensor([[5]]), torch.zeros(1, v))
    out = proc(torch.tensor([[5, first]]), torch.zeros(1, v))
    assert out[0, second] == 1.0  # the continuation of stage 0's word


def test_processor_validation(tiny_tokenizer):
    f = NarrativeField(values=torch.zeros(4))
    with pytest.raises(ConfigurationError, match="shares"):
        StagePlan((f, f), (0.5,))
    with pytest.raises(ConfigurationError, match="fields"):
        StagePlan((), ())
    with pytest.raises(ConfigurationError, match="max_new_tokens"):
        NarrativeGravityLogitsProcessor(Program(stages=StagePlan((f,), (1.0,))), max_new_tokens=0)
    with pytest.raises(ConfigurationError, match="max_new_tokens"):
        NarrativeGravityLogitsProcessor(Program(stages=StagePlan((f,), (1.0,))))
    with pytest.raises(ConfigurationError, match="cover_fraction"):
        StagePlan((f,), (1.0,), cover_fraction=0)


# --------------------------------------------------------------------------------------------------
# end to end on the tiny random model


def test_plan_then_write_on_a_tiny_model(tiny_model):
    model, tok = tiny_model
    res = plan_then_write(
        model,
        tok,
        "the planet and its orbit",
        encoder=ENC,
        stages=None,
        settings=PlanSettings(n_drafts=3, outline_tokens=12, include_outline=False),
        options=PLAN_OPTIONS.replace(max_new_tokens=10),
    )
    assert len(res.outlines) == 3
    assert res.outline is not None and res.outline.score == max(o.score for o in res.outlines)
    assert 0 < res.draft_tokens <= 3 * 12
    assert 0 < res.write_tokens <= 10
    assert res.generated_tokens == res.draft_tokens + res.write_tokens
    assert res.stages and abs(sum(s.share for s in res.stages) - 1) < 1e-6
    assert res.write_prompt == "the planet and its orbit"
    # the prompt's own words join every stage
    assert all({"planet", "orbit"} <= set(s.core_semantics) for s in res.stages)


def test_plan_then_write_pulls_with_the_topic_default_unless_told_otherwise(tiny_model, monkeypatch):
    from narrative_gravity.gravity.controllers import ConstantController, ThermostatController
    from narrative_gravity.profiles.schema import TOPIC_DEFAULTS

    model, tok = tiny_model
    built = []
    real = write_mod.staged_processor

    def spy(tokenizer, stages, **kw):
        built.append(kw)
        return real(tokenizer, stages, **kw)

    monkeypatch.setattr(write_mod, "staged_processor", spy)
    fast = {"n_drafts": 2, "outline_tokens": 8}
    kw = {"options": PLAN_OPTIONS.replace(max_new_tokens=6), "encoder": ENC}
    res = plan_then_write(model, tok, "the planet and its orbit", settings=PlanSettings(**fast), **kw)
    assert 0 < res.write_tokens <= 6
    (default,) = built
    # the semantic field of the prompt's words under every stage
    assert isinstance(default["base"], NarrativeField) and int((default["base"].values > 0).sum()) > 0
    # the topic default's thermostat, and a written stage word stops pulling
    ctrl = default["controller"]
    assert isinstance(ctrl, ThermostatController) and default["repeat_weight"] == 0.0
    knobs = TOPIC_DEFAULTS["thermostat"]
    assert ctrl._rows == (knobs["max_strength"],) and ctrl.options.strict_target == knobs["strict_target"]
    # the earlier pull: lexical stages alone, constant λ, no repeat damping
    plan_then_write(
        model,
        tok,
        "the planet",
        settings=PlanSettings(**fast, schedule="constant", strength=2.0, semantic=False, repeat_weight=1.0),
        **kw,
    )
    earlier = built[-1]
    assert earlier["base"] is None and earlier["repeat_weight"] == 1.0
    assert isinstance(earlier["controller"], ConstantController) and earlier["controller"]._rows == (2.0,)
    plan_then_write(model, tok, "the planet", settings=PlanSettings(**fast, strength=1.5, semantic=False), **kw)
    assert built[-1]["controller"]._rows == (1.5,)  # λ_max of the thermostat
    with pytest.raises(ConfigurationError, match="schedule"):
        PlanSettings(schedule="cosine")
    with pytest.raises(ConfigurationError, match="strength"):
        PlanSettings(strength=-1.0)


def test_plan_then_write_from_the_best_of_several_openings(tiny_model, monkeypatch):
    model, tok = tiny_model
    calls = []
    real_generate = model.generate

    def spy(**kw):
        out = real_generate(**kw)
        calls.append((kw["input_ids"].shape, out.shape))
        return out

    monkeypatch.setattr(model, "generate", spy)
    res = plan_then_write(
        model,
        tok,
        "the planet and its orbit",
        stages=[{"core_semantics": ["planet"], "share": 0.5}, {"core_semantics": ["orbit"]}],
        encoder=ENC,
        settings=PlanSettings(openings=3, opening_tokens=4),
        options=PLAN_OPTIONS.replace(max_new_tokens=10),
    )
    (open_in, open_out), (cont_in, cont_out) = calls
    assert open_in[0] == 3 and open_out[1] - open_in[1] <= 4  # three openings of at most 4 tokens, one batch
    assert cont_in[0] == 1 and cont_in[1] > open_in[1]  # one continuation that starts after an opening
    assert cont_out[1] - cont_in[1] <= 10 - (cont_in[1] - open_in[1])  # the budget is shared with the opening
    assert res.write_tokens == 3 * (open_out[1] - open_in[1]) + (cont_out[1] - cont_in[1])  # no early EOS here
    assert res.text and len(res.final_stage) == 1
    with pytest.raises(ConfigurationError, match="openings"):
        PlanSettings(openings=0)


def test_plan_then_write_can_put_the_outline_in_the_prompt(tiny_model):
    model, tok = tiny_model
    res = plan_then_write(
        model,
        tok,
        "the planet",
        encoder=ENC,
        settings=PlanSettings(n_drafts=2, outline_tokens=12, include_outline=True),
        options=PLAN_OPTIONS.replace(max_new_tokens=4),
    )
    assert res.write_prompt.startswith("the planet\nFollow this outline:\n1. ")
    assert all(sec in res.write_prompt for sec in res.outline.sections)


def test_plan_then_write_with_hand_stages_drafts_nothing(tiny_model):
    model, tok = tiny_model
    res = plan_then_write(
        model,
        tok,
        "the planet",
        stages=[{"core_semantics": ["planet"], "share": 0.5}, {"core_semantics": ["galaxy"]}],
        encoder=ENC,
        options=PLAN_OPTIONS.replace(max_new_tokens=6),
    )
    assert res.draft_tokens == 0 and res.outlines == [] and res.outline is None
    assert [s.core_semantics for s in res.stages] == [["planet"], ["galaxy"]]
    assert len(res.final_stage) == 1


# --------------------------------------------------------------------------------------------------
# stages declared in a profile


def _staged_profile(**extra):
    from narrative_gravity.profiles.schema import Profile

    return Profile.from_mapping(
        {
            "core_semantics": ["planet", "galaxy"],
            "schedule": "constant",
            "gravity_strength": 2.0,
            "stages": [
                {"name": "gather", "core_semantics": ["planet"], "share": 0.25},
                {"name": "analyse tool results", "core_semantics": ["galaxy"]},
            ],
            **extra,
        }
    )


def test_profile_stages_build_a_staged_processor_with_a_trace(tiny_tokenizer):
    from narrative_gravity.engines.hf import processor_from_profile
    from narrative_gravity.gravity.thermo import Trace

    tok = tiny_tokenizer
    trace = Trace()
    proc = processor_from_profile(_staged_profile(), tok, max_new_tokens=8, trace=trace)
    assert isinstance(proc, NarrativeGravityLogitsProcessor) and proc.program.stages is not None
    planet, galaxy = _tok_id(tok, "planet"), _tok_id(tok, "galaxy")
    ids, pulled = torch.tensor([[5, 6, 7]]), []
    for _ in range(4):  # stage 0 has 2 of the 8 tokens
        out = proc(ids, torch.zeros(1, len(tok)))
        pulled.append((float(out[0, planet]), float(out[0, galaxy])))
        ids = torch.cat([ids, torch.tensor([[9]])], dim=1)
    assert pulled == [(2.0, 0.0), (2.0, 0.0), (0.0, 2.0), (0.0, 2.0)]
    assert trace.to_numpy()["strength"].tolist() == [[2.0] * 4]
    assert (trace.to_numpy()["kl"] > 0).all()
    assert proc.repeat_weight == 1.0
    damped = processor_from_profile(_staged_profile(field={"repeat_weight": 0.0}), tok, max_new_tokens=8)
    assert damped.repeat_weight == 0.0  # the profile's field.repeat_weight reaches the stages


def test_profile_stages_need_a_budget_and_measure_only_uses_the_profile_field(tiny_tokenizer):
    from narrative_gravity.engines.hf import NarrativeGravityLogitsProcessor, processor_from_profile

    with pytest.raises(ConfigurationError, match="pass max_new_tokens"):
        processor_from_profile(_staged_profile(), tiny_tokenizer)
    control = processor_from_profile(_staged_profile(), tiny_tokenizer, max_new_tokens=8, measure_only=True)
    assert isinstance(control, NarrativeGravityLogitsProcessor) and control.measure_only


@pytest.mark.parametrize(
    ("stages", "message"),
    [
        ([{"core_semantics": ["a"], "share": 0.7}, {"core_semantics": ["b"], "share": 0.6}], "add up to 1.3"),
        ([{"core_semantics": ["a"], "share": 1.0}, {"core_semantics": ["b"]}], "leave nothing"),
        ([{"core_semantics": []}], r"stages\.0\.core_semantics"),
        ([{"core_semantics": ["a"], "weight": 2}], r"stages\.0\.weight"),
        ([], "stages"),
    ],
)
def test_profile_stage_errors_name_the_key(stages, message):
    from narrative_gravity.errors import ProfileError
    from narrative_gravity.profiles.schema import Profile

    with pytest.raises(ProfileError, match=message):
        Profile.from_mapping({"core_semantics": ["x"], "stages": stages})


# --------------------------------------------------------------------------------------------------
# the command line


def test_cli_plan_prints_the_drafts_stages_and_text(tiny_model, tmp_path):
    import json

    from typer.testing import CliRunner

    from narrative_gravity.cli.main import app

    model, tok = tiny_model
    model_dir = tmp_path / "tiny"
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    out = tmp_path / "plan.json"
    args = ["plan", "--prompt", "the planet and its orbit", "--model", str(model_dir), "--drafts", "3"]
    args += ["--outline-tokens", "10", "--max-new-tokens", "8", "--encoder", "hashing", "--output", str(out)]
    args += ["--no-semantic", "--openings", "2", "--opening-tokens", "3"]  # the semantic base is tested above
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "3 outline drafts" in res.output and "stage 1" in res.output and "drafting +" in res.output
    saved = json.loads(out.read_text())
    assert len(saved["outlines"]) == 3 and saved["stages"] and saved["draft_tokens"] <= 30
    assert f"{saved['draft_tokens']} drafting + {saved['write_tokens']} writing" in res.output
    assert saved["text"].split()[0][:15] in res.output  # the written text is printed
    bad = CliRunner().invoke(app, ["plan", "--prompt", "x", "--model", str(model_dir), "--encoder", "nope"])
    assert bad.exit_code == 2 and "--encoder must be minilm or hashing" in bad.output
    bad = CliRunner().invoke(app, ["plan", "--prompt", "x", "--model", str(model_dir), "--schedule", "cosine"])
    assert bad.exit_code == 2 and "--schedule must be thermostat or constant" in bad.output


# --------------------------------------------------------------------------------------------------
# the real default model


@pytest.mark.slow
def test_real_model_plan_then_write_with_the_defaults():
    from narrative_gravity.models import load_model

    model, tok = load_model()
    res = plan_then_write(
        model, tok, "Write a short article about coral reefs.", options=PLAN_OPTIONS.replace(max_new_tokens=64, seed=0)
    )
    assert len(res.outlines) == 2 and 0 < res.draft_tokens <= 2 * 28  # two drafts of at most 28 tokens
    # three openings of 24 tokens, then the kept one continued to 64 tokens in all
    assert 3 * 24 < res.write_tokens <= 3 * 24 + (64 - 24)
    assert all({"coral", "reefs"} <= set(s.core_semantics) for s in res.stages)
    assert not {"numbered", "exactly"} & {w for s in res.stages for w in s.core_semantics}
    assert "coral" in res.text.lower() or "reef" in res.text.lower()
    assert len(res.final_stage) == 1 and 0 <= res.final_stage[0] < len(res.stages)
