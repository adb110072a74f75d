"""Signed grafts and the trust policy: ed25519 over the graft id, kept as store sidecars, checked by `TrustedStore`.

Every refusal is checked by its exact message: forged (a flipped byte), re-signed by an untrusted key, stripped (the
file deleted), copied from another graft. The same round trip runs on a local store and on S3 (moto), the server
serves a signed graft and refuses an unsigned one, and the CLI's `keys new`, `sign`, `build --sign-key` and
`generate --trusted-keys` are run end to end. FORMAT.md's standalone signature check runs on real files.
"""

from __future__ import annotations

import hashlib
import json
import re
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography.hazmat.primitives import serialization
from test_cli import CHUNK, MODEL, TEXT_40, TEXT_48, build, cli, fails, ok, ok_json, runner

from kvgraft.cli import app
from kvgraft.core.errors import BadInputError, StoreError, UntrustedGraftError
from kvgraft.core.hashing import GraftId
from kvgraft.engine.engine import Engine
from kvgraft.format.signature import (
    SIGNED_PREFIX,
    KeyId,
    SigningKey,
    parse_signature,
    read_public_key,
    read_signing_key,
    write_key_pair,
)
from kvgraft.library.index import INDEX_NAME
from kvgraft.server import ServerConfig, create_app
from kvgraft.server.background import serve_in_thread
from kvgraft.store import GraftStore, LocalStore
from kvgraft.store.base import StoreTier
from kvgraft.store.trust import SIGNATURES_GENERATION, TrustedStore, TrustPolicy, sign_graft, signature_name

from conftest import TEST_CHUNK, TEXT, cached_model

FORMAT_MD = Path(__file__).resolve().parents[1] / "docs" / "FORMAT.md"
OTHER_TEXT = TEXT + " Another graft, with other blocks."


def _engine(store: GraftStore) -> Engine:
    model, tokenizer = cached_model(MODEL)
    return Engine(model, tokenizer, MODEL, TEST_CHUNK, store)


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    """A trusted keys directory holding alice.pub (alice.key beside it, in another directory)."""
    write_key_pair(tmp_path / "private", "alice")
    trusted = tmp_path / "trusted"
    trusted.mkdir()
    (trusted / "alice.pub").write_bytes((tmp_path / "private" / "alice.pub").read_bytes())
    return trusted


@pytest.fixture
def alice(tmp_path: Path, keys: Path) -> SigningKey:
    return read_signing_key(tmp_path / "private" / "alice.key")


@pytest.fixture
def mallory(tmp_path: Path) -> SigningKey:
    return write_key_pair(tmp_path / "mallory", "mallory")[2]


def _refusal(graft_id: str, keys: Path, reason: str) -> str:
    return f"graft {graft_id[:12]} is not signed by a trusted key ({keys}): {reason}"


CLI_HINT = "; sign it with `kvgraft sign ID --key NAME.key`, or add its signer's .pub to --trusted-keys"


def _refused(store: GraftStore, graft_id: str, keys: Path, reason: str) -> None:
    """A fresh policy tier neither lists the graft nor lets any read of it through, each with the exact message."""
    trusted = TrustedStore(store, TrustPolicy.load(keys))
    assert graft_id not in trusted.ids()
    message = re.escape(_refusal(graft_id, keys, reason))
    with pytest.raises(UntrustedGraftError, match=f"^{message}$"):
        trusted.manifest(graft_id)
    with pytest.raises(UntrustedGraftError, match=f"^{message}$"):
        trusted.get(graft_id[:10])
    with pytest.raises(UntrustedGraftError, match=f"^{message}$"):
        trusted.own_tensors(store.manifest(graft_id))
    assert trusted.prefetch(graft_id) is False


def _edit_signature(store: GraftStore, name: str, **changes: str) -> None:
    raw = store.read_sidecar(name)
    assert raw is not None
    store.write_sidecar(name, json.dumps(json.loads(raw) | changes).encode())


# --- keys and the signed message --------------------------------------------------------------------------------


