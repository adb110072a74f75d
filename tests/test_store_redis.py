"""The Redis tier against a real redis-server (see conftest_redis.py): the same generations as the durable store,
hits shared between processes, a corrupted entry never served, Redis going away mid-run never failing a request,
and `--shared-cache` on the CLI.
"""

from __future__ import annotations

import json
import logging
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest_redis import RedisServer
from typer.testing import CliRunner

from kvgraft.cli import app
from kvgraft.core.errors import StoreError
from kvgraft.core.sampling import SamplingParams
from kvgraft.engine.engine import Engine
from kvgraft.format.manifest import expected_hashes
from kvgraft.store import GraftStore, LocalStore
from kvgraft.store.cache import CachedStore

from conftest import TEST_CHUNK, TEXT, cached_model

pytest.importorskip("redis", reason="the Redis tier needs the redis package: pip install redis")

from kvgraft.store.redis_tier import RedisTier, with_shared_cache  # after the skip: redis may be missing

MODEL = "random:llama"
PARAMS = SamplingParams(max_new_tokens=6)
ALIGNED = TEXT + " again" * 4
"""224 tokens under random:llama: whole blocks only, so the graft keeps next-token logits of its own."""


def _engine(store: GraftStore) -> Engine:
    model, tokenizer = cached_model(MODEL)
    return Engine(model, tokenizer, MODEL, TEST_CHUNK, store)


def _dead_url() -> str:
    with socket.socket() as sock:  # a port nothing listens on once closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"redis://127.0.0.1:{port}/0"


def test_generations_through_the_tier_equal_the_durable_stores_and_a_second_process_hits(
    redis_url: str, tmp_path: Path
) -> None:
    local = LocalStore(tmp_path / "store")
    put = _engine(local).put(TEXT)
    manifest = local.manifest(put.id)
    entries = len(manifest.blocks) + len(expected_hashes(manifest))  # the blocks, and the own tensors file if any
    first = RedisTier(local, redis_url)
    assert first.location == f"{redis_url} over {local.location}"
    via_tier = _engine(first).generate(" and", put.id, PARAMS)
    direct = _engine(local).generate(" and", put.id, PARAMS)
    assert via_tier.exact and via_tier.output_tokens == direct.output_tokens
    assert via_tier.receipt.logits_chain_sha256 == direct.receipt.logits_chain_sha256
    assert first.hits == 0 and first.misses > 0 and first.corrupt == first.errors == 0
    # Another process: its own tier instance (and client) over the same durable store finds everything in Redis.
    second = RedisTier(local, redis_url)
    again = _engine(second).generate(" and", put.id, PARAMS)
    assert again.output_tokens == direct.output_tokens
    assert again.receipt.logits_chain_sha256 == direct.receipt.logits_chain_sha256
    assert second.misses == 0 and second.hits == entries
    ref = manifest.blocks[0]
    assert second.read_block(ref.key, ref)[0] == ref and second.hits == entries + 1


def test_an_aligned_grafts_own_tensors_go_through_the_tier_too(
    redis_url: str, redis_server: RedisServer, tmp_path: Path
) -> None:
    local = LocalStore(tmp_path / "store")
    put = _engine(local).put(ALIGNED)
    manifest = local.manifest(put.id)
    assert expected_hashes(manifest) and len(manifest.blocks) > 1  # next-token logits of its own, several blocks
    expected = local.get(put.id)

    def same(tier: RedisTier) -> None:
        got = tier.get(put.id)
        assert set(got.tensors) == set(expected.tensors)
        for name, tensor in expected.tensors.items():
            assert got.tensors[name].equal(tensor), name

    first = RedisTier(local, redis_url)
    same(first)
    assert first.misses == len(manifest.blocks) + 1
    client = redis_server.client()
    client.delete(f"kvgraft:tensors:{put.id}", f"kvgraft:block:{manifest.blocks[1].key}")
    second = RedisTier(local, redis_url)
    same(second)  # the own tensors and one block missed: both read from the store, the other blocks from Redis
    assert second.misses == 2 and second.hits == len(manifest.blocks) - 1
    third = RedisTier(local, redis_url)
    same(third)
    assert third.misses == 0 and third.corrupt == 0 and third.hits == len(manifest.blocks) + 1


