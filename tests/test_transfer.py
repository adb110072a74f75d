"""Moving grafts between stores (`kvgraft store copy`, `export`, `import`, kvgraft/store/transfer.py).

A local store -> S3 (moto, see conftest_s3.py) -> local round trip gives the same files byte for byte; a block shared
by several grafts is read and written once; an interrupted copy resumes and skips what is there; a damaged source
fails with one line and creates nothing; a bundle is a store layout that docs/FORMAT.md's standalone checker and
`kvgraft verify --receipt` accept, imports back byte for byte, and a hostile one is refused with nothing written.
"""

from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner, Result

from kvgraft.cli import app
from kvgraft.core.errors import IntegrityError
from kvgraft.core.hashing import BlockKey
from kvgraft.core.sampling import SamplingParams
from kvgraft.engine.engine import Engine
from kvgraft.engine.verify import verify_graft
from kvgraft.format.manifest import BlockRef
from kvgraft.store import GraftStore, LocalStore
from kvgraft.store.base import StoreTier
from kvgraft.store.transfer import copy_grafts

from conftest import TEST_CHUNK, cached_model

pytest.importorskip("obstore", reason="the S3 store needs obstore: pip install obstore")

from kvgraft.store.s3 import S3Store  # after the skip: obstore may be missing

MODEL = "random:llama"
# Byte tokenizer: len(text) + 1 tokens. A: 48 tokens = 3 blocks and next-token logits; B continues A (A's 3 blocks
# shared, then 2 of its own); C: 40 tokens = 2 blocks + a tail; D: 6 tokens, no block at all.
TEXT_A = "The state of a model after reading, kept safe.."
TEXT_B = " Restored, it continues exactly as a fresh run."
TEXT_C = "A restored state continues exactly so.."
TEXT_D = "short"
FORMAT_MD = Path(__file__).resolve().parents[1] / "docs" / "FORMAT.md"
HEX64 = "0123456789abcdef" * 4

runner = CliRunner()


# --- helpers ---------------------------------------------------------------------------------------------------


def cli(*args: Any) -> Result:
    return runner.invoke(app, [str(a) for a in args])


def ok_json(result: Result) -> Any:
    assert result.exception is None, f"{result.exception!r}\nstderr: {result.stderr}"
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def fails(result: Result, *fragments: str) -> str:
    """Exit 1, one 'error:' line on stderr holding every fragment, nothing on stdout, no traceback."""
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    return lines[0]


def layout_files(root: Path) -> dict[str, bytes]:
    """Every file under grafts/ and blocks/ of a local store, by path relative to the store."""
    return {
        path.relative_to(root).as_posix(): path.read_bytes()
        for top in ("grafts", "blocks")
        for path in sorted((root / top).rglob("*"))
        if path.is_file()
    }


