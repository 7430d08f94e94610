"""Context pruning and the news benchmark builder: fast tests with a hashing encoder; MiniLM and the real
data set only in the slow tests."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from narrative_gravity.cli.main import app
from narrative_gravity.errors import ConfigurationError
from narrative_gravity.levels.context import (
    PruneSettings,
    content_words,
    count_tokens,
    prune_context,
    result_table,
    stem,
)
from narrative_gravity.levels.ranking import BM25, cluster_embeddings, hashing_encoder
from narrative_gravity.profiles.schema import Profile
from narrative_gravity.ragbench import (
    CaseShape,
    Document,
    build_cases,
    exact_match_rank,
    inflections,
    key_entity,
    make_question,
    split_passages,
)

ENC = hashing_encoder(256)

PLANETS = [
    "The planet Mars moves along its orbit around the sun.",
    "A planet orbit is an ellipse with the sun at one focus of the orbit.",
    "Astronomers measure the orbit of each planet with a telescope.",
]
COOKING = [
    "Whisk the eggs with sugar, then fold the flour into the batter.",
    "Bake the batter in a hot oven until the cake turns golden.",
]


# --------------------------------------------------------------------------------------------------
# text helpers and BM25


def test_stem_merges_inflections_but_not_different_words():
    assert stem("orbits") == stem("orbit") == stem("orbiting")
    assert stem("confirmed") == stem("confirmation")
    assert stem("planet") != stem("plant")


def test_content_words_drop_stopwords_and_short_words():
    assert content_words("It is an orbit of the Moon") == ["orbit", "moon"]


def test_bm25_matches_the_formula_by_hand():
    docs = [["orbit", "planet"], ["cake"], ["planet", "planet", "moon"]]
    bm = BM25(docs, k1=1.2, b=0.75)
    n, df = 3, 2
    idf = np.log1p((n - df + 0.5) / (df + 0.5))
    avg = 2.0
    expected0 = idf * 1 * 2.2 / (1 + 1.2 * (0.25 + 0.75 * 2 / avg))
    expected2 = idf * 2 * 2.2 / (2 + 1.2 * (0.25 + 0.75 * 3 / avg))
    s = bm.scores(["planet"])
    assert s[0] == pytest.approx(expected0)
    assert s[1] == 0.0
    assert s[2] == pytest.approx(expected2)
    assert bm.scores(["unknown"]).tolist() == [0.0, 0.0, 0.0]


def test_bm25_rejects_bad_parameters():
    with pytest.raises(ConfigurationError, match="k1"):
        BM25([["a"]], k1=-1)


def test_clustering_groups_by_cosine_threshold():
    emb = np.array([[1.0, 0.0, 0.0], [0.95, 0.31, 0.0], [0.0, 0.0, 1.0], [0.0, 0.2, 0.98]])
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    assert cluster_embeddings(emb, 0.8).tolist() == [0, 0, 1, 1]
    assert cluster_embeddings(emb, 0.999).tolist() == [0, 1, 2, 3]
    assert len(set(cluster_embeddings(emb, -1.0).tolist())) == 1


def test_hashing_encoder_gives_unit_rows():
    e = ENC(["planet orbit", ""])
    assert np.linalg.norm(e[0]) == pytest.approx(1.0)
    assert np.linalg.norm(e[1]) == 0.0


# --------------------------------------------------------------------------------------------------
# prune_context


def test_every_chunk_gets_a_decision_and_a_reason():
    res = prune_context("What is the orbit of a planet?", PLANETS + COOKING, encoder=ENC)
    assert [d.index for d in res.decisions] == list(range(5))
    assert all(d.reason for d in res.decisions)
    assert {d.text for d in res.kept} == set(PLANETS)


def test_off_narrative_cluster_is_dropped_with_its_reason():
    res = prune_context("What is the orbit of a planet?", PLANETS + COOKING, encoder=ENC)
    dropped = {d.text: d.reason for d in res.dropped}
    assert set(dropped) == set(COOKING)
    assert all("off-narrative cluster" in r for r in dropped.values())
    # with cluster pruning switched off, the cooking chunks survive (no budget, no min_score)
    res = prune_context(
        "What is the orbit of a planet?", PLANETS + COOKING, encoder=ENC, settings=PruneSettings(cluster_margin=2.0)
    )
    assert len(res.kept) == 5


def test_budget_is_respected_and_counted_with_the_tokenizer(tiny_tokenizer):
    chunks = PLANETS + COOKING
    tokens = count_tokens(chunks, tiny_tokenizer)
    assert tokens == [len(tiny_tokenizer(c, add_special_tokens=False)["input_ids"]) for c in chunks]
    budget = tokens[0] + tokens[1]
    res = prune_context(
        "orbit of a planet",
        chunks,
        budget,
        tokenizer=tiny_tokenizer,
        encoder=ENC,
        settings=PruneSettings(cluster_margin=2.0),
    )
    assert res.tokens_kept <= budget
    assert res.tokens_total == sum(tokens)
    assert res.tokens_saved == sum(tokens) - res.tokens_kept
    assert any(d.reason.startswith("over budget") for d in res.dropped)
    assert 0 < res.saved_fraction < 1


def test_near_duplicates_are_dropped():
    chunks = [PLANETS[0], PLANETS[0] + " ", PLANETS[1]]
    res = prune_context("planet orbit", chunks, encoder=ENC)
    assert len(res.kept) == 2
    (dup,) = res.dropped
    assert dup.reason.startswith("near-duplicate of chunk")


def test_mmr_prefers_a_new_chunk_over_a_redundant_one():
    q = "planet orbit telescope"
    chunks = ["planet orbit telescope sun", "planet orbit telescope moon", "telescope mirror lens glass"]
    only_rel = prune_context(q, chunks, 8, encoder=ENC, settings=PruneSettings(mmr_lambda=1.0, cluster_margin=2.0))
    diverse = prune_context(q, chunks, 8, encoder=ENC, settings=PruneSettings(mmr_lambda=0.3, cluster_margin=2.0))
    assert {d.index for d in only_rel.kept} == {0, 1}
    assert {d.index for d in diverse.kept} == {0, 2}


def test_profile_narrative_changes_the_scores():
    chunks = ["The rocket reached orbit.", "The cake left the oven."]
    plain = prune_context("What happened next?", chunks, encoder=ENC)
    prof = Profile(core_semantics=["rocket", "orbit"])
    steered = prune_context("What happened next?", chunks, encoder=ENC, profile=prof)
    assert steered.decisions[0].narrative is not None and plain.decisions[0].narrative is None
    assert steered.decisions[0].score > steered.decisions[1].score
    assert plain.decisions[0].score == pytest.approx(plain.decisions[1].score)


def test_min_score_and_original_order():
    chunks = [COOKING[0], PLANETS[0], PLANETS[1]]
    res = prune_context(
        "planet orbit sun", chunks, encoder=ENC, settings=PruneSettings(min_score=0.1, cluster_margin=2.0)
    )
    assert "below min_score" in res.decisions[0].reason
    assert res.context() == PLANETS[0] + "\n\n" + PLANETS[1]


def test_mapping_chunks_keep_their_ids():
    res = prune_context("planet", [{"id": "a", "text": PLANETS[0]}, {"text": COOKING[0]}], encoder=ENC)
    assert [d.id for d in res.decisions] == ["a", "1"]
    assert json.loads(json.dumps(res.to_json()))["chunks"][0]["id"] == "a"


def test_empty_chunks_give_an_empty_result():
    res = prune_context("planet", [], encoder=ENC)
    assert res.decisions == [] and res.tokens_saved == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"question": " "}, "question"),
        ({"budget_tokens": -1}, "budget_tokens"),
        ({"chunks": "one string"}, "not one string"),
        ({"chunks": [3]}, "chunk 0"),
    ],
)
def test_bad_arguments_name_the_value(kwargs, message):
    args = {"question": "planet", "chunks": PLANETS, "encoder": ENC, **kwargs}
    with pytest.raises(ConfigurationError, match=message):
        prune_context(args.pop("question"), args.pop("chunks"), **args)


@pytest.mark.parametrize(
    ("kwargs", "message"), [({"lexical_weight": 1.5}, "lexical_weight"), ({"mmr_lambda": float("nan")}, "mmr_lambda")]
)
def test_bad_settings_name_the_value(kwargs, message):
    with pytest.raises(ConfigurationError, match=message):
        PruneSettings(**kwargs)


def test_result_table_lists_kept_then_dropped():
    from rich.console import Console

    res = prune_context("What is the orbit of a planet?", PLANETS + COOKING, encoder=ENC)
    console = Console(record=True, width=200)
    console.print(result_table(res))
    text = console.export_text()
    assert "3 of 5 chunks kept" in text and "saved" in text
    assert text.index("kept #1") < text.index("off-narrative")


def test_cli_prune_context_prints_the_table(tmp_path):
    path = tmp_path / "chunks.jsonl"
    path.write_text("\n".join(json.dumps({"id": f"c{i}", "text": t}) for i, t in enumerate(PLANETS + COOKING)))
    out = tmp_path / "res.json"
    res = CliRunner().invoke(
        app,
        [
            "prune-context",
            "--question",
            "What is the orbit of a planet?",
            "--documents",
            str(path),
            "--budget",
            "30",
            "--encoder",
            "hashing",
            "--count",
            "words",
            "--output",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    assert "tokens saved" in res.output
    data = json.loads(out.read_text())
    assert data["tokens_kept"] <= 30
    assert {c["id"] for c in data["chunks"] if not c["kept"]} >= {"c3", "c4"}


def test_cli_prune_context_rejects_a_bad_file(tmp_path):
    path = tmp_path / "chunks.jsonl"
    path.write_text('{"no_text": 1}\n')
    res = CliRunner().invoke(
        app, ["prune-context", "--question", "q", "--documents", str(path), "--encoder", "hashing", "--count", "words"]
    )
    assert res.exit_code == 2
    assert "text" in res.output


# --------------------------------------------------------------------------------------------------
# the benchmark builder (synthetic documents; the real data set is in the slow test)


def _docs() -> list[Document]:
    topics = {
        "mars": ("Mars", "Mars rover finds water", "rover water crater rock dust"),
        "venus": ("Venus", "Venus probe lands", "probe heat cloud acid pressure"),
        "cake": ("Paris", "Paris bakery wins prize", "bakery bread flour oven prize"),
        "ship": ("Oslo", "Oslo ferry sails again", "ferry harbour sea captain wind"),
        "bank": ("Berlin", "Berlin bank raises rates", "bank rates loan money inflation"),
        "film": ("Cannes", "Cannes film festival opens", "film actor director screen award"),
    }
    docs = []
    for k, (entity, title, vocab) in topics.items():
        w = vocab.split()
        sents = [
            f"{entity} reported that the {w[i % 5]} and the {w[(i + 1) % 5]} were studied by experts near {entity}."
            for i in range(12)
        ]
        docs.append(Document(k, title, " ".join(sents)))
    return docs


SHAPE = CaseShape(passage_words=30, random_passages=2, nearby_docs=1)


def test_build_cases_is_deterministic_per_seed():
    a = build_cases(_docs(), n_cases=4, seed=3, shape=SHAPE)
    b = build_cases(_docs(), n_cases=4, seed=3, shape=SHAPE)
    c = build_cases(_docs(), n_cases=4, seed=4, shape=SHAPE)
    assert a and [x.to_json() for x in a] == [x.to_json() for x in b]
    assert [x.to_json() for x in a] != [x.to_json() for x in c]


def test_cases_have_gold_from_one_document_and_distractors_from_others():
    cases = build_cases(
        _docs(), n_cases=3, seed=0, shape=CaseShape(passage_words=30, gold_passages=2, random_passages=2)
    )
    for case in cases:
        gold = [p for p in case.passages if p.gold]
        assert len(gold) == 2 and {p.doc_id for p in gold} == {case.doc_id}
        assert all(p.doc_id != case.doc_id for p in case.passages if not p.gold)
        assert sum(p.kind == "random" for p in case.passages) == 2
        assert case.entity in case.question


def test_question_words_are_not_copied_verbatim_from_the_gold():
    gold = ["Mars rover found water in a crater."]
    q = make_question("Mars rover finds water", "Mars", gold)
    assert q is not None and "Mars" in q
    qwords = set(content_words(q)) - {"mars", "news"}
    gold_words = set(content_words(gold[0]))
    # "rover" is a common word found verbatim: it must have been inflected; "finds" is not in the gold
    assert "rover" not in qwords and "rovers" in qwords and "finds" in qwords
    assert not (qwords & gold_words)


def test_question_needs_two_content_words():
    assert make_question("Mars", "Mars", ["Mars."]) is None


def test_helpers():
    assert key_entity("Talks in Oslo end", "Oslo hosted. The Oslo talks ended. oslo") == "Oslo"
    assert key_entity("Nothing here", "nothing") is None
    assert "votes" in inflections("vote")
    assert split_passages("A b c. D e f.", passage_words=100) == ["A b c. D e f."]
    assert exact_match_rank("planet orbit", ["cake", "planet orbit", "planet"]) == [1, 2, 0]


# --------------------------------------------------------------------------------------------------
# slow: MiniLM and the shipped news articles


@pytest.mark.slow
def test_minilm_pruning_keeps_the_topic_and_drops_the_other_one():
    pytest.importorskip("transformers")
    from narrative_gravity.fields.minilm import minilm_folder

    try:
        minilm_folder()
    except Exception as exc:  # pragma: no cover - depends on the machine
        pytest.skip(str(exc))
    question = "How did telescopes change astronomy?"
    chunks = [
        "Galileo pointed a telescope at Jupiter in 1610 and saw four moons.",
        "Larger mirrors let astronomers see faint galaxies far beyond the Milky Way.",
        "Space telescopes avoid the blurring of the atmosphere.",
        "Knead the dough for ten minutes, then let it rise in a warm place.",
        "Season the soup with salt, pepper and fresh herbs before serving.",
    ]
    res = prune_context(question, chunks)
    kept = {d.index for d in res.kept}
    assert kept == {0, 1, 2}
    assert all("off-narrative" in d.reason for d in res.dropped)


@pytest.mark.slow
def test_news_cases_build_deterministically():
    from narrative_gravity.errors import ModelNotFoundError
    from narrative_gravity.ragbench import load_news_articles

    try:
        docs = load_news_articles()
    except ModelNotFoundError as exc:  # pragma: no cover - the data package is optional
        pytest.skip(str(exc))
    assert len(docs) > 3000
    a = build_cases(docs, n_cases=5, seed=7)
    b = build_cases(docs, n_cases=5, seed=7)
    assert len(a) == 5 and [c.to_json() for c in a] == [c.to_json() for c in b]
    for c in a:
        assert len(c.gold_ids) == 3 and len(c.passages) == 12
        assert sum(p.kind == "nearby" for p in c.passages) == 4
