from __future__ import annotations

from pathlib import Path

import pytest

from kvgraft.core.errors import IntegrityError, NotFoundError
from kvgraft.core.sampling import SamplingParams
from kvgraft.engine.engine import Engine
from kvgraft.engine.verify import verify_receipt
from kvgraft.store import LocalStore
from kvgraft.store.cache import CachedStore, stored_bytes

from conftest import TEXT, cached_model


def _engine(store: CachedStore | LocalStore) -> Engine:
    model, tokenizer = cached_model("random:gemma4")
    return Engine(model, tokenizer, "random:gemma4", 16, store)


def test_lru_stays_within_its_byte_budget(tmp_path: Path) -> None:
    local = LocalStore(tmp_path / "s")
    ids = [_engine(local).put(f"{TEXT} {i}").id for i in range(5)]
    one = stored_bytes(local.get(ids[0]))
    cache = CachedStore(local, max_bytes=2 * one + one // 2)  # room for two grafts
    for graft_id in ids:
        cache.get(graft_id)
        assert cache.resident_bytes <= cache.max_bytes
    assert cache.cached_ids() == ids[-2:]
    cache.get(ids[3])  # a hit refreshes recency
    cache.get(ids[0])  # a miss evicts the least recently used
    assert cache.cached_ids() == [ids[3], ids[0]]
    assert (cache.hits, cache.misses) == (1, 6)
    cache.delete(ids[0][:10])
    assert cache.cached_ids() == [ids[3]] and cache.resident_bytes == one
    with pytest.raises(NotFoundError):
        cache.get(ids[0])


def test_a_graft_larger_than_the_budget_is_served_but_not_kept(tmp_path: Path) -> None:
    local = LocalStore(tmp_path / "s")
    graft_id = _engine(local).put(TEXT).id
    cache = CachedStore(local, max_bytes=10)
    assert cache.get(graft_id).manifest.id == graft_id
    assert cache.cached_ids() == [] and cache.resident_bytes == 0


def test_restores_served_from_the_cache_stay_exact(tmp_path: Path) -> None:
    cache = CachedStore(LocalStore(tmp_path / "s"), max_bytes=1 << 30)
    engine = _engine(cache)
    graft_id = engine.put(TEXT * 2).id
    params = SamplingParams(max_new_tokens=5)
    first = engine.generate(" x", graft_id=graft_id, params=params)
    second = engine.generate(" x", graft_id=graft_id, params=params)  # from RAM; the first run must not have
    assert cache.hits >= 1  # mutated the cached tensors
    assert first.receipt.logits_chain_sha256 == second.receipt.logits_chain_sha256
    assert verify_receipt(engine, second.receipt).exact


def test_prefetch_loads_in_the_background_and_the_next_get_is_a_hit(tmp_path: Path) -> None:
    local = LocalStore(tmp_path / "s")
    ids = [_engine(local).put(f"{TEXT} {i}").id for i in range(2)]
    cache = CachedStore(local, max_bytes=1 << 30)
    future = cache.start_prefetch(ids[1][:10])
    assert future is not None
    assert future.result(timeout=60).manifest.id == ids[1]
    assert cache.prefetch(ids[1]) is False  # already cached: nothing to do
    assert cache.get(ids[1]).manifest.id == ids[1]
    assert (cache.hits, cache.misses, cache.prefetched) == (1, 0, 1)
    assert cache.cached_ids() == [ids[1]]


def test_a_prefetch_of_a_corrupted_graft_fails_when_it_is_asked_for(tmp_path: Path) -> None:
    local = LocalStore(tmp_path / "s")
    graft_id = _engine(local).put(TEXT).id
    block = local.block_path(local.manifest(graft_id).blocks[0].key)
    raw = bytearray(block.read_bytes())
    raw[-1] ^= 0x01
    block.write_bytes(bytes(raw))
    cache = CachedStore(local, max_bytes=1 << 30)
    future = cache.start_prefetch(graft_id)
    assert future is not None and isinstance(future.exception(timeout=60), IntegrityError)
    with pytest.raises(IntegrityError, match="does not match its SHA-256"):
        cache.get(graft_id)
    assert cache.cached_ids() == []


def test_engine_prefetch_needs_a_ram_tier(tmp_path: Path) -> None:
    local = LocalStore(tmp_path / "s")
    graft_id = _engine(local).put(TEXT).id
    assert _engine(local).prefetch(graft_id) is False
    cache = CachedStore(local, max_bytes=1 << 30)
    engine = _engine(cache)
    assert engine.prefetch(graft_id) is True
    restored = engine.restore(graft_id)  # waits for the prefetch rather than reading the graft twice
    assert restored.manifest.id == graft_id and cache.misses == 0 and cache.hits == 1