def test_key_files_are_pem_private_0600_and_the_key_id_is_the_raw_key_hash(tmp_path: Path) -> None:
    private_path, public_path, key = write_key_pair(tmp_path / "k", "writer")
    assert (private_path.name, public_path.name) == ("writer.key", "writer.pub")
    assert stat.S_IMODE(private_path.stat().st_mode) == 0o600
    assert private_path.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    assert public_path.read_bytes().startswith(b"-----BEGIN PUBLIC KEY-----")
    raw = serialization.load_pem_public_key(public_path.read_bytes()).public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    )
    assert key.public.id == read_public_key(public_path).id == hashlib.sha256(raw).hexdigest()[:16]
    assert read_signing_key(private_path).public.raw == raw
    with pytest.raises(BadInputError, match=r"writer.key exists already; a key file is never overwritten"):
        write_key_pair(tmp_path / "k", "writer")
    assert read_signing_key(private_path).public.raw == raw  # untouched


def test_a_signature_signs_the_prefixed_id_and_nothing_else(store: LocalStore, alice: SigningKey) -> None:
    graft_id = _engine(store).put(TEXT).id
    signature = sign_graft(store, graft_id, alice)
    assert signature.graft_id == graft_id and signature.key_id == alice.public.id
    raw_signature = bytes.fromhex(signature.signature)
    assert alice.public.verifies(raw_signature, graft_id)
    alice.public.key.verify(raw_signature, SIGNED_PREFIX + graft_id.encode())  # raises if not
    assert SIGNED_PREFIX == b"kvgraft-graft-signature-v1:"
    assert not alice.public.verifies(raw_signature, "0" * 64)
    stored = store.read_sidecar(signature_name(graft_id, alice.public.id))
    assert stored == signature.to_bytes()
    assert parse_signature(stored, "x") == signature
    assert json.loads(stored) == {
        "format": "kvgraft-signature-1",
        "graft_id": graft_id,
        "key_id": alice.public.id,
        "public_key": alice.public.raw.hex(),
        "algorithm": "ed25519",
        "signature": signature.signature,
    }
    assert (store.root / "signatures" / f"{graft_id}.{alice.public.id}.json").is_file()


# --- the policy on a local store and on S3 ----------------------------------------------------------------------


def _round_trip(store: GraftStore, keys: Path, alice: SigningKey) -> None:
    signed, unsigned = _engine(store).put(TEXT).id, _engine(store).put(OTHER_TEXT).id
    trusted = TrustedStore(store, TrustPolicy.load(keys))
    token = trusted.change_token()
    sign_graft(store, signed, alice)
    assert trusted.change_token() != token  # a new signature is a change, as a new graft is
    assert trusted.ids() == [signed]
    assert trusted.verdict(signed).signer == KeyId(alice.public.id)
    assert trusted.resolve(signed[:8]) == signed
    got, plain = trusted.get(signed), store.get(signed)
    assert got.manifest == plain.manifest
    assert set(got.tensors) == set(plain.tensors)
    assert all(got.tensors[name].equal(tensor) for name, tensor in plain.tensors.items())
    _refused(store, unsigned, keys, "unsigned")
    grafted = _engine(trusted).generate(" and", signed)
    assert grafted.exact and grafted.receipt.graft_id == signed


def test_sign_and_verify_round_trip_on_a_local_store(store: LocalStore, keys: Path, alice: SigningKey) -> None:
    _round_trip(store, keys, alice)


def test_sign_and_verify_round_trip_on_s3(s3_url: str, keys: Path, alice: SigningKey) -> None:
    pytest.importorskip("obstore", reason="the S3 store needs obstore: pip install obstore")
    from kvgraft.store.s3 import S3Store

    store = S3Store(s3_url)
    _round_trip(store, keys, alice)
    assert store.read_sidecar(SIGNATURES_GENERATION) is not None


