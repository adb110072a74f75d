"""Tiny models with fixed-seed random weights, one per supported architecture, built in seconds with no download.

They exist so that every code path (full, sliding and KV-shared cache layers) is exercised in tests and
benchmarks. The windows of the sliding layers (32 tokens) are shorter than the test prompts on purpose.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    Gemma4TextConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
)

from kvgraft.models.byte_tokenizer import BOS_ID, BYTE_VOCAB_SIZE, EOS_ID, PAD_ID

SLIDING_WINDOW = 32
MAX_POSITIONS = 4096

_COMMON: dict[str, Any] = {
    "vocab_size": BYTE_VOCAB_SIZE,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": MAX_POSITIONS,
    "pad_token_id": PAD_ID,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
}
_MIXED = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def _llama() -> PretrainedConfig:
    return LlamaConfig(**_COMMON, num_hidden_layers=4, head_dim=64)


def _mistral() -> PretrainedConfig:
    # Mistral's own default: a sliding window on every layer.
    return MistralConfig(**_COMMON, num_hidden_layers=4, head_dim=64, sliding_window=SLIDING_WINDOW)


def _qwen2() -> PretrainedConfig:
    return Qwen2Config(**_COMMON, num_hidden_layers=4)


def _qwen3() -> PretrainedConfig:
    return Qwen3Config(**_COMMON, num_hidden_layers=4, head_dim=64)


def _gemma2() -> PretrainedConfig:
    return Gemma2Config(
        **_COMMON, num_hidden_layers=4, head_dim=64, sliding_window=SLIDING_WINDOW, layer_types=list(_MIXED)
    )


def _gemma3() -> PretrainedConfig:
    return Gemma3TextConfig(
        **_COMMON, num_hidden_layers=4, head_dim=64, sliding_window=SLIDING_WINDOW, layer_types=list(_MIXED)
    )


def _gemma4() -> PretrainedConfig:
    # Six layers, the last two KV-shared (they read the cache of the last sliding and the last full layer).
    layer_types = [*_MIXED, "sliding_attention", "full_attention"]
    return Gemma4TextConfig(  # type: ignore[call-arg]  # global_head_dim is popped from kwargs in __post_init__
        **_COMMON,
        num_hidden_layers=6,
        head_dim=64,
        global_head_dim=64,
        sliding_window=SLIDING_WINDOW,
        layer_types=layer_types,
        num_kv_shared_layers=2,
        vocab_size_per_layer_input=BYTE_VOCAB_SIZE,
        hidden_size_per_layer_input=64,
    )


def _gpt2() -> PretrainedConfig:
    return GPT2Config(
        vocab_size=BYTE_VOCAB_SIZE,
        n_embd=256,
        n_layer=4,
        n_head=4,
        n_positions=MAX_POSITIONS,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )


RANDOM_ARCHS = {
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "gemma4": _gemma4,
    "gpt2": _gpt2,
}


def random_config(arch: str) -> PretrainedConfig:
    return RANDOM_ARCHS[arch]()


def build_random_model(config: PretrainedConfig, seed: int, dtype: torch.dtype) -> PreTrainedModel:
    """Weights drawn in float32 from a generator seeded with `seed`, then cast: the same seed gives the same bytes."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.to(dtype).eval()
