"""The `kvgraft` command line, end to end through typer's CliRunner.

Happy paths check the exact JSON each command prints; bad inputs must each end in exit code 1, one line on
stderr starting with "error:", no traceback, and a store left as it was (no new graft, nothing under tmp/).
Every test uses its own store under tmp_path and a tiny random model (byte tokenizer: one token per byte + BOS).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import struct
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from click.testing import Result
from typer.testing import CliRunner

from kvgraft.cli import app
from kvgraft.core import fingerprint
from kvgraft.core.hashing import sha256_token_ids
from kvgraft.format.blocks import block_digest
from kvgraft.format.manifest import graft_id
from kvgraft.format.receipt import receipt_id
from kvgraft.format.tensor_files import block_file_bytes

MODEL = "random:llama"
CHUNK = 16
# Byte tokenizer: len(text) + 1 tokens. 47 chars -> 48 tokens = 3C (every token has stored KV, plus the
# next-token logits); 39 chars -> 40 tokens = 2C + 8 (a tail recomputed at use); 5 chars -> 6 tokens (no KV).
TEXT_48 = "The state of a model after reading, kept safe.."
TEXT_40 = "A restored state continues exactly so.."
TEXT_6 = "short"
assert (len(TEXT_48), len(TEXT_40), len(TEXT_6)) == (47, 39, 5)
MANIFEST_KEYS = {
    "id",
    "format_version",
    "tokens",
    "aligned_tokens",
    "chunk_size",
    "dtype",
    "fingerprint",
    "tensors_file",
    "layers",
    "blocks",
    "next_token_logits",
    "provenance",
    "created_at",
    "metadata",
}
HEX64 = re.compile(r"^[0-9a-f]{64}$")

runner = CliRunner()


# --- helpers -------------------------------------------------------------------------------------------------


def cli(*args: Any) -> Result:
    return runner.invoke(app, [str(a) for a in args])


def ok(result: Result) -> Result:
    assert result.exception is None, f"{result.exception!r}\nstderr: {result.stderr}"
    assert result.exit_code == 0, result.output
    return result


def ok_json(result: Result) -> Any:
    return json.loads(ok(result).stdout)


def fails(result: Result, *fragments: str) -> str:
    """Exit 1, one 'error:' line on stderr containing every fragment, nothing on stdout, no traceback."""
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    line = lines[0]
    assert line.startswith("error: "), line
    for fragment in fragments:
        assert fragment in line, f"{fragment!r} not in {line!r}"
    return line


def graft_ids(store: Path) -> list[str]:
    grafts = store / "grafts"
    if not grafts.is_dir():
        return []
    return sorted(p.name for p in grafts.iterdir() if (p / "manifest.json").is_file())


def tmp_leftovers(store: Path) -> list[str]:
    tmp = store / "tmp"
    return sorted(p.name for p in tmp.iterdir()) if tmp.is_dir() else []


def assert_store_unchanged(store: Path, before: list[str]) -> None:
    assert graft_ids(store) == before
    assert tmp_leftovers(store) == []


def build(store: Path, text: str, model: str = MODEL) -> str:
    data = ok_json(cli("build", "--text", text, "--model", model, "--store", store, "--chunk-size", CHUNK, "--json"))
    return str(data["id"])


def graft_dir(store: Path, gid: str) -> Path:
    return store / "grafts" / gid


def block_files(store: Path) -> list[Path]:
    return sorted((store / "blocks").glob("*/*.safetensors"))


def block_path(store: Path, gid: str, index: int) -> Path:
    key = json.loads((graft_dir(store, gid) / "manifest.json").read_text())["blocks"][index]["key"]
    return store / "blocks" / key[:2] / f"{key}.safetensors"


def tensor_ranges(path: Path) -> dict[str, tuple[int, int]]:
    """name -> (absolute start, end) of each tensor's bytes, from the safetensors header."""
    raw = path.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + header_len])
    header.pop("__metadata__", None)
    base = 8 + header_len
    return {name: (base + info["data_offsets"][0], base + info["data_offsets"][1]) for name, info in header.items()}


def forge_first_block(store: Path, gid: str) -> str:
    """Change a bit of block 0 with its digest and rewrite the graft id to match: it loads, it does not recompute.
    Returns the forged graft's id."""
    directory = graft_dir(store, gid)
    block = block_path(store, gid, 0)
    tensors = safetensors.torch.load_file(block)
    tensors["layers.000.key"].view(torch.uint8).reshape(-1)[0] ^= 0x01
    digest = block_digest(tensors)
    block.write_bytes(block_file_bytes(tensors, digest))
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["blocks"][0]["sha256"] = digest
    manifest["id"] = forged = graft_id(manifest)
    (directory / "manifest.json").write_text(json.dumps(manifest))
    directory.rename(directory.parent / forged)
    return forged


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / "store"


# --- happy paths ---------------------------------------------------------------------------------------------


