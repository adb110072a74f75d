"""Independent re-checks: a graft against a fresh recompute, and a receipt against a fresh rerun."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from kvgraft.core.cache_state import record_kv, restore
from kvgraft.core.errors import BadInputError, KvgraftError
from kvgraft.core.fingerprint import check_fingerprint
from kvgraft.core.hashing import GraftId, sha256_tensor
from kvgraft.core.sampling import SamplingParams
from kvgraft.core.schedule import ChunkCallback, forward_tokens
from kvgraft.engine.assembly import block_tensors, states_from
from kvgraft.engine.engine import Engine
from kvgraft.format.blocks import block_digest
from kvgraft.format.manifest import NEXT_LOGITS_NAME, Manifest
from kvgraft.format.receipt import Receipt
from kvgraft.store import GraftStore


@dataclass
class GraftVerification:
    """A graft against a fresh recompute of its tokens: exact when every tensor and the logits are equal."""

    graft_id: GraftId
    kv_equal: bool
    logits_equal: bool
    kl: float
    argmax_agree: bool
    mismatched: list[str] = field(default_factory=list)
    environment_differences: list[str] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return self.kv_equal and self.logits_equal and not self.environment_differences

    def to_json(self) -> dict[str, Any]:
        return {"exact": self.exact, **asdict(self)}


@dataclass
class ReceiptVerification:
    """A receipt against a fresh rerun: exact when tokens and logits chain are equal (and it is not approximate)."""

    receipt_id: str
    tokens_equal: bool
    logits_equal: bool
    first_divergence: int | None
    rerun_ttft_s: float
    environment_differences: list[str] = field(default_factory=list)
    approximate: bool = False
    """The receipt is of an approximate composition: never exact, whatever the rerun shows."""

    @property
    def exact(self) -> bool:
        return self.tokens_equal and self.logits_equal and not self.environment_differences and not self.approximate

    def to_json(self) -> dict[str, Any]:
        return {"exact": self.exact, **asdict(self)}


def kl_divergence(reference: torch.Tensor, other: torch.Tensor) -> float:
    """KL(softmax(reference) || softmax(other)), computed in float64.

    Args:
        reference: logits, [vocab].
        other: logits, [vocab].

    Returns:
        The divergence in nats (0.0 for identical logits).
    """
    p_log = torch.log_softmax(reference.double(), dim=-1)
    q_log = torch.log_softmax(other.double(), dim=-1)
    return float(torch.sum(p_log.exp() * (p_log - q_log)).item())


def verify_graft(engine: Engine, graft_id: str, on_chunk: ChunkCallback | None = None) -> GraftVerification:
    """Recompute the graft's KV from its tokens under the schedule, compare every tensor hash, then compare the
    next-token logits after the graft: restored + tail vs the fresh run over all tokens.

    Args:
        engine: an engine with the graft's model and a store holding the graft.
        graft_id: the graft's id, or a unique prefix of it.
        on_chunk: called with (tokens done, tokens in all) after each chunk of the recompute.

    Returns:
        Whether every block and the next-token logits are equal, the blocks that are not, the KL divergence
        and argmax agreement of the logits, and the environment differences.
    """
    manifest = engine.store.manifest(graft_id)
    with engine.graft_threads({manifest.id[:12]: manifest.fingerprint}):  # at the count the graft was made with
        return _verify_graft(engine, manifest.id, on_chunk)


def _verify_graft(engine: Engine, graft_id: str, on_chunk: ChunkCallback | None) -> GraftVerification:
    stored = engine.store.get(graft_id)
    manifest = stored.manifest
    env_diff = check_fingerprint(manifest.fingerprint, engine.fingerprint, allow_environment_mismatch=True)
    cache = DynamicCache(config=engine.model.config)
    aligned = manifest.aligned_tokens
    chunk = manifest.chunk_size
    tail = manifest.tokens[aligned:]
    with record_kv(cache) as recording:
        if aligned:
            fresh_logits = forward_tokens(engine.model, cache, manifest.tokens[:aligned], 0, engine.schedule, on_chunk)
    mismatched: list[str] = []
    for index, ref in enumerate(manifest.blocks):
        fresh = block_tensors(recording, index * chunk, (index + 1) * chunk)
        if block_digest(fresh) == ref.sha256:
            continue
        differing = [
            f"block {index} {name}"
            for name, tensor in sorted(fresh.items())
            if sha256_tensor(tensor) != sha256_tensor(stored.tensors[name][:, :, index * chunk : (index + 1) * chunk])
        ]
        mismatched.extend(differing or [f"block {index}"])
    if tail:
        fresh_logits = forward_tokens(engine.model, cache, tail, aligned, engine.schedule)
        states = states_from(manifest.layers, stored.tensors, aligned)
        grafted_cache = restore(states, engine.model.config, engine.model.device)
        grafted_logits = forward_tokens(engine.model, grafted_cache, tail, aligned, engine.schedule)
    else:
        # Every token has stored KV: the graft carries the next-token logits of its last chunk.
        grafted_logits = stored.tensors[NEXT_LOGITS_NAME]
    return GraftVerification(
        graft_id=manifest.id,
        kv_equal=not mismatched,
        logits_equal=sha256_tensor(fresh_logits) == sha256_tensor(grafted_logits),
        kl=kl_divergence(fresh_logits, grafted_logits),
        argmax_agree=int(fresh_logits.argmax()) == int(grafted_logits.argmax()),
        mismatched=mismatched,
        environment_differences=env_diff,
    )


@dataclass
class StoreVerification:
    """A verification pass over grafts of a store: every one chosen, checked or said why not."""

    store_grafts: int
    checked: list[GraftVerification] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    """graft id -> why it could not be checked (its model cannot be loaded here, a damaged file)"""

    @property
    def failed(self) -> list[GraftVerification]:
        return [result for result in self.checked if not result.exact]

    @property
    def exact(self) -> bool:
        return not self.failed and not self.skipped

    def to_json(self) -> dict[str, Any]:
        return {
            "exact": self.exact,
            "store_grafts": self.store_grafts,
            "checked": len(self.checked),
            "failed": [result.to_json() for result in self.failed],
            "skipped": dict(self.skipped),
        }


def choose_grafts(graft_ids: Sequence[str], sample: int | None, seed: int = 0) -> list[str]:
    """Every id, in order, or `sample` of them drawn at random (reproducibly, by `seed`).

    Args:
        graft_ids: the ids to choose from.
        sample: how many to draw; None for all of them.
        seed: seeds the draw.

    Returns:
        The chosen ids: all in order, or the sample sorted.

    Raises:
        BadInputError: `sample` below 1.
    """
    if sample is None or sample >= len(graft_ids):
        return list(graft_ids)
    if sample < 1:
        raise BadInputError(f"a sample needs at least one graft, got {sample}")
    return sorted(random.Random(seed).sample(list(graft_ids), sample))


def verify_grafts(
    engine_for: Callable[[Manifest], Engine],
    store: GraftStore,
    graft_ids: list[str],
    on_graft: Callable[[int, int], None] | None = None,
) -> StoreVerification:
    """`verify_graft` each graft with the engine `engine_for` gives for its manifest (loaded once per model, dtype
    and chunk size by the caller). A graft that cannot be checked is recorded in `skipped`, never raised.

    Args:
        engine_for: the engine to check a graft with, given its manifest.
        store: holds the grafts.
        graft_ids: the grafts to check (see `choose_grafts`).
        on_graft: called with (grafts done, grafts in all) after each graft.

    Returns:
        Every graft checked or skipped, and how many grafts the store holds.
    """
    result = StoreVerification(store_grafts=len(store.ids()))
    for done, graft_id in enumerate(graft_ids, start=1):
        try:
            engine = engine_for(store.manifest(graft_id))
            result.checked.append(verify_graft(engine, graft_id))
        except KvgraftError as exc:
            result.skipped[graft_id] = str(exc)
        if on_graft is not None:
            on_graft(done, len(graft_ids))
    return result


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index at which two token lists differ, or None when they are equal.

    Args:
        a: token ids.
        b: token ids.

    Returns:
        The first index holding different tokens; the shorter list's length when one is a proper prefix of the
        other; None when the lists are equal.
    """
    differing = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if differing is None and len(a) != len(b):
        return min(len(a), len(b))
    return differing