def test_a_corrupted_entry_is_a_miss_served_from_the_durable_store_and_replaced(
    redis_url: str, redis_server: RedisServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    local = LocalStore(tmp_path / "store")
    put = _engine(local).put(TEXT)
    tier = RedisTier(local, redis_url)
    tier.get(put.id)  # fills Redis
    ref = local.manifest(put.id).blocks[0]
    client = redis_server.client()
    entry = f"kvgraft:block:{ref.key}"
    good = client.get(entry)
    assert good is not None
    last = len(good) - 1  # the last byte is tensor data: the header still parses, the hash does not match
    client.setrange(entry, last, bytes([good[last] ^ 0x01]))
    expected = local.get(put.id)
    with caplog.at_level(logging.WARNING, logger="kvgraft.store.redis_tier"):
        got = tier.get(put.id)
    assert tier.corrupt == 1 and "failed its check" in caplog.text
    for name, tensor in expected.tensors.items():
        assert got.tensors[name].equal(tensor), name
    assert client.get(entry) == good  # replaced by the durable copy
    read_ref, _ = tier.read_block(ref.key, ref)
    assert read_ref == ref and tier.corrupt == 1


def test_redis_going_away_mid_run_never_fails_a_request(
    redis_url: str, redis_server: RedisServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    local = LocalStore(tmp_path / "store")
    put = _engine(local).put(TEXT)
    direct = _engine(local).generate(" and", put.id, PARAMS)
    tier = RedisTier(local, redis_url, retry_after_s=0.0)
    engine = _engine(tier)
    assert engine.generate(" and", put.id, PARAMS).output_tokens == direct.output_tokens
    if redis_server.process is None:
        tier = RedisTier(local, _dead_url(), retry_after_s=0.0)  # a CI-given Redis is not ours to stop
        engine = _engine(tier)
    else:
        redis_server.process.terminate()  # conftest_redis starts it again for the next test
        redis_server.process.wait(timeout=10)
    with caplog.at_level(logging.WARNING, logger="kvgraft.store.redis_tier"):
        for _ in range(2):
            result = engine.generate(" and", put.id, PARAMS)
            assert result.exact and result.receipt.logits_chain_sha256 == direct.receipt.logits_chain_sha256
    assert tier.errors > 0
    warnings = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING  # once per outage, not per request


def test_a_dead_redis_costs_at_most_one_short_timeout_per_period(tmp_path: Path) -> None:
    local = LocalStore(tmp_path / "store")
    put = _engine(local).put(TEXT)
    tier = RedisTier(local, _dead_url())
    for _ in range(3):
        assert tier.get(put.id).manifest.id == put.id
    assert tier.errors == 1  # the failed call; later ones skip Redis until the retry period is over


def test_delete_drops_the_grafts_entries(redis_url: str, redis_server: RedisServer, tmp_path: Path) -> None:
    tier = RedisTier(LocalStore(tmp_path / "store"), redis_url)
    put = _engine(tier).put(TEXT)
    tier.get(put.id)
    client = redis_server.client()
    assert client.dbsize() > 0
    tier.delete(put.id)
    assert client.dbsize() == 0 and tier.ids() == []


def test_the_ram_tier_goes_in_front_of_the_shared_one(redis_url: str, tmp_path: Path) -> None:
    local = LocalStore(tmp_path / "store")
    engine = Engine.load(MODEL, chunk_size=TEST_CHUNK, store=local, cache_bytes=1 << 30, shared_cache=redis_url)
    assert isinstance(engine.store, CachedStore) and isinstance(engine.store.inner, RedisTier)
    assert with_shared_cache(local, None) is local


@pytest.mark.parametrize("url", ["http://127.0.0.1:6379/0", "redis://:notaport/0", "redis://127.0.0.1:6379/x"])
def test_a_bad_shared_cache_url_is_one_clear_store_error(url: str, tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="shared cache URL") as caught:
        with_shared_cache(LocalStore(tmp_path), url)
    assert "\n" not in str(caught.value)


def test_a_missing_redis_package_is_one_clear_store_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "redis", None)  # import redis now raises ImportError
    with pytest.raises(StoreError, match="needs the redis package"):
        with_shared_cache(LocalStore(tmp_path), "redis://127.0.0.1:6379/0")


def test_the_cli_builds_and_generates_through_a_shared_cache(redis_url: str, tmp_path: Path) -> None:
    runner = CliRunner()
    store = tmp_path / "store"

    def run(*args: object) -> Any:
        result = runner.invoke(app, [str(a) for a in args])
        assert result.exception is None and result.exit_code == 0, f"{result.exception!r} {result.output}"
        return json.loads(result.stdout)

    built = run("build", "--text", TEXT, "--model", MODEL, "--store", store, "-C", TEST_CHUNK, "--json")
    common = ("--prompt", " and", "--graft", built["id"][:12], "-n", 4, "--store", store, "--json")
    out = run("generate", *common, "--shared-cache", redis_url)
    assert out["graft_id"] == built["id"] and out["exact"] is True
    again = run("generate", *common, "--shared-cache", redis_url)  # from Redis this time
    assert again["output_tokens"] == out["output_tokens"]
    bad = runner.invoke(app, ["generate", *map(str, common), "--shared-cache", "redis://host:port/0"])
    assert bad.exit_code != 0 and "shared cache URL" in bad.output
