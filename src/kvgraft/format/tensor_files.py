"""Tensors files and block files: safetensors written by the safetensors library, read back by a small reader that
memory-maps the file (or takes the bytes a remote store fetched) and checks its header, names, shapes, dtypes and the
SHA-256 of the bytes before any tensor is handed out (docs/FORMAT.md, sections "Tensors file" and "Blocks").

The file readers and the bytes readers share every check: each is a thin wrapper that gets a buffer (a copy-on-write
mapping, or a writable bytearray) and hands it to the same checking function. A whole graft's blocks are read by
`read_blocks_assembled` instead, which makes the same checks with the same messages but reads each block's bytes
straight into their place in the per-layer tensors and hashes them there (no mapping, no second copy)."""

from __future__ import annotations

import functools
import hashlib
import json
import mmap
import os
import struct
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

import safetensors.torch
import torch

from kvgraft.core.errors import FormatError, IntegrityError
from kvgraft.core.hashing import BlockKey, Digest, Sha256Hex
from kvgraft.format.blocks import BLOCK_DIGEST_KEY, empty_assembly
from kvgraft.format.manifest import BlockRef, Manifest, expected_hashes

_SAFETENSORS_DTYPES = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F64": torch.float64,
}


def tensors_file_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    # One metadata key only: safetensors writes several in an order that varies between processes.
    return safetensors.torch.save(tensors, metadata={"format": "pt"})


def block_file_bytes(tensors: dict[str, torch.Tensor], digest: Digest) -> bytes:
    """A block file: its tensors, and their digest in the header so a block can be checked before any manifest
    names it (when a new graft reuses it)."""
    return safetensors.torch.save(tensors, metadata={BLOCK_DIGEST_KEY: digest})


Buffer: TypeAlias = mmap.mmap | bytearray
"""What the checking functions read: a writable buffer, so the tensors handed out can view it without a copy."""


@dataclass(frozen=True)
class _TensorInfo:
    dtype: torch.dtype
    shape: list[int]
    start: int
    end: int


def _read_header(data: Buffer, where: str) -> tuple[dict[str, _TensorInfo], dict[str, Any]]:
    """Parse a safetensors header (8-byte little-endian length, then JSON) and check that it describes the file."""
    return _parse_header(data, len(data), where)


