"""The profile store: versions, history, diff, rollback, names, concurrent writers, SIGKILL safety, and `ngrav profile`."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import threading
import time
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from narrative_gravity.cli.main import app
from narrative_gravity.errors import ProfileError, StoreError
from narrative_gravity.profiles.schema import Profile
from narrative_gravity.profiles.store import ENV_VAR, Change, ProfileStore, default_store_root

BASE = {"core_semantics": ["orbit", "planet"], "gravity_strength": 1.2}
FORK = multiprocessing.get_context("fork")
runner = CliRunner()


def files(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


def numbered(i: int) -> dict[str, object]:
    """Profile number ``i``; writers store it with message ``i=<i>`` so readers can check that both belong together."""
    return {"core_semantics": [f"w{i}", "orbit"], "gravity_strength": (i % 200) / 10}


@pytest.fixture
def store(tmp_path: Path) -> ProfileStore:
    return ProfileStore(tmp_path / "store")


# ------------------------------------------------------------------------------------------------ round trip


def test_set_get_history_round_trip(store):
    assert store.set("space", BASE, message="first") == 1
    assert store.set("space", {**BASE, "gravity_strength": 2.0}) == 2
    assert store.set("space", Profile.from_mapping({**BASE, "penalize": ["recipe"]}), message="third") == 3
    assert store.get("space").penalize == ["recipe"]
    assert store.get("space", version=1) == Profile.from_mapping({**BASE, "name": "space"})
    assert store.get("space", version=2).gravity_strength == 2.0
    history = store.history("space")
    assert [(h.version, h.message) for h in history] == [(1, "first"), (2, None), (3, "third")]
    stamps = [datetime.fromisoformat(h.created.replace("Z", "+00:00")) for h in history]
    assert all(s.utcoffset() == timedelta(0) for s in stamps)
    assert stamps == sorted(stamps)
    assert store.versions("space") == [1, 2, 3]
    assert store.head_version("space") == 3


def test_snapshot_files_are_complete_json_documents(store):
    store.set("space", BASE, message="m")
    directory = store.root / "space"
    assert [f for f in files(directory) if not f.startswith(".")] == ["000001.json"]
    doc = json.loads((directory / "000001.json").read_text())
    assert doc["version"] == 1 and doc["message"] == "m" and doc["created"].endswith("Z")
    assert doc["profile"]["gravity_strength"] == 1.2 and doc["profile"]["schedule"] == "thermostat"  # defaults pinned
    assert doc["profile"]["field"]["mode"] == "semantic"


def test_the_stored_name_is_the_store_name(store):
    store.set("b-s", {**BASE, "name": "binary_search"})
    assert store.get("b-s").name == "b-s"


def test_versions_increase_by_one_per_set_even_when_unchanged(store):
    assert [store.set("p", BASE) for _ in range(5)] == [1, 2, 3, 4, 5]
    assert store.diff("p", 1, 5) == ""


def test_list_and_heads(store):
    assert store.list() == [] and store.heads() == {} and store.names() == []
    store.set("zeta", BASE)
    store.set("alpha", BASE, message="a1")
    store.set("alpha", BASE, message="a2")
    infos = store.list()
    assert [(i.name, i.version, i.message) for i in infos] == [("alpha", 2, "a2"), ("zeta", 1, None)]
    assert store.heads() == {"alpha": 2, "zeta": 1}


def test_diff_is_a_unified_diff_and_changes_name_the_keys(store):
    store.set("space", BASE)
    store.set("space", {**BASE, "gravity_strength": 2.0, "phases": {"strict": 3.0}})
    text = store.diff("space", 1, 2)
    lines = text.splitlines()
    assert lines[:2] == ["--- space@1", "+++ space@2"]
    assert '-  "gravity_strength": 1.2,' in lines and '+  "gravity_strength": 2.0,' in lines
    assert '-    "strict": 1.5' in lines and '+    "strict": 3.0' in lines
    assert store.diff("space", 2, 2) == ""
    assert store.changes("space", 1, 2) == [
        Change("gravity_strength", 1.2, 2.0, "changed"),
        Change("phases.strict", 1.5, 3.0, "changed"),
    ]
    assert store.changes("space", 1, 1) == []


def test_rollback_creates_a_new_version_equal_to_the_old_one(store):
    store.set("space", BASE, message="good")
    store.set("space", {**BASE, "gravity_strength": 9.0}, message="too strong")
    assert store.rollback("space", to=1) == 3
    assert store.get("space") == store.get("space", 1)
    assert store.get("space", 2).gravity_strength == 9.0  # history is not rewritten
    assert [h.message for h in store.history("space")] == ["good", "too strong", "rollback to 1"]
    assert store.diff("space", 1, 3) == ""
    with pytest.raises(StoreError, match="has no version 7; it has versions 1-3"):
        store.rollback("space", to=7)
    assert store.head_version("space") == 3


# ------------------------------------------------------------------------------------------------ errors


def test_invalid_profile_is_rejected_and_nothing_is_written(store):
    store.set("space", BASE)
    before = files(store.root / "space")
    with pytest.raises(ProfileError, match="unknown key `gravity_strenght`; did you mean `gravity_strength`"):
        store.set("space", {"core_semantics": ["x"], "gravity_strenght": 2})
    with pytest.raises(ProfileError, match="`core_semantics`"):
        store.set("space", {"gravity_strength": 1.0})
    with pytest.raises(ProfileError, match="root must be a mapping"):
        store.set("space", ["orbit"])  # type: ignore[arg-type]
    assert files(store.root / "space") == before
    assert store.head_version("space") == 1
    with pytest.raises(ProfileError):
        store.set("fresh", {"core_semantics": []})
    assert store.names() == ["space"]


@pytest.mark.parametrize(
    "name", ["", ".", "..", "../escape", "a/b", "/etc", ".hidden", "-flag", "with space", "tab\t", "é", "a" * 129, 3]
)
def test_bad_names_are_rejected_without_touching_the_disk(tmp_path, name):
    store = ProfileStore(tmp_path / "store")
    with pytest.raises(StoreError, match="is not allowed; use 1-128 letters"):
        store.set(name, BASE)
    with pytest.raises(StoreError, match="is not allowed"):
        store.get(name)
    with pytest.raises(StoreError, match="is not allowed"):
        store.head_version(name)
    assert files(tmp_path) == []


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.text(min_size=0, max_size=12))
def test_any_name_is_stored_under_the_root_or_rejected(tmp_path_factory, name):
    root = tmp_path_factory.mktemp("names")
    store = ProfileStore(root / "store")
    try:
        store.set(name, BASE)
    except StoreError as exc:
        assert "is not allowed" in str(exc)
        assert files(root) == []
    else:
        assert (root / "store" / name / "000001.json").is_file()
        assert store.names() == [name] and store.get(name).name == name


_words = st.lists(
    st.text(
        alphabet=st.characters(codec="utf-8", exclude_categories=("Cs", "Cc", "Zs", "Zl", "Zp")), min_size=1, max_size=8
    ),
    min_size=1,
    max_size=4,
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.fixed_dictionaries(
        {"core_semantics": _words},
        optional={
            "gravity_strength": st.floats(0.0, 20.0),
            "penalize": _words,
            "schedule": st.sampled_from(["constant", "phases", "thermostat"]),
            "decay_after_steps": st.none() | st.integers(0, 10_000),
            "prune_threshold": st.none() | st.floats(-1.0, 0.99),
        },
    )
)
def test_any_valid_profile_round_trips_exactly(tmp_path_factory, data):
    store = ProfileStore(tmp_path_factory.mktemp("profiles"))
    store.set("p", data)
    store.set("p", {**data, "description": "second"})
    assert store.get("p", 1) == Profile.from_mapping({**data, "name": "p"})
    assert store.get("p", 2).description == "second"
    assert [c.key for c in store.changes("p", 1, 2)] == ["description"]


def test_unknown_name_suggests_the_close_one_and_lists_the_rest(store):
    with pytest.raises(StoreError, match=r"the store .* is empty"):
        store.get("space")
    store.set("binary-search", BASE)
    store.set("space", BASE)
    with pytest.raises(StoreError, match=r"did you mean 'binary-search'\? stored profiles: binary-search, space"):
        store.get("binary-serch")
    with pytest.raises(StoreError) as info:
        store.history("zzz")
    assert "did you mean" not in str(info.value) and "stored profiles: binary-search, space" in str(info.value)


def test_unknown_version_lists_the_versions(store):
    store.set("space", BASE)
    store.set("space", BASE)
    for bad in (0, 3, -1):
        with pytest.raises(StoreError, match=f"has no version {bad}; it has versions 1-2"):
            store.get("space", bad)
    with pytest.raises(StoreError, match="whole number"):
        store.get("space", "2")  # type: ignore[arg-type]


def test_a_damaged_snapshot_is_reported_with_its_path(store):
    store.set("space", BASE)
    store.set("space", BASE)
    (store.root / "space" / "000002.json").write_text('{"version": 2, "prof')
    with pytest.raises(StoreError, match=r"000002\.json' is damaged: it is not valid JSON"):
        store.get("space")
    assert store.get("space", 1).core_semantics == ["orbit", "planet"]
    (store.root / "space" / "000002.json").write_text(json.dumps({"version": 1, "created": "x", "profile": BASE}))
    with pytest.raises(StoreError, match="says version 1 but its file name says 2"):
        store.snapshot("space")


def test_temp_files_of_dead_writers_are_ignored_and_swept(store):
    store.set("space", BASE)
    directory = store.root / "space"
    (directory / ".000002.json.tmp-dead").write_text('{"version": 2, "pro')  # a writer killed mid-write
    (directory / "notes.txt").write_text("not a snapshot")
    (directory / "2.json").write_text("{}")  # not a snapshot name: versions are always six digits or more
    assert store.head_version("space") == 1
    assert [h.version for h in store.history("space")] == [1]
    assert store.set("space", BASE) == 2
    assert files(directory) == [".lock", "000001.json", "000002.json", "2.json", "notes.txt"]


def test_an_unwritable_store_is_a_store_error(tmp_path):
    (tmp_path / "file").write_text("")
    store = ProfileStore(tmp_path / "file" / "store")
    with pytest.raises(StoreError, match="cannot create the profile folder"):
        store.set("space", BASE)
    assert store.list() == [] and store.head_version("space") == 0


def test_default_root_follows_env_then_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "env"))
    assert default_store_root() == tmp_path / "env"
    assert ProfileStore().root == tmp_path / "env"
    monkeypatch.delenv(ENV_VAR)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert default_store_root() == tmp_path / "xdg" / "narrative-gravity" / "profiles"
    (tmp_path / "file").write_text("")
    with pytest.raises(StoreError, match="is a file, not a folder"):
        ProfileStore(tmp_path / "file")


def test_watch_reports_current_heads_then_changes(store):
    store.set("a", BASE)
    stop = threading.Event()
    seen: list[tuple[str, int]] = []

    def consume() -> None:
        for change in store.watch(interval=0.01, stop=stop):
            seen.append(change)

    thread = threading.Thread(target=consume)
    thread.start()
    try:
        _wait_for(lambda: ("a", 1) in seen)
        store.set("b", BASE)
        store.set("a", BASE)
        _wait_for(lambda: ("a", 2) in seen and ("b", 1) in seen)
    finally:
        stop.set()
        thread.join(5)
    assert not thread.is_alive()
    assert seen[0] == ("a", 1) and len(seen) == 3 and set(seen) == {("a", 1), ("a", 2), ("b", 1)}
    named = store.watch(["a", "nope"], interval=0.01, stop=stop)
    assert list(named) == [("a", 2), ("nope", 0)]


def _wait_for(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.005)


# ------------------------------------------------------------------------------------------------ concurrency


def _sets(root: str, writer: int, n: int, go: object) -> None:
    go.wait(10)  # type: ignore[attr-defined]
    store = ProfileStore(root)
    for j in range(n):
        store.set("shared", numbered(writer * 100 + j), message=f"i={writer * 100 + j}")


def test_concurrent_process_writers_get_contiguous_versions(tmp_path):
    go = FORK.Event()
    procs = [FORK.Process(target=_sets, args=(str(tmp_path), w, 10, go)) for w in range(4)]
    for p in procs:
        p.start()
    go.set()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    store = ProfileStore(tmp_path)
    history = store.history("shared")
    assert [h.version for h in history] == list(range(1, 41))
    messages = [h.message for h in history]
    assert sorted(messages) == sorted(f"i={w * 100 + j}" for w in range(4) for j in range(10))
    for w in range(4):  # each writer's own sets appear in the order it made them
        mine = [m for m in messages if m is not None and int(m[2:]) // 100 == w]
        assert mine == [f"i={w * 100 + j}" for j in range(10)]
    for h in history:
        assert store.get("shared", h.version).core_semantics[0] == f"w{h.message[2:]}"


def test_concurrent_thread_writers_get_contiguous_versions(store):
    results: list[int] = []
    lock = threading.Lock()

    def work() -> None:
        for _ in range(5):
            v = store.set("t", BASE)
            with lock:
                results.append(v)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(results) == list(range(1, 21))
    assert store.versions("t") == list(range(1, 21))


def _write_forever(root: str, start: int) -> None:
    store = ProfileStore(root)
    i = start
    while True:
        store.set("k", numbered(i), message=f"i={i}")
        i += 1


def test_sigkilled_writers_never_expose_a_partial_snapshot(tmp_path):
    """≥100 writers are SIGKILLed 5-50 ms after they start writing in a loop, while this process keeps reading."""
    kills = 100
    store = ProfileStore(tmp_path)
    store.set("k", numbered(0), message="i=0")
    rng = random.Random(1234)
    reads = torn = 0
    last = 1
    for k in range(kills):
        proc = FORK.Process(target=_write_forever, args=(str(tmp_path), (k + 1) * 1_000_000), daemon=True)
        proc.start()
        until = time.monotonic() + rng.uniform(0.005, 0.05)
        while time.monotonic() < until:
            snap = store.snapshot("k")  # raises on any partial or damaged file
            assert snap.message == f"i={snap.profile.core_semantics[0][1:]}"
            assert snap.version >= last
            last = snap.version
            reads += 1
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        assert proc.exitcode == -signal.SIGKILL  # the writer never failed on its own
        torn += any(n.startswith(".") and ".tmp-" in n for n in os.listdir(tmp_path / "k"))
    assert reads > kills
    assert torn > 0, "no kill landed mid-write, so this test proved nothing"
    history = store.history("k")  # every snapshot parses and validates
    assert [h.version for h in history] == list(range(1, len(history) + 1))
    assert len(history) > kills // 4  # killed lock holders did not block the next writer
    assert store.set("k", numbered(1), message="i=1") == len(history) + 1
    assert not [n for n in os.listdir(tmp_path / "k") if ".tmp-" in n]


# ------------------------------------------------------------------------------------------------ CLI


def _cli(store_root: Path, *args: str):
    return runner.invoke(app, ["profile", "--store", str(store_root), *args])


def test_cli_round_trip(tmp_path):
    root = tmp_path / "store"
    f1 = tmp_path / "space.yaml"
    f1.write_text("core_semantics: [orbit, planet]\ngravity_strength: 1.2\n")
    f2 = tmp_path / "space2.json"
    f2.write_text(json.dumps({"core_semantics": ["orbit", "planet"], "gravity_strength": 2.5}))
    res = _cli(root, "list")
    assert res.exit_code == 0 and "no profiles" in res.output
    res = _cli(root, "set", "space", str(f1), "--message", "first cut")
    assert res.exit_code == 0 and "space: stored version 1" in res.output
    assert _cli(root, "set", "space", str(f2)).exit_code == 0
    res = _cli(root, "list")
    assert res.exit_code == 0 and "space" in res.output and "2" in res.output
    res = _cli(root, "history", "space")
    assert res.exit_code == 0 and "first cut" in res.output
    res = _cli(root, "show", "space", "--version", "1")
    assert res.exit_code == 0
    shown = json.loads(res.stdout)
    assert shown["gravity_strength"] == 1.2 and shown["name"] == "space"
    assert "space version 1" in res.stderr and "first cut" in res.stderr
    res = _cli(root, "diff", "space", "1", "2")
    assert (
        res.exit_code == 0
        and '-  "gravity_strength": 1.2,' in res.output
        and '+  "gravity_strength": 2.5,' in res.output
    )
    res = _cli(root, "diff", "space", "1", "2", "--keys")
    assert res.exit_code == 0 and "gravity_strength" in res.output and "2.5" in res.output
    res = _cli(root, "rollback", "space", "--to", "1")
    assert res.exit_code == 0 and "stored version 3 (= version 1)" in res.output
    assert "are identical" in _cli(root, "diff", "space", "1", "3").output
    assert ProfileStore(root).get("space").gravity_strength == 1.2
    shown_file = tmp_path / "shown.json"  # `show` output can be `set` again
    shown_file.write_text(_cli(root, "show", "space", "--version", "2").stdout)
    assert _cli(root, "set", "space", str(shown_file)).exit_code == 0
    assert ProfileStore(root).get("space") == ProfileStore(root).get("space", 2)


def test_cli_store_comes_from_the_environment(tmp_path, monkeypatch):
    f = tmp_path / "p.json"
    f.write_text(json.dumps(BASE))
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "envstore"))
    res = runner.invoke(app, ["profile", "set", "p", str(f)])
    assert res.exit_code == 0
    assert ProfileStore(tmp_path / "envstore").head_version("p") == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["show", "spcae"], "did you mean 'space'?"),
        (["show", "space", "--version", "5"], "has no version 5; it has versions 1"),
        (["history", "../etc"], "is not allowed"),
        (["diff", "space", "1", "9"], "has no version 9"),
        (["rollback", "space", "--to", "4"], "has no version 4"),
        (["set", "space", "missing.json"], "does not exist"),
    ],
)
def test_cli_errors_exit_2_with_a_message(tmp_path, args, message):
    root = tmp_path / "store"
    ProfileStore(root).set("space", BASE)
    res = _cli(root, *args)
    assert res.exit_code == 2
    assert "error:" in res.output and message in res.output
    assert ProfileStore(root).head_version("space") == 1


def test_cli_set_rejects_a_bad_profile_naming_the_key(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"core_semantics": ["x"], "gravity_strenght": 2}))
    res = _cli(tmp_path / "store", "set", "space", str(bad))
    assert res.exit_code == 2 and "gravity_strenght" in res.output and "gravity_strength" in res.output
    assert ProfileStore(tmp_path / "store").names() == []


def test_cli_help_lists_profile_and_ends_with_examples():
    res = runner.invoke(app, ["--help"])
    assert res.exit_code == 0 and "profile" in res.output
    res = runner.invoke(app, ["profile", "--help"])
    assert res.exit_code == 0
    for cmd in ("list", "show", "set", "history", "diff", "rollback", "--store"):
        assert cmd in res.output
    assert "ngrav profile rollback space --to 1" in res.output


def test_a_damaged_head_is_flagged_and_the_others_are_listed(tmp_path):
    """One damaged head snapshot made `profile list` fail for every profile."""
    from typer.testing import CliRunner

    from narrative_gravity.cli.main import app
    from narrative_gravity.profiles.store import StoreDamagedError

    store = ProfileStore(tmp_path)
    store.set("fine", {"core_semantics": ["orbit"]})
    store.set("broken", {"core_semantics": ["orbit"]})
    (tmp_path / "broken" / "000001.json").write_text("[1, 2", encoding="utf-8")
    infos = {i.name: i for i in store.list()}
    assert infos["fine"].error is None and infos["fine"].version == 1
    assert "damaged" in infos["broken"].error
    with pytest.raises(StoreDamagedError):
        store.get("broken")
    res = CliRunner().invoke(app, ["profile", "--store", str(tmp_path), "list"], env={"COLUMNS": "300"})
    assert res.exit_code == 0, res.output
    assert "fine" in res.output and "damaged: broken" in res.output
