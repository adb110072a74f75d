"""Tensors files and block files: safetensors written by the safetensors library, read back by a small reader that
memory-maps the file (or takes the bytes a remote store fetched) and checks its header, names, shapes, dtypes and the
SHA-256 of the bytes before any tensor is handed out (docs/FORMAT.md, sections "Tensors file" and "Blocks").

The file readers and the bytes readers share every check: each is a thin wrapper that gets a buffer (a copy-on-write
mapping, or a writable bytearray) and hands it to the same checking function."""

from __future__ import annotations

import hashlib
import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

import safetensors.torch
import torch

from kvgraft.core.errors import FormatError, IntegrityError
from kvgraft.core.hashing import BlockKey, Digest, Sha256Hex
from kvgraft.format.blocks import BLOCK_DIGEST_KEY
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
    file_size = len(data)
    if file_size < 8:
        raise FormatError(f"{where}: tensors file is truncated (no header)")
    (header_len,) = struct.unpack("<Q", data[:8])
    if header_len > file_size - 8:
        raise FormatError(f"{where}: tensors file is truncated (header runs past the end)")
    try:
        header = json.loads(data[8 : 8 + header_len])
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
