"""Rollout without a server: the live pointer, staging and promotion in the store, rollout configs, the arm
choice, the arm log, the report, and the promotion gate (`ngrav profile stage/promote/rollout/report`)."""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from narrative_gravity.cli.main import app
from narrative_gravity.errors import StoreError
from narrative_gravity.eval.promote import Limit, check_limit
from narrative_gravity.eval.rollout_report import build_report, render_report
from narrative_gravity.profiles.armlog import ArmLog
from narrative_gravity.profiles.rollout import (
    ARMS,
    LIVE,
    PINNED,
    SPLIT_A,
    SPLIT_B,
    RolloutConfig,
    RolloutError,
    route,
    route_key,
)
from narrative_gravity.profiles.store import ProfileStore, StoreDamagedError

BASE = {"core_semantics": ["orbit", "planet"], "gravity_strength": 1.2, "schedule": "constant"}
FORK = multiprocessing.get_context("fork")
runner = CliRunner()


def strength(i: float) -> dict[str, object]:
    return {**BASE, "gravity_strength": float(i)}


@pytest.fixture
def store(tmp_path: Path) -> ProfileStore:
    return ProfileStore(tmp_path / "store")


def cli(store: ProfileStore, *args: str):
    return runner.invoke(app, ["profile", "--store", str(store.root), *args])


# ------------------------------------------------------------------------------------------------ live pointer


def test_a_store_without_pointer_serves_the_newest_version(store):
    store.set("space", strength(1))
    store.set("space", strength(2))
    assert not (store.root / "space" / "live.json").exists()  # stores written before pointers look like this
    assert store.live_version("space") == 2 and store.staged("space") == []
    assert store.get("space").gravity_strength == 2.0
    assert store.route_info("space").live == 2


def test_a_staged_version_is_not_served_until_promoted(store):
    store.set("space", strength(1))
    assert store.stage("space", strength(5), message="try 5") == 2
    assert store.live_version("space") == 1 and store.staged("space") == [2]
    assert store.get("space").gravity_strength == 1.0  # the default read is the live version
    assert store.get("space", 2).gravity_strength == 5.0
    info = {i.name: i for i in store.list()}["space"]
    assert (info.version, info.live, info.staged) == (2, 1, (2,))
    assert store.promote("space") == 2
    assert store.live_version("space") == 2 and store.get("space").gravity_strength == 5.0
    assert [(m.previous, m.version) for m in store.live_history("space")] == [(None, 1), (1, 2)]


def test_set_and_rollback_make_the_new_version_live(store):
    store.set("space", strength(1))
    store.stage("space", strength(5))
    assert store.set("space", strength(3)) == 3  # set = store and make live, as before pointers
    assert store.live_version("space") == 3 and store.staged("space") == []
    store.stage("space", strength(7))
    assert store.rollback("space", to=1) == 5
    assert store.live_version("space") == 5 and store.get("space").gravity_strength == 1.0
    assert store.promote("space", 4) == 4  # a staged version stays promotable by number


def test_promote_refuses_what_it_cannot_do(store):
    with pytest.raises(StoreError, match="no live version to keep serving"):
        store.stage("new", BASE)
    assert not (store.root / "new").exists()
    store.set("space", strength(1))
    with pytest.raises(StoreError, match="nothing is staged"):
        store.promote("space")
    with pytest.raises(StoreError, match="has no version 9"):
        store.promote("space", 9)
    store.stage("space", strength(2))
    with pytest.raises(StoreError, match="changed from 7 to 1 meanwhile"):
        store.promote("space", 2, expect_live=7)
    assert store.live_version("space") == 1


def test_a_damaged_pointer_is_the_stores_fault_and_names_the_fix(store):
    store.set("space", strength(1))
    store.stage("space", strength(2))
    (store.root / "space" / "live.json").write_text('{"format": 1, "version": 12}')
    with pytest.raises(StoreDamagedError, match=r"names version 12.*delete the file"):
        store.live_version("space")
    assert store.get("space", 1).gravity_strength == 1.0  # pinned reads still work
    res = cli(store, "promote", "space", "--version", "2", "--no-check")  # the fix the message names
    assert res.exit_code == 0 and "was a damaged pointer" in res.output
    assert store.live_version("space") == 2
    (store.root / "space" / "live.json").write_text("{not json")
    assert store.set("space", strength(3)) == 3 and store.live_version("space") == 3  # set makes it live: repaired


def _stage_many(root: str, n: int, go: object) -> None:
    go.wait(10)  # type: ignore[attr-defined]
    store = ProfileStore(root)
    for i in range(n):
        store.stage("shared", strength(10 + i % 5))