def verify_receipt(engine: Engine, receipt: Receipt, on_chunk: ChunkCallback | None = None) -> ReceiptVerification:
    """Rerun the receipt's generation fresh (no graft, all input tokens from position 0) and compare hashes.

    Args:
        engine: an engine with the receipt's model; its fingerprint is compared with the receipt's.
        receipt: the receipt to check.
        on_chunk: called with (tokens done, tokens in all) after each chunk of the rerun's prefill.

    Returns:
        Whether the rerun's output tokens and logits chain equal the receipt's, where they first diverge, and
        the environment differences.
    """
    with engine.graft_threads({receipt.id[:12]: receipt.fingerprint}):  # at the count the receipt's run used
        env_diff = check_fingerprint(receipt.fingerprint, engine.fingerprint, allow_environment_mismatch=True)
        rerun = engine.run_fresh(receipt.input_tokens, receipt.sampling, on_chunk=on_chunk)
    return ReceiptVerification(
        receipt_id=receipt.id,
        tokens_equal=rerun.output_tokens == receipt.output_tokens,
        logits_equal=rerun.logits_chain == receipt.logits_chain_sha256,
        first_divergence=first_divergence(receipt.output_tokens, rerun.output_tokens),
        rerun_ttft_s=rerun.ttft_s,
        environment_differences=env_diff,
        approximate=receipt.approximate,
    )


@dataclass
class CompositionError:
    """How far an approximate composition is from the exact recompute of the same concatenated tokens."""

    graft_ids: list[str]
    kl_first: float
    """KL(exact || approximate) of the first generated token's distribution."""
    argmax_agree: bool
    tokens_equal: bool
    first_divergence: int | None
    approximate_tokens: list[int]
    exact_tokens: list[int]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def measure_composition(
    engine: Engine, graft_ids: list[str], prompt: str, params: SamplingParams | None = None
) -> CompositionError:
    """Run an approximate composition and the exact fresh run over the same tokens, and compare them.

    Args:
        engine: the engine holding the grafts.
        graft_ids: the grafts, in context order.
        prompt: the text after them.
        params: sampling and `max_new_tokens` (default `SamplingParams()`).

    Returns:
        The KL divergence of the first token's distributions, whether their argmax agrees, and both outputs with
        their first divergence.
    """
    params = params or SamplingParams()
    approx = engine.generate(prompt, graft_ids=graft_ids, params=params, keep_logits=True, approximate=True)
    exact = engine.run_fresh(approx.receipt.input_tokens, params, keep_logits=True)
    a, b = approx.output_tokens, exact.output_tokens
    first_a, first_b = approx.generation.step_logits[0], exact.step_logits[0]
    composition = approx.receipt.composition
    return CompositionError(
        graft_ids=list(composition.grafts) if composition is not None else list(graft_ids),
        kl_first=kl_divergence(first_b, first_a),
        argmax_agree=int(first_a.argmax()) == int(first_b.argmax()),
        tokens_equal=a == b,
        first_divergence=first_divergence(a, b),
        approximate_tokens=list(a),
        exact_tokens=list(b),
    )
