"""The exactness contract: build -> store -> load -> continue equals the fresh run, bit for bit.

Parametrized over every random architecture and both dtypes, for graft lengths that are and are not multiples
of C, and longer than the sliding window (32) of the mistral and gemma models.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvgraft.core.hashing import sha256_tensor
from kvgraft.core.sampling import SamplingParams
from kvgraft.core.schedule import forward_tokens
from kvgraft.engine.engine import Engine
from kvgraft.engine.verify import verify_graft, verify_receipt
from kvgraft.models.random_models import RANDOM_ARCHS

from conftest import TEST_CHUNK, EngineFactory

# Byte tokenizer: len(text) + 1 (BOS) tokens. 48 = 3C (a multiple of C: the graft stores next-token logits),
# 81 = 5C + 1, 260 = 16C + 4; all but 48 are longer than the sliding window (32). On AVX2 CPUs an unscheduled
# prefill of 256 tokens already differs in its bits from the chunked one, so these lengths make the schedule matter.
LENGTHS = [48, 81, 260]


def _text(n_tokens: int) -> str:
    base = "The state of a model after reading, kept and restored exactly. "
    return (base * 5)[: n_tokens - 1]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", list(RANDOM_ARCHS))
def test_grafted_generation_equals_fresh_run(make_engine: EngineFactory, arch: str, dtype: str) -> None:
    engine = make_engine(f"random:{arch}", dtype)
    params = SamplingParams(max_new_tokens=6)
    for n in LENGTHS:
        put = engine.put(_text(n))
        assert put.tokens == n
        assert put.aligned_tokens == (n // TEST_CHUNK) * TEST_CHUNK
        grafted = engine.generate(" and then", graft_id=put.id, params=params, keep_logits=True)
        # The fresh run: no graft, every input token from position 0 under the same schedule.
        fresh = engine.run_fresh(grafted.receipt.input_tokens, params, keep_logits=True)
        assert fresh.output_tokens == grafted.output_tokens
        assert [sha256_tensor(x) for x in fresh.step_logits] == [
            sha256_tensor(x) for x in grafted.generation.step_logits
        ]
        assert fresh.logits_chain == grafted.receipt.logits_chain_sha256
        assert verify_receipt(engine, grafted.receipt).exact


@pytest.mark.parametrize("arch", ["llama", "gemma4"])
def test_verify_recomputes_every_tensor_hash(make_engine: EngineFactory, arch: str) -> None:
    engine = make_engine(f"random:{arch}")
    put = engine.put(_text(260))
    result = verify_graft(engine, put.id)
    assert (result.exact, result.kv_equal, result.logits_equal, result.kl, result.argmax_agree) == (
        True,
        True,
        True,
        0.0,
        True,
    )


def test_sampling_is_reproduced_from_the_seed(make_engine: EngineFactory) -> None:
    engine = make_engine("random:qwen3")
    put = engine.put(_text(81))
    params = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=7)
    first = engine.generate(" x", graft_id=put.id, params=params)
    again = engine.generate(" x", graft_id=put.id, params=params)
    other = engine.generate(" x", graft_id=put.id, params=SamplingParams(max_new_tokens=12, temperature=1.0, seed=8))
    assert first.output_tokens == again.output_tokens
    assert first.output_tokens != other.output_tokens
    assert verify_receipt(engine, first.receipt).exact


def _scheduled_key_hashes(engine: Engine, tokens: list[int]) -> list[str]:
    cache = DynamicCache(config=engine.model.config)
    forward_tokens(engine.model, cache, tokens, 0, engine.schedule)
    return [sha256_tensor(layer.keys) for layer in cache.layers if getattr(layer, "keys", None) is not None]


@pytest.mark.parametrize("arch", ["llama", "gemma4"])
def test_the_hash_check_sees_a_one_ulp_change(make_engine: EngineFactory, arch: str) -> None:
    """The control that shows the exactness tests can fail, on any CPU: nudging every weight of the first layer's key
    projection by one ULP changes the bits of the KV the schedule computes, and the hashes see it.

    (An unscheduled one-shot prefill is no control: whether its bits differ from the chunked ones depends on the
    CPU's kernels. They differ on AVX2 machines and were equal on an AVX512 one; README, "The exactness contract".)
    """
    engine = make_engine(f"random:{arch}")
    tokens = engine.encode_context(_text(260))[:256]
    before = _scheduled_key_hashes(engine, tokens)
    weight = next(p for name, p in engine.model.named_parameters() if name.endswith("k_proj.weight"))
    saved = weight.detach().clone()
    with torch.no_grad():
        weight.copy_(torch.nextafter(weight, torch.full_like(weight, float("inf"))))
    try:
        nudged = _scheduled_key_hashes(engine, tokens)
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    assert len(before) == len(nudged) > 0
    assert nudged != before
    assert _scheduled_key_hashes(engine, tokens) == before  # the weight restored, the same bits again
