"""Generation under the chunk schedule, from a fresh cache or a restored graft.

The input is `graft tokens + prompt tokens`. With a graft, the first `aligned_tokens` come from the stored KV and
the rest (graft tail and prompt) are computed under the schedule from the aligned position; without one, all
input tokens are computed from position 0. Either way the same chunks see the same bytes, so a grafted run and
a fresh run agree on every step's logits.

`decode` is built from steps in the manner of gpt-fast: `prefill` (the input under the schedule, giving the first
logits), `decode_step` (one token, from `kvgraft.core.schedule`), `sample`, `stop_reason`, and a `DecodeState`
that keeps the logits chain, the output tokens and the timings.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from kvgraft.core.errors import BadInputError
from kvgraft.core.hashing import LogitsChain, Sha256Hex
from kvgraft.core.sampling import SamplingParams
from kvgraft.core.schedule import ChunkCallback, ChunkSchedule, decode_step, forward_tokens

TokenCallback = Callable[[int], None]

StopReason = Literal["eos", "stop", "length"]
"""Why decoding ended: the model's end-of-sequence token, a stop string or stop token, or `max_new_tokens`."""


@dataclass(frozen=True, kw_only=True)
class Generation:
    """What one decoding run produced. `logits_chain` commits to every step's logits, in order."""

    output_tokens: list[int]
    text: str
    """The decoded output tokens, cut before the first stop string."""
    logits_chain: Sha256Hex
    stop_reason: StopReason
    ttft_s: float
    decode_s: float
    """Seconds from the first token to the end of decoding."""
    prefill_tokens: int
    token_logprobs: list[float] = field(default_factory=list)
    """Natural-log probability the model gave each output token (the model's own confidence)."""
    step_logits: list[torch.Tensor] = field(default_factory=list)
    """Each step's logits, [vocab], on the CPU (whatever the model's device); only when decoding was asked to keep
    them."""

    @property
    def decode_tokens_per_s(self) -> float:
        steps = len(self.output_tokens) - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0


@dataclass(kw_only=True)
class DecodeState:
    """The bookkeeping of one decoding run: the logits chain, the output so far and when its first token came.

    `started_at` is a `time.perf_counter()` value: when the request began.
    """

    started_at: float
    keep_logits: bool = False
    chain: LogitsChain = field(default_factory=LogitsChain)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    kept: list[torch.Tensor] = field(default_factory=list)
    ttft_s: float = 0.0
    first_at: float | None = None

    def observe(self, logits: torch.Tensor) -> torch.Tensor:
        """Fold one step's logits into the chain (and keep them if asked).

        Args:
            logits: the step's next-token logits, [vocab], on the model's device (or on the CPU: a graft's stored
                ones).

        Returns:
            The same logits on the CPU, [vocab], which the chain hashes and sampling and log-probabilities read
            (one copy from the device per step; on the CPU, the very tensor).
        """
        step = logits.detach().to("cpu")
        self.chain.update(step)
        if self.keep_logits:
            self.kept.append(step.clone())
        return step

    def emit(self, token: int, step: torch.Tensor) -> None:
        """Record a sampled token and its log-probability; the first one fixes the time to first token.

        Args:
            token: the sampled token id.
            step: the CPU logits it was sampled from, [vocab].
        """
        self.tokens.append(token)
        self.logprobs.append(float(torch.log_softmax(step.double(), dim=-1)[token]))
        if self.first_at is None:
            self.first_at = time.perf_counter()
            self.ttft_s = self.first_at - self.started_at

    def finish(
        self, tokenizer: PreTrainedTokenizerBase, stops: tuple[str, ...], reason: StopReason, prefill_tokens: int
    ) -> Generation:
        """The finished run.

        Args:
            tokenizer: decodes the output tokens to text.
            stops: stop strings; the text is cut before the first one.
            reason: why decoding ended.
            prefill_tokens: how many input tokens were computed before the first step.

        Returns:
            The `Generation`, with `decode_s` measured from the first token to now.
        """
        text = _text_of(tokenizer, self.tokens)
        cut = _stop_cut(text, stops)
        if cut is not None:
            text = text[:cut]
        first_at = self.started_at if self.first_at is None else self.first_at
        return Generation(
            output_tokens=self.tokens,
            text=text,
            logits_chain=self.chain.hexdigest,
            stop_reason=reason,
            ttft_s=self.ttft_s,
            decode_s=time.perf_counter() - first_at,
            prefill_tokens=prefill_tokens,
            token_logprobs=self.logprobs,
            step_logits=self.kept,
        )


