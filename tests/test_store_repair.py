"""Damage and races a store survives (issue 12 items 1, 2, 9, 12, 14): a rebuild repairs, a damaged manifest is one
damaged row, the index is checked, a block removed under a build is recomputed, a failed put takes back its blocks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvgraft.cli.app import app
from kvgraft.core.errors import IntegrityError, MissingBlockError, StoreError
from kvgraft.library.index import INDEX_NAME, load_index, scan_index, store_stats
from kvgraft.store import LocalStore
from kvgraft.store.base import keys_named_in, scan_manifests

from conftest import TEXT, EngineFactory

OTHER = "An unrelated text that shares no prefix with the first one, long enough for a few chunks of its own."


def _flip(path: Path, offset: int = -1) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _manifest_path(store: LocalStore, graft_id: str) -> Path:
    return store.root / "grafts" / graft_id / "manifest.json"


def test_a_rebuild_repairs_a_damaged_block_of_an_existing_graft(make_engine: EngineFactory, store: LocalStore) -> None:
    engine = make_engine()
    put = engine.put(TEXT)
    second = store.block_path(store.manifest(put.id).blocks[1].key)
    good = second.read_bytes()
    _flip(second)
    with pytest.raises(IntegrityError):
        store.get(put.id)
    again = engine.put(TEXT)
    assert again.id == put.id and not again.created
    assert second.read_bytes() == good
    store.get(put.id)  # every hash checks again


@pytest.mark.parametrize("part", ["manifest.json", "tensors.safetensors"])
def test_a_rebuild_repairs_a_damaged_graft_file(make_engine: EngineFactory, store: LocalStore, part: str) -> None:
    engine = make_engine()
    put = engine.put(TEXT)
    path = store.root / "grafts" / put.id / part
    path.write_bytes(path.read_bytes()[:-7])  # truncated
    assert list(scan_manifests(store).damaged) == ([put.id] if part == "manifest.json" else [])
    again = engine.put(TEXT)
    assert again.id == put.id and not again.created
    assert store.get(put.id).manifest.id == put.id
    assert list((store.root / "tmp").iterdir()) == []


def test_a_damaged_manifest_is_one_damaged_row_and_every_walk_carries_on(
    make_engine: EngineFactory, store: LocalStore
) -> None:
    engine = make_engine()
    healthy, broken = engine.put(TEXT), engine.put(OTHER)
    own_blocks = {ref.key for ref in store.manifest(broken.id).blocks}
    path = _manifest_path(store, broken.id)
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    (store.root / INDEX_NAME).unlink(missing_ok=True)  # the index takes the damaged graft in: found damaged

    runner = CliRunner()
    listed = runner.invoke(app, ["ls", "--store", str(store.root), "--json"])
    assert listed.exit_code == 0, listed.output
    data = json.loads(listed.output)
    assert [row["id"] for row in data["grafts"]] == [healthy.id]
    assert [row["id"] for row in data["damaged"]] == [broken.id]
    assert "manifest" in data["damaged"][0]["error"]

    stats = runner.invoke(app, ["store", "stats", "--store", str(store.root), "--json"])
    assert stats.exit_code == 0, stats.output
    assert json.loads(stats.output)["grafts"] == 1 and json.loads(stats.output)["damaged_grafts"] == 1
    assert store.gc(0.0).removed == 0  # the blocks its surviving bytes name are kept: a rebuild may repair it

    # rm frees the blocks no healthy graft names: its surviving bytes' keys now, the rest by the next gc
    store.delete(broken.id)
    assert store.ids() == [healthy.id]
    store.gc(0.0)
    on_disk = {p.name.removesuffix(".safetensors") for p in store.block_files()}
    assert on_disk == {ref.key for ref in store.manifest(healthy.id).blocks}
    assert not own_blocks & on_disk
    store.get(healthy.id)


def test_keys_named_in_finds_what_survives_of_a_truncated_manifest() -> None:
    key = "ab" * 32
    assert keys_named_in(b'{"blocks": [{"key": "' + key.encode() + b'", "sha256": "12') == {key}


def test_a_damaged_index_is_rebuilt_not_trusted(make_engine: EngineFactory, store: LocalStore) -> None:
    engine = make_engine()
    engine.put(TEXT, metadata={"title": "first", "summary": "the first summary"})
    truth = load_index(store)
    path = store.root / INDEX_NAME
    raw = path.read_bytes()
    at = raw.index(b"the first summary")
    path.write_bytes(raw[:at] + b"THE" + raw[at + 3 :])  # same length, still valid JSON: only the checksum tells
    assert load_index(store) == truth
    assert b"the first summary" in path.read_bytes()  # rewritten from the manifests


def test_a_put_whose_reused_blocks_were_removed_is_a_missing_block_error(
    make_engine: EngineFactory, store: LocalStore
) -> None:
    engine = make_engine()
    parent = engine.put(TEXT)
    built = engine.build(" and a continuation of it, long enough to add a block or two.", after=parent.id)
    assert built.reused_blocks > 0
    store.delete(parent.id)  # a concurrent rm, between the build's reads and its put
    with pytest.raises(MissingBlockError, match="neither stored nor given"):
        store.put(built.manifest, built.tensors, built.blocks)
    assert store.ids() == [] and store.block_files() == []  # the blocks it had written are taken back
    m = built.manifest
    fresh = engine.build_tokens(list(m.tokens), m.source_sha256, dict(m.metadata), reuse_stored=False)
    assert fresh.manifest.blocks == m.blocks  # computed again: the same keys and bytes
    assert store.put(fresh.manifest, fresh.tensors, fresh.blocks)[1]


def test_engine_put_recovers_from_blocks_removed_under_it(
    make_engine: EngineFactory, store: LocalStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine()
    first = engine.put(TEXT)
    real_build = engine.build

    def build_then_lose_blocks(*args: object, **kwargs: object) -> object:
        built = real_build(*args, **kwargs)  # type: ignore[arg-type]
        store.delete(first.id)  # what a concurrent `kvgraft rm` does between the build and its put
        return built

    monkeypatch.setattr(engine, "build", build_then_lose_blocks)
    again = engine.put(TEXT + " More.")
    assert again.created
    store.get(again.id)
    assert store.ids() == [again.id]


def test_a_failed_put_takes_back_the_blocks_it_wrote(
    make_engine: EngineFactory, store: LocalStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine()
    built = engine.build(TEXT)

    def full_disk(*args: object) -> None:
        raise StoreError("cannot write graft: No space left on device")

    monkeypatch.setattr(store, "_commit", full_disk)
    with pytest.raises(StoreError, match="No space left"):
        store.put(built.manifest, built.tensors, built.blocks)
    assert store.block_files() == [] and store.ids() == []
    assert list((store.root / "tmp").iterdir()) == []


def test_stats_and_sizes_carry_on_when_blocks_vanish(make_engine: EngineFactory, store: LocalStore) -> None:
    engine = make_engine()
    put = engine.put(TEXT)
    store.block_path(store.manifest(put.id).blocks[0].key).unlink()  # what a concurrent rm does mid-walk
    assert store.size_bytes(put.id) > 0
    assert store_stats(store).grafts == 1
    assert scan_index(store).damaged == {}
