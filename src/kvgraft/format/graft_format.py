"""The on-disk graft format, version 2 (docs/FORMAT.md is the spec; keep the two in step).

A graft is a manifest plus a chain of KV blocks. Block i holds, for every layer that has KV, the keys and values of
positions [i*C, (i+1)*C); it is stored once per store under its chained key, SHA-256 over (the previous block's
key, the fingerprint, the block's token ids), so grafts that begin with the same tokens share their leading blocks
on disk. Sliding-window layers are stored at full length like the others: the model keeps only their last window-1
positions, which restoring takes from the blocks. The manifest lists every token, the blocks with the SHA-256 of
their tensor bytes, the fingerprint and per layer the block tensors' shapes. The graft id is the SHA-256 of the
canonical manifest without `id` and `created_at`, so the same content always gets the same id.
"""

from __future__ import annotations

import functools
import hashlib
import json
import mmap
import re
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from kvgraft.core.cache_state import KvRecording, LayerKind, LayerState
from kvgraft.core.errors import FormatError, IntegrityError
from kvgraft.core.fingerprint import Fingerprint
from kvgraft.core.hashing import Sha256Hex, sha256_json, tensor_bytes

FORMAT_VERSION = 2
MANIFEST_NAME = "manifest.json"
NEXT_LOGITS_NAME = "next_token_logits"
TENSORS_NAME = "tensors.safetensors"
BLOCK_SUFFIX = ".safetensors"
BLOCK_DIGEST_KEY = "sha256"
_ID_EXCLUDED = ("id", "created_at")
_READ_PIECE = 16 << 20
_SAFETENSORS_DTYPES = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F64": torch.float64,
}
_TENSORS_FILE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*\.safetensors")  # used with fullmatch
_HEX64 = re.compile(r"[0-9a-f]{64}")
_KINDS: tuple[LayerKind, ...] = ("full", "sliding", "shared")


@dataclass(frozen=True)
class LayerEntry:
    kind: LayerKind
    key_shape: list[int] | None = None
    """Shape of this layer's key tensor in every block, [1, kv_heads, C, head_dim]; None for shared layers and
    when the graft has no block (so for value_shape)."""
    value_shape: list[int] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "key_shape": self.key_shape, "value_shape": self.value_shape}


@dataclass(frozen=True)
class BlockRef:
    key: Sha256Hex
    """Chained key: sha256_json({"parent": previous key or None, "fingerprint": fingerprint digest, "tokens": ...})"""
    sha256: Sha256Hex
    """SHA-256 of the block's tensor bytes, tensors taken in name order (the safetensors data section)."""

    def to_json(self) -> dict[str, str]:
        return {"key": self.key, "sha256": self.sha256}


@dataclass(frozen=True)
class Manifest:
    tokens: list[int]
    aligned_tokens: int
    chunk_size: int
    dtype: str
    fingerprint: Fingerprint
    layers: list[LayerEntry]
    blocks: list[BlockRef]
    source_sha256: Sha256Hex
    model_name: str
    kvgraft_version: str
    created_at: str
    metadata: dict[str, Any] = field(default_factory=dict)
    next_logits_sha256: Sha256Hex | None = None
    tensors_file: str = TENSORS_NAME
    format_version: int = FORMAT_VERSION

    def body(self) -> dict[str, Any]:
        """The manifest as JSON, without `id` (which is derived from this)."""
        return {
            "format_version": self.format_version,
            "tokens": list(self.tokens),
            "aligned_tokens": self.aligned_tokens,
            "chunk_size": self.chunk_size,
            "dtype": self.dtype,
            "fingerprint": self.fingerprint.to_json(),
            "tensors_file": self.tensors_file,
            "layers": [layer.to_json() for layer in self.layers],
            "blocks": [block.to_json() for block in self.blocks],
            "next_token_logits": (
                {"tensor": NEXT_LOGITS_NAME, "sha256": self.next_logits_sha256} if self.next_logits_sha256 else None
            ),
            "provenance": {
                "source_sha256": self.source_sha256,
                "model_name": self.model_name,
                "kvgraft_version": self.kvgraft_version,
            },
            "created_at": self.created_at,
            "metadata": self.metadata,
        }

    @property
    def id(self) -> Sha256Hex:
        return graft_id(self.body())

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, **self.body()}


