"""The fixed chunk schedule: the only way kvgraft runs a model forward.

KV bytes depend on how tokens are batched into forward calls (matmul kernels differ with the row count), so
"the fresh run" is defined once, here: prompt chunks end at absolute multiples of C counted from position 0
(the last one may be partial) and decoding feeds one token per call. A graft stored at a multiple of C and
continued under this schedule reproduces the fresh run bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from kvgraft.core.errors import BadInputError

DEFAULT_CHUNK_SIZE = 64

ChunkCallback = Callable[[int, int], None]
"""Called after each chunk with (tokens done, tokens in all)."""


@dataclass(frozen=True)
class ChunkSchedule:
    chunk_size: int = DEFAULT_CHUNK_SIZE

    def __post_init__(self) -> None:
        if self.chunk_size < 1:
            raise BadInputError(f"chunk size must be a positive integer, got {self.chunk_size}")

    def spans(self, start: int, end: int) -> list[tuple[int, int]]:
        """Half-open [a, b) spans covering [start, end), each ending at the next multiple of C (or at `end`)."""
        spans = []
        position = start
        while position < end:
            boundary = (position // self.chunk_size + 1) * self.chunk_size
            stop = min(boundary, end)
            spans.append((position, stop))
            position = stop
        return spans

    def aligned_length(self, n_tokens: int) -> int:
        """Tokens of an n-token text whose KV a graft stores: the largest multiple of C not above n."""
        return (n_tokens // self.chunk_size) * self.chunk_size


def forward_tokens(
    model: PreTrainedModel,
    cache: DynamicCache,
    token_ids: list[int],
    start: int,
    schedule: ChunkSchedule,
    on_chunk: ChunkCallback | None = None,
) -> torch.Tensor:
    """Feed `token_ids` at absolute positions start.. into `cache` under the schedule.

    Returns the logits of the last position, shape [vocab]. The cache must hold exactly `start` tokens.
    """
    if not token_ids:
        raise BadInputError("nothing to compute: no tokens after the graft")
    if cache.get_seq_length() != start:
        raise RuntimeError(f"cache holds {cache.get_seq_length()} tokens, expected {start}")
    vocab = int(model.config.get_text_config().vocab_size)
    bad = next((t for t in token_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise BadInputError(f"token id {bad} is outside the model's vocabulary of {vocab}")
    device = model.device
    logits: torch.Tensor | None = None
    end = start + len(token_ids)
    with torch.inference_mode():
        for a, b in schedule.spans(start, end):
            ids = torch.tensor([token_ids[a - start : b - start]], dtype=torch.long, device=device)
            positions = torch.arange(a, b, dtype=torch.long, device=device).unsqueeze(0)
            out = model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1)
            logits = out.logits[0, -1]
            if on_chunk is not None:
                on_chunk(b - start, end - start)
    assert logits is not None
    return logits


def decode_step(model: PreTrainedModel, cache: DynamicCache, token_id: int, position: int) -> torch.Tensor:
    """Feed one token at `position`; returns the next-token logits, shape [vocab]."""
    return forward_tokens(model, cache, [token_id], position, ChunkSchedule(1))