def prefill(
    model: PreTrainedModel,
    schedule: ChunkSchedule,
    cache: DynamicCache,
    pending: list[int],
    start: int,
    first_logits: torch.Tensor | None = None,
    on_chunk: ChunkCallback | None = None,
) -> torch.Tensor:
    """Compute the input not yet in the cache, under the schedule, and return the first step's logits.

    Args:
        model: the model.
        schedule: the chunk schedule every forward follows.
        cache: holds exactly `start` positions; `pending` is appended to it.
        pending: token ids to compute at positions `start..`; may be empty when `first_logits` is given.
        start: the position of `pending[0]`.
        first_logits: next-token logits for a cache that needs nothing computed (a graft's stored ones), [vocab].
        on_chunk: called with (tokens done, tokens in all) after each chunk.

    Returns:
        The next-token logits after the input, [vocab].

    Raises:
        BadInputError: nothing to compute and no `first_logits`.
    """
    if pending:
        return forward_tokens(model, cache, pending, start, schedule, on_chunk)
    if first_logits is not None:
        return first_logits
    raise BadInputError("nothing to compute: give a prompt")


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """The CPU random generator a sampled run draws from, seeded with `params.seed`; None for greedy decoding."""
    if params.temperature > 0:
        return torch.Generator(device="cpu").manual_seed(params.seed)
    return None


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Choose the next token: greedy, or from the tempered softmax (in float64) restricted to the top-p nucleus.

    Args:
        logits: next-token logits on the CPU, [vocab].
        params: temperature and top_p; temperature 0 is greedy.
        generator: the seeded generator of `make_generator`; None is greedy.

    Returns:
        The chosen token id.
    """
    if params.temperature <= 0 or generator is None:
        return int(torch.argmax(logits).item())
    scaled = logits.double() / params.temperature
    if not torch.isfinite(scaled.max()):
        # A temperature so small (1e-310) that logits / T overflows: sampling at it is its limit, the argmax. (Masked
        # -inf logits alone leave the maximum finite, so they keep the ordinary path.)
        return int(torch.argmax(logits).item())
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < params.top_p
        filtered = torch.zeros_like(probs)
        filtered[order[keep]] = probs[order[keep]]
        probs = filtered
    return int(torch.multinomial(probs, 1, generator=generator).item())


def stop_reason(
    tokens: list[int], tokenizer: PreTrainedTokenizerBase, eos: int | None, params: SamplingParams
) -> StopReason | None:
    """Why decoding stops after the last of `tokens`, or None to go on.

    Args:
        tokens: the output tokens so far (at least one).
        tokenizer: decodes them, to look for stop strings.
        eos: the end-of-sequence token id, if the tokenizer has one.
        params: the stop strings, stop token ids and `max_new_tokens`.

    Returns:
        "eos", "stop" (a stop token id, or a stop string in the text) or "length", checked in that order; None
        while none applies.
    """
    if eos is not None and tokens[-1] == eos:
        return "eos"
    if tokens[-1] in params.stop_token_ids:
        return "stop"
    if params.stop and _stop_cut(_text_of(tokenizer, tokens), params.stop) is not None:
        return "stop"
    if len(tokens) >= params.max_new_tokens:
        return "length"
    return None


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
    """Compute `pending` at positions `start..` under the schedule, then decode up to `max_new_tokens` tokens.

    Args:
        model: the model.
        tokenizer: its tokenizer (end-of-sequence token, stop strings, the output text).
        schedule: the chunk schedule of the prefill.
        cache: holds exactly `start` positions (a restored graft, or nothing); decoding appends to it.
        pending: the input token ids not in the cache; empty when `first_logits` give the first token.
        start: the position of `pending[0]`.
        params: sampling, stop strings and `max_new_tokens`.
        started_at: a `time.perf_counter()` value, when the request began, so that time to first token counts
            graft loading and restore too.
        first_logits: a graft's stored next-token logits, [vocab], used when `pending` is empty.
        keep_logits: keep every step's logits in `Generation.step_logits`.
        on_chunk: called with (tokens done, tokens in all) after each prefill chunk.
        on_token: called with each output token as it is chosen.

    Returns:
        The output tokens and text, the logits chain, why it stopped and the timings.

    Raises:
        BadInputError: `max_new_tokens` below 1, or nothing to compute.
    """
    if params.max_new_tokens < 1:
        raise BadInputError("max new tokens must be at least 1")
    generator = make_generator(params)
    eos = tokenizer.eos_token_id
    logits = prefill(model, schedule, cache, pending, start, first_logits, on_chunk)
    state = DecodeState(started_at=started_at, keep_logits=keep_logits)
    position = start + len(pending)
    while True:
        step = state.observe(logits)
        token = sample(step, params, generator)
        state.emit(token, step)
        if on_token is not None:
            on_token(token)
        reason = stop_reason(state.tokens, tokenizer, eos, params)
        if reason is not None:
            return state.finish(tokenizer, params.stop, reason, prefill_tokens=len(pending))
        logits = decode_step(model, cache, token, position)
        position += 1
