"""kvgraft_sdpa computes transformers' sdpa bytes, bit for bit, without copying grouped key/value heads."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.integrations import sdpa_attention

from kvgraft.core.attention import FAST_SDPA, bytes_family, gqa_sdpa_forward, use_in_place_gqa
from kvgraft.core.hashing import sha256_tensor
from kvgraft.core.schedule import ChunkSchedule, forward_tokens
from kvgraft.engine.engine import Engine
from kvgraft.models.loading import load_model
from kvgraft.models.random_models import RANDOM_ARCHS
from kvgraft.store import LocalStore


def _run(model: PreTrainedModel, tokens: list[int]) -> list[str]:
    """Logits of a chunked prompt (C=16, partial last chunk), three decode steps, then every cached tensor,
    as SHA-256 digests of their bytes."""
    cache = DynamicCache(config=model.config)
    out = [sha256_tensor(forward_tokens(model, cache, tokens, 0, ChunkSchedule(16)))]
    for step in range(3):
        out.append(sha256_tensor(forward_tokens(model, cache, [7 + step], len(tokens) + step, ChunkSchedule(1))))
    for layer in cache.layers:
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(tensor, torch.Tensor):
                out.append(sha256_tensor(tensor))
    return out


@pytest.mark.parametrize(("arch", "dtype"), itertools.product(sorted(RANDOM_ARCHS), ["float32", "bfloat16"]))
def test_same_bytes_as_sdpa_on_every_architecture(arch: str, dtype: str) -> None:
    model, _ = load_model(f"random:{arch}", dtype=dtype)
    tokens = [(i * 37) % 200 + 3 for i in range(45)]
    plain = _run(model, tokens)
    use_in_place_gqa(model)
    fast = _run(model, tokens)
    assert str(model.config._attn_implementation) in {FAST_SDPA, "eager"}
    assert fast == plain


def test_prompt_chunks_after_a_cache_read_grouped_heads_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = load_model("random:llama")
    tokens = list(range(3, 43))
    plain = _run(model, tokens)
    use_in_place_gqa(model)

    def refuse(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("repeat_kv was called")

    monkeypatch.setattr(sdpa_attention, "repeat_kv", refuse)
    assert _run(model, tokens) == plain


@pytest.mark.parametrize(
    ("dtype", "heads", "q_len", "kv_len", "threads"),
    itertools.product([torch.float32, torch.bfloat16], [(8, 2), (8, 1)], [2, 24], [24, 130], [1, 2]),
)
def test_kernel_matches_repeated_heads(
    dtype: torch.dtype, heads: tuple[int, int], q_len: int, kv_len: int, threads: int
) -> None:
    query_heads, kv_heads = heads
    generator = torch.Generator().manual_seed(q_len * kv_len)
    query = torch.randn(1, query_heads, q_len, 64, generator=generator).to(dtype)
    key = torch.randn(1, kv_heads, kv_len, 64, generator=generator).to(dtype)
    value = torch.randn(1, kv_heads, kv_len, 64, generator=generator).to(dtype)
    mask = (torch.arange(q_len)[:, None] + kv_len - q_len >= torch.arange(kv_len)[None, :])[None, None]
    module = torch.nn.Module()
    module.num_key_value_groups = query_heads // kv_heads  # type: ignore[assignment]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        expected, _ = sdpa_attention.sdpa_attention_forward(module, query, key, value, mask, scaling=0.125)
        got, _ = gqa_sdpa_forward(module, query, key, value, mask, scaling=0.125)
    finally:
        torch.set_num_threads(before)
    assert got.shape == (1, q_len, query_heads, 64)
    assert torch.equal(got, expected)


def test_engine_runs_kvgraft_sdpa_and_its_grafts_say_sdpa(tmp_path: Path) -> None:
    model, tokenizer = load_model("random:qwen2")
    engine = Engine(model, tokenizer, "random:qwen2", store=LocalStore(tmp_path))
    assert model.config._attn_implementation == FAST_SDPA
    assert engine.fingerprint.model["attn_implementation"] == "sdpa"


def test_other_implementations_stay() -> None:
    model, _ = load_model("random:llama", attn_implementation="eager")
    use_in_place_gqa(model)
    assert model.config._attn_implementation == "eager"
    assert bytes_family("eager") == "eager"
    assert bytes_family(FAST_SDPA) == "sdpa"
