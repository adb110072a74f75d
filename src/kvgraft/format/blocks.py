"""KV blocks: how they are keyed, named and hashed (docs/FORMAT.md, section "Blocks").

Block i of a graft holds, for every layer that has KV, the keys and values of positions [i*C, (i+1)*C). It is stored
once per store under its chained key, SHA-256 over (the previous block's key, the fingerprint, the block's token
ids), so grafts that begin with the same tokens share their leading blocks.
"""

from __future__ import annotations

import functools
import hashlib
from concurrent.futures import ThreadPoolExecutor

import torch

from kvgraft.core.fingerprint import Fingerprint
from kvgraft.core.hashing import BlockKey, Digest, Sha256Hex, sha256_json, tensor_bytes

BLOCK_SUFFIX = ".safetensors"
BLOCK_DIGEST_KEY = "sha256"


def block_keys(fingerprint: Fingerprint, tokens: list[int], chunk_size: int) -> list[BlockKey]:
    """The chained keys of the blocks of `tokens` (one per whole chunk), as vLLM keys its prefix blocks.

    A key commits to every token before and in its block and to the fingerprint (weights, schedule, numeric
    environment), so equal keys mean equal KV bytes under kvgraft's exactness contract.
    """
    digest = fingerprint.digest
    keys: list[BlockKey] = []
    parent: BlockKey | None = None
    for start in range(0, len(tokens) // chunk_size * chunk_size, chunk_size):
        parent = BlockKey(
            sha256_json({"parent": parent, "fingerprint": digest, "tokens": tokens[start : start + chunk_size]})
        )
        keys.append(parent)
    return keys


def block_tensor_name(layer: int, part: str) -> str:
    """Zero-padded so that name order is layer order (and so the order of the safetensors data section)."""
    return f"layers.{layer:03d}.{part}"


def block_digest(tensors: dict[str, torch.Tensor]) -> Digest:
    """SHA-256 of the tensors' raw bytes, concatenated in name order."""
    hasher = hashlib.sha256()
    for name in sorted(tensors):
        hasher.update(tensor_bytes(tensors[name]))
    return Digest(Sha256Hex(hasher.hexdigest()))


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


def empty_assembly(shapes: dict[str, list[int]], count: int, dtype: str) -> dict[str, torch.Tensor]:
    """Per-layer tensors for `count` blocks, to be filled block by block in place (what `assemble` returns,
    preallocated).

    Args:
        shapes: Each tensor of a block with its shape, [1, kv_heads, C, head_dim].
        count: The number of blocks.
        dtype: The torch dtype name of the graft's tensors.

    Returns:
        Uninitialised contiguous tensors [1, kv_heads, count * C, head_dim] by name; none when there is no block.
    """
    if count == 0:
        return {}
    kind = getattr(torch, dtype)
    return {
        name: torch.empty([*shape[:-2], shape[-2] * count, shape[-1]], dtype=kind) for name, shape in shapes.items()
    }


@functools.cache
def _assembly_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=max(1, torch.get_num_threads()), thread_name_prefix="kvgraft-assemble")
