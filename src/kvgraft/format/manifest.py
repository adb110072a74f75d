"""The graft manifest, format version 2 (docs/FORMAT.md is the spec; keep the two in step).

A graft is a manifest plus a chain of KV blocks (see `kvgraft.format.blocks`). Sliding-window layers are stored at
full length like the others: the model keeps only their last window-1 positions, which restoring takes from the
blocks. The manifest lists every token, the blocks with the SHA-256 of their tensor bytes, the fingerprint and per
layer the block tensors' shapes. The graft id is the SHA-256 of the canonical manifest without `id` and
`created_at`, so the same content always gets the same id.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from kvgraft.core.cache_state import LayerKind
from kvgraft.core.errors import FormatError, IntegrityError
from kvgraft.core.fingerprint import Fingerprint
from kvgraft.core.hashing import BlockKey, Digest, GraftId, Sha256Hex, sha256_json
from kvgraft.format.blocks import block_keys, block_tensor_name

FORMAT_VERSION = 2
MANIFEST_NAME = "manifest.json"


NEXT_LOGITS_NAME = "next_token_logits"
TENSORS_NAME = "tensors.safetensors"


_ID_EXCLUDED = ("id", "created_at")
_TENSORS_FILE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*\.safetensors")  # used with fullmatch


_HEX64 = re.compile(r"[0-9a-f]{64}")


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
    key: BlockKey
    """Chained key: sha256_json({"parent": previous key or None, "fingerprint": fingerprint digest, "tokens": ...})"""
    sha256: Digest
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
    source_sha256: Digest
    model_name: str
    kvgraft_version: str
    created_at: str
    metadata: dict[str, Any] = field(default_factory=dict)
    next_logits_sha256: Digest | None = None
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
    def id(self) -> GraftId:
        return graft_id(self.body())

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, **self.body()}


def graft_id(manifest: dict[str, Any]) -> GraftId:
    """SHA-256 of the canonical JSON of the manifest with `id` and `created_at` removed."""
    return GraftId(sha256_json({k: v for k, v in manifest.items() if k not in _ID_EXCLUDED}))


def manifest_bytes(manifest: Manifest) -> bytes:
    return json.dumps(manifest.to_json(), indent=1, sort_keys=True, ensure_ascii=False).encode() + b"\n"


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
        source_sha256=Digest(Sha256Hex(str(provenance["source_sha256"]))),
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
    return BlockRef(BlockKey(Sha256Hex(key)), Digest(Sha256Hex(digest)))


def _next_logits_sha(entry: Any) -> Digest | None:
    if entry is None:
        return None
    if entry["tensor"] != NEXT_LOGITS_NAME:
        raise ValueError(f"next_token_logits.tensor must be {NEXT_LOGITS_NAME!r}")
    return Digest(Sha256Hex(str(entry["sha256"])))


def _int(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an integer")
    return value


def _layer_from_json(entry: dict[str, Any], aligned: int, chunk_size: int) -> LayerEntry:
    if entry["kind"] not in tuple(LayerKind):
        raise ValueError(f"unknown layer kind {entry['kind']!r}")
    kind = LayerKind(entry["kind"])
    if set(entry) != {"kind", "key_shape", "value_shape"}:
        raise ValueError("a layer entry has exactly kind, key_shape and value_shape")
    layer = LayerEntry(kind=kind, key_shape=_shape(entry["key_shape"]), value_shape=_shape(entry["value_shape"]))
    stores = kind.stores_kv and aligned > 0
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


def expected_hashes(manifest: Manifest) -> dict[str, Digest]:
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