def test_build_text_prints_exactly_id_tokens_aligned_bytes(store: Path) -> None:
    data = ok_json(cli("build", "--text", TEXT_40, "--model", MODEL, "--store", store, "-C", CHUNK, "--json"))
    assert set(data) == {"id", "tokens", "aligned_tokens", "bytes", "blocks", "reused_blocks"}
    assert HEX64.match(data["id"])
    assert data["tokens"] == len(TEXT_40) + 1 == 40
    assert data["aligned_tokens"] == 32
    assert (data["blocks"], data["reused_blocks"]) == (2, 0)
    directory = graft_dir(store, data["id"])
    blocks = block_files(store)
    assert len(blocks) == 2
    assert data["bytes"] == sum(p.stat().st_size for p in [*directory.iterdir(), *blocks])
    assert sorted(p.name for p in directory.iterdir()) == ["manifest.json", "tensors.safetensors"]
    assert graft_ids(store) == [data["id"]]
    assert tmp_leftovers(store) == []


def test_build_is_idempotent(store: Path) -> None:
    first = ok_json(cli("build", "--text", TEXT_48, "--model", MODEL, "--store", store, "-C", CHUNK, "--json"))
    second = ok_json(cli("build", "--text", TEXT_48, "--model", MODEL, "--store", store, "-C", CHUNK, "--json"))
    # The second build reads its first two blocks back instead of computing them; the third chunk is computed
    # again because its forward gives the stored next-token logits. Same content, same id, nothing new on disk.
    assert (first.pop("reused_blocks"), second.pop("reused_blocks")) == (0, 2)
    assert first == second
    assert len(block_files(store)) == 3
    listing = ok_json(cli("ls", "--store", store, "--json"))
    assert [g["id"] for g in listing["grafts"]] == [first["id"]]
    assert tmp_leftovers(store) == []


def test_build_jsonl_prints_a_list_in_file_order(store: Path, tmp_path: Path) -> None:
    jsonl = tmp_path / "texts.jsonl"
    jsonl.write_text(
        json.dumps(TEXT_40) + "\n\n" + json.dumps({"text": TEXT_48, "title": "second", "lang": "en"}) + "\n"
    )
    data = ok_json(cli("build", "--jsonl", jsonl, "--model", MODEL, "--store", store, "-C", CHUNK, "--json"))
    assert isinstance(data, list) and len(data) == 2
    assert all(set(row) == {"id", "tokens", "aligned_tokens", "bytes", "blocks", "reused_blocks"} for row in data)
    assert [row["tokens"] for row in data] == [40, 48]
    assert [row["aligned_tokens"] for row in data] == [32, 48]
    assert graft_ids(store) == sorted(row["id"] for row in data)
    # Fields other than "text" become metadata.
    second = ok_json(cli("inspect", data[1]["id"], "--store", store, "--json"))
    assert second["metadata"] == {"title": "second", "lang": "en", "summary": TEXT_48}  # summary: for retrieval
    first = ok_json(cli("inspect", data[0]["id"], "--store", store, "--json"))
    assert first["metadata"] == {"summary": TEXT_40}


def test_build_file_and_ls(store: Path, tmp_path: Path) -> None:
    text_file = tmp_path / "text.txt"
    text_file.write_text(TEXT_48, encoding="utf-8")
    built = ok_json(
        cli(
            "build", "--file", text_file, "--title", "a file", "--model", MODEL, "--store", store, "-C", CHUNK, "--json"
        )
    )
    assert built["tokens"] == 48 and built["aligned_tokens"] == 48
    # Same text by --text gives another graft: the title is metadata, and metadata is part of the id.
    by_text = build(store, TEXT_48)
    assert by_text != built["id"]
    listing = ok_json(cli("ls", "--store", store, "--json"))
    assert listing["store"] == str(store)
    rows = {row["id"]: row for row in listing["grafts"]}
    assert set(rows) == {built["id"], by_text}
    for row in rows.values():
        assert set(row) == {"id", "tokens", "aligned_tokens", "model", "dtype", "title", "created_at"}
        assert (row["tokens"], row["aligned_tokens"], row["model"], row["dtype"]) == (48, 48, MODEL, "float32")
    assert rows[built["id"]]["title"] == "a file"
    assert rows[by_text]["title"] is None


@pytest.mark.parametrize("command", [("ls",), ("store", "stats"), ("store", "gc"), ("rm", "ab12"), ("inspect", "ab12")])
def test_a_store_that_is_missing_or_a_file_is_an_error_not_an_empty_store(
    store: Path, tmp_path: Path, command: tuple[str, ...]
) -> None:
    fails(cli(*command, "--store", store), f"no store at {store}")
    assert not store.exists()
    afile = tmp_path / "afile"
    afile.write_text("not a store")
    fails(cli(*command, "--store", afile), f"store path {afile} is not a directory")
    fails(cli("build", "--text", "hi", "--store", afile), f"store path {afile} is not a directory")
    assert afile.read_text() == "not a store"


def test_ls_of_an_empty_store_is_empty(store: Path) -> None:
    store.mkdir()
    assert ok_json(cli("ls", "--store", store, "--json")) == {"store": str(store), "grafts": [], "damaged": []}