def test_concurrent_writers_never_expose_a_staged_version(tmp_path):
    """Processes stage versions while threads set and promote and this process reads the live version."""
    store = ProfileStore(tmp_path)
    store.set("shared", strength(1))
    go = FORK.Event()
    procs = [FORK.Process(target=_stage_many, args=(str(tmp_path), 15, go)) for _ in range(3)]
    for p in procs:
        p.start()
    seen: list[int] = []
    stop = threading.Event()

    def read() -> None:
        reader = ProfileStore(tmp_path)  # a fresh reader: no cache shared with the writers
        while not stop.is_set():
            seen.append(reader.get("shared").gravity_strength)

    thread = threading.Thread(target=read)
    thread.start()
    go.set()
    for p in procs:
        p.join(60)
    stop.set()
    thread.join(10)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert store.versions("shared") == list(range(1, 47))  # contiguous, no duplicates
    assert set(seen) == {1.0}, "a reader was served a staged version"
    assert store.live_version("shared") == 1 and len(store.staged("shared")) == 45

    # now promotions and sets race; the pointer always names a version that exists, and the last writer wins
    errors: list[BaseException] = []

    def promote_some() -> None:
        for v in range(2, 20):
            try:
                store.promote("shared", v)
            except BaseException as exc:  # pragma: no cover - the assertion below shows it
                errors.append(exc)

    def set_some() -> None:
        for _ in range(5):
            store.set("shared", strength(3))

    threads = [threading.Thread(target=promote_some), threading.Thread(target=set_some)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    assert store.live_version("shared") in store.versions("shared")
    assert store.versions("shared") == list(range(1, 52))


# ------------------------------------------------------------------------------------------------ rollout config


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"shadow": 5}, r"rollout `shadow` \(got 5\).*less than or equal to 1.*e\.g\. 0\.05 for 5%"),
        ({"shadow": "5%"}, r"rollout `shadow` \(got '5%'\): write a number"),
        ({"shadw": 0.1}, r"unknown rollout key `shadw`; did you mean `shadow`\?"),
        ({"split": {"version": 2}}, r"rollout `split.share` is missing"),
        ({"split": {"version": 2, "share": 0}}, r"`split.share` \(got 0\): Input should be greater than 0"),
        ({"split": {"version": 2.5, "share": 0.1}}, r"`split.version` \(got 2.5\): write a whole version number"),
        ({"split": {"verison": 2, "share": 0.1}}, r"did you mean `version`\?"),
        ([0.05], r"must be a mapping, but is list"),
    ],
)
def test_rollout_config_errors_name_the_key_and_the_fix(data, message):
    with pytest.raises(RolloutError, match=message):
        RolloutConfig.from_mapping(data)


def test_rollout_config_is_checked_against_the_versions_and_kept_with_history(store):
    store.set("space", strength(1))
    with pytest.raises(RolloutError, match="has versions 1-1; stage it first"):
        store.set_rollout("space", {"split": {"version": 2, "share": 0.1}})
    with pytest.raises(RolloutError, match="the live version of 'space': both arms would serve it"):
        store.set_rollout("space", {"split": {"version": 1, "share": 0.1}})
    assert store.rollout("space").revision == 0 and store.rollout("space").config.empty
    store.stage("space", strength(2))
    state = store.set_rollout("space", {"shadow": 0.05, "split": {"version": 2, "share": 0.1}}, message="canary")
    assert state.revision == 1 and store.route_info("space").rollout == state.config
    assert store.set_rollout("space", None).revision == 2
    assert store.route_info("space").rollout is None
    assert [(s.revision, s.message, s.config.shadow) for s in store.rollout_history("space")] == [
        (1, "canary", 0.05),
        (2, None, 0.0),
    ]
    doc = json.loads((store.root / "space" / "rollout.json").read_text())
    assert doc["revision"] == 2 and doc["rollout"] == {}


def test_route_info_rereads_changed_files_only(store):
    store.set("space", strength(1))
    store.stage("space", strength(2))
    store.set_rollout("space", {"split": {"version": 2, "share": 0.5}})
    first = store.route_info("space")
    assert store.route_info("space") is not first and store.route_info("space") == first
    assert len(store._docs) == 2  # parsed once each, then served from the stat cache
    store.promote("space", 2)
    assert store.route_info("space").live == 2


# ------------------------------------------------------------------------------------------------ arm choice


SPLIT = RolloutConfig.from_mapping({"shadow": 0.2, "split": {"version": 4, "share": 0.3}})


