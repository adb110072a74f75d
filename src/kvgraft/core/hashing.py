"""Hashes over canonical encodings: tensors as raw little-endian bytes, JSON with sorted keys, token ids as
little-endian int64. Never Python's `hash()` (salted per process) and never pickle."""

from __future__ import annotations

import hashlib
import json
import sys
from typing import Any, NewType

import numpy as np
import torch

Sha256Hex = NewType("Sha256Hex", str)
"""64 lowercase hex digits of a SHA-256 digest."""

GraftId = NewType("GraftId", Sha256Hex)
"""A graft's id: the SHA-256 of its canonical manifest without `id` and `created_at`."""

BlockKey = NewType("BlockKey", Sha256Hex)
"""A KV block's chained key: what the block's tokens are (its place in a prefix, under one fingerprint)."""

Digest = NewType("Digest", Sha256Hex)
"""The SHA-256 of some bytes (a block's tensors, a tensor, a token list): what the bytes are."""

_LOGITS_CHAIN_SEED = b"kvgraft/logits-chain/v1"

if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for is little-endian
    raise ImportError("kvgraft writes tensors as little-endian bytes and needs a little-endian machine")


def sha256_bytes(data: bytes | bytearray | memoryview) -> Digest:
    return Digest(Sha256Hex(hashlib.sha256(data).hexdigest()))


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a tensor in row-major order (a view when the tensor is contiguous).

    Works for every dtype, bfloat16 included, by reinterpreting the storage as uint8 rather than converting values.
    """
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    array: np.ndarray[tuple[int], np.dtype[np.uint8]] = flat.view(torch.uint8).numpy()
    return memoryview(array.data).cast("B")


def sha256_tensor(tensor: torch.Tensor) -> Digest:
    return sha256_bytes(tensor_bytes(tensor))


def canonical_json(obj: Any) -> bytes:
    """UTF-8 JSON with sorted keys and no insignificant whitespace: the one encoding kvgraft hashes."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def sha256_json(obj: Any) -> Sha256Hex:
    """The SHA-256 of `canonical_json(obj)`; callers name what it is (a GraftId, a BlockKey, a receipt id)."""
    return Sha256Hex(hashlib.sha256(canonical_json(obj)).hexdigest())


def token_ids_bytes(token_ids: list[int]) -> bytes:
    return np.asarray(token_ids, dtype="<i8").tobytes()


def sha256_token_ids(token_ids: list[int]) -> Digest:
    """SHA-256 of token ids encoded as consecutive little-endian int64 values."""
    return sha256_bytes(token_ids_bytes(token_ids))


class LogitsChain:
    """A chained SHA-256 over the logits of successive steps.

    h_0 = SHA-256(seed), h_i = SHA-256(h_{i-1} || SHA-256(logits_i)). One value commits to every step's logits,
    in order; two runs agree on it only if every step agreed bit for bit.
    """

    def __init__(self) -> None:
        self._digest = hashlib.sha256(_LOGITS_CHAIN_SEED).digest()
        self.steps = 0

    def update(self, logits: torch.Tensor) -> None:
        """Fold in one step's logits, shape [vocab] (any dtype; hashed as stored)."""
        step = hashlib.sha256(tensor_bytes(logits)).digest()
        self._digest = hashlib.sha256(self._digest + step).digest()
        self.steps += 1

    @property
    def hexdigest(self) -> Sha256Hex:
        return Sha256Hex(self._digest.hex())
