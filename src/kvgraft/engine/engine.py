"""The engine: one loaded model, its fingerprint, its schedule and a store, with the operations on grafts.

This is the Python API the CLI and the server are thin layers over; nothing here prints.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import cached_property
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from kvgraft.core import reproducibility
from kvgraft.core.attention import use_in_place_gqa
from kvgraft.core.cache_state import LayerKind, record_kv, restore
from kvgraft.core.decode import Generation, TokenCallback, decode
from kvgraft.core.errors import (
    BadInputError,
    FormatError,
    IntegrityError,
    MissingBlockError,
    NotAChainError,
    ReproducibilityError,
)
from kvgraft.core.fingerprint import (
    Fingerprint,
    check_fingerprint,
    compute_fingerprint,
    recorded_threads,
    with_threads,
)
from kvgraft.core.hashing import BlockKey, Digest, GraftId, sha256_bytes, sha256_tensor
from kvgraft.core.sampling import SamplingParams
from kvgraft.core.schedule import DEFAULT_CHUNK_SIZE, ChunkCallback, ChunkSchedule, forward_tokens
from kvgraft.core.version import __version__
from kvgraft.engine.assembly import block_tensors, layer_entries, states_from
from kvgraft.engine.compose import chain_error, compose_approximate, is_chain
from kvgraft.format.blocks import assemble, block_digest, block_keys
from kvgraft.format.manifest import NEXT_LOGITS_NAME, BlockRef, Manifest
from kvgraft.format.metadata import with_default_summary
from kvgraft.format.receipt import Composition, CompositionMode, Receipt
from kvgraft.models.loading import DEFAULT_DEVICE, load_model, max_positions
from kvgraft.store import GraftStore, open_store
from kvgraft.store.cache import CachedStore
from kvgraft.store.redis_tier import with_shared_cache


@dataclass(frozen=True)
class BuiltGraft:
    manifest: Manifest
    tensors: dict[str, torch.Tensor]
    """The graft's own tensors (the next-token logits, when every token has KV)."""
    blocks: dict[BlockKey, dict[str, torch.Tensor]]
    """The blocks this build computed, by key; the others were already stored and were reused."""
    reused_blocks: int = 0


@dataclass(frozen=True)
class PutResult:
    id: GraftId
    tokens: int
    aligned_tokens: int
    bytes: int
    created: bool
    blocks: int = 0
    reused_blocks: int = 0
    manifest: Manifest | None = field(default=None, repr=False, compare=False)
    """The stored graft's manifest, so that callers need not read it back (not part of the JSON)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "tokens": self.tokens,
            "aligned_tokens": self.aligned_tokens,
            "bytes": self.bytes,
            "blocks": self.blocks,
            "reused_blocks": self.reused_blocks,
        }


@dataclass(frozen=True, kw_only=True)
class RestoredGraft:
    """A graft restored into a cache, ready to continue at position `manifest.aligned_tokens`."""

    manifest: Manifest
    cache: DynamicCache
    """Holds the graft's `aligned_tokens` positions."""
    next_logits: torch.Tensor | None
    """The stored next-token logits, [vocab], when every token of the graft has KV; else None."""
    environment_differences: list[str]
    load_s: float
    restore_s: float


@dataclass(frozen=True, kw_only=True)
class PreparedContext:
    """The context a generation continues, as one strategy (no graft, a graft or chain, an approximate
    composition) prepared it: a cache holding `start` positions of `input_ids`, the rest still to compute."""

    cache: DynamicCache
    input_ids: list[int]
    """Every input token: the grafts' tokens, then the prompt's."""
    prompt_tokens: int
    start: int
    environment_differences: list[str]
    first_logits: torch.Tensor | None
    """Next-token logits, [vocab], for when nothing is left to compute; None otherwise."""
    composition: Composition | None = None
    restored: RestoredGraft | None = None

    @property
    def approximate(self) -> bool:
        return self.composition is not None and self.composition.approximate


