"""Capture the per-layer state of a transformers `DynamicCache` and restore it into a new one.

Three layer kinds exist in transformers 5.x caches built with `DynamicCache(config=...)`:
- full (`DynamicLayer`): keys/values [batch, kv_heads, seq, head_dim] for every past token;
- sliding (`DynamicSlidingWindowLayer`): only the last window-1 tokens, plus `cumulative_length`, the count of
  all tokens seen, which positions and masks depend on;
- shared (`DummyLayer`, Gemma 4 KV-shared layers): no tensors; they read another layer's KV during the forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DummyLayer, DynamicLayer, DynamicSlidingWindowLayer

from kvgraft.errors import FingerprintMismatchError

LayerKind = Literal["full", "sliding", "shared"]


@dataclass(frozen=True)
class LayerState:
    """One cache layer's state. keys/values: [1, kv_heads, stored_seq, head_dim], None for shared layers or
    when no token is stored; `cumulative_length` counts every token the layer has seen."""

    kind: LayerKind
    keys: torch.Tensor | None
    values: torch.Tensor | None
    cumulative_length: int


def layer_kind(layer: object) -> LayerKind:
    # Order matters: the sliding layer class derives from the full one.
    if isinstance(layer, DynamicSlidingWindowLayer):
        return "sliding"
    if isinstance(layer, DynamicLayer):
        return "full"
    if isinstance(layer, DummyLayer):
        return "shared"
    raise FingerprintMismatchError(f"unsupported cache layer type {type(layer).__name__}")


def capture(cache: DynamicCache) -> list[LayerState]:
    """Snapshot a cache's layers (the tensors are shared with the cache, not copied)."""
    states: list[LayerState] = []
    for layer in cache.layers:
        kind = layer_kind(layer)
        if (
            isinstance(layer, DynamicLayer)
            and layer.keys is not None
            and layer.values is not None
            and layer.keys.numel()
        ):
            cumulative = (
                layer.cumulative_length if isinstance(layer, DynamicSlidingWindowLayer) else layer.keys.shape[-2]
            )
            states.append(LayerState(kind, layer.keys.contiguous(), layer.values.contiguous(), int(cumulative)))
        else:
            states.append(LayerState(kind, None, None, cache.get_seq_length()))
    return states


def restore(states: list[LayerState], config: PretrainedConfig, device: torch.device | str = "cpu") -> DynamicCache:
    """A new `DynamicCache(config=config)` holding `states`; refuses states whose layer kinds do not match."""
    cache = DynamicCache(config=config)
    if len(cache.layers) != len(states):
        raise FingerprintMismatchError(f"graft has {len(states)} layers, the model has {len(cache.layers)}")
    for index, (layer, state) in enumerate(zip(cache.layers, states, strict=True)):
        kind = layer_kind(layer)
        if kind != state.kind:
            raise FingerprintMismatchError(f"layer {index} is {kind} in the model but {state.kind} in the graft")
        if state.keys is None or state.values is None or not isinstance(layer, DynamicLayer):
            continue
        expected = state.cumulative_length
        if isinstance(layer, DynamicSlidingWindowLayer):
            expected = min(expected, layer.sliding_window - 1)
        if state.keys.shape[-2] != expected or state.values.shape != state.keys.shape[:-1] + state.values.shape[-1:]:
            raise FingerprintMismatchError(
                f"layer {index} stores {state.keys.shape[-2]} positions, the model keeps {expected} for this graft"
            )
        keys, values = state.keys.to(device), state.values.to(device)
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
        if isinstance(layer, DynamicSlidingWindowLayer):
            layer.cumulative_length = state.cumulative_length
    return cache
