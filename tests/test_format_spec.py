"""docs/FORMAT.md is an executable spec: its standalone checker (json, hashlib, sys, pathlib and safetensors only)
must accept every graft kvgraft writes and name what is wrong with a damaged one, and its test vectors must be
what kvgraft computes."""

from __future__ import annotations

import ast
import hashlib
import json
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from kvgraft.core.errors import FormatError, IntegrityError
from kvgraft.core.fingerprint import Fingerprint
from kvgraft.core.hashing import LogitsChain, canonical_json, sha256_json, sha256_token_ids, tensor_bytes
from kvgraft.engine.engine import Engine
from kvgraft.format.blocks import block_digest, block_keys, block_tensor_name
from kvgraft.format.manifest import MANIFEST_NAME, TENSORS_NAME, parse_manifest
from kvgraft.store import LocalStore

from conftest import TEST_CHUNK, cached_model

FORMAT_MD = Path(__file__).resolve().parents[1] / "docs" / "FORMAT.md"
ALLOWED_IMPORTS = {"json", "hashlib", "sys", "pathlib", "safetensors"}
DTYPES = ["float32", "bfloat16"]
# Byte tokenizer: a context is len(text) + 1 tokens (BOS), a continuation len(text). C = 16.
# "48": 3C, next_token_logits stored. "61": 3C + 13, begins with the tokens of "48", so it lists (and reuses) the
# same three blocks. "6": shorter than C, no block at all. "after": built after "61", 61 + 19 = 80 = 5C tokens.
TEXTS = {"48": "x" * 47, "61": "x" * 47 + "y" * 13, "6": "short"}
AFTER_TEXT = " and then some more"
TOKENS = {"48": 48, "61": 61, "6": 6, "after": 80}


class Built(NamedTuple):
    store: Path
    graft: Path
    id: str


Grafts = dict[tuple[str, str], Built]


def _doc() -> str:
    return FORMAT_MD.read_text(encoding="utf-8")


def _standalone_check() -> str:
    text = _doc()
    blocks = re.findall(r"^```python\n(.*?)^```$", text, re.S | re.M)
    assert len(blocks) == 1, "docs/FORMAT.md must hold exactly one ```python block: the standalone check"
    assert "<!-- standalone-check -->\n```python" in text
    return blocks[0]


@pytest.fixture(scope="module")
def checker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("spec") / "check_graft.py"
    path.write_text(_standalone_check(), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def grafts(tmp_path_factory: pytest.TempPathFactory) -> Grafts:
    """(dtype, name) -> the graft, all in one store, built once for the module. Never damage them in place."""
    store = LocalStore(tmp_path_factory.mktemp("store"))
    built = {}
    for dtype in DTYPES:
        model, tokenizer = cached_model("random:gemma4", dtype)
        engine = Engine(model, tokenizer, "random:gemma4", TEST_CHUNK, store)
        puts = {name: engine.put(text) for name, text in TEXTS.items()}
        puts["after"] = engine.put(AFTER_TEXT, after=puts["61"].id)
        assert (puts["61"].reused_blocks, puts["after"].reused_blocks) == (3, 3)
        for name, put in puts.items():
            assert put.tokens == TOKENS[name]
            built[dtype, name] = Built(store.root, store.root / "grafts" / put.id, put.id)
    return built


def _run(checker: Path, graft: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(checker), str(graft)], capture_output=True, text=True, timeout=60, check=False
    )


def _failures(result: subprocess.CompletedProcess[str]) -> list[str]:
    """The FAIL lines of a run that must have failed."""
    assert result.returncode == 1, result.stdout + result.stderr
    assert "OK" not in result.stdout
    lines = result.stdout.splitlines()
    assert lines and all(line.startswith("FAIL ") for line in lines), result.stdout
    return lines


def _copy(built: Built, tmp_path: Path) -> tuple[LocalStore, Path]:
    """A copy of the whole store (grafts and the blocks they share) at tmp_path/store, to damage freely."""
    root = Path(shutil.copytree(built.store, tmp_path / "store"))
    return LocalStore(root), root / "grafts" / built.id


def _manifest(graft: Path) -> dict[str, Any]:
    manifest: dict[str, Any] = json.loads((graft / MANIFEST_NAME).read_text(encoding="utf-8"))
    return manifest