def test_inspect_json_is_the_manifest_plus_an_absolute_tensors_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # a relative --store: tensors_path must still come out absolute
    store = tmp_path / "store"
    gid = build(Path("store"), TEXT_48)
    data = ok_json(cli("inspect", gid[:10], "--store", "store", "--json"))
    assert set(data) == MANIFEST_KEYS | {"tensors_path"}
    on_disk = json.loads((graft_dir(store, gid) / "manifest.json").read_text())
    assert {k: v for k, v in data.items() if k != "tensors_path"} == on_disk
    assert data["id"] == gid
    assert data["format_version"] == 2
    assert data["tokens"][0] != data["tokens"][1] and len(data["tokens"]) == 48
    assert (data["aligned_tokens"], data["chunk_size"], data["dtype"]) == (48, CHUNK, "float32")
    assert data["provenance"]["model_name"] == MODEL
    assert data["next_token_logits"]["tensor"] == "next_token_logits"
    tensors_path = Path(data["tensors_path"])
    assert tensors_path.is_absolute()
    assert tensors_path.is_file()
    assert tensors_path == (store / "grafts" / gid / "tensors.safetensors").resolve()


def test_generate_with_receipt_then_verify_receipt(store: Path, tmp_path: Path) -> None:
    gid = build(store, TEXT_40)
    receipt_path = tmp_path / "receipt.json"
    out = ok_json(
        cli(
            "generate",
            "--prompt",
            " and",
            "--graft",
            gid[:12],
            "--max-new-tokens",
            5,
            "--receipt",
            receipt_path,
            "--store",
            store,
            "--json",
        )
    )
    assert out["graft_id"] == gid
    assert out["exact"] is True
    assert out["prompt_tokens"] == 4  # " and": 4 bytes, no BOS after a graft
    assert 1 <= len(out["output_tokens"]) <= 5
    if out["stop_reason"] == "length":
        assert len(out["output_tokens"]) == 5
    assert {"ttft_s", "decode_tokens_per_s", "total_s", "graft_load_s", "graft_restore_s"} <= set(out["timings"])

    receipt = json.loads(receipt_path.read_text())
    assert receipt["id"] == out["receipt_id"]
    assert receipt["graft_id"] == gid
    assert receipt["graft_aligned_tokens"] == 32
    assert receipt["output_tokens"] == out["output_tokens"]
    assert receipt["steps"] == len(out["output_tokens"])
    manifest_tokens = json.loads((graft_dir(store, gid) / "manifest.json").read_text())["tokens"]
    assert receipt["input_tokens"][:40] == manifest_tokens
    assert len(receipt["input_tokens"]) == 40 + 4
    assert receipt["input_sha256"] == sha256_token_ids(receipt["input_tokens"])
    assert receipt["output_sha256"] == sha256_token_ids(receipt["output_tokens"])
    assert HEX64.match(receipt["logits_chain_sha256"])
    assert receipt["sampling"]["max_new_tokens"] == 5

    checked = ok_json(cli("verify", "--receipt", receipt_path, "--store", store, "--json"))
    assert checked["receipt_id"] == receipt["id"]
    assert checked["exact"] is True
    assert (checked["tokens_equal"], checked["logits_equal"], checked["first_divergence"]) == (True, True, None)
    assert checked["environment_differences"] == []


def test_verify_receipt_catches_a_forged_output_token(store: Path, tmp_path: Path) -> None:
    receipt_path = tmp_path / "receipt.json"
    ok(cli("generate", "--prompt", TEXT_40, "-n", 5, "--model", MODEL, "--receipt", receipt_path, "--store", store))
    receipt = json.loads(receipt_path.read_text())
    assert receipt["graft_id"] is None
    steps = len(receipt["output_tokens"])
    # Change the last output token and keep the receipt self-consistent: only a fresh rerun can tell.
    receipt["output_tokens"][-1] = (receipt["output_tokens"][-1] + 1) % 256
    receipt["output_sha256"] = sha256_token_ids(receipt["output_tokens"])
    receipt["id"] = receipt_id({k: v for k, v in receipt.items() if k != "id"})
    receipt_path.write_text(json.dumps(receipt))
    result = cli("verify", "--receipt", receipt_path, "--store", store, "--json")
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert result.exit_code == 1
    data = json.loads(result.stdout)
    assert (data["exact"], data["tokens_equal"], data["first_divergence"]) == (False, False, steps - 1)
    assert result.stderr.strip() == "not exact: differs in output tokens"


@pytest.mark.parametrize("text", [TEXT_48, TEXT_40, TEXT_6], ids=["all-aligned", "with-tail", "no-kv"])
def test_verify_graft_is_exact(store: Path, text: str) -> None:
    gid = build(store, text)
    data = ok_json(cli("verify", gid, "--store", store, "--json"))
    assert data == {
        "graft_id": gid,
        "exact": True,
        "kv_equal": True,
        "logits_equal": True,
        "kl": 0.0,
        "argmax_agree": True,
        "mismatched": [],
        "environment_differences": [],
    }


def test_verify_catches_a_forged_but_self_consistent_graft(store: Path) -> None:
    """A block changed with its digest and the graft id rewritten to match: loading succeeds, recompute does not."""
    gid = build(store, TEXT_48)
    forged = forge_first_block(store, gid)

    result = cli("verify", forged, "--store", store, "--json")
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert result.exit_code == 1
    data = json.loads(result.stdout)
    assert (data["exact"], data["kv_equal"], data["logits_equal"]) == (False, False, True)
    assert data["mismatched"] == ["block 0 layers.000.key"]
    assert result.stderr.strip() == "not exact: differs in KV tensors (block 0 layers.000.key)"