def test_a_forged_signature_is_refused(store: LocalStore, keys: Path, alice: SigningKey) -> None:
    graft_id = _engine(store).put(TEXT).id
    signature = sign_graft(store, graft_id, alice)
    flipped = bytearray(bytes.fromhex(signature.signature))
    flipped[5] ^= 0x01
    _edit_signature(store, signature_name(graft_id, alice.public.id), signature=flipped.hex())
    _refused(store, graft_id, keys, f"signature by key {alice.public.id} does not verify")


def test_a_graft_re_signed_by_an_untrusted_key_is_refused(
    store: LocalStore, keys: Path, alice: SigningKey, mallory: SigningKey
) -> None:
    graft_id = _engine(store).put(TEXT).id
    sign_graft(store, graft_id, mallory)  # under mallory's own name: a trusted reader never reads it
    _refused(store, graft_id, keys, "unsigned")
    # Mallory's signature put where alice's would be: read, and refused for its key.
    mine = store.read_sidecar(signature_name(graft_id, mallory.public.id))
    assert mine is not None
    store.write_sidecar(signature_name(graft_id, alice.public.id), mine)
    _refused(store, graft_id, keys, f"signature by key {mallory.public.id} is not trusted")
    # ... with alice's key id written in: the file is malformed (the id is not its public key's).
    _edit_signature(store, signature_name(graft_id, alice.public.id), key_id=alice.public.id)
    _refused(
        store,
        graft_id,
        keys,
        f"signature file {signature_name(graft_id, alice.public.id)}: key_id is not the id of its public_key",
    )
    # ... with alice's public key too: checked with alice's trusted key, mallory's signature does not verify.
    _edit_signature(store, signature_name(graft_id, alice.public.id), public_key=alice.public.raw.hex())
    _refused(store, graft_id, keys, f"signature by key {alice.public.id} does not verify")


def test_a_stripped_signature_is_refused(store: LocalStore, keys: Path, alice: SigningKey) -> None:
    graft_id = _engine(store).put(TEXT).id
    sign_graft(store, graft_id, alice)
    assert TrustedStore(store, TrustPolicy.load(keys)).ids() == [graft_id]
    (store.root / signature_name(graft_id, alice.public.id)).unlink()
    _refused(store, graft_id, keys, "unsigned")


def test_deleting_a_graft_deletes_its_signatures_on_a_local_store(
    store: LocalStore, alice: SigningKey, mallory: SigningKey
) -> None:
    kept, removed = _engine(store).put(TEXT).id, _engine(store).put(OTHER_TEXT).id
    for graft_id in (kept, removed):
        sign_graft(store, graft_id, alice)
    sign_graft(store, removed, mallory)
    store.delete(removed)
    names = sorted(p.name for p in (store.root / "signatures").iterdir())
    assert names == sorted([f"{kept}.{alice.public.id}.json", "generation"])


def test_a_signature_copied_to_another_graft_is_refused(store: LocalStore, keys: Path, alice: SigningKey) -> None:
    signed, other = _engine(store).put(TEXT).id, _engine(store).put(OTHER_TEXT).id
    sign_graft(store, signed, alice)
    copied = store.read_sidecar(signature_name(signed, alice.public.id))
    assert copied is not None
    store.write_sidecar(signature_name(other, alice.public.id), copied)
    _refused(store, other, keys, f"the signature is for graft {signed[:12]}, not this one")
    _edit_signature(store, signature_name(other, alice.public.id), graft_id=other)  # the id edited in
    _refused(store, other, keys, f"signature by key {alice.public.id} does not verify")
    assert TrustedStore(store, TrustPolicy.load(keys)).ids() == [signed]


