"""docs/FORMAT.md is an executable spec: its standalone checker (json, hashlib, sys, pathlib and safetensors only)
must accept every graft kvgraft writes and name what is wrong with a damaged one."""

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

import pytest

from kvgraft.engine import Engine
from kvgraft.errors import FormatError, IntegrityError
from kvgraft.graft_format import MANIFEST_NAME, TENSORS_NAME
from kvgraft.store import LocalStore

from conftest import TEST_CHUNK, cached_model

FORMAT_MD = Path(__file__).resolve().parents[1] / "docs" / "FORMAT.md"
ALLOWED_IMPORTS = {"json", "hashlib", "sys", "pathlib", "safetensors"}
# Byte tokenizer: len(text) + 1 tokens (BOS). 48 = 3C (next_token_logits stored), 61 = 3C + 13, 6 < C (no KV).
TEXTS = {48: "x" * 47, 61: "y" * 60, 6: "short"}


def _standalone_check() -> str:
    text = FORMAT_MD.read_text(encoding="utf-8")
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
def grafts(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], tuple[Path, str]]:
    """(dtype, token count) -> (graft directory, id), built once for the module."""
    store = LocalStore(tmp_path_factory.mktemp("store"))
    built = {}
    for dtype in ("float32", "bfloat16"):
        model, tokenizer = cached_model("random:gemma4", dtype)
        engine = Engine(model, tokenizer, "random:gemma4", TEST_CHUNK, store)
        for n, text in TEXTS.items():
            put = engine.put(text)
            assert put.tokens == n
            built[dtype, n] = (store.root / "grafts" / put.id, put.id)
    return built


def _run(checker: Path, graft: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(checker), str(graft)], capture_output=True, text=True, timeout=60, check=False
    )


def _copy(graft: Path, tmp_path: Path) -> Path:
    """A copy of a graft in a store of its own at tmp_path/store, to damage freely."""
    return Path(shutil.copytree(graft, tmp_path / "store" / "grafts" / graft.name))


def _data_region(tensors: Path) -> tuple[int, dict[str, dict[str, object]]]:
    raw = tensors.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    header.pop("__metadata__", None)
    return 8 + size, header


def test_the_check_imports_only_the_stdlib_and_safetensors() -> None:
    tree = ast.parse(_standalone_check())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert imported <= ALLOWED_IMPORTS, imported - ALLOWED_IMPORTS


@pytest.mark.parametrize("n_tokens", list(TEXTS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_check_accepts_every_graft_kvgraft_writes(
    checker: Path, grafts: dict[tuple[str, int], tuple[Path, str]], dtype: str, n_tokens: int
) -> None:
    graft, graft_id = grafts[dtype, n_tokens]
    manifest = json.loads((graft / MANIFEST_NAME).read_text(encoding="utf-8"))
    assert manifest["aligned_tokens"] == n_tokens // TEST_CHUNK * TEST_CHUNK
    assert (manifest["next_token_logits"] is not None) == (n_tokens % TEST_CHUNK == 0)
    result = _run(checker, graft)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == f"OK {graft_id}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tensor", ["layers.1.value", "layers.0.key", "next_token_logits"])
def test_one_flipped_byte_names_the_tensor(
    checker: Path, grafts: dict[tuple[str, int], tuple[Path, str]], tmp_path: Path, dtype: str, tensor: str
) -> None:
    graft = _copy(grafts[dtype, 48][0], tmp_path)
    tensors = graft / TENSORS_NAME
    data_start, header = _data_region(tensors)
    begin, end = header[tensor]["data_offsets"]  # type: ignore[misc]
    raw = bytearray(tensors.read_bytes())
    raw[data_start + (begin + end) // 2] ^= 0x01
    tensors.write_bytes(bytes(raw))

    result = _run(checker, graft)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "OK" not in result.stdout
    failing = [line for line in result.stdout.splitlines() if line.startswith("FAIL")]
    assert len(failing) == 1 and f"tensor {tensor}:" in failing[0], result.stdout
    # kvgraft's own reader refuses the same file.
    with pytest.raises(IntegrityError, match=re.escape(tensor)):
        LocalStore(tmp_path / "store").get(graft.name)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_edited_token_breaks_the_id(
    checker: Path, grafts: dict[tuple[str, int], tuple[Path, str]], tmp_path: Path, dtype: str
) -> None:
    graft = _copy(grafts[dtype, 61][0], tmp_path)
    path = graft / MANIFEST_NAME
    manifest = json.loads(path.read_text(encoding="utf-8"))
    manifest["tokens"][5] += 1
    path.write_text(json.dumps(manifest, indent=1, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")

    result = _run(checker, graft)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "OK" not in result.stdout
    assert "does not match the content hash" in result.stdout
    assert manifest["id"] in result.stdout


def test_a_graft_without_next_token_logits_where_the_rule_wants_them_fails(
    checker: Path, grafts: dict[tuple[str, int], tuple[Path, str]], tmp_path: Path
) -> None:
    """Dropping the entry (and re-signing the id) breaks the next_token_logits rule, not only a hash."""
    graft = _copy(grafts["float32", 48][0], tmp_path)
    path = graft / MANIFEST_NAME
    manifest = json.loads(path.read_text(encoding="utf-8"))
    manifest["next_token_logits"] = None
    body = {k: v for k, v in manifest.items() if k not in ("id", "created_at")}
    manifest["id"] = hashlib.sha256(
        json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    ).hexdigest()
    path.write_text(json.dumps(manifest), encoding="utf-8")

    result = _run(checker, graft)
    assert result.returncode == 1
    assert "next_token_logits must be present" in result.stdout


def test_a_reshaped_tensor_with_the_same_bytes_is_refused(
    checker: Path, grafts: dict[tuple[str, int], tuple[Path, str]], tmp_path: Path
) -> None:
    """Hashes cover bytes only; the shapes in the manifest (covered by the id) catch a header reshaped in place."""
    graft = _copy(grafts["float32", 48][0], tmp_path)
    tensors = graft / TENSORS_NAME
    raw = tensors.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    _, heads, stored, head_dim = header["layers.1.key"]["shape"]
    header["layers.1.key"]["shape"] = [1, heads * 2, stored, head_dim // 2]
    new_header = json.dumps(header, separators=(",", ":")).encode().ljust(size)
    assert len(new_header) == size
    tensors.write_bytes(raw[:8] + new_header + raw[8 + size :])

    result = _run(checker, graft)
    assert result.returncode == 1 and "tensor layers.1.key: shape" in result.stdout, result.stdout
    with pytest.raises(FormatError, match=r"tensor layers\.1\.key has shape .* the manifest says"):
        LocalStore(tmp_path / "store").get(graft.name)