@settings(max_examples=200, deadline=None)
@given(key=st.text(min_size=1, max_size=20), share=st.floats(0.01, 0.99))
def test_the_arm_is_deterministic_per_key_and_grows_with_the_share(key, share):
    cfg = RolloutConfig.from_mapping({"split": {"version": 4, "share": share}})
    k = route_key(user=key)
    first = route(cfg, name="space", live=3, key=k)
    assert first == route(cfg, name="space", live=3, key=k)
    assert first.arm in (SPLIT_A, SPLIT_B) and first.version == (4 if first.arm == SPLIT_B else 3)
    if first.arm == SPLIT_B:  # raising the share keeps every key that was on b there
        bigger = RolloutConfig.from_mapping({"split": {"version": 4, "share": min(1.0, share + 0.2)}})
        assert route(bigger, name="space", live=3, key=k).arm == SPLIT_B


def test_the_shares_hold_over_many_keys_and_a_pinned_version_bypasses_the_split():
    routes = [route(SPLIT, name="space", live=3, key=route_key(seed=i)) for i in range(4000)]
    b = sum(r.arm == SPLIT_B for r in routes) / len(routes)
    shadow = sum(r.shadow for r in routes) / len(routes)
    assert abs(b - 0.3) < 0.03 and abs(shadow - 0.2) < 0.03
    assert route(SPLIT, name="space", live=3, key="seed:1", pinned=2).arm == PINNED
    assert route(None, name="space", live=3, key=None) == route(RolloutConfig(), name="space", live=3, key="x")
    assert route(None, name="space", live=3, key=None).arm == LIVE
    # without a key the draw is random, in the same proportion
    random_b = sum(route(SPLIT, name="space", live=3, key=None).arm == SPLIT_B for _ in range(4000)) / 4000
    assert abs(random_b - 0.3) < 0.04


# ------------------------------------------------------------------------------------------------ arm log, report


def test_the_arm_log_stays_bounded_and_keeps_the_newest(tmp_path):
    log = ArmLog(tmp_path / "arms.jsonl", max_bytes=2000)
    for i in range(500):
        log.append({"i": i, "arm": "live", "pad": "x" * 30})
        size = sum(p.stat().st_size for p in (log.path, log.rotated) if p.exists())
        assert size <= 2 * log.max_bytes
    kept = [r["i"] for r in log.read()]
    assert kept == list(range(kept[0], 500)) and len(kept) > 20
    with log.path.open("ab") as fh:
        fh.write(b'{"torn": ')  # a torn last line is skipped
    assert [r["i"] for r in log.read()] == kept


def _records() -> list[dict[str, object]]:
    recs: list[dict[str, object]] = []
    for i in range(40):
        arm, version = (SPLIT_B, 4) if i % 4 == 0 else (SPLIT_A, 3)
        mass = 0.6 if arm == SPLIT_B else 0.4
        recs.append(
            {
                "request": f"r{i}",
                "arm": arm,
                "version": version,
                "narrative_mass": mass + (i % 5) / 100,
                "narrative_mass_before": 0.2,
                "kl": 0.1,
                "off_topic_rate": 0.5,
                "completion_tokens": 10,
                "latency_s": 0.2,
                "t": f"2025-01-01T00:00:{i:02d}Z",
            }
        )
        if i % 5 == 0:
            recs.append(
                {"request": f"r{i}:shadow", "of": f"r{i}", "arm": "shadow", "version": version, "narrative_mass": 0.2}
            )
    return recs


def test_the_report_compares_arms_with_intervals():
    rep = build_report("space", _records())
    assert [(a["arm"], a["version"], a["n"]) for a in rep["arms"]] == [
        (SPLIT_A, 3, 30),
        (SPLIT_B, 4, 10),
        ("shadow", 3, 6),
        ("shadow", 4, 2),
    ]
    for a in rep["arms"]:
        m = a["metrics"]["narrative_mass"]
        assert m["low"] <= m["mean"] <= m["high"]
    split, *paired = rep["comparisons"]
    assert split["name"] == "split:b@4 − split:a@3" and split["kind"] == "unpaired"
    d = split["metrics"]["narrative_mass"]
    assert d["low"] <= d["difference"] <= d["high"] and d["low"] > 0.15  # b pulls clearly harder
    assert d["difference"] == pytest.approx(0.2, abs=0.01)
    assert [(c["name"], c["pairs"]) for c in paired] == [("split:a@3 − shadow@3", 6), ("split:b@4 − shadow@4", 2)]
    assert paired[0]["metrics"]["narrative_mass"]["verdict"] == "better"
    assert "latency_s" not in paired[0]["metrics"]  # a capped shadow's latency says nothing
    json.dumps(rep, allow_nan=False)  # JSON-ready
    assert len(render_report(rep)) == 2 and set(ARMS) >= {a["arm"] for a in rep["arms"]}


