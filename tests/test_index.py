"""The persistent library index: derived from the graft directories, rebuilt when lost, reconciled after a crash."""

from __future__ import annotations

import json
import shutil

from typer.testing import CliRunner

from kvgraft.cli import app
from kvgraft.format.metadata import GraftKind
from kvgraft.library.index import INDEX_NAME, INDEX_VERSION, load_index, store_stats
from kvgraft.store import LocalStore

from conftest import TEXT, EngineFactory


def _fill(make_engine: EngineFactory, n: int) -> list[str]:
    engine = make_engine()
    return [engine.put(f"{TEXT} number {i}", metadata={"title": f"t{i}"}).id for i in range(n)]


def test_index_is_rebuilt_after_it_is_deleted(make_engine: EngineFactory, store: LocalStore) -> None:
    ids = _fill(make_engine, 3)
    first = load_index(store)
    assert sorted(first) == sorted(ids) and (store.root / INDEX_NAME).is_file()
    (store.root / INDEX_NAME).unlink()
    assert load_index(store) == first
    (store.root / INDEX_NAME).write_text("{damaged")
    assert load_index(store) == first
    assert json.loads((store.root / INDEX_NAME).read_text())["index_version"] == INDEX_VERSION


def test_index_catches_up_after_a_crash_between_graft_write_and_index_update(
    make_engine: EngineFactory, store: LocalStore
) -> None:
    ids = _fill(make_engine, 2)
    load_index(store)
    saved = (store.root / INDEX_NAME).read_text()
    new = make_engine().put(TEXT + " written just before the crash").id
    (store.root / INDEX_NAME).write_text(saved)  # the index update never happened
    entries = load_index(store)
    assert sorted(entries) == sorted([*ids, new])
    assert entries[new].tokens == len(store.manifest(new).tokens)
    # and a graft removed behind the index's back is dropped
    shutil.rmtree(store.root / "grafts" / ids[0])
    assert sorted(load_index(store)) == sorted([ids[1], new])


def test_store_stats_counts_grafts_tokens_and_bytes(make_engine: EngineFactory, store: LocalStore) -> None:
    ids = _fill(make_engine, 3)
    stats = store_stats(store)
    assert stats.grafts == 3
    assert stats.tokens == sum(len(store.manifest(i).tokens) for i in ids)
    # The grafts begin with the same text: their leading blocks are on disk once but count for each graft.
    assert stats.logical_bytes == sum(store.size_bytes(i) for i in ids)
    files = [p for p in store.root.rglob("*") if p.is_file() and p.name != INDEX_NAME]
    assert stats.disk_bytes == sum(p.stat().st_size for p in files)
    assert stats.dedup_ratio == stats.logical_bytes / stats.disk_bytes > 1.5
    result = CliRunner().invoke(app, ["store", "stats", "--store", str(store.root), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == stats.to_json()


def test_index_reads_metadata_leniently_and_types_the_known_kinds(
    make_engine: EngineFactory, store: LocalStore
) -> None:
    engine = make_engine()
    problem = {"id": "p1", "problem_sha256": "s1", "text": "How many pens now?"}
    block = engine.put(f"{TEXT} block", metadata={"kind": "block", "problems": [problem, "junk", {"id": "x"}]}).id
    replay_meta = {"kind": "replay", "problem_id": "p1", "problem_sha256": "s1", "prompt_tokens_sha256": "h1"}
    replay = engine.put(f"{TEXT} replay", metadata=replay_meta).id
    note = engine.put(f"{TEXT} note", metadata={"kind": "note", "summary": "a note"}).id
    broken = engine.put(f"{TEXT} broken", metadata={"kind": "replay", "problems": 7}).id
    entries = load_index(store)
    assert entries[block].kind is GraftKind.BLOCK and entries[block].problems == [problem]
    assert entries[block].retrieval_texts() == [("p1", "How many pens now?")]
    assert entries[replay].kind is GraftKind.REPLAY and entries[replay].prompt_tokens_sha256 == "h1"
    assert entries[replay].problems == [{"id": "p1", "problem_sha256": "s1"}]
    assert entries[note].kind == "note" and entries[note].retrieval_texts() == [("summary", "a note")]
    assert entries[broken].kind is GraftKind.REPLAY and entries[broken].problems == []
    rows = {row["id"]: row for row in json.loads((store.root / INDEX_NAME).read_text())["grafts"]}
    assert [rows[i]["kind"] for i in (block, replay, note, broken)] == ["block", "replay", "note", "replay"]
    again = load_index(store)  # read back from index.json: the kinds are typed again
    assert again == entries and again[block].kind is GraftKind.BLOCK and again[replay].kind is GraftKind.REPLAY
