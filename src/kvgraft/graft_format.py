"""The on-disk graft format, version 1 (docs/FORMAT.md is the spec; keep the two in step).

A graft is a directory holding `manifest.json` and one safetensors file. The manifest lists every token, how
many of them have stored KV (`aligned_tokens`), the fingerprint, and per layer the tensor names and the SHA-256
of each tensor's raw little-endian bytes. The graft id is the SHA-256 of the canonical manifest without `id`
and `created_at`, so the same content always gets the same id.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import safetensors.torch
import torch

from kvgraft.cache_state import LayerKind, LayerState
from kvgraft.errors import FormatError, IntegrityError
from kvgraft.fingerprint import Fingerprint
from kvgraft.hashing import Sha256Hex, sha256_json, sha256_tensor

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
NEXT_LOGITS_NAME = "next_token_logits"
TENSORS_NAME = "tensors.safetensors"
_ID_EXCLUDED = ("id", "created_at")
_READ_PIECE = 16 << 20
_SAFETENSORS_DTYPES = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F64": torch.float64,
}
_TENSORS_FILE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]*\.safetensors$")
_KINDS: tuple[LayerKind, ...] = ("full", "sliding", "shared")


@dataclass(frozen=True)
class LayerEntry:
    kind: LayerKind
    key: str | None
    value: str | None
    key_sha256: Sha256Hex | None
    value_sha256: Sha256Hex | None
    cumulative_length: int
    key_shape: list[int] | None = None
    """[1, kv_heads, stored, head_dim]; None when the layer stores no tensor (so for value_shape)."""
    value_shape: list[int] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "key": self.key,
            "value": self.value,
            "key_sha256": self.key_sha256,
            "value_sha256": self.value_sha256,
            "key_shape": self.key_shape,
            "value_shape": self.value_shape,
            "cumulative_length": self.cumulative_length,
        }


@dataclass(frozen=True)
class Manifest:
    tokens: list[int]
    aligned_tokens: int
    chunk_size: int
    dtype: str
    fingerprint: Fingerprint
    layers: list[LayerEntry]
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


def tensor_name(layer: int, part: str) -> str:
    return f"layers.{layer}.{part}"


def entries_for(states: list[LayerState]) -> tuple[list[LayerEntry], dict[str, torch.Tensor]]:
    """Layer entries (with hashes) and the named tensors to store for captured cache states.

    The tensors for layer i are named layers.i.key and layers.i.value, each [1, kv_heads, stored, head_dim].
    """
    entries: list[LayerEntry] = []
    tensors: dict[str, torch.Tensor] = {}
    for index, state in enumerate(states):
        if state.keys is None or state.values is None:
            entries.append(LayerEntry(state.kind, None, None, None, None, state.cumulative_length))
            continue
        key_name, value_name = tensor_name(index, "key"), tensor_name(index, "value")
        tensors[key_name], tensors[value_name] = state.keys.contiguous().cpu(), state.values.contiguous().cpu()
        entries.append(
            LayerEntry(
                state.kind,
                key_name,
                value_name,
                sha256_tensor(tensors[key_name]),
                sha256_tensor(tensors[value_name]),
                state.cumulative_length,
                list(state.keys.shape),
                list(state.values.shape),
            )
        )
    return entries, tensors


def tensors_file_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    return safetensors.torch.save(tensors, metadata={"format": "pt", "kvgraft_format_version": str(FORMAT_VERSION)})


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
        raise FormatError(
            f"{where}: unknown format_version {version!r}; this kvgraft reads version {FORMAT_VERSION}, upgrade kvgraft"
        )
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
    layers = [_layer_from_json(entry, aligned) for entry in data["layers"]]
    provenance = data["provenance"]
    manifest = Manifest(
        tokens=tokens,
        aligned_tokens=aligned,
        chunk_size=chunk_size,
        dtype=str(data["dtype"]),
        fingerprint=Fingerprint.from_json(data["fingerprint"]),
        layers=layers,
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
    if not _TENSORS_FILE.match(manifest.tensors_file):
        raise ValueError("tensors_file must be a plain *.safetensors file name beside the manifest")
    if manifest.chunk_size != manifest.fingerprint.schedule["chunk_size"]:
        raise ValueError("chunk_size differs from fingerprint.schedule.chunk_size")
    if manifest.dtype != manifest.fingerprint.model["dtype"]:
        raise ValueError("dtype differs from fingerprint.model.dtype")
    return manifest


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


def _layer_from_json(entry: dict[str, Any], aligned: int) -> LayerEntry:
    kind = entry["kind"]
    if kind not in _KINDS:
        raise ValueError(f"unknown layer kind {kind!r}")
    layer = LayerEntry(
        kind=kind,
        key=entry["key"],
        value=entry["value"],
        key_sha256=entry["key_sha256"],
        value_sha256=entry["value_sha256"],
        cumulative_length=_int(entry["cumulative_length"], "cumulative_length"),
        key_shape=_shape(entry["key_shape"]),
        value_shape=_shape(entry["value_shape"]),
    )
    stores = kind != "shared" and aligned > 0
    fields = (layer.key, layer.value, layer.key_sha256, layer.value_sha256, layer.key_shape, layer.value_shape)
    if not all((f is not None) == stores for f in fields):
        raise ValueError(f"a {kind} layer entry must {'name' if stores else 'not name'} key and value tensors")
    if layer.cumulative_length != aligned:
        raise ValueError("cumulative_length must equal aligned_tokens")
    for shape in (layer.key_shape, layer.value_shape):
        if shape is not None and (len(shape) != 4 or shape[0] != 1 or not 0 < shape[2] <= aligned):
            raise ValueError(f"shape {shape} is not [1, kv_heads, stored <= aligned_tokens, head_dim]")
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


def _read_header(handle: BinaryIO, file_size: int, where: str) -> tuple[int, dict[str, _TensorInfo]]:
    """Parse a safetensors header (8-byte little-endian length, then JSON). Returns (data start, tensors)."""
    head = handle.read(8)
    if len(head) != 8:
        raise FormatError(f"{where}: tensors file is truncated (no header)")
    (header_len,) = struct.unpack("<Q", head)
    if header_len > file_size - 8:
        raise FormatError(f"{where}: tensors file is truncated (header runs past the end)")
    try:
        header = json.loads(handle.read(header_len))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise FormatError(f"{where}: tensors file header is not valid JSON") from None
    if not isinstance(header, dict):
        raise FormatError(f"{where}: tensors file header is not a JSON object")
    header.pop("__metadata__", None)
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
    return data_start, infos


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


def expected_hashes(manifest: Manifest) -> dict[str, Sha256Hex | None]:
    """Every tensor a manifest names, with the SHA-256 recorded for it."""
    expected: dict[str, Sha256Hex | None] = {}
    for entry in manifest.layers:
        if entry.key and entry.value:
            expected[entry.key], expected[entry.value] = entry.key_sha256, entry.value_sha256
    if manifest.next_logits_sha256:
        expected[NEXT_LOGITS_NAME] = manifest.next_logits_sha256
    return expected


def expected_shapes(manifest: Manifest) -> dict[str, list[int]]:
    shapes: dict[str, list[int]] = {}
    for entry in manifest.layers:
        if entry.key and entry.key_shape is not None:
            shapes[entry.key] = entry.key_shape
        if entry.value and entry.value_shape is not None:
            shapes[entry.value] = entry.value_shape
    return shapes


def read_tensors_checked(path: Path, manifest: Manifest) -> dict[str, torch.Tensor]:
    """Read every tensor the manifest names, hashing each while it is read (one pass over the bytes).

    Raises IntegrityError on the first tensor whose SHA-256 differs from the manifest; no tensor is returned then.
    """
    where = str(path)
    expected = expected_hashes(manifest)
    try:
        handle = path.open("rb")
    except FileNotFoundError:
        raise FormatError(f"{where}: tensors file is missing") from None
    with handle:
        file_size = path.stat().st_size
        _, infos = _read_header(handle, file_size, where)
        missing = sorted(set(expected) - set(infos))
        if missing:
            raise FormatError(f"{where}: tensors file lacks {', '.join(missing)}")
        ordered = sorted((infos[name].start, name) for name in expected)
        base = ordered[0][0] if ordered else 0
        buffer = bytearray(max((infos[name].end for name in expected), default=base) - base)
        view = memoryview(buffer)
        shapes = expected_shapes(manifest)
        for _, name in ordered:
            info = infos[name]
            if name in shapes and info.shape != shapes[name]:
                raise FormatError(f"{where}: tensor {name} has shape {info.shape}, the manifest says {shapes[name]}")
            hasher = hashlib.sha256()
            position = info.start
            handle.seek(position)
            while position < info.end:
                n = min(_READ_PIECE, info.end - position)
                piece = view[position - base : position - base + n]
                if handle.readinto(piece) != n:
                    raise FormatError(f"{where}: tensors file is truncated")
                hasher.update(piece)
                position += n
            if hasher.hexdigest() != expected[name]:
                raise IntegrityError(
                    f"{where}: tensor {name} does not match its SHA-256 in the manifest (corrupted file)"
                )
        tensors: dict[str, torch.Tensor] = {}
        for name in expected:
            info = infos[name]
            count = 1
            for dim in info.shape:
                count *= dim
            if count == 0:
                tensors[name] = torch.empty(info.shape, dtype=info.dtype)
            else:
                tensors[name] = torch.frombuffer(buffer, dtype=info.dtype, count=count, offset=info.start - base).view(
                    info.shape
                )
    return tensors


def states_from(manifest: Manifest, tensors: dict[str, torch.Tensor]) -> list[LayerState]:
    states = []
    for entry in manifest.layers:
        keys = tensors[entry.key] if entry.key else None
        values = tensors[entry.value] if entry.value else None
        states.append(LayerState(entry.kind, keys, values, entry.cumulative_length))
    return states
