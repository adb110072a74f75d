from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvgraft.errors import FormatError, IntegrityError, NotFoundError, StoreError
from kvgraft.store import LocalStore, default_store_path, open_store

from conftest import TEXT, EngineFactory


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
    graft_id, _ = store.put(built.manifest, built.tensors)
    stored = store.get(graft_id[:10])
    assert stored.manifest == built.manifest
    assert sorted(stored.tensors) == sorted(built.tensors)
    for name, tensor in built.tensors.items():
        assert tensor.dtype == stored.tensors[name].dtype
        assert tensor.numpy().tobytes() == stored.tensors[name].numpy().tobytes()


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


def test_flipped_byte_is_an_integrity_error(make_engine: EngineFactory, store: LocalStore) -> None:
    engine = make_engine()
    put = engine.put(TEXT)
    path = Path(store.tensors_path(put.id))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=r"tensor layers\.3\.value does not match its SHA-256"):
        store.get(put.id)


def test_truncated_file_is_a_format_error(make_engine: EngineFactory, store: LocalStore) -> None:
    engine = make_engine()
    put = engine.put(TEXT)
    path = Path(store.tensors_path(put.id))
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(FormatError, match="truncated"):
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
        LocalStore(blocker).put(built.manifest, built.tensors)


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
        store.put(built.manifest, built.tensors)
    monkeypatch.undo()
    assert store.ids() == []
    assert list((store.root / "tmp").iterdir()) == []
