"""Generation under the chunk schedule, from a fresh cache or a restored graft.

The input is `graft tokens + prompt tokens`. With a graft, the first `aligned_tokens` come from the stored KV and
the rest (graft tail and prompt) are computed under the schedule from the aligned position; without one, all
input tokens are computed from position 0. Either way the same chunks see the same bytes, so a grafted run and
a fresh run agree on every step's logits.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from kvgraft.core.errors import BadInputError
from kvgraft.core.hashing import LogitsChain, Sha256Hex
from kvgraft.core.sampling import SamplingParams
from kvgraft.core.schedule import ChunkCallback, ChunkSchedule, decode_step, forward_tokens

TokenCallback = Callable[[int], None]


@dataclass
class Generation:
    """What one decoding run produced. `logits_chain` commits to every step's logits, in order."""

    output_tokens: list[int]
    text: str
    logits_chain: Sha256Hex
    stop_reason: str
    ttft_s: float
    decode_s: float
    prefill_tokens: int
    token_logprobs: list[float] = field(default_factory=list)
    """Natural-log probability the model gave each output token (the model's own confidence)."""
    step_logits: list[torch.Tensor] = field(default_factory=list)

    @property
    def decode_tokens_per_s(self) -> float:
        steps = len(self.output_tokens) - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0


def _sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    if params.temperature <= 0 or generator is None:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits.double() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < params.top_p
        filtered = torch.zeros_like(probs)
        filtered[order[keep]] = probs[order[keep]]
        probs = filtered
    return int(torch.multinomial(probs, 1, generator=generator).item())


def _text_of(tokenizer: PreTrainedTokenizerBase, tokens: list[int]) -> str:
    return str(tokenizer.decode(tokens, skip_special_tokens=True))


def _stop_cut(text: str, stops: tuple[str, ...]) -> int | None:
    cuts = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(cuts) if cuts else None


def decode(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    schedule: ChunkSchedule,
    cache: DynamicCache,
    pending: list[int],
    start: int,
    params: SamplingParams,
    started_at: float,
    first_logits: torch.Tensor | None = None,
    keep_logits: bool = False,
    on_chunk: ChunkCallback | None = None,
    on_token: TokenCallback | None = None,
) -> Generation:
    """Compute `pending` tokens at positions start.. under the schedule, then decode up to max_new_tokens.

    `started_at` (a `time.perf_counter()` value) is when the request began, so that time to first token counts
    graft loading and restore too. When `pending` is empty, `first_logits` [vocab] (a graft's stored next-token
    logits) give the first token.
    """
    if params.max_new_tokens < 1:
        raise BadInputError("max new tokens must be at least 1")
    generator = None
    if params.temperature > 0:
        generator = torch.Generator(device="cpu").manual_seed(params.seed)
    eos = tokenizer.eos_token_id
    chain = LogitsChain()
    kept: list[torch.Tensor] = []
    if pending:
        logits = forward_tokens(model, cache, pending, start, schedule, on_chunk)
    elif first_logits is not None:
        logits = first_logits
    else:
        raise BadInputError("nothing to compute: give a prompt")
    position = start + len(pending)
    tokens: list[int] = []
    logprobs: list[float] = []
    stop_reason = "length"
    ttft = 0.0
    first_at = started_at
    while True:
        chain.update(logits)
        if keep_logits:
            kept.append(logits.detach().clone())
        step = logits.detach().to("cpu")
        token = _sample(step, params, generator)
        tokens.append(token)
        logprobs.append(float(torch.log_softmax(step.double(), dim=-1)[token]))
        if len(tokens) == 1:
            first_at = time.perf_counter()
            ttft = first_at - started_at
        if on_token is not None:
            on_token(token)
        if eos is not None and token == eos:
            stop_reason = "eos"
            break
        if params.stop and _stop_cut(_text_of(tokenizer, tokens), params.stop) is not None:
            stop_reason = "stop"
            break
        if len(tokens) >= params.max_new_tokens:
            break
        logits = decode_step(model, cache, token, position)
        position += 1
    text = _text_of(tokenizer, tokens)
    cut = _stop_cut(text, params.stop)
    if cut is not None:
        text = text[:cut]
    return Generation(
        output_tokens=tokens,
        text=text,
        logits_chain=chain.hexdigest,
        stop_reason=stop_reason,
        ttft_s=ttft,
        decode_s=time.perf_counter() - first_at,
        prefill_tokens=len(pending),
        token_logprobs=logprobs,
        step_logits=kept,
    )