def _resign(graft: Path, manifest: dict[str, Any]) -> Path:
    """Write an edited manifest with its id recomputed, in a graft directory renamed to the new id."""
    manifest["id"] = hashlib.sha256(
        canonical_json({k: v for k, v in manifest.items() if k not in ("id", "created_at")})
    ).hexdigest()
    (graft / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1, sort_keys=True), encoding="utf-8")
    return graft.rename(graft.parent / manifest["id"])


def _header(path: Path) -> tuple[int, dict[str, Any]]:
    """(data region start, raw header including __metadata__) of a safetensors file."""
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    return 8 + size, json.loads(raw[8 : 8 + size])


def _flip_byte(path: Path, tensor: str) -> None:
    """Flip one bit in the middle of a tensor's bytes, leaving the header alone."""
    data_start, header = _header(path)
    begin, end = header[tensor]["data_offsets"]
    raw = bytearray(path.read_bytes())
    raw[data_start + (begin + end) // 2] ^= 0x01
    path.write_bytes(bytes(raw))


# --- the checker ---------------------------------------------------------------------------------------------


def test_the_check_imports_only_the_stdlib_and_safetensors() -> None:
    tree = ast.parse(_standalone_check())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert imported <= ALLOWED_IMPORTS, imported - ALLOWED_IMPORTS


@pytest.mark.parametrize("name", list(TOKENS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_check_accepts_every_graft_kvgraft_writes(checker: Path, grafts: Grafts, dtype: str, name: str) -> None:
    built = grafts[dtype, name]
    manifest = _manifest(built.graft)
    n_tokens = TOKENS[name]
    assert manifest["format_version"] == 2
    assert manifest["aligned_tokens"] == n_tokens // TEST_CHUNK * TEST_CHUNK
    assert len(manifest["blocks"]) == n_tokens // TEST_CHUNK
    assert (manifest["next_token_logits"] is not None) == (n_tokens % TEST_CHUNK == 0)
    assert [layer["kind"] for layer in manifest["layers"]].count("shared") > 0
    assert {"full", "sliding"} <= {layer["kind"] for layer in manifest["layers"]}
    result = _run(checker, built.graft)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == f"OK {built.id}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_blocks_are_stored_once_and_hash_as_their_data_region(grafts: Grafts, dtype: str) -> None:
    """Grafts that begin alike list the same blocks; a block's digest is the SHA-256 of its data region and its
    __metadata__ is exactly {"sha256": digest} (sections 4.2, 6)."""
    blocks = {name: _manifest(grafts[dtype, name].graft)["blocks"] for name in TOKENS}
    assert blocks["61"] == blocks["48"] == blocks["after"][:3]
    assert blocks["6"] == []
    store = LocalStore(grafts[dtype, "48"].store)
    for block in blocks["after"]:
        path = store.block_path(block["key"])
        assert path == store.root / "blocks" / block["key"][:2] / f"{block['key']}.safetensors"
        data_start, header = _header(path)
        assert header.pop("__metadata__") == {"sha256": block["sha256"]}
        assert hashlib.sha256(path.read_bytes()[data_start:]).hexdigest() == block["sha256"]
        assert list(header) == sorted(header)  # names padded so that name order is layer order


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("index", "tensor"), [(0, "layers.000.key"), (1, "layers.001.value"), (2, "layers.002.key")])
def test_one_flipped_byte_in_a_block_names_the_block(
    checker: Path, grafts: Grafts, tmp_path: Path, dtype: str, index: int, tensor: str
) -> None:
    store, graft = _copy(grafts[dtype, "48"], tmp_path)
    key = _manifest(graft)["blocks"][index]["key"]
    _flip_byte(store.block_path(key), tensor)

    failing = _failures(_run(checker, graft))
    assert len(failing) == 1 and f"block {index} ({key[:12]}...): sha256" in failing[0], failing
    # The block is shared: the graft that begins with the same tokens is damaged too, and says so.
    shared = _failures(_run(checker, store.root / "grafts" / grafts[dtype, "61"].id))
    assert len(shared) == 1 and f"block {index} ({key[:12]}...)" in shared[0], shared
    # kvgraft's own reader refuses the same file.
    with pytest.raises(IntegrityError, match=f"block {key[:12]} does not match its SHA-256"):
        store.get(graft.name)


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_flipped_byte_in_next_token_logits_names_the_tensor(
    checker: Path, grafts: Grafts, tmp_path: Path, dtype: str
) -> None:
    store, graft = _copy(grafts[dtype, "48"], tmp_path)
    _flip_byte(graft / TENSORS_NAME, "next_token_logits")

    failing = _failures(_run(checker, graft))
    assert len(failing) == 1 and "tensor next_token_logits: sha256" in failing[0], failing
    with pytest.raises(IntegrityError, match="next_token_logits"):
        store.get(graft.name)


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_edited_token_breaks_the_id(checker: Path, grafts: Grafts, tmp_path: Path, dtype: str) -> None:
    store, graft = _copy(grafts[dtype, "61"], tmp_path)
    manifest = _manifest(graft)
    manifest["tokens"][5] += 1
    (graft / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1, sort_keys=True), encoding="utf-8")

    failing = _failures(_run(checker, graft))
    assert any("does not match the content hash" in line and manifest["id"] in line for line in failing), failing
    with pytest.raises(IntegrityError, match="does not match its content hash"):
        store.get(graft.name)


def test_a_graft_without_next_token_logits_where_the_rule_wants_them_fails(
    checker: Path, grafts: Grafts, tmp_path: Path
) -> None:
    """Dropping the entry (and re-signing the id) breaks the next_token_logits rule, not only a hash."""
    store, graft = _copy(grafts["float32", "48"], tmp_path)
    manifest = _manifest(graft)
    manifest["next_token_logits"] = None
    graft = _resign(graft, manifest)

    failing = _failures(_run(checker, graft))
    assert any("next_token_logits must be present" in line for line in failing), failing
    with pytest.raises(FormatError, match="next_token_logits must be present exactly when"):
        store.get(graft.name)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_reshaped_block_tensor_with_the_same_bytes_is_refused(
    checker: Path, grafts: Grafts, tmp_path: Path, dtype: str
) -> None:
    """Digests cover bytes only; the shapes in the manifest (covered by the id) catch a header reshaped in place."""
    store, graft = _copy(grafts[dtype, "48"], tmp_path)
    key = _manifest(graft)["blocks"][1]["key"]
    path = store.block_path(key)
    raw = path.read_bytes()
    data_start, header = _header(path)
    _, heads, positions, head_dim = header["layers.001.key"]["shape"]
    header["layers.001.key"]["shape"] = [1, heads * 2, positions, head_dim // 2]
    new_header = json.dumps(header, separators=(",", ":")).encode().ljust(data_start - 8)
    assert len(new_header) == data_start - 8
    path.write_bytes(raw[:8] + new_header + raw[data_start:])

    failing = _failures(_run(checker, graft))
    assert len(failing) == 1, failing  # the bytes, and so the digest, are intact
    assert f"block 1 ({key[:12]}...): tensor layers.001.key has shape" in failing[0], failing
    with pytest.raises(FormatError, match=r"tensor layers\.001\.key has shape .* the manifest says"):
        store.get(graft.name)


def test_a_missing_block_file_is_reported(checker: Path, grafts: Grafts, tmp_path: Path) -> None:
    store, graft = _copy(grafts["bfloat16", "after"], tmp_path)
    key = _manifest(graft)["blocks"][3]["key"]
    store.block_path(key).unlink()

    failing = _failures(_run(checker, graft))
    assert len(failing) == 1 and f"block 3 ({key[:12]}...): block file" in failing[0], failing
    assert "is missing" in failing[0]
    with pytest.raises(FormatError, match=f"block {key[:12]} is missing"):
        store.get(graft.name)


@pytest.mark.parametrize("dtype", DTYPES)
def test_block_keys_that_do_not_chain_are_refused(checker: Path, grafts: Grafts, tmp_path: Path, dtype: str) -> None:
    """Blocks 1 and 2 swapped, manifest re-signed: every file matches its digest, but the order is wrong."""
    store, graft = _copy(grafts[dtype, "48"], tmp_path)
    manifest = _manifest(graft)
    blocks = manifest["blocks"]
    blocks[1], blocks[2] = blocks[2], blocks[1]
    graft = _resign(graft, manifest)

    failing = _failures(_run(checker, graft))
    assert len(failing) == 2, failing
    for index, line in zip((1, 2), failing, strict=True):
        assert f"block {index} ({blocks[index]['key'][:12]}...): key does not chain" in line, failing
    with pytest.raises(FormatError, match="block keys do not chain"):
        store.get(graft.name)


def test_a_version_1_manifest_is_refused_as_the_doc_says(checker: Path, grafts: Grafts, tmp_path: Path) -> None:
    _, graft = _copy(grafts["float32", "6"], tmp_path)
    manifest = _manifest(graft)
    manifest["format_version"] = 1
    graft = _resign(graft, manifest)
    path = graft / MANIFEST_NAME

    quoted = re.search(r"^FormatError: <path>/manifest\.json: (unknown format_version 1; .*)$", _doc(), re.M)
    assert quoted is not None, "section 9 quotes the message a version 1 graft gets"
    with pytest.raises(FormatError) as refused:
        parse_manifest(path.read_bytes(), str(path))
    assert str(refused.value) == f"{path}: {quoted.group(1)}"
    assert str(refused.value).endswith("reads version 2, rebuild the graft")
    assert "unknown format_version 1" in _failures(_run(checker, graft))[0]


# --- test vectors --------------------------------------------------------------------------------------------


def _vectors() -> str:
    """Section 8 of the doc."""
    text = _doc()
    start = text.index("\n## 8. Test vectors")
    return text[start : text.index("\n## ", start + 1)]


def _row(label: str) -> str:
    rows = [line for line in _vectors().splitlines() if line.startswith("|") and label in line]
    assert len(rows) == 1, f"one row of section 8 must contain {label!r}"
    return rows[0]


def _hex(label: str) -> list[str]:
    """The hex values (in backquotes) of the value column of a section 8 row."""
    return re.findall(r"`([0-9a-f]+)`", _row(label).rsplit("|", 2)[1])


def test_the_test_vectors_are_what_kvgraft_computes() -> None:
    obj = {"b": [1, 2.5, None], "a": "é", "c": True}
    assert f"`{canonical_json(obj).decode()}`" in _row("canonical JSON of")
    assert _hex("| its `sha256_json`") == [sha256_json(obj)]
    assert _hex("`sha256_token_ids([2, 3, 258])`") == [sha256_token_ids([2, 3, 258])]
    for dtype in (torch.float32, torch.bfloat16):
        values = torch.tensor([0.0, 1.0, -2.5], dtype=dtype)
        raw = bytes(tensor_bytes(values))
        assert _hex(f"{str(dtype).removeprefix('torch.')} tensor `[0.0, 1.0, -2.5]`") == [
            raw.hex(),
            hashlib.sha256(raw).hexdigest(),
        ]
    chain = LogitsChain()
    assert _hex("logits chain `h_0`") == [chain.hexdigest]
    chain.update(torch.tensor([0.0, 1.0, -2.5]))
    assert _hex("chain after one step") == [chain.hexdigest]


def test_the_block_test_vectors_are_what_kvgraft_computes() -> None:
    found = re.search(r"<!-- test-fingerprint -->\n```json\n(.*?)\n```", _doc(), re.S)
    assert found is not None, "section 8 gives the test fingerprint in a json block"
    fingerprint = Fingerprint.from_json(json.loads(found.group(1)))
    assert fingerprint.to_json() == json.loads(found.group(1))  # well formed: nothing normalised away
    digest = fingerprint.digest
    assert _hex("the test fingerprint below") == [digest]
    assert f"`{canonical_json(fingerprint.to_json()).decode()}`" in _vectors()

    keys = block_keys(fingerprint, [2, 3, 258, 7, 9], 2)
    assert len(keys) == 2
    assert _hex("`key_0` (tokens") == [keys[0]]
    assert _hex("`key_1` (tokens") == [keys[1]]
    preimage = canonical_json({"parent": None, "fingerprint": digest, "tokens": [2, 3]}).decode()
    assert f"`{preimage}`" in _vectors() and hashlib.sha256(preimage.encode()).hexdigest() == keys[0]

    block = {
        block_tensor_name(0, "value"): torch.tensor([-2.5]),
        block_tensor_name(0, "key"): torch.tensor([0.0, 1.0]),
    }
    assert list(block) == ["layers.000.value", "layers.000.key"]
    assert _hex("block digest of")[0] == block_digest(block)