def test_build_check_stores_the_same_graft(store: Path, tmp_path: Path) -> None:
    plain = ok_json(cli("build", "--text", TEXT_48, "--model", MODEL, "--store", store, "-C", CHUNK, "--json"))
    other = tmp_path / "other"
    checked = ok_json(
        cli("build", "--text", TEXT_48, "--model", MODEL, "--store", other, "-C", CHUNK, "--check", "--json")
    )
    assert checked == plain
    assert [p.read_bytes() for p in block_files(other)] == [p.read_bytes() for p in block_files(store)]


def test_verify_all_and_a_sample(store: Path) -> None:
    for text in (TEXT_48, TEXT_40, TEXT_6):
        build(store, text)
    data = ok_json(cli("verify", "--all", "--store", store, "--json"))
    assert data == {"exact": True, "store_grafts": 3, "checked": 3, "failed": [], "skipped": {}}
    assert ok(cli("verify", "--all", "--store", store)).stdout.strip() == (
        "3 of 3 grafts checked: 3 exact, 0 not exact, 0 could not be checked"
    )
    sample = ok_json(cli("verify", "--all", "--sample", 2, "--seed", 1, "--store", store, "--json"))
    assert (sample["checked"], sample["store_grafts"], sample["exact"]) == (2, 3, True)


def test_verify_all_reports_a_forged_graft_and_one_it_cannot_check(store: Path) -> None:
    good = build(store, TEXT_40)
    gid = build(store, TEXT_48)
    forged = forge_first_block(store, gid)
    damaged = build(store, TEXT_48.upper())  # shares no block with the others
    damaged_block = block_path(store, damaged, 2)
    raw = bytearray(damaged_block.read_bytes())
    raw[-1] ^= 0x01
    damaged_block.write_bytes(bytes(raw))

    result = cli("verify", "--all", "--store", store, "--json")
    assert result.exit_code == 1
    data = json.loads(result.stdout)
    assert (data["exact"], data["store_grafts"], data["checked"]) == (False, 3, 2)
    assert [f["graft_id"] for f in data["failed"]] == [forged]
    assert data["failed"][0]["mismatched"] == ["block 0 layers.000.key"]
    assert list(data["skipped"]) == [damaged] and "SHA-256" in data["skipped"][damaged]
    text = cli("verify", "--all", "--store", store).stdout
    assert "2 of 3 grafts checked: 1 exact, 1 not exact, 1 could not be checked" in text
    assert good not in text


def test_rm_then_ls_is_empty(store: Path) -> None:
    keep = build(store, TEXT_40)
    gid = build(store, TEXT_48)
    assert ok_json(cli("rm", gid, "--store", store, "--json")) == {"removed": [gid]}
    assert graft_ids(store) == [keep]
    ok(cli("rm", keep[:8], "--store", store))
    assert ok_json(cli("ls", "--store", store, "--json"))["grafts"] == []
    assert list((store / "grafts").iterdir()) == []
    assert tmp_leftovers(store) == []


def test_demo_json(tmp_path: Path) -> None:
    data = ok_json(cli("demo", "--exactness", "--json", "--store", tmp_path / "store"))
    assert data["model"] == "random:gemma4"
    assert data["exact"] is True
    assert data["graft_verified"] is True
    assert data["receipt_verified"] is True
    assert data["aligned_tokens"] % 64 == 0
    assert 0 < data["aligned_tokens"] <= data["graft_tokens"]
    assert data["new_tokens"] <= 32
    assert graft_ids(tmp_path / "store") == [data["graft_id"]]
    assert tmp_leftovers(tmp_path / "store") == []


# --- bad inputs ----------------------------------------------------------------------------------------------


