"""Several grafts in one context.

Exact: grafts that form one chain (each one's tokens begin with the previous one's, as `build(after=...)` makes
them) are the last graft's state; restoring it is restoring them all, bit for bit.

Approximate: grafts built separately, each from position 0, are placed one after another. Each graft's keys are
re-rotated to its new offset with the model's own rotary embedding (RoPE is a rotation by the position, so rotating
by the offset moves a key there), its unaligned tail is computed on top, and the next graft follows. What this
cannot give back is each graft's attention to the grafts before it: its KV was computed without them. The result
is therefore never exact; it is labelled approximate wherever it goes, and `measure_composition` reports its error
against the exact recompute of the same concatenated tokens.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import pairwise

import torch
from transformers import DynamicCache, PreTrainedModel

from kvgraft.core.cache_state import append_kv
from kvgraft.core.errors import BadInputError
from kvgraft.core.schedule import ChunkSchedule, forward_tokens
from kvgraft.format.blocks import block_tensor_name
from kvgraft.format.manifest import Manifest
from kvgraft.store.base import StoredGraft


def is_chain(manifests: list[Manifest]) -> bool:
    """Whether each graft's tokens begin with all of the previous graft's tokens.

    Args:
        manifests: the grafts, in context order.

    Returns:
        True when the last graft's state is the state of them all.
    """
    return all(len(b.tokens) >= len(a.tokens) and b.tokens[: len(a.tokens)] == a.tokens for a, b in pairwise(manifests))


def chain_error(manifests: list[Manifest]) -> str:
    """Why a list of grafts is not a chain, for the user.

    Args:
        manifests: the grafts, in context order.

    Returns:
        The first pair that breaks the chain, in words; empty when they are a chain.
    """
    for index, (a, b) in enumerate(pairwise(manifests)):
        if b.tokens[: len(a.tokens)] != a.tokens:
            return (
                f"graft {b.id[:12]} does not begin with the tokens of graft {a.id[:12]} (position {index + 1} in the "
                "list), so the grafts are not one chain"
            )
    return ""


class Rerotator:
    """Moves cached keys by a position offset with the model's rotary embedding: k' = k cos(d) + rotate_half(k) sin(d).

    Computed in float32 and cast back to the cache's dtype.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        found = [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]
        rotate_half = getattr(sys.modules[type(model).__module__], "rotate_half", None)
        if len(found) != 1 or rotate_half is None:
            raise BadInputError(
                f"{type(model).__name__} has no single rotary position embedding; its grafts cannot be re-positioned "
                "(approximate composition needs RoPE)"
            )
        self.rotary = found[0]
        self.rotate_half = rotate_half
        self.takes_layer_type = "layer_type" in inspect.signature(self.rotary.forward).parameters
        config = model.config.get_text_config()
        self.layer_types: list[str] | None = getattr(config, "layer_types", None)
        self.device = model.device

    def _cos_sin(self, layer: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        probe = torch.zeros(1, dtype=torch.float32, device=self.device)
        positions = torch.tensor([[offset]], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            if self.takes_layer_type and self.layer_types is not None:
                cos, sin = self.rotary(probe, positions, self.layer_types[layer])
            else:
                cos, sin = self.rotary(probe, positions)
        return cos.float()[:, None], sin.float()[:, None]  # [1, 1, 1, rotary_dim]: broadcast over heads, positions

    def move(self, keys: torch.Tensor, layer: int, offset: int) -> torch.Tensor:
        """Re-rotate keys by `offset` positions.

        Args:
            keys: one layer's keys at positions p.., [1, kv_heads, n, head_dim].
            layer: the layer's index (its rotary embedding may depend on its type).
            offset: how many positions to move them by.

        Returns:
            The keys as if computed at positions p+offset.., [1, kv_heads, n, head_dim], in the keys' dtype.

        Raises:
            BadInputError: the rotary dimension is not the head dimension (partial rotary embeddings).
        """
        if offset == 0:
            return keys
        cos, sin = self._cos_sin(layer, offset)
        if cos.shape[-1] != keys.shape[-1]:
            raise BadInputError(
                f"layer {layer}: rotary dimension {cos.shape[-1]} differs from head_dim {keys.shape[-1]}; "
                "re-positioning partial rotary embeddings is not supported"
            )
        k = keys.float()
        return (k * cos + self.rotate_half(k) * sin).to(keys.dtype)


@dataclass(frozen=True, kw_only=True)
class ComposedContext:
    """A cache holding several grafts one after another (approximately), and the tokens it stands for."""

    cache: DynamicCache
    tokens: list[int]
    offsets: tuple[int, ...]
    """Position at which each graft starts."""
    last_logits: torch.Tensor | None
    """Next-token logits after the last graft's tail, [vocab]; None when the last graft has no tail."""


def compose_approximate(
    model: PreTrainedModel, schedule: ChunkSchedule, grafts: Iterable[StoredGraft]
) -> ComposedContext:
    """Place each graft after the previous ones: its aligned KV re-rotated to its offset, then its tail computed.

    Args:
        model: the model (its rotary embedding re-positions the keys).
        schedule: the chunk schedule the tails are computed under.
        grafts: the grafts, read from a store (their tensors checked), in context order; read one at a time, so
            that a lazy iterable holds one graft's tensors in memory at once.

    Returns:
        The composed cache, holding every graft's tokens, and the logits after the last graft's tail.

    Raises:
        BadInputError: the model has no single rotary embedding, or only a partial one.
    """
    rerotator = Rerotator(model)
    cache = DynamicCache(config=model.config)
    tokens: list[int] = []
    offsets: list[int] = []
    last_logits: torch.Tensor | None = None
    for stored in grafts:
        manifest = stored.manifest
        offset = len(tokens)
        offsets.append(offset)
        layers_kv: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        for index, entry in enumerate(manifest.layers):
            keys = stored.tensors.get(block_tensor_name(index, "key")) if entry.key_shape else None
            values = stored.tensors.get(block_tensor_name(index, "value")) if entry.value_shape else None
            if keys is None or values is None:
                layers_kv.append(None)
            else:
                moved = rerotator.move(keys.to(model.device), index, offset)
                layers_kv.append((moved, values.to(model.device)))
        if manifest.aligned_tokens:
            append_kv(cache, layers_kv)
        tail = manifest.tokens[manifest.aligned_tokens :]
        last_logits = forward_tokens(model, cache, tail, offset + manifest.aligned_tokens, schedule) if tail else None
        tokens += manifest.tokens
    return ComposedContext(cache=cache, tokens=tokens, offsets=tuple(offsets), last_logits=last_logits)