def _parse_header(head: Buffer | bytes, file_size: int, where: str) -> tuple[dict[str, _TensorInfo], dict[str, Any]]:
    """`_read_header` from the file's first bytes only (at least the length and the JSON, when they fit in the file)
    and its size: what a reader that does not map the file has."""
    if file_size < 8 or len(head) < 8:
        raise FormatError(f"{where}: tensors file is truncated (no header)")
    (header_len,) = struct.unpack("<Q", head[:8])
    if header_len > file_size - 8:
        raise FormatError(f"{where}: tensors file is truncated (header runs past the end)")
    try:
        header = json.loads(head[8 : 8 + header_len])
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise FormatError(f"{where}: tensors file header is not valid JSON") from None
    if not isinstance(header, dict):
        raise FormatError(f"{where}: tensors file header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    data_start = 8 + header_len
    infos: dict[str, _TensorInfo] = {}
    for name, info in header.items():
        try:
            infos[name] = _tensor_info(info, data_start)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise FormatError(f"{where}: tensors file header entry {name!r} is malformed ({exc})") from None
    data_end = max((t.end for t in infos.values()), default=data_start)
    if data_end != file_size:
        raise FormatError(
            f"{where}: tensors file is {file_size} bytes, its header describes {data_end}: truncated or padded"
        )
    return infos, metadata if isinstance(metadata, dict) else {}


def _tensor_info(info: Any, data_start: int) -> _TensorInfo:
    dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
    if dtype is None:
        raise ValueError(f"unsupported dtype {info['dtype']!r}")
    shape = [int(d) for d in info["shape"]]
    start, end = (int(x) for x in info["data_offsets"])
    count = 1
    for dim in shape:
        count *= dim
    if not 0 <= start <= end or end - start != count * dtype.itemsize or min(shape, default=0) < 0:
        raise ValueError(f"offsets {start}..{end} do not hold a {dtype} tensor of shape {shape}")
    return _TensorInfo(dtype, shape, data_start + start, data_start + end)


def _map_file(path: Path, where: str, what: str) -> mmap.mmap:
    """Memory-map a file copy-on-write: pages come from the page cache as they are hashed, nothing is read twice."""
    try:
        with path.open("rb") as handle:
            if path.stat().st_size < 8:
                raise FormatError(f"{where}: {what} is truncated (no header)")
            return mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    except FileNotFoundError:
        raise FormatError(f"{where}: {what} is missing") from None


def _tensors_of(data: Buffer, infos: dict[str, _TensorInfo], names: list[str]) -> dict[str, torch.Tensor]:
    """Tensors viewing the buffer (no copy)."""
    tensors: dict[str, torch.Tensor] = {}
    for name in names:
        info = infos[name]
        count = (info.end - info.start) // info.dtype.itemsize
        if count == 0:
            tensors[name] = torch.empty(info.shape, dtype=info.dtype)
        else:
            flat = torch.frombuffer(data, dtype=info.dtype, count=count, offset=info.start)
            tensors[name] = flat.view(info.shape)
    return tensors


def read_tensors_checked(path: Path, manifest: Manifest) -> dict[str, torch.Tensor]:
    """The graft's own tensors (next-token logits), each hashed and checked against the manifest.

    Raises IntegrityError when a tensor's SHA-256 differs from the manifest; no tensor is returned then.
    """
    where = str(path)
    return _tensors_checked(_map_file(path, where, "tensors file"), where, manifest)


def read_tensors_checked_bytes(data: bytes | bytearray, where: str, manifest: Manifest) -> dict[str, torch.Tensor]:
    """`read_tensors_checked` over bytes already fetched (a remote store's object).

    Args:
        data: The tensors file's bytes; a bytearray is used in place, other bytes are copied once into one.
        where: Where the bytes came from (a URL), for messages.
        manifest: The graft's manifest, whose hashes the tensors must match.

    Returns:
        The tensors by name, each checked. Raises FormatError or IntegrityError as the file reader does.
    """
    return _tensors_checked(_writable(data), where, manifest)


def _tensors_checked(data: Buffer, where: str, manifest: Manifest) -> dict[str, torch.Tensor]:
    expected = expected_hashes(manifest)
    infos, _ = _read_header(data, where)
    missing = sorted(set(expected) - set(infos))
    if missing:
        raise FormatError(f"{where}: tensors file lacks {', '.join(missing)}")
    view = memoryview(data)
    for name, digest in expected.items():
        if hashlib.sha256(view[infos[name].start : infos[name].end]).hexdigest() != digest:
            raise IntegrityError(f"{where}: tensor {name} does not match its SHA-256 in the manifest (corrupted file)")
    view.release()
    return _tensors_of(data, infos, sorted(expected))


def read_block_checked(
    path: Path,
    key: BlockKey,
    block: BlockRef | None,
    shapes: dict[str, list[int]] | None,
    dtype: str | None = None,
) -> tuple[BlockRef, dict[str, torch.Tensor]]:
    """One block's tensors, memory-mapped, after checking their names, shapes and the SHA-256 of their bytes.

    `block` is the manifest's entry; None when no manifest names the block yet (a build reusing it): the bytes are
    then checked against the digest the block file declares. `shapes` and `dtype` (a torch dtype name) None accept
    the file's own.
    Raises FormatError (missing, truncated, other tensors or shapes) or IntegrityError (bytes differ).
    """
    where = str(path)
    return _block_checked(_map_file(path, where, f"block {key[:12]}"), where, key, block, shapes, dtype)


def read_block_checked_bytes(
    data: bytes | bytearray,
    where: str,
    key: BlockKey,
    block: BlockRef | None,
    shapes: dict[str, list[int]] | None,
    dtype: str | None = None,
) -> tuple[BlockRef, dict[str, torch.Tensor]]:
    """`read_block_checked` over bytes already fetched (a remote store's object), with the same checks.

    Args:
        data: The block file's bytes; a bytearray is used in place, other bytes are copied once into one.
        where: Where the bytes came from (a URL), for messages.
        key: The block's chained key.
        block: The manifest's entry; None checks against the digest the block declares.
        shapes: Tensor names and shapes the block must hold; None accepts the block's own.
        dtype: The torch dtype name every tensor must have; None accepts the block's own.

    Returns:
        The block's reference (key and digest) and its tensors, viewing `data`.
    """
    return _block_checked(_writable(data), where, key, block, shapes, dtype)


def _block_checked(
    data: Buffer,
    where: str,
    key: BlockKey,
    block: BlockRef | None,
    shapes: dict[str, list[int]] | None,
    dtype: str | None,
) -> tuple[BlockRef, dict[str, torch.Tensor]]:
    infos, metadata = _read_header(data, where)
    if shapes is not None and set(infos) != set(shapes):
        raise FormatError(f"{where}: block holds tensors {sorted(infos)}, the graft expects {sorted(shapes)}")
    names = sorted(infos)
    hasher = hashlib.sha256()
    view = memoryview(data)
    for name in names:
        if dtype is not None and infos[name].dtype != getattr(torch, dtype, None):
            raise FormatError(f"{where}: tensor {name} is {infos[name].dtype}, the manifest says {dtype}")
        if shapes is not None and infos[name].shape != shapes[name]:
            raise FormatError(f"{where}: tensor {name} has shape {infos[name].shape}, the manifest says {shapes[name]}")
        hasher.update(view[infos[name].start : infos[name].end])
    view.release()
    expected = block.sha256 if block is not None else metadata.get(BLOCK_DIGEST_KEY)
    if hasher.hexdigest() != expected:
        raise IntegrityError(f"{where}: block {key[:12]} does not match its SHA-256 (corrupted file)")
    return BlockRef(key, Digest(Sha256Hex(hasher.hexdigest()))), _tensors_of(data, infos, names)


def read_blocks_assembled(
    blocks: Sequence[tuple[Path, BlockRef]], shapes: dict[str, list[int]], dtype: str
) -> dict[str, torch.Tensor]:
    """A graft's blocks read straight into per-layer tensors at their final offsets, each block's bytes hashed from
    where they land: what `assemble` over `read_block_checked` of every block gives, in one pass with no mapping and
    no second copy. Blocks are read and hashed on a pool of threads (reads and SHA-256 of large buffers release the
    GIL).

    Args:
        blocks: Each block's file and its manifest entry, in order.
        shapes: Tensor names and shapes every block must hold, [1, kv_heads, C, head_dim] each.
        dtype: The torch dtype name every tensor must have.

    Returns:
        `layers.<i>.key` / `.value` over all the blocks' positions, [1, kv_heads, blocks * C, head_dim]; none when
        there is no block.

    Raises:
        FormatError: a block missing, truncated, or holding other tensors, shapes or dtypes.
        IntegrityError: a block's bytes differ from its SHA-256 in the manifest.
        Of several damaged blocks, the first in order is reported (as a reader going block by block would).
    """
    if not blocks:
        return {}
    assembled = empty_assembly(shapes, len(blocks), dtype)
    # One flat writable byte view per destination: slicing it is cheap, and preadv writes through it in place.
    targets = {name: tensor.view(-1).view(torch.uint8).numpy().data for name, tensor in assembled.items()}
    pending = [
        _read_pool(os.getpid()).submit(_read_block_into, path, ref, index, len(blocks), shapes, dtype, targets)
        for index, (path, ref) in enumerate(blocks)
    ]
    wait(pending)
    for future in pending:
        future.result()  # the first failure in block order, the others' work being done
    for target in targets.values():
        target.release()
    return assembled


def _read_block_into(
    path: Path,
    block: BlockRef,
    index: int,
    count: int,
    shapes: dict[str, list[int]],
    dtype: str,
    targets: dict[str, memoryview],
) -> None:
    """Block `index` of `count`: its header checked as `read_block_checked` checks it, then each tensor read into
    positions [index * C, (index + 1) * C) of its destination and hashed there, while the bytes are in the cache."""
    where, key = str(path), block.key
    hasher = hashlib.sha256()
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise FormatError(f"{where}: block {key[:12]} is missing") from None
    try:
        size = os.fstat(fd).st_size
        if size < 8:
            raise FormatError(f"{where}: block {key[:12]} is truncated (no header)")
        head = os.pread(fd, 8, 0)
        if len(head) == 8 and (header_len := struct.unpack("<Q", head)[0]) <= size - 8:
            head += os.pread(fd, header_len, 8)
        infos, _ = _parse_header(head, size, where)
        if set(infos) != set(shapes):
            raise FormatError(f"{where}: block holds tensors {sorted(infos)}, the graft expects {sorted(shapes)}")
        names = sorted(infos)
        for name in names:
            if infos[name].dtype != getattr(torch, dtype, None):
                raise FormatError(f"{where}: tensor {name} is {infos[name].dtype}, the manifest says {dtype}")
            if infos[name].shape != shapes[name]:
                raise FormatError(
                    f"{where}: tensor {name} has shape {infos[name].shape}, the manifest says {shapes[name]}"
                )
        for name in names:
            info, target = infos[name], targets[name]
            # Row r of a block's [1, kv_heads, C, head_dim] tensor (one head's C positions) is `run` bytes, and sits
            # in the destination [1, kv_heads, count * C, head_dim] at r * count * run + index * run.
            rows = 1
            for dim in info.shape[:-2]:
                rows *= dim
            run = (info.end - info.start) // rows if rows else 0
            if run == 0:
                continue
            parts = [target[(r * count + index) * run : (r * count + index + 1) * run] for r in range(rows)]
            _read_exactly(fd, parts, info.start, where, key)
            for part in parts:
                hasher.update(part)
                part.release()
    finally:
        os.close(fd)
    if hasher.hexdigest() != block.sha256:
        raise IntegrityError(f"{where}: block {key[:12]} does not match its SHA-256 (corrupted file)")


def _read_exactly(fd: int, parts: list[memoryview], offset: int, where: str, key: BlockKey) -> None:
    """Fill `parts`, in order, from the file's bytes at `offset` (a scatter read; several when the kernel returns
    fewer bytes than asked).

    Raises:
        FormatError: the file ended first (it shrank after its size was read).
    """
    pending = parts
    while pending:
        batch = pending[:_IOV_MAX]
        done = os.preadv(fd, batch, offset)
        if done == 0:
            raise FormatError(f"{where}: block {key[:12]} is truncated (the file shrank while it was read)")
        offset += done
        rest: list[memoryview] = []
        for position, part in enumerate(pending):
            if done >= len(part):
                done -= len(part)
                continue
            rest = [part[done:], *pending[position + 1 :]]
            break
        pending = rest


_IOV_MAX = 1024
"""Buffers per preadv call: POSIX's minimum IOV_MAX is 16, Linux's and macOS's 1024."""


@functools.cache
def _read_pool(pid: int) -> ThreadPoolExecutor:
    """The pool that reads blocks, one per process (`pid`): a forked child starts its own, the parent's threads being
    absent there. Sized by the CPUs this process may use, not torch's thread count (a restore runs at the graft's
    recorded count, often 1), and at least 4: a cold read waits on the disk, and reads in flight hide its latency
    (measured on 2 cores: 4 threads restore a cold 4096-token Llama-1B graft faster than 2)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return ThreadPoolExecutor(max_workers=max(4, min(8, cpus)), thread_name_prefix="kvgraft-read")


def declared_block_digest(path: Path, key: BlockKey) -> str | None:
    """The digest a block file declares in its header (its bytes are not read)."""
    return _declared_digest(_map_file(path, str(path), f"block {key[:12]}"), str(path))


def declared_block_digest_bytes(data: bytes | bytearray, where: str) -> str | None:
    """The digest a block declares in its header, from its bytes (the tensor bytes are not hashed).

    Args:
        data: The block file's bytes.
        where: Where the bytes came from, for messages.

    Returns:
        The declared digest, or None when the header declares none.
    """
    return _declared_digest(_writable(data), where)


def _declared_digest(data: Buffer, where: str) -> str | None:
    _, metadata = _read_header(data, where)
    digest = metadata.get(BLOCK_DIGEST_KEY)
    return digest if isinstance(digest, str) else None


def _writable(data: bytes | bytearray) -> bytearray:
    """A writable buffer: torch refuses to view read-only memory without a warning, so bytes are copied once."""
    return data if isinstance(data, bytearray) else bytearray(data)