@dataclass(frozen=True, kw_only=True)
class GenerationResult:
    """A generation: its text, tokens, timings, and the receipt that commits to it."""

    text: str
    prompt_tokens: int
    output_tokens: list[int]
    graft_id: GraftId | None
    exact: bool
    stop_reason: str
    timings: dict[str, float]
    receipt: Receipt
    generation: Generation = field(repr=False)

    @property
    def approximate(self) -> bool:
        return self.receipt.approximate

    def to_json(self) -> dict[str, Any]:
        """The result's JSON object (the CLI's `generate --json`)."""
        composition = self.receipt.composition
        return {
            "text": self.text,
            "graft_id": self.graft_id,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": list(self.output_tokens),
            "exact": self.exact,
            "approximate": self.approximate,
            "composition": composition.to_json() if composition is not None else None,
            "stop_reason": self.stop_reason,
            "timings": dict(self.timings),
            "receipt_id": self.receipt.id,
        }


def _shapes(tensors: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    return {name: list(tensor.shape) for name, tensor in tensors.items()}


def _check_same(
    first: list[dict[str, torch.Tensor]],
    digests: list[Digest],
    second: list[dict[str, torch.Tensor]],
    logits: torch.Tensor | None,
    logits_again: torch.Tensor | None,
    offset: int,
) -> None:
    """Raise ReproducibilityError naming the first block (or the logits) whose two computations differ.
    `digests` are the first computation's block digests (the build stores them)."""
    for index, (a, b, digest) in enumerate(zip(first, second, digests, strict=True)):
        if block_digest(b) != digest:
            differing = sorted(name for name in a if sha256_tensor(a[name]) != sha256_tensor(b[name]))
            raise ReproducibilityError(
                f"block {offset + index} ({', '.join(differing[:4])}) differed between two computations of the "
                "same tokens; nothing was stored (this machine's arithmetic is not reproducible right now)"
            )
    if logits is not None and logits_again is not None and sha256_tensor(logits) != sha256_tensor(logits_again):
        raise ReproducibilityError(
            "the next-token logits differed between two computations of the same tokens; nothing was stored "
            "(this machine's arithmetic is not reproducible right now)"
        )


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Engine:
    """Build, store, restore, generate and verify grafts with one model.

    >>> engine = Engine.load("random:gemma4", store=".kvgraft")            # doctest: +SKIP
    >>> put = engine.put("A text worth keeping as state.")                  # doctest: +SKIP
    >>> engine.generate(" and then", graft_id=put.id).text                  # doctest: +SKIP
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        model_name: str,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        store: GraftStore | None = None,
        allow_environment_mismatch: bool = False,
    ) -> None:
        use_in_place_gqa(model)  # the same bytes as transformers' sdpa with fewer copies (kvgraft.core.attention)
        self.model = model
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.schedule = ChunkSchedule(chunk_size)
        self.store: GraftStore = store if store is not None else open_store()
        self.allow_environment_mismatch = allow_environment_mismatch

    @classmethod
    def load(
        cls,
        spec: str,
        dtype: str | None = None,
        device: str = DEFAULT_DEVICE,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        store: str | GraftStore | None = None,
        allow_environment_mismatch: bool = False,
        cache_bytes: int | None = None,
        shared_cache: str | None = None,
    ) -> Engine:
        """`shared_cache` (redis://HOST:PORT/DB) puts a Redis tier shared between processes in front of the store;
        `cache_bytes` puts an LRU of restored grafts, bounded in bytes, in front of that (this process's RAM first).
        `device` is cpu, cuda, cuda:N or mps (BadInputError for another name or one this machine lacks); `dtype`
        None is the device's default (bfloat16 on CUDA, float32 elsewhere)."""
        graft_store: GraftStore = store if store is not None and not isinstance(store, str) else open_store(store)
        graft_store = with_shared_cache(graft_store, shared_cache)  # before the model loads: a bad URL fails at once
        model, tokenizer = load_model(spec, dtype=dtype, device=device)
        if cache_bytes is not None:
            graft_store = CachedStore(graft_store, cache_bytes)
        return cls(model, tokenizer, spec, chunk_size, graft_store, allow_environment_mismatch)

    @cached_property
    def _loaded_fingerprint(self) -> Fingerprint:
        return compute_fingerprint(self.model, self.tokenizer, self.schedule.chunk_size)

    @property
    def fingerprint(self) -> Fingerprint:
        """The fingerprint of what this engine computes now: at torch's thread count in the calling OS thread."""
        return with_threads(self._loaded_fingerprint, reproducibility.current_threads())

    # --- thread counts ------------------------------------------------------------------------------------

    @contextmanager
    def graft_threads(self, fingerprints: Mapping[str, Fingerprint]) -> Iterator[None]:
        """Run the body at the thread count the grafts were made with, then go back to this thread's count.

        Any machine can run any count, so a graft made where another count was in use is continued exactly
        (bit for bit what a fresh run at that count gives) instead of being refused; the receipts and grafts
        the body makes record that count.

        Args:
            fingerprints: the grafts' fingerprints by id, in context order (empty: nothing changes).

        Raises:
            EnvironmentMismatchError: the grafts were made with different counts (unless the engine allows
                environment differences: then the last graft's count).
        """
        count = recorded_threads(fingerprints, self.allow_environment_mismatch)
        if count is None:
            yield
            return
        with reproducibility.threads(count):
            yield

    def check_graft(self, fingerprint: Fingerprint) -> list[str]:
        """Check that this engine can use a graft, once switched to the graft's thread count.

        Args:
            fingerprint: the graft's fingerprint.

        Returns:
            The environment differences allowed (empty: exact).

        Raises:
            FingerprintMismatchError: another model, tokenizer or schedule.
            EnvironmentMismatchError: another numeric environment, unless the engine allows it.
        """
        count = recorded_threads({"graft": fingerprint})
        current = self.fingerprint if count is None else with_threads(self.fingerprint, count)
        return check_fingerprint(fingerprint, current, self.allow_environment_mismatch)

    # --- tokens -------------------------------------------------------------------------------------------

    def encode_context(self, text: str) -> list[int]:
        """Tokens of a text that starts a context (with the tokenizer's BOS, if it adds one)."""
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def encode_continuation(self, text: str) -> list[int]:
        """Tokens of a text that continues a context (no BOS)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _check_length(self, n_tokens: int, what: str) -> None:
        limit = max_positions(self.model)
        if limit is not None and n_tokens > limit:
            raise BadInputError(f"{what} is {n_tokens} tokens; the model supports at most {limit} positions")

    # --- build and store ----------------------------------------------------------------------------------

    def check_text(self, text: str) -> list[int]:
        """The tokens of a graft text; raises BadInputError if it is empty or longer than the model's positions."""
        if not text.strip():
            raise BadInputError("text is empty; a graft needs some text")
        tokens = self.encode_context(text)
        self._check_length(len(tokens), "text")
        return tokens

    def build(
        self,
        text: str,
        metadata: dict[str, Any] | None = None,
        on_chunk: ChunkCallback | None = None,
        after: str | None = None,
        check: bool = False,
    ) -> BuiltGraft:
        """Compute a graft of `text`: KV of its C-aligned prefix under the schedule, plus all its token ids.

        `after` names a stored graft to continue: the new graft's tokens are that graft's tokens followed by
        `text`, so the two form one exact chain and share the parent's blocks. Leading blocks already in the store
        (a common preamble, a parent) are read and restored instead of computed, which is exact by construction.
        """
        meta = with_default_summary(metadata or {}, text)
        if after is None:
            tokens = self.check_text(text)
            return self.build_tokens(tokens, sha256_bytes(text.encode()), meta, on_chunk, check)
        parent = self.store.manifest(after)
        # At the parent's thread count: the child continues the parent's computation and shares its blocks.
        with self.graft_threads({parent.id[:12]: parent.fingerprint}):
            check_fingerprint(parent.fingerprint, self.fingerprint, self.allow_environment_mismatch)
            if not text:
                raise BadInputError("text is empty; a graft after another needs some text of its own")
            tokens = list(parent.tokens) + self.encode_continuation(text)
            self._check_length(len(tokens), "the parent graft plus text")
            meta["after"] = parent.id
            return self.build_tokens(tokens, sha256_bytes(text.encode()), meta, on_chunk, check)

    def build_tokens(
        self,
        tokens: list[int],
        source_sha256: Digest,
        metadata: dict[str, Any],
        on_chunk: ChunkCallback | None = None,
        check: bool = False,
        reuse_stored: bool = True,
    ) -> BuiltGraft:
        """`check` computes every new block (and the next-token logits) a second time and raises
        ReproducibilityError, storing nothing, if the two computations differ in any bit. `reuse_stored` False
        computes every block, even those the store has."""
        chunk = self.schedule.chunk_size
        aligned = self.schedule.aligned_length(len(tokens))
        keys = block_keys(self.fingerprint, tokens, chunk)
        keep_logits = 0 < aligned == len(tokens)
        reuse = 0
        while reuse_stored and reuse < len(keys) and self.store.has_block(keys[reuse]):
            reuse += 1
        if keep_logits:
            # The next-token logits come from the last chunk's forward: compute at least that one.
            reuse = min(reuse, len(keys) - 1)
        kinds = [LayerKind.of(layer) for layer in DynamicCache(config=self.model.config).layers]
        refs: list[BlockRef] = []
        reused: list[dict[str, torch.Tensor]] = []
        for index, key in enumerate(keys[:reuse]):
            try:
                ref, block = self.store.read_block(key)
            except (FormatError, IntegrityError):
                reuse = index  # a damaged stored block: compute it again from here; the put replaces it
                break
            refs.append(ref)
            reused.append(block)
        if any(_shapes(block) != _shapes(reused[0]) for block in reused):
            raise FormatError("stored blocks of this prefix hold different tensors; the store is inconsistent")
        computed, logits = self._compute_blocks(tokens[reuse * chunk : aligned], reused, kinds, on_chunk)
        digests = [block_digest(block) for block in computed]
        if check:
            again, logits_again = self._compute_blocks(tokens[reuse * chunk : aligned], reused, kinds, None)
            _check_same(computed, digests, again, logits, logits_again, reuse)
        refs.extend(BlockRef(key, digest) for key, digest in zip(keys[reuse:], digests, strict=True))
        by_key = dict(zip(keys[reuse:], computed, strict=True))
        first = reused[0] if reused else (computed[0] if computed else None)
        tensors: dict[str, torch.Tensor] = {}
        next_logits_sha = None
        if keep_logits:
            assert logits is not None
            tensors[NEXT_LOGITS_NAME] = logits
            next_logits_sha = sha256_tensor(logits)
        manifest = Manifest(
            tokens=tokens,
            aligned_tokens=aligned,
            chunk_size=chunk,
            dtype=self.fingerprint.model["dtype"],
            fingerprint=self.fingerprint,
            layers=layer_entries(first, kinds),
            blocks=refs,
            source_sha256=source_sha256,
            model_name=self.model_name,
            kvgraft_version=__version__,
            created_at=_now(),
            metadata=metadata,
            next_logits_sha256=next_logits_sha,
        )
        return BuiltGraft(manifest, tensors, by_key, reuse)

    def _compute_blocks(
        self,
        tokens: list[int],
        reused: list[dict[str, torch.Tensor]],
        kinds: list[LayerKind],
        on_chunk: ChunkCallback | None,
    ) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor | None]:
        """The blocks of `tokens` (a whole number of chunks) after the `reused` stored blocks, each block's
        tensors [1, kv_heads, C, head_dim], and the logits after the last token ([1, vocab]; None if no tokens)."""
        chunk = self.schedule.chunk_size
        start = len(reused) * chunk
        if reused:
            layers = layer_entries(reused[0], kinds)
            cache = restore(states_from(layers, assemble(reused), start), self.model.config, self.model.device)
        else:
            cache = DynamicCache(config=self.model.config)
        logits = None
        with record_kv(cache) as recording:
            if tokens:
                logits = forward_tokens(self.model, cache, tokens, start, self.schedule, on_chunk)
        blocks = [block_tensors(recording, i * chunk, (i + 1) * chunk) for i in range(len(tokens) // chunk)]
        return blocks, None if logits is None else logits.detach().contiguous().cpu()

    def put(
        self,
        text: str,
        metadata: dict[str, Any] | None = None,
        on_chunk: ChunkCallback | None = None,
        after: str | None = None,
        check: bool = False,
    ) -> PutResult:
        """Build and store. `check` computes each new block twice and stores nothing unless both agree in every
        bit (see `build_tokens`): about twice the compute of the blocks built."""
        built = self.build(text, metadata, on_chunk, after, check)
        try:
            graft_id, created = self.store.put(built.manifest, built.tensors, built.blocks)
        except MissingBlockError:
            # Another process removed blocks this build reused (a concurrent rm or gc): compute them all and put again.
            m = built.manifest
            with self.graft_threads({"build": m.fingerprint}):  # the count the first try used (a parent's)
                built = self.build_tokens(list(m.tokens), m.source_sha256, dict(m.metadata), on_chunk, check, False)
            graft_id, created = self.store.put(built.manifest, built.tensors, built.blocks)
        return PutResult(
            graft_id,
            len(built.manifest.tokens),
            built.manifest.aligned_tokens,
            self.store.size_bytes(graft_id),
            created,
            len(built.manifest.blocks),
            built.reused_blocks,
            built.manifest,
        )

    # --- restore and generate -----------------------------------------------------------------------------

    def restore(self, graft_id: str) -> RestoredGraft:
        """Load a graft (every tensor hash checked), check its fingerprint, and restore it into a cache.

        torch is switched to the thread count the graft was made with, in the calling OS thread, and stays there:
        the cache must be continued at that count to give what a fresh run at it gives. (`generate` switches
        back when it is done.)

        Args:
            graft_id: the graft's id, or a unique prefix of it.

        Returns:
            The graft's manifest, a cache holding its `aligned_tokens` positions, its stored next-token logits
            ([vocab], when every token has KV), the environment differences and the load and restore times.

        Raises:
            FingerprintMismatchError: the graft was built by another model, tokenizer or schedule (or another
                environment, unless the engine allows that).
        """
        t0 = time.perf_counter()
        manifest = self.store.manifest(graft_id)
        env_diff = self.check_graft(manifest.fingerprint)
        count = recorded_threads({manifest.id[:12]: manifest.fingerprint})
        if count is not None:
            reproducibility.set_threads(count)
        stored = self.store.get(manifest.id)
        t1 = time.perf_counter()
        manifest = stored.manifest
        states = states_from(manifest.layers, stored.tensors, manifest.aligned_tokens)
        cache = restore(states, self.model.config, self.model.device)
        next_logits = stored.tensors.get(NEXT_LOGITS_NAME)
        next_logits = next_logits.reshape(-1) if next_logits is not None else None
        return RestoredGraft(
            manifest=stored.manifest,
            cache=cache,
            next_logits=next_logits,
            environment_differences=env_diff,
            load_s=t1 - t0,
            restore_s=time.perf_counter() - t1,
        )

    def prefetch(self, graft_id: str) -> bool:
        """Start loading a graft likely to be asked for next (e.g. a retrieval's runner-up) into the RAM tier, in
        the background. False when there is no RAM tier (`Engine.load(..., cache_bytes=N)`) or it is there already.
        """
        return self.store.prefetch(graft_id)

    def run_fresh(
        self,
        input_tokens: list[int],
        params: SamplingParams,
        keep_logits: bool = False,
        on_chunk: ChunkCallback | None = None,
    ) -> Generation:
        """The fresh run: every input token computed from position 0 under the schedule, then decoding.

        This is what a grafted run must equal; receipts are verified against it.

        Args:
            input_tokens: every input token id (a receipt's `input_tokens`).
            params: sampling, stop strings and `max_new_tokens`.
            keep_logits: keep every step's logits ([vocab] each) in `Generation.step_logits`.
            on_chunk: called with (tokens done, tokens in all) after each chunk of the prefill.

        Returns:
            The generation: output tokens and text, logits chain, stop reason, timings.
        """
        cache = DynamicCache(config=self.model.config)
        started = time.perf_counter()
        return decode(
            self.model,
            self.tokenizer,
            self.schedule,
            cache,
            input_tokens,
            0,
            params,
            started,
            keep_logits=keep_logits,
            on_chunk=on_chunk,
        )

    def generate(
        self,
        prompt: str,
        graft_id: str | None = None,
        params: SamplingParams | None = None,
        on_chunk: ChunkCallback | None = None,
        on_token: TokenCallback | None = None,
        keep_logits: bool = False,
        graft_ids: list[str] | None = None,
        approximate: bool = False,
    ) -> GenerationResult:
        """Continue `prompt` (after the grafts' text when grafts are given) and return text, timings and a receipt.

        Several grafts (`graft_ids`, after `graft_id` if both are given) are exact when they form one chain; other
        lists are refused unless `approximate`, which re-positions them (see `kvgraft.engine.compose`) and labels the
        result and its receipt approximate.

        Args:
            prompt: the text to continue; may be empty when grafts are given.
            graft_id: a graft to continue from.
            params: sampling, stop strings and `max_new_tokens` (default `SamplingParams()`).
            on_chunk: called with (tokens done, tokens in all) after each chunk of the prefill.
            on_token: called with each output token as it is chosen.
            keep_logits: keep every step's logits ([vocab] each) in `GenerationResult.generation.step_logits`.
            graft_ids: further grafts, in context order.
            approximate: compose grafts that are not one chain by re-positioning them.

        Returns:
            The text, tokens, timings and the receipt of the run.

        Raises:
            BadInputError: an empty prompt and no graft, nothing to compute, or input plus `max_new_tokens` longer
                than the model's positions.
            NotAChainError: several grafts that are not one chain, without `approximate`.
            EnvironmentMismatchError: grafts made with different thread counts (or another numeric environment),
                unless the engine allows environment differences.
        """
        params = params or SamplingParams()
        started = time.perf_counter()
        ids = ([graft_id] if graft_id is not None else []) + list(graft_ids or [])
        manifests = [self.store.manifest(i) for i in ids]
        # The whole run at the grafts' thread count (the receipt records it), then back to this thread's count.
        with self.graft_threads({m.id[:12]: m.fingerprint for m in manifests}):
            return self._generate(prompt, manifests, params, started, on_chunk, on_token, keep_logits, approximate)

    def _generate(
        self,
        prompt: str,
        manifests: list[Manifest],
        params: SamplingParams,
        started: float,
        on_chunk: ChunkCallback | None,
        on_token: TokenCallback | None,
        keep_logits: bool,
        approximate: bool,
    ) -> GenerationResult:
        """`generate` once the thread count is settled."""
        context = self._prepare_context(prompt, manifests, approximate)
        self._check_length(len(context.input_ids) + params.max_new_tokens, "input plus max new tokens")
        generation = decode(
            self.model,
            self.tokenizer,
            self.schedule,
            context.cache,
            context.input_ids[context.start :],
            context.start,
            params,
            started,
            first_logits=context.first_logits,
            keep_logits=keep_logits,
            on_chunk=on_chunk,
            on_token=on_token,
        )
        timings = {
            "ttft_s": generation.ttft_s,
            "decode_tokens_per_s": generation.decode_tokens_per_s,
            "total_s": time.perf_counter() - started,
        }
        if context.restored is not None:
            timings |= {"graft_load_s": context.restored.load_s, "graft_restore_s": context.restored.restore_s}
        receipt = self._receipt(context, generation, params, timings)
        return GenerationResult(
            text=generation.text,
            prompt_tokens=context.prompt_tokens,
            output_tokens=generation.output_tokens,
            graft_id=receipt.graft_id,
            exact=receipt.exact,
            stop_reason=generation.stop_reason,
            timings=timings,
            receipt=receipt,
            generation=generation,
        )

    def _prepare_context(self, prompt: str, manifests: list[Manifest], approximate: bool) -> PreparedContext:
        """Pick the context strategy: the bare prompt, one graft or an exact chain, or an approximate composition."""
        if not manifests:
            return self._bare_context(prompt)
        prompt_ids = self.encode_continuation(prompt)
        if len(manifests) == 1 or is_chain(manifests):
            return self._restored_context(manifests, prompt_ids)
        if not approximate:
            raise NotAChainError(chain_error(manifests))
        return self._approximate_context(manifests, prompt_ids)

    def _bare_context(self, prompt: str) -> PreparedContext:
        """No graft: an empty cache and the prompt (with BOS), all of it to compute from position 0."""
        if not prompt:
            raise BadInputError("prompt is empty; give a prompt or a graft")
        prompt_ids = self.encode_context(prompt)
        return PreparedContext(
            cache=DynamicCache(config=self.model.config),
            input_ids=prompt_ids,
            prompt_tokens=len(prompt_ids),
            start=0,
            environment_differences=[],
            first_logits=None,
        )

    def _restored_context(self, manifests: list[Manifest], prompt_ids: list[int]) -> PreparedContext:
        """One graft, or grafts that form one chain (exact): the last one restored, its tail and the prompt to
        compute from its aligned position."""
        restored = self.restore(manifests[-1].id)
        composition = None
        if len(manifests) > 1:
            composition = Composition(mode=CompositionMode.CHAIN, grafts=tuple(m.id for m in manifests))
        return PreparedContext(
            cache=restored.cache,
            input_ids=list(restored.manifest.tokens) + prompt_ids,
            prompt_tokens=len(prompt_ids),
            start=restored.manifest.aligned_tokens,
            environment_differences=restored.environment_differences,
            first_logits=restored.next_logits,
            composition=composition,
            restored=restored,
        )

    def _approximate_context(self, manifests: list[Manifest], prompt_ids: list[int]) -> PreparedContext:
        """Grafts that are not one chain, re-positioned one after another (never exact); the prompt to compute."""
        env_diff = sorted(
            {
                d
                for m in manifests
                for d in check_fingerprint(m.fingerprint, self.fingerprint, self.allow_environment_mismatch)
            }
        )
        composed = compose_approximate(self.model, self.schedule, (self.store.get(m.id) for m in manifests))
        if not prompt_ids and composed.last_logits is None:
            raise BadInputError("an approximate composition whose last graft has no tail to compute needs a prompt")
        return PreparedContext(
            cache=composed.cache,
            input_ids=composed.tokens + prompt_ids,
            prompt_tokens=len(prompt_ids),
            start=len(composed.tokens),
            environment_differences=env_diff,
            first_logits=composed.last_logits,
            composition=Composition(
                mode=CompositionMode.APPROXIMATE,
                grafts=tuple(m.id for m in manifests),
                offsets=composed.offsets,
            ),
        )

    def _receipt(
        self, context: PreparedContext, generation: Generation, params: SamplingParams, timings: dict[str, float]
    ) -> Receipt:
        """The receipt of a generation in `context`: exact unless the environment differs or it is approximate."""
        return Receipt(
            fingerprint=self.fingerprint,
            model_name=self.model_name,
            graft_id=context.restored.manifest.id if context.restored else None,
            graft_aligned_tokens=context.start,
            input_tokens=context.input_ids,
            output_tokens=generation.output_tokens,
            logits_chain_sha256=generation.logits_chain,
            sampling=params,
            exact=not context.environment_differences and not context.approximate,
            environment_differences=context.environment_differences,
            created_at=_now(),
            timings=timings,
            composition=context.composition,
        )
