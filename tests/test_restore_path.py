"""The one-pass restore path (`read_blocks_assembled`): blocks read straight into the per-layer tensors and hashed
there must give the very bytes, and the very errors, of the block-by-block path it replaces (`read_block_checked`
on each block in order, then `assemble`)."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvgraft.core.errors import KvgraftError
from kvgraft.core.hashing import BlockKey, Sha256Hex
from kvgraft.format.blocks import assemble, block_digest, block_tensor_name
from kvgraft.format.manifest import BlockRef, expected_block_shapes
from kvgraft.format.tensor_files import block_file_bytes, read_block_checked, read_blocks_assembled
from kvgraft.store.local import LocalStore

from conftest import EngineFactory

Shapes = dict[str, list[int]]


def _write_blocks(
    tmp_path: Path, count: int, shape: list[int], dtype: torch.dtype, layers: int = 3, seed: int = 0
) -> tuple[list[tuple[Path, BlockRef]], Shapes]:
    """`count` block files of random tensors, `layers` layers of keys and values of `shape` each."""
    generator = torch.Generator().manual_seed(seed)
    shapes = {block_tensor_name(i, part): shape for i in range(layers) for part in ("key", "value")}
    blocks = []
    for index in range(count):
        tensors = {name: torch.randn(shape, generator=generator).to(dtype) for name in shapes}
        key = BlockKey(Sha256Hex(hashlib.sha256(f"{seed}-{index}".encode()).hexdigest()))
        ref = BlockRef(key, block_digest(tensors))
        path = tmp_path / f"{key}.safetensors"
        path.write_bytes(block_file_bytes(tensors, ref.sha256))
        blocks.append((path, ref))
    return blocks, shapes


def _block_by_block(blocks: list[tuple[Path, BlockRef]], shapes: Shapes, dtype: str) -> dict[str, torch.Tensor]:
    """The path the one-pass read replaces."""
    return assemble([read_block_checked(path, ref.key, ref, shapes, dtype)[1] for path, ref in blocks])


def _raw(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.dtype, list[int], str]]:
    return {
        name: (t.dtype, list(t.shape), hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest())
        for name, t in tensors.items()
    }


def _outcome(read: Callable[[], object]) -> tuple[str, str]:
    try:
        read()
    except KvgraftError as exc:
        return type(exc).__name__, str(exc)
    return "ok", ""


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("count", [1, 2, 7])
def test_one_pass_gives_the_bytes_of_block_by_block(tmp_path: Path, dtype: torch.dtype, count: int) -> None:
    blocks, shapes = _write_blocks(tmp_path, count, [1, 4, 8, 16], dtype)
    name = str(dtype).removeprefix("torch.")
    one_pass = read_blocks_assembled(blocks, shapes, name)
    assert _raw(one_pass) == _raw(_block_by_block(blocks, shapes, name))
    for tensor in one_pass.values():
        assert tensor.is_contiguous() and list(tensor.shape) == [1, 4, 8 * count, 16]


def test_more_rows_than_one_scatter_read_takes(tmp_path: Path) -> None:
    # 1100 heads: each tensor of a block is 1100 runs in its destination, more than one preadv takes (1024).
    blocks, shapes = _write_blocks(tmp_path, 3, [1, 1100, 2, 4], torch.float32, layers=1)
    assert _raw(read_blocks_assembled(blocks, shapes, "float32")) == _raw(_block_by_block(blocks, shapes, "float32"))


def test_no_blocks_is_no_tensors() -> None:
    assert read_blocks_assembled([], {block_tensor_name(0, "key"): [1, 2, 4, 8]}, "float32") == {}


def _damaged(tmp_path: Path, how: str, seed: int) -> tuple[list[tuple[Path, BlockRef]], Shapes]:
    blocks, shapes = _write_blocks(tmp_path, 4, [1, 2, 4, 8], torch.float32, seed=seed)
    rng = random.Random(seed)
    path = blocks[rng.randrange(len(blocks))][0]
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif how == "flip-data-of-two":  # two blocks damaged: the first in order is the one reported
        data[-1] ^= 0x01
        other = blocks[0][0] if path != blocks[0][0] else blocks[-1][0]
        other_data = bytearray(other.read_bytes())
        other_data[-5] ^= 0x10
        other.write_bytes(bytes(other_data))
    elif how == "truncate":
        data = data[: rng.randrange(len(data))]
    elif how == "append":
        data += bytes(rng.randrange(1, 9))
    elif how == "missing":
        path.unlink()
        return blocks, shapes
    path.write_bytes(bytes(data))
    return blocks, shapes


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("how", ["flip", "flip-data-of-two", "truncate", "append", "missing"])
def test_damage_is_reported_as_block_by_block_reports_it(tmp_path: Path, how: str, seed: int) -> None:
    blocks, shapes = _damaged(tmp_path, how, seed)
    before = _outcome(lambda: _block_by_block(blocks, shapes, "float32"))
    assert before[0] != "ok" or how == "flip"  # a flip in the header's padding can be harmless
    assert _outcome(lambda: read_blocks_assembled(blocks, shapes, "float32")) == before


@pytest.mark.parametrize(
    ("shapes_change", "dtype"),
    [
        ({}, "bfloat16"),  # the manifest says another dtype
        ({block_tensor_name(1, "value"): [1, 2, 5, 8]}, "float32"),  # another shape
        ({block_tensor_name(9, "key"): [1, 2, 4, 8]}, "float32"),  # a tensor the blocks lack
    ],
)
def test_other_tensors_are_reported_as_block_by_block_reports_them(
    tmp_path: Path, shapes_change: Shapes, dtype: str
) -> None:
    blocks, shapes = _write_blocks(tmp_path, 2, [1, 2, 4, 8], torch.float32)
    expected = shapes | shapes_change
    before = _outcome(lambda: _block_by_block(blocks, expected, dtype))
    assert before[0] == "FormatError"
    assert _outcome(lambda: read_blocks_assembled(blocks, expected, dtype)) == before


def test_a_store_restore_equals_its_blocks_assembled(make_engine: EngineFactory, store: LocalStore) -> None:
    engine = make_engine()
    put = engine.put("A graft restored in one pass holds the very bytes its blocks hold. " * 6)
    manifest = store.manifest(put.id)
    assert len(manifest.blocks) > 1
    blocks = [(store.block_path(ref.key), ref) for ref in manifest.blocks]
    old = _block_by_block(blocks, expected_block_shapes(manifest), manifest.dtype)
    restored = {k: v for k, v in store.get(put.id).tensors.items() if k.startswith("layers.")}
    assert _raw(restored) == _raw(old)


def test_blocks_without_tensors_are_still_checked(tmp_path: Path) -> None:
    # A graft whose layers hold no KV of their own still names blocks: each must be there and match its digest.
    blocks, _ = _write_blocks(tmp_path, 2, [1, 2, 4, 8], torch.float32, layers=0)
    assert read_blocks_assembled(blocks, {}, "float32") == {}
    blocks[1][0].unlink()
    before = _outcome(lambda: _block_by_block(blocks, {}, "float32"))
    assert before[0] == "FormatError"
    assert _outcome(lambda: read_blocks_assembled(blocks, {}, "float32")) == before
