"""The S3 store against a real S3-compatible server (moto in server mode, see conftest_s3.py): the same grafts and
the same generations as a local store, every fetched byte checked, the manifest as the commit point, gc of what a
killed upload leaves, the CLI on an s3:// store, and one clear StoreError for an endpoint or bucket that is not there.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kvgraft.cli import app
from kvgraft.core.errors import FormatError, IntegrityError, NotFoundError, StoreError
from kvgraft.core.sampling import SamplingParams
from kvgraft.engine.engine import Engine
from kvgraft.store import GraftStore, LocalStore, open_store
from kvgraft.store.base import GcReport

from conftest import TEST_CHUNK, TEXT, cached_model

pytest.importorskip("obstore", reason="the S3 store needs obstore: pip install obstore")

from kvgraft.store.s3 import S3Store  # after the skip: obstore may be missing

MODEL = "random:llama"
PARAMS = SamplingParams(max_new_tokens=6)


def _engine(store: GraftStore) -> Engine:
    model, tokenizer = cached_model(MODEL)
    return Engine(model, tokenizer, MODEL, TEST_CHUNK, store)


def _key(prefix: str, path: str) -> str:
    return f"{prefix}/{path}" if prefix else path


def test_open_store_picks_the_backend_from_the_url(s3_url: str, tmp_path: Path) -> None:
    store = open_store(s3_url)
    assert isinstance(store, S3Store)
    assert store.location == s3_url and store.directory is None
    assert isinstance(open_store(tmp_path / "x"), LocalStore)


def test_round_trip_matches_a_local_store(s3_url: str, tmp_path: Path) -> None:
    remote, local = S3Store(s3_url), LocalStore(tmp_path / "local")
    put_remote, put_local = _engine(remote).put(TEXT), _engine(local).put(TEXT)
    assert put_remote.id == put_local.id and put_remote.created
    assert _engine(remote).put(TEXT).created is False  # the same content again creates nothing
    assert remote.tensors_path(put_remote.id) == f"{s3_url}/grafts/{put_remote.id}/tensors.safetensors"
    got_remote, got_local = remote.get(put_remote.id), local.get(put_local.id)
    # created_at is outside the id: the same content built twice differs only there.
    assert got_remote.manifest.id == got_local.manifest.id
    assert got_remote.manifest.blocks == got_local.manifest.blocks
    assert set(got_remote.tensors) == set(got_local.tensors)
    for name, tensor in got_local.tensors.items():
        assert got_remote.tensors[name].equal(tensor), name
    from_remote = _engine(remote).generate(" and", put_remote.id, PARAMS)
    from_local = _engine(local).generate(" and", put_local.id, PARAMS)
    assert from_remote.exact and from_remote.output_tokens == from_local.output_tokens
    assert from_remote.receipt.logits_chain_sha256 == from_local.receipt.logits_chain_sha256


def test_a_flipped_byte_in_a_stored_block_is_never_served(s3_url: str, s3_client: Any) -> None:
    store = S3Store(s3_url)
    put = _engine(store).put(TEXT)
    key = _key(store.prefix, store.block_path(store.manifest(put.id).blocks[0].key))
    body = bytearray(s3_client.get_object(Bucket=store.bucket, Key=key)["Body"].read())
    body[-1] ^= 0x01  # the last byte is tensor data: the header still parses, the hash does not match
    s3_client.put_object(Bucket=store.bucket, Key=key, Body=bytes(body))
    with pytest.raises(IntegrityError, match="does not match its SHA-256"):
        store.get(put.id)
    with pytest.raises(IntegrityError):
        _engine(store).generate(" and", put.id, PARAMS)


def test_an_edited_manifest_is_refused(s3_url: str, s3_client: Any) -> None:
    store = S3Store(s3_url)
    put = _engine(store).put(TEXT, metadata={"title": "before"})
    key = _key(store.prefix, f"grafts/{put.id}/manifest.json")
    data = json.loads(s3_client.get_object(Bucket=store.bucket, Key=key)["Body"].read())
    data["metadata"]["title"] = "after"
    s3_client.put_object(Bucket=store.bucket, Key=key, Body=json.dumps(data).encode())
    with pytest.raises(IntegrityError, match="does not match its content hash"):
        store.manifest(put.id)
    with pytest.raises(IntegrityError):
        store.get(put.id)


def test_a_missing_block_is_a_format_error(s3_url: str, s3_client: Any) -> None:
    store = S3Store(s3_url)
    put = _engine(store).put(TEXT)
    key = _key(store.prefix, store.block_path(store.manifest(put.id).blocks[-1].key))
    s3_client.delete_object(Bucket=store.bucket, Key=key)
    with pytest.raises(FormatError, match="is missing"):
        store.get(put.id)


def test_a_killed_upload_leaves_no_graft_and_gc_removes_its_blocks(s3_url: str, s3_client: Any) -> None:
    store = S3Store(s3_url)
    engine = _engine(store)
    built = engine.build(TEXT)
    # What a put killed before its commit point leaves: the blocks and the tensors file, no manifest.
    for ref in built.manifest.blocks:
        store._put_block(ref, built.blocks[ref.key])
    store._write(f"grafts/{built.manifest.id}/tensors.safetensors", b"partial")
    assert store.ids() == []
    with pytest.raises(NotFoundError):
        store.get(built.manifest.id)
    # Younger than the grace period: a build may be about to name them.
    assert store.gc() == GcReport(0, 0, kept_young=len(built.manifest.blocks))
    time.sleep(1.1)  # last_modified has a one-second resolution
    report = store.gc(1.0)
    assert (report.removed, report.kept_young) == (len(built.manifest.blocks), 0) and report.freed_bytes > 0
    listed = s3_client.list_objects_v2(Bucket=store.bucket)
    assert listed.get("KeyCount", 0) == 0  # the orphaned tensors file went too
    # The same graft uploads cleanly afterwards, and delete leaves nothing behind.
    put = engine.put(TEXT)
    assert put.created and store.ids() == [put.id]
    store.delete(put.id)
    assert store.ids() == [] and store.disk_bytes() == 0


def test_blocks_shared_between_grafts_outlive_one_delete(s3_url: str) -> None:
    store = S3Store(s3_url)
    engine = _engine(store)
    first = engine.put(TEXT)
    second = engine.put(TEXT + " More text after it, long enough for another block or two.")
    shared = {ref.key for ref in store.manifest(first.id).blocks}
    store.delete(second.id)
    assert all(store.has_block(key) for key in shared)
    assert store.get(first.id).manifest.id == first.id
    assert store.gc(0.0) == GcReport(0, 0, 0)


def test_the_cli_builds_lists_and_generates_on_an_s3_store(s3_url: str) -> None:
    runner = CliRunner()

    def run(*args: object) -> Any:
        result = runner.invoke(app, [str(a) for a in args])
        assert result.exception is None and result.exit_code == 0, f"{result.exception!r} {result.output}"
        return json.loads(result.stdout)

    built = run("build", "--text", TEXT, "--model", MODEL, "--store", s3_url, "-C", TEST_CHUNK, "--json")
    listing = run("ls", "--store", s3_url, "--json")
    assert listing["store"] == s3_url and [row["id"] for row in listing["grafts"]] == [built["id"]]
    out = run("generate", "--prompt", " and", "--graft", built["id"][:12], "-n", 4, "--store", s3_url, "--json")
    assert out["graft_id"] == built["id"] and out["exact"] is True


def test_a_missing_bucket_is_one_clear_store_error(s3_client: Any) -> None:
    with pytest.raises(StoreError, match="bucket kvgraft-no-such-bucket does not exist"):
        S3Store("s3://kvgraft-no-such-bucket/lib").ids()


def test_an_unreachable_endpoint_fails_fast_with_a_store_error(s3_client: Any) -> None:
    store = S3Store("s3://bucket/lib", endpoint="http://127.0.0.1:9")  # discard port: nothing listens
    # Bounded: three retries with backoff, then the error (0.4-0.7 s measured; tests/test_store_faults.py has more).
    expected = "cannot reach http://127.0.0.1:9 for store s3://bucket/lib (connection failed; gave up after 3 retries"
    with pytest.raises(StoreError, match=re.escape(expected)) as caught:
        store.ids()
    assert "\n" not in str(caught.value)


def test_a_url_without_a_bucket_is_refused() -> None:
    with pytest.raises(StoreError, match="names no bucket"):
        S3Store("s3:///lib")


def test_a_replica_sees_another_replicas_puts_and_deletes_through_the_change_token(s3_url: str) -> None:
    writer, replica = S3Store(s3_url), S3Store(s3_url)
    before = replica.change_token()
    put = _engine(writer).put(TEXT)
    after_put = replica.change_token()
    assert after_put != before and replica.ids() == [put.id]
    assert _engine(writer).put(TEXT).created is False and replica.change_token() == after_put  # nothing new
    replica.delete(put.id)
    assert writer.change_token() not in (before, after_put) and writer.ids() == []