def graft_id(manifest: dict[str, Any]) -> Sha256Hex:
    """SHA-256 of the canonical JSON of the manifest with `id` and `created_at` removed."""
    return sha256_json({k: v for k, v in manifest.items() if k not in _ID_EXCLUDED})


def manifest_bytes(manifest: Manifest) -> bytes:
    return json.dumps(manifest.to_json(), indent=1, sort_keys=True, ensure_ascii=False).encode() + b"\n"


# --- blocks --------------------------------------------------------------------------------------------------


def fingerprint_digest(fingerprint: Fingerprint) -> Sha256Hex:
    return sha256_json(fingerprint.to_json())


def block_keys(fingerprint: Fingerprint, tokens: list[int], chunk_size: int) -> list[Sha256Hex]:
    """The chained keys of the blocks of `tokens` (one per whole chunk), as vLLM keys its prefix blocks.

    A key commits to every token before and in its block and to the fingerprint (weights, schedule, numeric
    environment), so equal keys mean equal KV bytes under kvgraft's exactness contract.
    """
    digest = fingerprint_digest(fingerprint)
    keys: list[Sha256Hex] = []
    parent: Sha256Hex | None = None
    for start in range(0, len(tokens) // chunk_size * chunk_size, chunk_size):
        parent = sha256_json({"parent": parent, "fingerprint": digest, "tokens": tokens[start : start + chunk_size]})
        keys.append(parent)
    return keys


def block_tensor_name(layer: int, part: str) -> str:
    """Zero-padded so that name order is layer order (and so the order of the safetensors data section)."""
    return f"layers.{layer:03d}.{part}"


def block_tensors(recording: KvRecording, start: int, end: int) -> dict[str, torch.Tensor]:
    """The tensors of one block: positions [start, end) of a recording, per layer that has KV."""
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(len(recording.chunks)):
        kv = recording.layer_kv(layer, start, end)
        if kv is not None:
            tensors[block_tensor_name(layer, "key")] = kv[0].cpu()
            tensors[block_tensor_name(layer, "value")] = kv[1].cpu()
    return tensors


def block_digest(tensors: dict[str, torch.Tensor]) -> Sha256Hex:
    """SHA-256 of the tensors' raw bytes, concatenated in name order."""
    hasher = hashlib.sha256()
    for name in sorted(tensors):
        hasher.update(tensor_bytes(tensors[name]))
    return Sha256Hex(hasher.hexdigest())


def layer_entries(tensors: dict[str, torch.Tensor] | None, kinds: list[LayerKind]) -> list[LayerEntry]:
    """Per-layer entries from one block's tensors (or none, for a graft without blocks)."""
    entries = []
    for index, kind in enumerate(kinds):
        key = tensors.get(block_tensor_name(index, "key")) if tensors else None
        value = tensors.get(block_tensor_name(index, "value")) if tensors else None
        if key is None or value is None:
            entries.append(LayerEntry(kind))
        else:
            entries.append(LayerEntry(kind, list(key.shape), list(value.shape)))
    return entries


def tensors_file_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    # One metadata key only: safetensors writes several in an order that varies between processes.
    return safetensors.torch.save(tensors, metadata={"format": "pt"})


def block_file_bytes(tensors: dict[str, torch.Tensor], digest: Sha256Hex) -> bytes:
    """A block file: its tensors, and their digest in the header so a block can be checked before any manifest
    names it (when a new graft reuses it)."""
    return safetensors.torch.save(tensors, metadata={BLOCK_DIGEST_KEY: digest})


# --- reading -------------------------------------------------------------------------------------------------


def parse_manifest(raw: bytes, where: str) -> Manifest:
    """Parse and validate manifest bytes; the id must equal the content hash. Raises FormatError or IntegrityError."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise FormatError(f"{where}: manifest is not valid JSON ({exc.msg if hasattr(exc, 'msg') else exc})") from None
    if not isinstance(data, dict):
        raise FormatError(f"{where}: manifest must be a JSON object")
    version = data.get("format_version")
    if version != FORMAT_VERSION:
        advice = "rebuild the graft" if isinstance(version, int) and version < FORMAT_VERSION else "upgrade kvgraft"
        raise FormatError(
            f"{where}: unknown format_version {version!r}; this kvgraft reads version {FORMAT_VERSION}, {advice}"
        )
    try:
        content_hash = graft_id(data)
    except (TypeError, ValueError):  # values canonical JSON cannot hold (NaN, say)
        raise FormatError(f"{where}: manifest holds values canonical JSON cannot encode") from None
    if data.get("id") != content_hash:
        # Checked before the structure, so that a tampered manifest is reported as tampered.
        raise IntegrityError(f"{where}: manifest id {data.get('id')!r} does not match its content hash {content_hash}")
    try:
        manifest = _manifest_from_json(data)
        computed = manifest.id
    except (KeyError, TypeError, ValueError, AttributeError) as exc:  # UnicodeError is a ValueError
        raise FormatError(f"{where}: malformed manifest ({type(exc).__name__}: {exc})") from None
    if data.get("id") != computed:
        raise IntegrityError(f"{where}: manifest id {data.get('id')!r} does not match its content hash {manifest.id}")
    return manifest


def _manifest_from_json(data: dict[str, Any]) -> Manifest:
    tokens = data["tokens"]
    if not isinstance(tokens, list) or not all(type(t) is int and t >= 0 for t in tokens):
        raise ValueError("tokens must be a list of non-negative integers")
    aligned, chunk_size = _int(data["aligned_tokens"], "aligned_tokens"), _int(data["chunk_size"], "chunk_size")
    if chunk_size < 1 or aligned != len(tokens) // chunk_size * chunk_size:
        raise ValueError("aligned_tokens must be the largest multiple of chunk_size not above the token count")
    layers = [_layer_from_json(entry, aligned, chunk_size) for entry in data["layers"]]
    blocks = [_block_from_json(entry) for entry in data["blocks"]]
    if len(blocks) != aligned // chunk_size:
        raise ValueError("blocks must list one block per chunk of aligned_tokens")
    provenance = data["provenance"]
    manifest = Manifest(
        tokens=tokens,
        aligned_tokens=aligned,
        chunk_size=chunk_size,
        dtype=str(data["dtype"]),
        fingerprint=Fingerprint.from_json(data["fingerprint"]),
        layers=layers,
        blocks=blocks,
        source_sha256=Sha256Hex(str(provenance["source_sha256"])),
        model_name=str(provenance["model_name"]),
        kvgraft_version=str(provenance["kvgraft_version"]),
        created_at=str(data["created_at"]),
        metadata=dict(data["metadata"]),
        next_logits_sha256=_next_logits_sha(data["next_token_logits"]),
        tensors_file=str(data["tensors_file"]),
    )
    if (manifest.next_logits_sha256 is not None) != (0 < manifest.aligned_tokens == len(tokens)):
        raise ValueError("next_token_logits must be present exactly when every token has stored KV")
    if not _TENSORS_FILE.fullmatch(manifest.tensors_file):
        raise ValueError("tensors_file must be a plain *.safetensors file name beside the manifest")
    if manifest.chunk_size != manifest.fingerprint.schedule["chunk_size"]:
        raise ValueError("chunk_size differs from fingerprint.schedule.chunk_size")
    if manifest.dtype != manifest.fingerprint.model["dtype"]:
        raise ValueError("dtype differs from fingerprint.model.dtype")
    keys = block_keys(manifest.fingerprint, tokens, chunk_size)
    if [b.key for b in blocks] != keys:
        raise ValueError("block keys do not chain over the tokens and fingerprint")
    return manifest


def _block_from_json(entry: dict[str, Any]) -> BlockRef:
    key, digest = entry["key"], entry["sha256"]
    if set(entry) != {"key", "sha256"} or not all(isinstance(h, str) and _HEX64.fullmatch(h) for h in (key, digest)):
        raise ValueError('a block entry is {"key": <hex>, "sha256": <hex>}')
    return BlockRef(Sha256Hex(key), Sha256Hex(digest))


def _next_logits_sha(entry: Any) -> Sha256Hex | None:
    if entry is None:
        return None
    if entry["tensor"] != NEXT_LOGITS_NAME:
        raise ValueError(f"next_token_logits.tensor must be {NEXT_LOGITS_NAME!r}")
    return Sha256Hex(str(entry["sha256"]))


def _int(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an integer")
    return value


def _layer_from_json(entry: dict[str, Any], aligned: int, chunk_size: int) -> LayerEntry:
    kind = entry["kind"]
    if kind not in _KINDS:
        raise ValueError(f"unknown layer kind {kind!r}")
    if set(entry) != {"kind", "key_shape", "value_shape"}:
        raise ValueError("a layer entry has exactly kind, key_shape and value_shape")
    layer = LayerEntry(kind=kind, key_shape=_shape(entry["key_shape"]), value_shape=_shape(entry["value_shape"]))
    stores = kind != "shared" and aligned > 0
    if not all((shape is not None) == stores for shape in (layer.key_shape, layer.value_shape)):
        raise ValueError(f"a {kind} layer entry must {'give' if stores else 'not give'} key and value shapes")
    for shape in (layer.key_shape, layer.value_shape):
        if shape is not None and (len(shape) != 4 or shape[0] != 1 or shape[2] != chunk_size or min(shape) < 1):
            raise ValueError(f"shape {shape} is not [1, kv_heads, chunk_size, head_dim]")
    if layer.key_shape is not None and layer.value_shape is not None and layer.key_shape[:3] != layer.value_shape[:3]:
        raise ValueError("key and value shapes differ in more than head_dim")
    return layer


def _shape(value: Any) -> list[int] | None:
    return None if value is None else [_int(d, "shape") for d in value]


@dataclass(frozen=True)
class _TensorInfo:
    dtype: torch.dtype
    shape: list[int]
    start: int
    end: int


def _read_header(data: mmap.mmap, where: str) -> tuple[dict[str, _TensorInfo], dict[str, Any]]:
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


def _tensors_of(data: mmap.mmap, infos: dict[str, _TensorInfo], names: list[str]) -> dict[str, torch.Tensor]:
    """Tensors viewing the mapped file (no copy)."""
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


def expected_hashes(manifest: Manifest) -> dict[str, Sha256Hex]:
    """The tensors the graft's own tensors file holds (the next-token logits, if any), with their SHA-256."""
    return {NEXT_LOGITS_NAME: manifest.next_logits_sha256} if manifest.next_logits_sha256 else {}


def expected_block_shapes(manifest: Manifest) -> dict[str, list[int]]:
    """Every tensor a block of this graft holds, with its shape."""
    shapes: dict[str, list[int]] = {}
    for index, entry in enumerate(manifest.layers):
        if entry.key_shape is not None and entry.value_shape is not None:
            shapes[block_tensor_name(index, "key")] = entry.key_shape
            shapes[block_tensor_name(index, "value")] = entry.value_shape
    return shapes


def read_tensors_checked(path: Path, manifest: Manifest) -> dict[str, torch.Tensor]:
    """The graft's own tensors (next-token logits), each hashed and checked against the manifest.

    Raises IntegrityError when a tensor's SHA-256 differs from the manifest; no tensor is returned then.
    """
    where = str(path)
    expected = expected_hashes(manifest)
    data = _map_file(path, where, "tensors file")
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
    key: Sha256Hex,
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
    data = _map_file(path, where, f"block {key[:12]}")
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
    return BlockRef(key, Sha256Hex(hasher.hexdigest())), _tensors_of(data, infos, names)


def declared_block_digest(path: Path, key: Sha256Hex) -> str | None:
    """The digest a block file declares in its header (its bytes are not read)."""
    data = _map_file(path, str(path), f"block {key[:12]}")
    _, metadata = _read_header(data, str(path))
    digest = metadata.get(BLOCK_DIGEST_KEY)
    return digest if isinstance(digest, str) else None


def assemble(blocks: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Per-layer keys/values over all the blocks' positions, [1, kv_heads, blocks * C, head_dim], in order; named
    `layers.<i>.key` / `layers.<i>.value` (the names of a block). The result owns its memory (no file mapping)."""
    if not blocks:
        return {}

    def join(name: str) -> torch.Tensor:
        parts = [block[name] for block in blocks]
        return torch.cat(parts, dim=-2) if len(parts) > 1 else parts[0].clone()

    names = list(blocks[0])
    # The copy is the costly part of a restore after hashing; layers are independent, so they are spread over
    # threads (torch releases the GIL while copying).
    return dict(zip(names, _assembly_pool().map(join, names), strict=True))


@functools.cache
def _assembly_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=max(1, torch.get_num_threads()), thread_name_prefix="kvgraft-assemble")


def states_from(layers: list[LayerEntry], tensors: dict[str, torch.Tensor], length: int) -> list[LayerState]:
    """Cache states from assembled tensors (see `assemble`) holding `length` positions."""
    states = []
    for index, entry in enumerate(layers):
        keys = tensors.get(block_tensor_name(index, "key")) if length else None
        values = tensors.get(block_tensor_name(index, "value")) if length else None
        states.append(LayerState(entry.kind, keys, values, length))
    return states