def test_each_corrupted_tensor_is_named(store: Path, tmp_path: Path) -> None:
    """A flipped byte anywhere is caught: in any tensor of any block (the block and its file are named), and in
    the next-token logits of the graft's own tensors file."""
    gid = build(store, TEXT_48)
    manifest = json.loads((graft_dir(store, gid) / "manifest.json").read_text())
    layers = 4  # random:llama
    block_tensors = {f"layers.{i:03d}.{part}" for i in range(layers) for part in ("key", "value")}
    targets: list[tuple[Path, str, str]] = [(graft_dir(store, gid) / "tensors.safetensors", "next_token_logits", "")]
    for index, entry in enumerate(manifest["blocks"]):
        path = block_path(store, gid, index)
        assert set(tensor_ranges(path)) == block_tensors
        targets += [(path, name, entry["key"][:12]) for name in sorted(block_tensors)]
    assert set(tensor_ranges(targets[0][0])) == {"next_token_logits"}
    receipt = tmp_path / "receipt.json"
    for path, name, key in targets:
        original = path.read_bytes()
        start, end = tensor_ranges(path)[name]
        corrupted = bytearray(original)
        corrupted[(start + end) // 2] ^= 0xFF
        path.write_bytes(corrupted)
        message = f"block {key} does not match its SHA-256" if key else f"tensor {name} does not match its SHA-256"
        fails(cli("verify", gid, "--store", store, "--json"), message, str(path))
        fails(cli("generate", "--graft", gid, "-n", 2, "--receipt", receipt, "--store", store, "--json"), message)
        assert not receipt.exists()
        assert_store_unchanged(store, [gid])
        path.write_bytes(original)
    ok(cli("verify", gid, "--store", store))


def test_missing_block(store: Path) -> None:
    gid = build(store, TEXT_48)
    path = block_path(store, gid, 1)
    path.unlink()
    fails(cli("verify", gid, "--store", store), f"block {path.stem[:12]} is missing", str(path))
    fails(cli("generate", "--graft", gid, "-n", 2, "--store", store), f"block {path.stem[:12]} is missing")


@pytest.mark.parametrize(
    ("keep", "fragment"),
    [(5, "tensors file is truncated (no header)"), (0.5, "truncated or padded"), (-1, "truncated or padded")],
    ids=["no-header", "half", "last-byte"],
)
def test_truncated_tensors_file(store: Path, keep: float, fragment: str) -> None:
    gid = build(store, TEXT_48)
    tensors = graft_dir(store, gid) / "tensors.safetensors"
    raw = tensors.read_bytes()
    cut = int(len(raw) * keep) if isinstance(keep, float) else keep
    tensors.write_bytes(raw[:cut])
    fails(cli("verify", gid, "--store", store), fragment)
    fails(cli("generate", "--graft", gid, "-n", 2, "--store", store), fragment)
    assert_store_unchanged(store, [gid])


def test_missing_tensors_file(store: Path) -> None:
    gid = build(store, TEXT_48)
    (graft_dir(store, gid) / "tensors.safetensors").unlink()
    fails(cli("verify", gid, "--store", store), "tensors file is missing")
    fails(cli("generate", "--graft", gid, "-n", 2, "--store", store), "tensors file is missing")


def test_malformed_manifest(store: Path) -> None:
    gid = build(store, TEXT_48)
    (graft_dir(store, gid) / "manifest.json").write_text('{"format_version": 1, "tokens": [')
    for args in (
        ("inspect", gid),
        ("verify", gid),
        ("generate", "--graft", gid, "-n", 2),
    ):
        fails(cli(*args, "--store", store, "--json"), "manifest.json: manifest is not valid JSON")
    # ls carries on: the broken graft is one damaged row, with the error.
    listed = ok_json(cli("ls", "--store", store, "--json"))
    assert listed["grafts"] == [] and [row["id"] for row in listed["damaged"]] == [gid]
    assert "manifest.json: manifest is not valid JSON" in listed["damaged"][0]["error"]
    assert_store_unchanged(store, [gid])
    # A broken graft can still be removed.
    ok(cli("rm", gid, "--store", store))
    assert graft_ids(store) == []


def test_manifest_of_an_unknown_format_version(store: Path) -> None:
    gid = build(store, TEXT_48)
    path = graft_dir(store, gid) / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["format_version"] = 99
    path.write_text(json.dumps(manifest))
    for args in (("inspect", gid), ("verify", gid), ("generate", "--graft", gid, "-n", 2)):
        fails(cli(*args, "--store", store), "unknown format_version 99", "upgrade kvgraft")
    assert_store_unchanged(store, [gid])


def test_edited_manifest_no_longer_matches_its_id(store: Path) -> None:
    gid = build(store, TEXT_48)
    path = graft_dir(store, gid) / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["metadata"] = {"title": "edited"}
    path.write_text(json.dumps(manifest))
    for args in (("inspect", gid), ("verify", gid), ("generate", "--graft", gid, "-n", 2)):
        fails(cli(*args, "--store", store), "does not match its content hash")


def test_graft_refused_by_another_model(store: Path, tmp_path: Path) -> None:
    gid = build(store, TEXT_48, model="random:llama")
    receipt = tmp_path / "receipt.json"
    fragments = ("graft was built for another model", "weights_sha256")
    fails(
        cli("generate", "--graft", gid, "--model", "random:llama:1", "-n", 2, "--receipt", receipt, "--store", store),
        *fragments,
    )
    line = fails(cli("verify", gid, "--model", "random:llama:1", "--store", store, "--json"), *fragments)
    assert "config_sha256" not in line  # same architecture, other weights: only the weights differ
    assert not receipt.exists()
    # Another chunk size is refused too.
    fails(cli("generate", "--graft", gid, "-C", 32, "-n", 2, "--store", store), "chunk_size 16 vs 32")
    assert_store_unchanged(store, [gid])


def test_environment_mismatch_is_refused_with_the_flag_that_allows_it(
    store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gid = build(store, TEXT_48)
    stored = json.loads((graft_dir(store, gid) / "manifest.json").read_text())["fingerprint"]["environment"]
    real = fingerprint.numeric_environment
    monkeypatch.setattr(fingerprint, "numeric_environment", lambda device: real(device) | {"cpu_capability": "X"})
    problem = (
        f"error: numeric environment differs (graft vs this run: cpu_capability {stored['cpu_capability']!r} vs 'X'); "
        "exactness is not guaranteed under another environment"
    )
    line = fails(cli("generate", "--graft", gid, "-n", 2, "--store", store))
    assert line == problem + "; pass --allow-env-mismatch to use it anyway, reported as not exact"
    assert_store_unchanged(store, [gid])
    allowed = ok_json(cli("generate", "--graft", gid, "-n", 2, "--allow-env-mismatch", "--store", store, "--json"))
    assert allowed["exact"] is False


def test_grafts_that_are_not_one_chain_are_refused_with_the_flags_that_help(store: Path) -> None:
    a = build(store, TEXT_48)
    b = build(store, TEXT_40)
    line = fails(cli("generate", "-g", a, "-g", b, "-n", 2, "--store", store))
    assert line == (
        f"error: graft {b[:12]} does not begin with the tokens of graft {a[:12]} (position 1 in the list), so the "
        "grafts are not one chain; build it with --after, or pass --approximate"
    )
    assert_store_unchanged(store, sorted([a, b]))


@pytest.mark.parametrize("text", ["", "   \n\t  "], ids=["empty", "whitespace"])
def test_build_empty_text(store: Path, text: str) -> None:
    fails(cli("build", "--text", text, "--model", MODEL, "--store", store, "--json"), "text is empty")
    assert_store_unchanged(store, [])


def test_build_text_longer_than_the_model_positions(store: Path) -> None:
    fails(
        cli("build", "--text", "a" * 5000, "--model", MODEL, "--store", store, "-C", CHUNK, "--json"),
        "text is 5001 tokens; the model supports at most 4096 positions",
    )
    assert_store_unchanged(store, [])


def test_generate_past_the_model_positions(store: Path) -> None:
    gid = build(store, TEXT_48)
    fails(
        cli("generate", "--graft", gid, "-n", 4096, "--store", store),
        "input plus max new tokens is 4144 tokens; the model supports at most 4096 positions",
    )


def test_unknown_graft_id(store: Path) -> None:
    fails(cli("inspect", "abc123", "--store", store), f"no store at {store}")
    store.mkdir()
    fails(cli("inspect", "abc123", "--store", store), f"no graft abc123 in store {store}")
    gid = build(store, TEXT_48)
    other = ("0" if gid[0] != "0" else "1") + gid[1:]
    for args in (("inspect", other), ("verify", other), ("generate", "--graft", other, "-n", 2), ("rm", other)):
        fails(cli(*args, "--store", store), f"no graft {other}")
    fails(cli("inspect", "not-hex", "--store", store), "'not-hex' is not a graft id (hex digits expected)")
    fails(cli("rm", gid, "zz", "--store", store), "'zz' is not a graft id")
    assert_store_unchanged(store, [gid])  # rm resolves every id before it deletes any


def test_ambiguous_prefix(store: Path, tmp_path: Path) -> None:
    # 17 grafts: two of them must share a first hex digit.
    jsonl = tmp_path / "many.jsonl"
    jsonl.write_text("".join(json.dumps(f"text number {i}") + "\n" for i in range(17)))
    built = ok_json(cli("build", "--jsonl", jsonl, "--model", MODEL, "--store", store, "-C", CHUNK, "--json"))
    ids = sorted(row["id"] for row in built)
    assert len(set(ids)) == 17
    a, b = next((x, y) for x, y in itertools.pairwise(ids) if x[0] == y[0])
    prefix = next(a[:i] for i in range(64, 0, -1) if b.startswith(a[:i]))
    for args in (("inspect", prefix), ("verify", prefix), ("generate", "--graft", prefix, "-n", 2), ("rm", prefix)):
        fails(cli(*args, "--store", store), f"graft id prefix {prefix} is ambiguous", "give more digits")
    assert_store_unchanged(store, ids)
    # One more digit of either is unique again.
    assert ok_json(cli("inspect", a[: len(prefix) + 1], "--store", store, "--json"))["id"] == a


def test_store_path_is_a_regular_file(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.write_text("not a store")
    fails(
        cli("build", "--text", TEXT_48, "--model", MODEL, "--store", store, "--json"),
        f"store path {store} is not a directory",
    )
    assert store.read_text() == "not a store"


def test_store_tmp_is_a_regular_file(store: Path) -> None:
    """Works as root too: the store cannot stage a graft, so nothing is stored."""
    gid = build(store, TEXT_40)
    (store / "tmp").rmdir()
    (store / "tmp").write_text("in the way")
    fails(cli("build", "--text", TEXT_48, "--model", MODEL, "--store", store, "-C", CHUNK), str(store))
    assert graft_ids(store) == [gid]
    fails(cli("rm", gid, "--store", store), str(store))
    assert graft_ids(store) == [gid]


def test_store_directory_without_write_permission(store: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root ignores directory permissions")
    gid = build(store, TEXT_40)
    for directory in (store, store / "grafts", store / "tmp"):
        directory.chmod(0o500)
    try:
        fails(cli("build", "--text", TEXT_48, "--model", MODEL, "--store", store, "-C", CHUNK), "not writable")
        assert graft_ids(store) == [gid]
    finally:
        for directory in (store, store / "grafts", store / "tmp"):
            directory.chmod(0o700)
    assert tmp_leftovers(store) == []


@pytest.mark.parametrize(
    "sources",
    [
        (),
        ("--text", "abc", "--file", "FILE"),
        ("--text", "abc", "--jsonl", "FILE"),
        ("--file", "FILE", "--jsonl", "FILE"),
        ("--text", "abc", "--file", "FILE", "--jsonl", "FILE"),
    ],
    ids=["none", "text+file", "text+jsonl", "file+jsonl", "all"],
)
def test_build_needs_exactly_one_source(store: Path, tmp_path: Path, sources: tuple[str, ...]) -> None:
    path = tmp_path / "text.txt"
    path.write_text('"abc def"\n')
    args = [str(path) if a == "FILE" else a for a in sources]
    fails(cli("build", *args, "--model", MODEL, "--store", store), "give exactly one of --text, --file or --jsonl")
    assert_store_unchanged(store, [])


def test_build_file_that_does_not_exist(store: Path, tmp_path: Path) -> None:
    missing = tmp_path / "missing.txt"
    fails(cli("build", "--file", missing, "--model", MODEL, "--store", store), f"no such file: {missing}")
    fails(cli("build", "--jsonl", missing, "--model", MODEL, "--store", store), f"no such file: {missing}")
    assert_store_unchanged(store, [])


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ('"fine"\n{oops\n', ":2: not valid JSON"),
        ('"fine"\n42\n', ':2: expected a JSON string or an object with a "text" field'),
        ('{"title": "no text"}\n', ':1: expected a JSON string or an object with a "text" field'),
        ("\n  \n", "no texts in file"),
    ],
    ids=["bad-json", "number", "no-text-field", "blank"],
)
def test_build_bad_jsonl(store: Path, tmp_path: Path, content: str, fragment: str) -> None:
    jsonl = tmp_path / "bad.jsonl"
    jsonl.write_text(content)
    fails(cli("build", "--jsonl", jsonl, "--model", MODEL, "--store", store, "--json"), str(jsonl), fragment)
    assert_store_unchanged(store, [])


def test_build_file_not_utf8(store: Path, tmp_path: Path) -> None:
    path = tmp_path / "binary.txt"
    path.write_bytes(b"\xff\xfe\x00bad")
    fails(cli("build", "--file", path, "--model", MODEL, "--store", store), f"cannot read {path}")
    assert_store_unchanged(store, [])


def test_unknown_model_spec(store: Path) -> None:
    fails(cli("build", "--text", TEXT_48, "--model", "random:nope", "--store", store), "unknown model 'random:nope'")
    fails(cli("build", "--text", TEXT_48, "--model", "random:llama:x", "--store", store), "must be an integer")
    assert_store_unchanged(store, [])


@pytest.mark.parametrize("extra", [(), ("ID", "--receipt", "RECEIPT")], ids=["neither", "both"])
def test_verify_needs_an_id_or_a_receipt(store: Path, tmp_path: Path, extra: tuple[str, ...]) -> None:
    receipt = tmp_path / "receipt.json"
    receipt.write_text("{}")
    args = [str(receipt) if a == "RECEIPT" else "abc" if a == "ID" else a for a in extra]
    fails(cli("verify", *args, "--store", store), "give a graft id, --receipt FILE or --all (one of them)")


def test_verify_sample_needs_all(store: Path) -> None:
    fails(cli("verify", "abc", "--sample", 2, "--store", store), "--sample goes with --all")


def test_generate_needs_a_prompt_or_a_graft(store: Path) -> None:
    fails(cli("generate", "--model", MODEL, "--store", store), "prompt is empty; give a prompt or a graft")


def test_generate_receipt_to_an_unwritable_path(store: Path, tmp_path: Path) -> None:
    target = tmp_path / "no-such-dir" / "receipt.json"
    fails(
        cli("generate", "--prompt", "hi", "--model", MODEL, "-n", 2, "--receipt", target, "--store", store),
        f"cannot write receipt to {target}",
    )


def test_generate_receipt_on_a_full_disk_leaves_no_file(
    store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "receipts"
    out.mkdir()

    def disk_full(*_: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", disk_full)
    target = out / "receipt.json"
    fails(
        cli("generate", "--prompt", "hi", "--model", MODEL, "-n", 2, "--receipt", target, "--store", store),
        f"cannot write receipt to {target}: No space left on device",
    )
    assert list(out.iterdir()) == []  # neither an empty receipt nor its temporary file


def _receipt(store: Path, tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    path = tmp_path / "receipt.json"
    ok(cli("generate", "--prompt", TEXT_6, "--model", MODEL, "-n", 3, "--receipt", path, "--store", store))
    return path, json.loads(path.read_text())


def test_bad_receipts(store: Path, tmp_path: Path) -> None:
    path, receipt = _receipt(store, tmp_path)
    fails(cli("verify", "--receipt", tmp_path / "nope.json", "--store", store), "no such file")
    path.write_text("{not json")
    fails(cli("verify", "--receipt", path, "--store", store), "receipt is not valid JSON")
    path.write_text(json.dumps(receipt | {"receipt_version": 7}))
    fails(cli("verify", "--receipt", path, "--store", store), "unknown receipt_version 7")
    path.write_text(json.dumps(receipt | {"output_tokens": [*receipt["output_tokens"], 1]}))
    fails(cli("verify", "--receipt", path, "--store", store), "output_sha256 does not match output_tokens")
    path.write_text(json.dumps({k: v for k, v in receipt.items() if k != "sampling"}))
    fails(cli("verify", "--receipt", path, "--store", store), "malformed receipt (KeyError")


# --- malformed files of the right syntax, and batches with one bad text ------------------------------------------


@pytest.mark.parametrize("damage", ["no-data-offsets", "entry-not-an-object"])
def test_structurally_bad_tensors_header(store: Path, damage: str) -> None:
    gid = build(store, TEXT_48)
    tensors = block_path(store, gid, 0)
    raw = tensors.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + header_len])
    if damage == "no-data-offsets":
        del header["layers.000.key"]["data_offsets"]
    else:
        header["layers.000.key"] = "gone"
    # Valid JSON of the original length (trailing spaces), so only the structure is wrong.
    new_header = json.dumps(header, separators=(",", ":")).encode().ljust(header_len)
    assert len(new_header) == header_len
    tensors.write_bytes(raw[:8] + new_header + raw[8 + header_len :])
    fails(cli("verify", gid, "--store", store), str(tensors))


@pytest.mark.parametrize(
    "field", ["timings-list", "no-dtype", "chunk-size-text", "token-out-of-vocab"], ids=lambda f: f
)
def test_receipt_with_wrong_shaped_fields(store: Path, tmp_path: Path, field: str) -> None:
    path, receipt = _receipt(store, tmp_path)
    if field == "timings-list":
        receipt["timings"] = []
    elif field == "no-dtype":
        del receipt["fingerprint"]["model"]["dtype"]
    elif field == "chunk-size-text":
        receipt["fingerprint"]["schedule"]["chunk_size"] = "sixteen"
    else:
        receipt["input_tokens"][1] = 10**6
        receipt["input_sha256"] = sha256_token_ids(receipt["input_tokens"])
    receipt["id"] = receipt_id({k: v for k, v in receipt.items() if k != "id"})
    path.write_text(json.dumps(receipt))
    expected = {"token-out-of-vocab": "token id 1000000 is outside the model's vocabulary of 259"}
    fails(cli("verify", "--receipt", path, "--store", store), expected.get(field, "malformed receipt"))


def test_build_jsonl_with_one_bad_text_stores_nothing(store: Path, tmp_path: Path) -> None:
    jsonl = tmp_path / "texts.jsonl"
    jsonl.write_text(json.dumps(TEXT_48) + "\n" + json.dumps({"text": "   "}) + "\n")
    fails(cli("build", "--jsonl", jsonl, "--model", MODEL, "--store", store, "--json"), "text is empty")
    assert_store_unchanged(store, [])


def test_harvest_solutions_then_bench_json(tmp_path: Path) -> None:
    store = tmp_path / "store"
    solutions = tmp_path / "solutions.jsonl"
    rows = [
        {"problem": "Ada has 5 pens. Gets 3. How many pens now?", "answer": "8", "solution": "5+3=8. Answer:8"},
        {"problem": "Ben has 9 cups. Loses 4. How many cups now?", "answer": "5", "solution": "9-4=6. Answer:6"},
    ]
    solutions.write_text("".join(json.dumps(r) + "\n" for r in rows))
    harvested = ok_json(cli("harvest", "--solutions", solutions, "--model", "demo", "--store", store, "--json"))
    assert (harvested["problems"], harvested["verified"], len(harvested["replay_grafts"])) == (2, 1, 1)
    assert [r["verified"] for r in harvested["records"]] == [True, False]
    data = ok_json(
        cli("bench", "--dataset", solutions, "--model", "demo", "--store", store, "--out", tmp_path / "r", "--json")
    )
    assert data["rungs"]["grafted"]["seen"]["n"] == 1 and data["rungs"]["grafted"]["unseen"]["n"] == 1
    assert data["problems"][0]["grafted"]["path"] == "replay"
    assert data["receipts"]["verified"] == data["receipts"]["total"] >= 1
    assert Path(data["report"]).is_file()


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (
            ["generate", "--max-new-tokens", "0", "hi"],
            ["Invalid value for '--max-new-tokens'", "kvgraft generate --help"],
        ),
        (["generate", "--bogus"], ["No such option: --bogus"]),
        (["store", "gc", "--grace", "soon"], ["Invalid value for '--grace'", "kvgraft store gc --help"]),
    ],
)
def test_a_usage_error_is_one_error_line_and_exit_1(args: list[str], fragments: list[str]) -> None:
    fails(cli(*args), *fragments)


def test_gc_says_what_it_kept_and_how_to_remove_it(store: Path) -> None:
    build(store, TEXT_48)
    block = next((store / "blocks").rglob("*.safetensors"))
    orphan = store / "blocks" / "ff" / ("f" * 64 + ".safetensors")  # a block no graft names, as a killed build leaves
    orphan.parent.mkdir(exist_ok=True)
    orphan.write_bytes(block.read_bytes())
    line = ok(cli("store", "gc", "--store", store)).stdout
    assert " ".join(line.split()) == (
        "removed 0 unreferenced blocks, 0 bytes; kept 1 blocks younger than the grace period (3600 s: a build may be"
        " about to name them); --grace 0 to remove them"
    )
    assert ok_json(cli("store", "gc", "--store", store, "--grace", "0", "--json")) == {
        "removed_blocks": 1,
        "freed_bytes": len(block.read_bytes()),
        "kept_young_blocks": 0,
    }
    assert not orphan.exists() and block.exists()
