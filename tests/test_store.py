from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kvgraft.core.errors import FormatError, IntegrityError, NotFoundError, StoreError
from kvgraft.format.blocks import block_digest
from kvgraft.format.tensor_files import block_file_bytes
from kvgraft.library.index import store_stats
from kvgraft.store import LocalStore, default_store_path, open_store
from kvgraft.store.base import GcReport

from conftest import TEST_CHUNK, TEXT, EngineFactory


def test_put_is_idempotent_and_leaves_no_staging(make_engine: EngineFactory, store: LocalStore) -> None:
    engine = make_engine()
    first = engine.put(TEXT)
    again = engine.put(TEXT)
    assert first.id == again.id and first.created and not again.created
    assert store.ids() == [first.id]
    assert list((store.root / "tmp").iterdir()) == []


def test_get_returns_the_stored_tensors(make_engine: EngineFactory, store: LocalStore) -> None:
    engine = make_engine()
    built = engine.build(TEXT)
    assert len(built.blocks) == len(built.manifest.blocks) == built.manifest.aligned_tokens // TEST_CHUNK
    graft_id, _ = store.put(built.manifest, built.tensors, built.blocks)
    stored = store.get(graft_id[:10])
    assert stored.manifest == built.manifest
    # Each layer's tensor is its blocks end to end, [1, kv_heads, aligned_tokens, head_dim].
    for name in built.blocks[built.manifest.blocks[0].key]:
        joined = torch.cat([built.blocks[ref.key][name] for ref in built.manifest.blocks], dim=-2)
        assert stored.tensors[name].dtype == joined.dtype
        assert stored.tensors[name].numpy().tobytes() == joined.numpy().tobytes()
    assert sorted(p.name for p in (store.root / "grafts" / graft_id).iterdir()) == [
        "manifest.json",
        "tensors.safetensors",
    ]
    assert len(store.block_files()) == len(built.manifest.blocks)


def test_resolve_by_prefix_unknown_and_ambiguous(make_engine: EngineFactory, store: LocalStore) -> None:
    engine = make_engine()
    ids = [engine.put(f"{TEXT} variant {i}").id for i in range(20)]
    assert store.resolve(ids[0][:12]) == ids[0]
    with pytest.raises(NotFoundError, match="no graft 0000000000 in store"):
        store.resolve("0000000000")
    with pytest.raises(NotFoundError, match="not a graft id"):
        store.resolve("not-hex!")
    firsts = [i[0] for i in ids]
    shared = next(c for c in firsts if firsts.count(c) > 1)  # 20 ids over 16 hex digits: some first digit repeats
    with pytest.raises(NotFoundError, match=f"graft id prefix {shared} is ambiguous"):
        store.resolve(shared)


def _last_block(store: LocalStore, graft_id: str) -> Path:
    return store.block_path(store.manifest(graft_id).blocks[-1].key)


def test_flipped_byte_in_a_block_is_an_integrity_error(make_engine: EngineFactory, store: LocalStore) -> None:
    engine = make_engine()
    put = engine.put(TEXT)
    path = _last_block(store, put.id)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    key = store.manifest(put.id).blocks[-1].key
    with pytest.raises(IntegrityError, match=f"block {key[:12]} does not match its SHA-256"):
        store.get(put.id)


def test_truncated_block_is_a_format_error(make_engine: EngineFactory, store: LocalStore) -> None:
    engine = make_engine()
    put = engine.put(TEXT)
    path = _last_block(store, put.id)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(FormatError, match="truncated"):
        store.get(put.id)


def test_missing_block_is_a_format_error(make_engine: EngineFactory, store: LocalStore) -> None:
    engine = make_engine()
    put = engine.put(TEXT)
    key = store.manifest(put.id).blocks[0].key
    store.block_path(key).unlink()
    with pytest.raises(FormatError, match=f"block {key[:12]} is missing"):
        store.get(put.id)


def test_delete_removes_the_graft(make_engine: EngineFactory, store: LocalStore) -> None:
    engine = make_engine()
    put = engine.put(TEXT)
    store.delete(put.id[:8])
    assert store.ids() == []
    with pytest.raises(NotFoundError):
        store.get(put.id)


