"""Record the KV a transformers `DynamicCache` receives, and restore per-layer state into a new cache.

Three layer kinds exist in transformers 5.x caches built with `DynamicCache(config=...)`:
- full (`DynamicLayer`): keys/values [batch, kv_heads, seq, head_dim] for every past token;
- sliding (`DynamicSlidingWindowLayer`): only the last window-1 tokens, plus `cumulative_length`, the count of
  all tokens seen, which positions and masks depend on;
- shared (`DummyLayer`, Gemma 4 KV-shared layers): no tensors; they read another layer's KV during the forward.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DummyLayer, DynamicLayer, DynamicSlidingWindowLayer

from kvgraft.core.errors import FingerprintMismatchError


class LayerKind(StrEnum):
    """What a cache layer keeps; the value is what manifests record (docs/FORMAT.md, "layers")."""

    FULL = "full"
    SLIDING = "sliding"
    SHARED = "shared"

    @property
    def stores_kv(self) -> bool:
        """Whether the layer has KV of its own (a shared layer reads another layer's)."""
        return self is not LayerKind.SHARED

    @classmethod
    def of(cls, layer: object) -> LayerKind:
        """The kind of a transformers cache layer; FingerprintMismatchError for a layer type kvgraft does not know."""
        return _spec_of(layer).kind


@dataclass(frozen=True)
class LayerState:
    """One cache layer's state. keys/values: [1, kv_heads, stored_seq, head_dim], None for shared layers or
    when no token is stored; `cumulative_length` counts every token the layer has seen."""

    kind: LayerKind
    keys: torch.Tensor | None
    values: torch.Tensor | None
    cumulative_length: int


class _LayerSpec:
    """How one kind of transformers cache layer is restored. Subclasses say which layer class they handle."""

    kind: ClassVar[LayerKind]
    layer_class: ClassVar[type]

    def load(self, layer: Any, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        """Put a state's keys/values ([1, kv_heads, length, head_dim], already on the layer's device) into `layer`."""
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values

    def kept(self, layer: Any, length: int) -> int:
        """How many of `length` positions the live layer keeps."""
        return length


class _FullSpec(_LayerSpec):
    kind = LayerKind.FULL
    layer_class = DynamicLayer


class _SlidingSpec(_LayerSpec):
    """Grafts store every position of sliding layers too (so that blocks can be shared); the model keeps the last
    window-1, which are the very tensors a fresh run would hold, and counts every position it has seen."""

    kind = LayerKind.SLIDING
    layer_class = DynamicSlidingWindowLayer

    def kept(self, layer: Any, length: int) -> int:
        return min(length, int(layer.sliding_window) - 1)

    def load(self, layer: Any, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        super().load(layer, keys, values, length)
        layer.cumulative_length = length


class _SharedSpec(_LayerSpec):
    kind = LayerKind.SHARED
    layer_class = DummyLayer


# Most specific first: the sliding layer class derives from the full one.
_SPECS: tuple[_LayerSpec, ...] = (_SlidingSpec(), _FullSpec(), _SharedSpec())


def _spec_of(layer: object) -> _LayerSpec:
    for spec in _SPECS:
        if isinstance(layer, spec.layer_class):
            return spec
    raise FingerprintMismatchError(f"unsupported cache layer type {type(layer).__name__}")


def restore(states: list[LayerState], config: PretrainedConfig, device: torch.device | str = "cpu") -> DynamicCache:
    """A new cache holding `states`.

    Args:
        states: One state per layer of the model, in order.
        config: The model's config (`DynamicCache(config=config)` builds the layers).
        device: Where the cache's tensors go: the model's device. Stored tensors (on the CPU, often memory-mapped)
            are copied there; on the CPU they are used in place.

    Returns:
        The cache, as a fresh run would hold it after `cumulative_length` tokens.

    Raises:
        FingerprintMismatchError: layer count, kinds or lengths differ from the model's.
    """
    cache = DynamicCache(config=config)
    if len(cache.layers) != len(states):
        raise FingerprintMismatchError(f"graft has {len(states)} layers, the model has {len(cache.layers)}")
    for index, (layer, state) in enumerate(zip(cache.layers, states, strict=True)):
        spec = _spec_of(layer)
        if spec.kind != state.kind:
            raise FingerprintMismatchError(f"layer {index} is {spec.kind} in the model but {state.kind} in the graft")
        if state.keys is None or state.values is None or not spec.kind.stores_kv:
            continue
        keys, values = state.keys, state.values
        if values.shape[:-1] != keys.shape[:-1] or keys.shape[-2] != state.cumulative_length:
            raise FingerprintMismatchError(
                f"layer {index} stores {keys.shape[-2]} positions, the graft has {state.cumulative_length} tokens"
            )
        kept = spec.kept(layer, state.cumulative_length)
        keys, values = keys[:, :, keys.shape[-2] - kept :], values[:, :, values.shape[-2] - kept :]
        spec.load(layer, keys.contiguous().to(device), values.contiguous().to(device), state.cumulative_length)
    return cache


@dataclass
class KvRecording:
    """The KV each cache layer received during a recording, in order: chunks[layer] = [(keys, values), ...],
    each [1, kv_heads, chunk, head_dim]. Shared layers receive nothing."""

    chunks: list[list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=list)
    _joined: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def layer_kv(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Keys and values of positions [start, end) counted from the recording's first position (copies)."""
        parts = self.chunks[layer]
        if not parts:
            return None
        if layer not in self._joined:
            self._joined[layer] = (torch.cat([k for k, _ in parts], dim=-2), torch.cat([v for _, v in parts], dim=-2))
        keys, values = self._joined[layer]
        return keys[:, :, start:end].clone(memory_format=torch.contiguous_format), values[:, :, start:end].clone(
            memory_format=torch.contiguous_format
        )


@contextmanager
def record_kv(cache: DynamicCache) -> Iterator[KvRecording]:
    """Record every key/value tensor the model writes into `cache` while the context is open.

    The model's computation is untouched: each layer's own `update` still runs; the recording only keeps a
    reference to what it was given. This is how sliding layers' KV is captured at full length although the
    cache itself keeps only the last window-1 positions.
    """
    recording = KvRecording([[] for _ in cache.layers])
    patched: list[DynamicLayer] = []
    for index, layer in enumerate(cache.layers):
        if not isinstance(layer, DynamicLayer):
            continue
        original = layer.update

        def update(
            key_states: torch.Tensor,
            value_states: torch.Tensor,
            *args: Any,
            _original: Any = original,
            _index: int = index,
            **kwargs: Any,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            recording.chunks[_index].append((key_states, value_states))
            return _original(key_states, value_states, *args, **kwargs)

        layer.update = update  # type: ignore[method-assign]
        patched.append(layer)
    try:
        yield recording
    finally:
        for layer in patched:
            del layer.update  # the instance attribute goes; the class method shows through again


def append_kv(cache: DynamicCache, layers_kv: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
    """Append per-layer KV ([1, kv_heads, n, head_dim]) after what `cache` holds, as if n more tokens were read.

    Used only by approximate composition; sliding layers keep their last window-1 positions as usual.
    """
    for layer, kv in zip(cache.layers, layers_kv, strict=True):
        if kv is not None and isinstance(layer, DynamicLayer):
            layer.update(*kv)