def flip_last_byte(path: Path) -> None:
    """The last byte of a block or tensors file is tensor data: the header still parses, the hash does not match."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def standalone_checker(into: Path) -> Path:
    text = FORMAT_MD.read_text(encoding="utf-8")
    (code,) = re.findall(r"<!-- standalone-check -->\n```python\n(.*?)^```$", text, re.S | re.M)
    path = into / "check_graft.py"
    path.write_text(code, encoding="utf-8")
    return path


class Source:
    """The module's source store and its grafts' ids by name (A, B, C, D)."""

    def __init__(self, root: Path, ids: dict[str, str]) -> None:
        self.root, self.ids = root, ids

    def copy_to(self, target: Path) -> LocalStore:
        """A private copy to damage (the module's store is shared by every test)."""
        shutil.copytree(self.root, target)
        return LocalStore(target)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Source:
    root = tmp_path_factory.mktemp("source") / "store"
    model, tokenizer = cached_model(MODEL)
    engine = Engine(model, tokenizer, MODEL, TEST_CHUNK, LocalStore(root))
    a = engine.put(TEXT_A, {"title": "A"})
    ids: dict[str, str] = {"A": a.id, "B": engine.put(TEXT_B, after=a.id).id}
    ids |= {"C": engine.put(TEXT_C).id, "D": engine.put(TEXT_D).id}
    store = LocalStore(root)
    assert [len(store.manifest(ids[name]).blocks) for name in "ABCD"] == [3, 5, 2, 0]
    return Source(root, ids)


def distinct_blocks(store: GraftStore, ids: list[str]) -> set[str]:
    return {ref.key for graft in ids for ref in store.manifest(graft).blocks}


class CountingStore(StoreTier):
    """A real store, counting the block reads and the blocks given to puts that pass through it."""

    def __init__(self, inner: GraftStore) -> None:
        super().__init__(inner)
        self.reads: list[str] = []
        self.given: list[str] = []

    def read_block(
        self,
        key: BlockKey,
        block: BlockRef | None = None,
        shapes: dict[str, list[int]] | None = None,
        dtype: str | None = None,
    ) -> tuple[BlockRef, dict[str, torch.Tensor]]:
        self.reads.append(key)
        return self.inner.read_block(key, block, shapes, dtype)

    def put(self, manifest: Any, tensors: Any, blocks: Any = None) -> Any:
        self.given.extend(blocks or {})
        return self.inner.put(manifest, tensors, blocks)


# --- store copy ------------------------------------------------------------------------------------------------


def test_local_to_s3_to_local_gives_the_same_files_byte_for_byte(source: Source, s3_url: str, tmp_path: Path) -> None:
    every = sorted(source.ids.values())
    src = LocalStore(source.root)
    blocks = len(distinct_blocks(src, every))
    there = ok_json(cli("store", "copy", source.root, s3_url, "--json"))
    assert there["source"] == str(source.root) and there["destination"] == s3_url
    assert (there["copied"], there["skipped"]) == (every, [])
    assert (there["blocks_copied"], there["blocks_skipped"]) == (blocks, 0) == (7, 0)
    assert there["bytes_copied"] > 0
    remote = S3Store(s3_url)
    assert remote.ids() == every

    back = LocalStore(tmp_path / "back")
    result = copy_grafts(remote, back)
    assert (result.copied, result.blocks_copied, result.bytes_copied) == (every, blocks, there["bytes_copied"])
    assert back.ids() == every
    assert layout_files(back.root) == layout_files(source.root)  # manifests, tensors files and blocks

    again = ok_json(cli("store", "copy", s3_url, back.root, "--json"))  # nothing left to copy
    assert (again["copied"], again["skipped"], again["blocks_copied"], again["bytes_copied"]) == ([], every, 0, 0)


def test_a_block_shared_by_several_grafts_is_read_and_written_once(source: Source, tmp_path: Path) -> None:
    src = CountingStore(LocalStore(source.root))
    dst = CountingStore(LocalStore(tmp_path / "dst"))
    a, b = source.ids["A"], source.ids["B"]
    result = copy_grafts(src, dst, [a[:10], b[:10], a])  # prefixes, and A twice: each graft once
    shared = distinct_blocks(src, [a]) & distinct_blocks(src, [b])
    assert len(shared) == 3
    assert sorted(src.reads) == sorted(dst.given) == sorted(distinct_blocks(src, [a, b]))  # 5 distinct, once each
    assert (result.copied, result.blocks_copied, result.blocks_skipped) == ([a, b], 5, 0)

    # B alone into a store that holds A: A's blocks are not read again, only B's own two.
    src.reads.clear()
    other = LocalStore(tmp_path / "other")
    copy_grafts(LocalStore(source.root), other, [a])
    result = copy_grafts(src, other, [b])
    assert (result.blocks_copied, result.blocks_skipped, len(src.reads)) == (2, 3, 2)


def test_an_interrupted_copy_resumes_and_skips_what_is_there(source: Source, s3_url: str) -> None:
    ids = source.ids
    src, dst = LocalStore(source.root), S3Store(s3_url)
    steps: list[tuple[int, int]] = []

    def interrupt(done: int, total: int) -> None:
        steps.append((done, total))
        if done == 3 + 1 + 1:  # A's 3 blocks, A committed, then C's first block
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        copy_grafts(src, dst, [ids["A"], ids["C"], ids["B"]], interrupt)
    # 3 grafts and 7 distinct blocks to go; the run stopped in C, before C's put: only A is there, whole.
    assert steps[0] == (0, 3 + 7) and steps[-1] == (5, 10)
    assert dst.ids() == [ids["A"]]
    assert not dst.has_block(src.manifest(ids["C"]).blocks[0].key)

    every = sorted(ids.values())
    result = copy_grafts(src, dst)
    assert result.skipped == [ids["A"]] and sorted(result.copied) == sorted(set(every) - {ids["A"]})
    assert (result.blocks_copied, result.blocks_skipped) == (4, 3)  # C's 2 and B's own 2; A's 3 (in B) skipped
    assert dst.ids() == every
    model, tokenizer = cached_model(MODEL)
    engine = Engine(model, tokenizer, MODEL, TEST_CHUNK, dst)
    for graft in every:  # each graft read back from S3 against a fresh recompute of its tokens
        assert verify_graft(engine, graft).exact, graft


def test_a_damaged_block_in_the_source_fails_and_creates_nothing(source: Source, tmp_path: Path) -> None:
    damaged = source.copy_to(tmp_path / "damaged")
    b = source.ids["B"]
    flip_last_byte(damaged.block_path(damaged.manifest(b).blocks[-1].key))
    dst = tmp_path / "dst"
    line = fails(cli("store", "copy", damaged.root, dst, b[:12]), "block", "does not match its SHA-256")
    assert "corrupted file" in line
    assert not dst.exists()  # no graft, no block, not even the directory

    # Grafts copied before the damaged one stay, whole; the damaged one is absent.
    with pytest.raises(IntegrityError):
        copy_grafts(damaged, LocalStore(dst), [source.ids["C"], b])
    assert LocalStore(dst).ids() == [source.ids["C"]]


def test_copy_refuses_a_missing_source_and_the_same_store(source: Source, tmp_path: Path) -> None:
    fails(cli("store", "copy", tmp_path / "nowhere", tmp_path / "dst"), "no store at")
    fails(cli("store", "copy", source.root, source.root), "same store")
    fails(cli("store", "copy", source.root, tmp_path / "dst", "ffff"), "no graft ffff")
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_own_tensors_are_read_without_blocks_and_checked(
    backend: str, source: Source, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    store: GraftStore = LocalStore(tmp_path / "store")
    if backend == "s3":
        store = S3Store(request.getfixturevalue("s3_url"))
    copy_grafts(LocalStore(source.root), store, [source.ids["A"], source.ids["C"]])
    counting = CountingStore(store)
    manifest = counting.manifest(source.ids["A"])
    own = counting.own_tensors(manifest)
    assert set(own) == {"next_token_logits"} and counting.reads == []
    assert own["next_token_logits"].equal(store.get(manifest.id).tensors["next_token_logits"])
    assert counting.own_tensors(counting.manifest(source.ids["C"])) == {}  # a tail: no logits stored

    # A flipped byte in the tensors file is refused.
    if isinstance(store, LocalStore):
        flip_last_byte(Path(store.tensors_path(manifest.id)))
    else:
        assert isinstance(store, S3Store)
        client = request.getfixturevalue("s3_client")
        key = f"{store.prefix}/grafts/{manifest.id}/{manifest.tensors_file}"
        body = bytearray(client.get_object(Bucket=store.bucket, Key=key)["Body"].read())
        body[-1] ^= 0x01
        client.put_object(Bucket=store.bucket, Key=key, Body=bytes(body))
    with pytest.raises(IntegrityError, match="next_token_logits does not match its SHA-256"):
        store.own_tensors(manifest)


# --- export and import -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def receipt(source: Source, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A receipt of a generation from graft B, as `kvgraft generate --receipt` writes it."""
    model, tokenizer = cached_model(MODEL)
    engine = Engine(model, tokenizer, MODEL, TEST_CHUNK, LocalStore(source.root))
    result = engine.generate(" And", source.ids["B"], SamplingParams(max_new_tokens=4))
    path = tmp_path_factory.mktemp("receipt") / "receipt.json"
    result.receipt.write(path)
    return path


def test_a_bundle_checks_standalone_reruns_its_receipt_and_imports_byte_for_byte(
    source: Source, receipt: Path, s3_url: str, tmp_path: Path
) -> None:
    a, b = source.ids["A"], source.ids["B"]
    receipt_id = json.loads(receipt.read_text())["id"]
    bundle = tmp_path / "bundle.tar"
    exported = ok_json(
        cli("export", b[:8], a[:8], "--receipts", receipt, "-o", bundle, "--store", source.root, "--json")
    )
    assert (exported["copied"], exported["receipts"], exported["blocks_copied"]) == ([b, a], [receipt_id], 5)
    assert exported["bundle"] == str(bundle) and exported["bundle_bytes"] == bundle.stat().st_size
    assert [p.name for p in tmp_path.iterdir()] == ["bundle.tar"]  # no staging left beside it

    # A third party: plain tar, docs/FORMAT.md's checker (no kvgraft), `kvgraft verify --receipt`.
    third = tmp_path / "third"
    third.mkdir()
    subprocess.run(["tar", "-xf", str(bundle), "-C", str(third)], check=True)
    assert sorted(p.name for p in third.iterdir()) == ["blocks", "grafts", "receipts"]
    checker = standalone_checker(tmp_path)
    for graft in (a, b):
        run = subprocess.run(
            [sys.executable, str(checker), str(third / "grafts" / graft)], capture_output=True, text=True, check=False
        )
        assert (run.returncode, run.stdout.strip()) == (0, f"OK {graft}"), run.stdout + run.stderr
    extracted = third / "receipts" / f"{receipt_id}.json"
    assert extracted.read_bytes() == receipt.read_bytes()
    checked = ok_json(cli("verify", "--receipt", extracted, "--store", third, "--json"))
    assert (checked["receipt_id"], checked["tokens_equal"], checked["logits_equal"]) == (receipt_id, True, True)

    # Import into a fresh S3 store, then copy it back out: the same files as the source's, the receipt kept.
    imported = ok_json(cli("import", bundle, "--store", s3_url, "--json"))
    assert (sorted(imported["copied"]), imported["receipts"], imported["source"]) == (
        sorted([a, b]),
        [receipt_id],
        str(bundle),
    )
    remote = S3Store(s3_url)
    assert remote.read_sidecar(f"receipts/{receipt_id}.json") == receipt.read_bytes()
    copy_grafts(remote, LocalStore(tmp_path / "back"))
    keys = distinct_blocks(LocalStore(source.root), [a, b])
    expected = {k: v for k, v in layout_files(source.root).items() if k.split("/")[1] in {a, b} or Path(k).stem in keys}
    assert len(expected) == 2 * 2 + 5
    assert layout_files(third) == expected == layout_files(tmp_path / "back")

    again = ok_json(cli("import", bundle, "--store", s3_url, "--json"))
    assert (again["copied"], again["receipts"], again["receipts_skipped"]) == ([], [], [receipt_id])


def test_export_refuses_an_edited_receipt_and_writes_nothing(source: Source, receipt: Path, tmp_path: Path) -> None:
    edited = json.loads(receipt.read_text())
    edited["output_tokens"][0] += 1
    forged = tmp_path / "forged.json"
    forged.write_text(json.dumps(edited))
    bundle = tmp_path / "bundle.tar"
    args = ("export", source.ids["A"], "-o", bundle, "--store", source.root, "--receipts")
    fails(cli(*args, forged), "output_sha256 does not match")
    fails(cli(*args, tmp_path / "none.json"), "no receipt file")
    fails(cli(*args, HEX64), f"no receipt {HEX64}")  # an id the store does not keep
    assert sorted(p.name for p in tmp_path.iterdir()) == ["forged.json"]


def _hostile(kind: str) -> tarfile.TarInfo:
    if kind == "dotdot":
        return tarfile.TarInfo("grafts/../../evil.txt")
    if kind == "absolute":
        return tarfile.TarInfo("/tmp/kvgraft-evil.txt")
    info = tarfile.TarInfo(f"grafts/{HEX64}/manifest.json")
    info.type, info.linkname = {
        "symlink": (tarfile.SYMTYPE, "/etc/passwd"),
        "hardlink": (tarfile.LNKTYPE, "/etc/passwd"),
        "device": (tarfile.CHRTYPE, ""),
        "fifo": (tarfile.FIFOTYPE, ""),
    }[kind]
    return info


@pytest.mark.parametrize(
    ("kind", "why"),
    [
        ("dotdot", "path climbs out with '..'"),
        ("absolute", "absolute path"),
        ("symlink", "symbolic link"),
        ("hardlink", "hard link"),
        ("device", "device"),
        ("fifo", "special file"),
        ("unexpected", "not a file of a bundle"),
    ],
)
def test_a_hostile_bundle_is_refused_and_nothing_is_written(
    kind: str, why: str, source: Source, tmp_path: Path
) -> None:
    good = tmp_path / "good.tar"
    ok_json(cli("export", source.ids["A"], "-o", good, "--store", source.root, "--json"))
    bad = tmp_path / "bad.tar"
    with tarfile.open(good) as original, tarfile.open(bad, "w") as tar:
        for member in original.getmembers():  # a whole valid graft first: it must not be imported either
            tar.addfile(member, original.extractfile(member))
        payload = b"owned\n"
        info = tarfile.TarInfo("notes/readme.txt") if kind == "unexpected" else _hostile(kind)
        info.size = len(payload) if info.isfile() else 0
        tar.addfile(info, io.BytesIO(payload) if info.isfile() else None)
    staging_before = set(Path(tempfile.gettempdir()).glob("kvgraft-import-*"))
    store = tmp_path / "store"
    fails(cli("import", bad, "--store", store), "refusing unsafe bundle entry", why, "nothing was imported")
    assert not store.exists()
    assert not (tmp_path / "evil.txt").exists() and not Path("/tmp/kvgraft-evil.txt").exists()
    assert set(Path(tempfile.gettempdir()).glob("kvgraft-import-*")) == staging_before


def test_import_of_what_is_not_a_whole_bundle(source: Source, tmp_path: Path) -> None:
    store = tmp_path / "store"
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"not a tar at all" * 100)
    fails(cli("import", junk, "--store", store), "not a readable tar bundle")
    fails(cli("import", tmp_path / "none.tar", "--store", store), "no bundle file")
    good = tmp_path / "good.tar"
    ok_json(cli("export", source.ids["B"], "-o", good, "--store", source.root, "--json"))
    cut = tmp_path / "cut.tar"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])  # a download that stopped half way
    fails(cli("import", cut, "--store", store), str(cut))
    assert not store.exists()


def test_import_checks_every_receipt_before_it_writes_anything(source: Source, receipt: Path, tmp_path: Path) -> None:
    good = tmp_path / "good.tar"
    ok_json(cli("export", source.ids["B"], "-r", receipt, "-o", good, "--store", source.root, "--json"))
    edited = json.loads(receipt.read_text())
    edited["input_tokens"][-1] += 1
    bad = tmp_path / "bad.tar"
    with tarfile.open(good) as original, tarfile.open(bad, "w") as tar:
        for member in original.getmembers():
            data = original.extractfile(member).read()  # type: ignore[union-attr]
            if member.name.startswith("receipts/"):
                data = json.dumps(edited).encode()
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    store = tmp_path / "store"
    fails(cli("import", bad, "--store", store), "receipts/", "input_sha256 does not match input_tokens")
    assert not store.exists()  # the graft before the receipt in the bundle was not imported either