def test_store_path_that_is_a_file_is_refused(make_engine: EngineFactory, tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    engine = make_engine()
    built = engine.build(TEXT)
    with pytest.raises(StoreError, match="is not a directory"):
        LocalStore(blocker).put(built.manifest, built.tensors, built.blocks)


def test_default_store_path_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("KVGRAFT_STORE", raising=False)
    assert default_store_path() == Path(".kvgraft")
    monkeypatch.setenv("KVGRAFT_STORE", str(tmp_path / "s"))
    assert open_store().root == tmp_path / "s"
    assert open_store(tmp_path / "x").root == tmp_path / "x"


def test_a_crash_before_the_rename_leaves_no_graft(
    make_engine: EngineFactory, store: LocalStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Simulate a failure after the files are written but before the directory rename: nothing is visible."""
    engine = make_engine()
    built = engine.build(TEXT)

    def crash(self: Path, target: str | os.PathLike[str]) -> Path:
        raise OSError(5, "simulated crash")

    monkeypatch.setattr(Path, "rename", crash)
    with pytest.raises(StoreError, match="simulated crash"):
        store.put(built.manifest, built.tensors, built.blocks)
    monkeypatch.undo()
    assert store.ids() == []
    assert list((store.root / "tmp").iterdir()) == []
    # The failed put took back the blocks it wrote, so a full disk is freed at once, not after gc's grace period.
    assert store.block_files() == []
    assert store.put(built.manifest, built.tensors, built.blocks) == (built.manifest.id, True)


def test_gc_keeps_young_unreferenced_blocks_and_says_so(make_engine: EngineFactory, store: LocalStore) -> None:
    """Blocks a killed put left (it could not take them back) are litter no graft names: gc keeps them for the grace
    period (a build may be about to name them), counts them, and removes them once old enough."""
    built = make_engine().build(TEXT)
    store._ensure_writable()
    for ref in built.manifest.blocks:
        store._put_block(ref, built.blocks[ref.key])
    assert store.gc(grace_s=3600) == GcReport(0, 0, kept_young=len(built.manifest.blocks))
    report = store.gc(grace_s=0)
    assert (report.removed, report.kept_young) == (len(built.manifest.blocks), 0)
    assert report.freed_bytes > 0 and store.block_files() == []


PREAMBLE = "You are a careful solver. Show the work, then the answer. " * 4


def test_shared_prefix_blocks_are_stored_once(make_engine: EngineFactory, store: LocalStore) -> None:
    engine = make_engine()
    first = engine.put(PREAMBLE + "Question one: what is two plus two?")
    second = engine.put(PREAMBLE + "Question two: what is three times three?")
    tokens = [engine.encode_context(PREAMBLE + q) for q in ("Question one", "Question two")]
    common = next(i for i, (x, y) in enumerate(zip(*tokens, strict=False)) if x != y)
    shared = common // TEST_CHUNK
    assert (first.reused_blocks, second.reused_blocks) == (0, shared)
    a, b = (store.manifest(p.id).blocks for p in (first, second))
    assert [r.key for r in a[:shared]] == [r.key for r in b[:shared]]
    assert a[shared].key != b[shared].key
    assert len(store.block_files()) == len(a) + len(b) - shared
    stats = store_stats(store)
    assert stats.logical_bytes == first.bytes + second.bytes
    assert stats.disk_bytes < stats.logical_bytes and stats.dedup_ratio > 1.0
    # Deleting one graft keeps the blocks the other still names.
    store.delete(first.id)
    assert len(store.block_files()) == len(b)
    assert store.get(second.id).manifest.id == second.id
    store.delete(second.id)
    assert store.block_files() == []


def test_a_stored_block_with_other_bytes_is_refused(make_engine: EngineFactory, store: LocalStore) -> None:
    engine = make_engine()
    built = engine.build(TEXT)
    ref = built.manifest.blocks[0]
    other = {name: tensor + 1 for name, tensor in built.blocks[ref.key].items()}
    # Write the forged block under the real key, as a nondeterministic environment would.
    store.block_path(ref.key).parent.mkdir(parents=True)
    store.block_path(ref.key).write_bytes(block_file_bytes(other, block_digest(other)))
    with pytest.raises(IntegrityError, match=f"block {ref.key[:12]} is stored with other bytes"):
        store.put(built.manifest, built.tensors, built.blocks)


def test_a_damaged_shared_block_is_recomputed_and_replaced_by_the_next_build(
    make_engine: EngineFactory, store: LocalStore
) -> None:
    engine = make_engine()
    first = engine.put(PREAMBLE + "Question one")
    key = store.manifest(first.id).blocks[0].key
    path = store.block_path(key)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError):
        store.get(first.id)
    second = engine.put(PREAMBLE + "Question two")
    assert second.reused_blocks == 0  # the damaged first block stopped the reuse at once
    assert store.get(first.id).manifest.id == first.id  # and its rewrite repaired the first graft too


def test_a_block_whose_dtype_differs_from_the_manifest_is_refused(
    make_engine: EngineFactory, store: LocalStore
) -> None:
    engine = make_engine()
    put = engine.put(TEXT)
    ref = store.manifest(put.id).blocks[0]
    tensors = store.read_block(ref.key)[1]
    as_bf16 = {name: t.clone().view(torch.bfloat16) for name, t in tensors.items()}
    store.block_path(ref.key).write_bytes(block_file_bytes(as_bf16, ref.sha256))  # same bytes, other dtype
    with pytest.raises(FormatError, match=r"is torch\.bfloat16, the manifest says float32"):
        store.get(put.id)


def test_gc_clears_staging_litter(store: LocalStore, make_engine: EngineFactory) -> None:
    make_engine().put(TEXT)
    litter = store.root / "tmp" / "abandoned-put"
    litter.mkdir()
    (litter / "tensors.safetensors").write_bytes(b"partial")
    assert store.gc(grace_s=3600).removed == 0 and litter.exists()
    store.gc(grace_s=0)
    assert not litter.exists() and len(store.ids()) == 1


def test_sidecars_are_written_through_tmp_and_a_failed_write_leaves_nothing(
    store: LocalStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.root.mkdir(parents=True)
    store.write_sidecar("index.json", b"{}")
    store.write_sidecar("receipts/" + "a" * 64 + ".json", b"{}")
    assert sorted(p.name for p in store.root.iterdir()) == ["index.json", "lock", "receipts", "tmp"]
    assert list((store.root / "tmp").iterdir()) == []

    def disk_full(*_: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", disk_full)
    store.write_sidecar("index.json", b'{"new": 1}')  # a derived file: kept as it was, never half-written
    assert (store.root / "index.json").read_bytes() == b"{}"
    assert list((store.root / "tmp").iterdir()) == []
    with pytest.raises(StoreError, match="not a sidecar name"):
        store.write_sidecar("../escape.json", b"{}")