def test_cli_report_reads_the_store_and_prints_a_table_or_json(store):
    store.set("space", strength(1))
    for rec in _records():
        store.arms_log("space").append(rec)
    res = cli(store, "report", "space")
    assert res.exit_code == 0, res.output
    assert "split:b@4" in res.output and "95% bootstrap interval" in res.output and "narrative mass" in res.output
    res = cli(store, "report", "space", "--format", "json")
    body = json.loads(res.output)
    assert body["live"] == 1 and body["comparisons"][0]["kind"] == "unpaired"
    res = cli(store, "report", "spcae")
    assert res.exit_code == 2 and "did you mean 'space'" in res.output


# ------------------------------------------------------------------------------------------------ CLI


def test_cli_stage_rollout_promote_and_the_live_marks(store, tmp_path):
    f1, f2 = tmp_path / "v1.json", tmp_path / "v2.json"
    f1.write_text(json.dumps(strength(1)))
    f2.write_text(json.dumps(strength(4)))
    assert cli(store, "set", "space", str(f1)).exit_code == 0
    res = cli(store, "stage", "space", str(f2), "-m", "stronger")
    assert res.exit_code == 0 and "staged version 2; version 1 stays live" in res.output
    res = cli(store, "list")
    assert res.exit_code == 0 and "live" in res.output and "staged" in res.output
    res = cli(store, "show", "space")
    assert '"gravity_strength": 1.0' in res.stdout and "[live]" in res.output
    assert "[staged]" in cli(store, "show", "space", "--version", "2").output
    res = cli(store, "history", "space")
    assert res.exit_code == 0 and "live: version 1" in res.output and "staged" in res.output

    res = cli(store, "rollout", "space", "--shadow", "0.05", "--split-version", "2", "--split-share", "0.1")
    assert res.exit_code == 0, res.output
    assert "shadow 5.0%" in res.output and "10.0% of requests to version 2" in res.output
    res = cli(store, "rollout", "space", "--split-share", "2")
    assert res.exit_code == 2 and "`split.share` (got 2.0)" in res.output
    res = cli(store, "rollout", "space", "--split-version", "1")
    assert res.exit_code == 2 and "the live version" in res.output
    assert "revision" in cli(store, "rollout", "space", "--history").output

    res = cli(store, "promote", "space")
    assert res.exit_code == 2 and "--prompts SET and at least one --limit" in res.output
    res = cli(store, "promote", "space", "--prompts", "topics", "--limit", "distinct2:0.1")
    assert res.exit_code == 2 and "did you mean 'distinct_2'" in res.output
    res = cli(store, "promote", "space", "--no-check")
    assert res.exit_code == 0 and "version 2 is live (was 1)" in res.output
    res = cli(store, "rollout", "space")
    assert "inactive: version 2 is live now" in res.output
    res = cli(store, "rollback", "space", "--to", "1")
    assert res.exit_code == 0 and store.live_version("space") == 3


def test_limits_parse_and_read_the_metric_direction():
    assert Limit.parse("rep_2:10%") == Limit("rep_2", 10.0, relative=True)
    for bad in ("distinct_2", "distinct_2:-1", "distinct_2:abc", ":0.1"):
        with pytest.raises(ValueError, match="--limit"):
            Limit.parse(bad)
    # rep_2 is lower-is-better: a rise is the regression
    up = check_limit(Limit.parse("rep_2:0.05"), live=[0.1, 0.1, 0.2], candidate=[0.5, 0.6, 0.7])
    assert not up.passed and up.regression == pytest.approx(0.4667, abs=1e-3) and up.pairs == 3
    down = check_limit(Limit.parse("rep_2:0.05"), live=[0.5, 0.6, 0.7], candidate=[0.1, 0.1, 0.2])
    assert down.passed and down.regression < 0
    assert "allowed 0.05 (rep_2:0.05)" in up.describe()
    assert not check_limit(Limit.parse("rep_2:1"), live=[float("nan")], candidate=[0.5]).passed  # no pairs


def test_the_log_files_are_not_snapshots(store):
    store.set("space", strength(1))
    store.arms_log("space").append({"arm": "live"})
    store.set_rollout("space", {"shadow": 0.1})
    assert store.versions("space") == [1]
    assert sorted(n for n in os.listdir(store.root / "space") if not n.startswith(".")) == [
        "000001.json",
        "arms.jsonl",
        "rollout-history.jsonl",
        "rollout.json",
    ]