def test_a_policy_needs_keys(tmp_path: Path) -> None:
    with pytest.raises(BadInputError, match=r"^trusted keys directory .*nowhere does not exist or is not a directory$"):
        TrustPolicy.load(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(BadInputError, match=r"^trusted keys directory .*empty holds no public key \(\*\.pub\)$"):
        TrustPolicy.load(tmp_path / "empty")
    (tmp_path / "empty" / "bad.pub").write_text("not a key")
    with pytest.raises(BadInputError, match=r"bad\.pub is not a PEM public key"):
        TrustPolicy.load(tmp_path / "empty")


def test_a_read_only_store_that_keeps_no_signature_is_an_error(tmp_path: Path, alice: SigningKey) -> None:
    class KeepsNothing(StoreTier):
        """A store that silently keeps no sidecar, as a read-only one does."""

        def write_sidecar(self, name: str, data: bytes) -> None:
            return None

    store = LocalStore(tmp_path / "ro")
    graft_id = _engine(store).put(TEXT).id
    with pytest.raises(StoreError, match="did not keep the signature"):
        sign_graft(KeepsNothing(store), graft_id, alice)


def test_the_index_is_not_rewritten_from_a_filtered_view(store: LocalStore, keys: Path, alice: SigningKey) -> None:
    from kvgraft.library.index import load_index

    signed, unsigned = _engine(store).put(TEXT).id, _engine(store).put(OTHER_TEXT).id
    sign_graft(store, signed, alice)
    assert set(load_index(store)) == {signed, unsigned}
    before = store.read_sidecar(INDEX_NAME)
    assert set(load_index(TrustedStore(store, TrustPolicy.load(keys)))) == {signed}
    assert store.read_sidecar(INDEX_NAME) == before


# --- the server -------------------------------------------------------------------------------------------------


@pytest.fixture
def served_with_policy(store: LocalStore, keys: Path, alice: SigningKey) -> Iterator[tuple[httpx.Client, str, str]]:
    signed, unsigned = _engine(store).put(TEXT).id, _engine(store).put(OTHER_TEXT).id
    sign_graft(store, signed, alice)
    engine = _engine(TrustedStore(store, TrustPolicy.load(keys)))
    with (
        serve_in_thread(create_app(engine, ServerConfig(api_key="k", hidden_paths=(str(keys),)))) as server,
        httpx.Client(base_url=server.url, headers={"Authorization": "Bearer k"}, timeout=60) as http,
    ):
        yield http, signed, unsigned


def _complete(http: httpx.Client, kvgraft: dict[str, Any]) -> httpx.Response:
    body = {"model": MODEL, "prompt": " and", "max_tokens": 3, "kvgraft": kvgraft}
    return http.post("/v1/completions", json=body)


def test_a_server_under_a_policy_serves_signed_grafts_only(
    served_with_policy: tuple[httpx.Client, str, str], keys: Path
) -> None:
    http, signed, unsigned = served_with_policy
    reply = _complete(http, {"grafts": [signed]})
    assert reply.status_code == 200, reply.text
    assert [g["id"] for g in reply.json()["kvgraft"]["grafts"]] == [signed]
    refused = _complete(http, {"grafts": [unsigned]})
    assert refused.status_code == 404, refused.text
    # The server's keys directory is its own business: clients see `<hidden>`.
    message = refused.json()["error"]["message"]
    assert message.startswith(_refusal(unsigned, Path("<hidden>"), "unsigned")), message
    assert str(keys) not in message
    listed = http.get("/v1/grafts")
    assert listed.status_code == 200, listed.text
    assert unsigned not in listed.text and signed in listed.text
    retrieved = _complete(http, {"retrieve": True, "min_score": 0.0, "min_match": 0.0})
    assert retrieved.status_code == 200, retrieved.text
    assert unsigned not in retrieved.text


# --- the CLI ----------------------------------------------------------------------------------------------------


def test_cli_keys_sign_and_generate_under_a_policy(tmp_path: Path) -> None:
    store = tmp_path / "cli-store"
    made = ok_json(cli("keys", "new", "writer", "--dir", tmp_path / "k", "--json"))
    key_path, pub_path = tmp_path / "k" / "writer.key", tmp_path / "k" / "writer.pub"
    assert made == {
        "name": "writer",
        "key_id": read_public_key(pub_path).id,
        "private_key": str(key_path),
        "public_key": str(pub_path),
    }
    fails(cli("keys", "new", "writer", "--dir", tmp_path / "k"), f"{key_path} exists already")
    trusted = tmp_path / "trusted"
    trusted.mkdir()
    (trusted / "writer.pub").write_bytes(pub_path.read_bytes())

    graft_id = build(store, TEXT_48)
    generate = ("generate", "--graft", graft_id[:10], "-n", 3, "--store", store, "--trusted-keys", trusted, "--json")
    line = fails(cli(*generate))
    assert line == f"error: {_refusal(graft_id, trusted, 'unsigned')}{CLI_HINT}"
    fails(
        cli(*generate[:-3], "--trusted-keys", tmp_path / "none"),
        f"trusted keys directory {tmp_path / 'none'} does not exist",
    )

    signed = ok_json(cli("sign", graft_id[:10], "--key", key_path, "--store", store, "--json"))
    assert signed == {"key_id": made["key_id"], "signed": [graft_id]}
    result = ok_json(cli(*generate))
    assert result["graft_id"] == graft_id and result["exact"] is True
    assert ok_json(cli("verify", graft_id, "--store", store, "--trusted-keys", trusted, "--json"))["kv_equal"]

    # The policy from the environment; a graft built and signed in one step passes it.
    other = ok_json(
        cli("build", "--text", TEXT_40, "-m", MODEL, "-s", store, "-C", CHUNK, "--sign-key", key_path, "--json")
    )
    assert other["signed_by"] == made["key_id"]
    env = {"KVGRAFT_TRUSTED_KEYS": str(trusted)}
    by_env = runner.invoke(app, ["generate", "-g", other["id"], "-n", "2", "-s", str(store), "--json"], env=env)
    assert json.loads(ok(by_env).stdout)["graft_id"] == other["id"]
    (store / "signatures" / f"{other['id']}.{made['key_id']}.json").unlink()
    refused = runner.invoke(app, ["generate", "-g", other["id"], "-n", "2", "-s", str(store)], env=env)
    assert fails(refused) == f"error: {_refusal(other['id'], trusted, 'unsigned')}{CLI_HINT}"


# --- FORMAT.md's standalone check -------------------------------------------------------------------------------


def _doc_check(tmp_path: Path) -> Path:
    text = FORMAT_MD.read_text(encoding="utf-8")
    (code,) = re.findall(r"<!-- signature-check -->\n```py\n(.*?)^```$", text, re.S | re.M)
    path = tmp_path / "check_signature.py"
    path.write_text(code)
    return path


def test_format_md_signature_check_accepts_real_signatures_and_refuses_forged_ones(
    tmp_path: Path, store: LocalStore, keys: Path, alice: SigningKey, mallory: SigningKey
) -> None:
    checker = _doc_check(tmp_path)
    graft_id = _engine(store).put(TEXT).id
    signed_file = store.root / signature_name(sign_graft(store, graft_id, alice).graft_id, alice.public.id)

    def run(signature_file: Path, graft: str = graft_id) -> tuple[int, str]:
        done = subprocess.run(
            [sys.executable, str(checker), str(signature_file), str(keys / "alice.pub"), graft],
            capture_output=True,
            text=True,
            check=False,
        )
        return done.returncode, done.stdout.strip()

    assert run(signed_file) == (0, f"OK {alice.public.id}")
    assert run(signed_file, GraftId("0" * 64))[0] == 1
    forged = tmp_path / "forged.json"
    data = json.loads(signed_file.read_text())
    flipped = bytearray(bytes.fromhex(data["signature"]))
    flipped[0] ^= 0x01
    forged.write_text(json.dumps(data | {"signature": flipped.hex()}))
    assert run(forged) == (1, "FAIL the signature does not verify")
    sign_graft(store, graft_id, mallory)
    assert run(store.root / signature_name(graft_id, mallory.public.id)) == (
        1,
        f"FAIL signed by key {mallory.public.id}, not by the trusted key {alice.public.id}",
    )
