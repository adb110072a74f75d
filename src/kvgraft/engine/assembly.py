"""Between cache state and blocks: cut a recording into block tensors, and join stored blocks into the per-layer
tensors a restore puts back into a cache."""

from __future__ import annotations

import torch

from kvgraft.core.cache_state import KvRecording, LayerKind, LayerState
from kvgraft.format.blocks import block_tensor_name
from kvgraft.format.manifest import LayerEntry


def block_tensors(recording: KvRecording, start: int, end: int) -> dict[str, torch.Tensor]:
    """The tensors of one block: positions [start, end) of a recording, per layer that has KV."""
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(len(recording.chunks)):
        kv = recording.layer_kv(layer, start, end)
        if kv is not None:
            tensors[block_tensor_name(layer, "key")] = kv[0].cpu()
            tensors[block_tensor_name(layer, "value")] = kv[1].cpu()
    return tensors


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


def states_from(layers: list[LayerEntry], tensors: dict[str, torch.Tensor], length: int) -> list[LayerState]:
    """Cache states from assembled tensors (see `assemble`) holding `length` positions."""
    states = []
    for index, entry in enumerate(layers):
        keys = tensors.get(block_tensor_name(index, "key")) if length else None
        values = tensors.get(block_tensor_name(index, "value")) if length else None
        states.append(LayerState(entry.kind, keys, values, length))
    return states
