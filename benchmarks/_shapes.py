"""Model shapes shared by the benchmarks."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, PreTrainedModel

from kvgraft.models.byte_tokenizer import BOS_ID, BYTE_VOCAB_SIZE, EOS_ID, PAD_ID
from kvgraft.models.random_models import build_random_model


def byte_llama_config(
    hidden: int, ffn: int, layers: int, heads: int, kv_heads: int, head_dim: int, max_positions: int
) -> LlamaConfig:
    """A Llama configuration of the given layer shapes with the byte vocabulary (Llama 3 rope, tied embeddings)."""
    return LlamaConfig(
        vocab_size=BYTE_VOCAB_SIZE,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        rope_theta=500000.0,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        tie_word_embeddings=True,
    )


def llama_1b_like(layers: int = 16, max_positions: int = 16384) -> PreTrainedModel:
    """Llama-3.2-1B layer shapes (hidden 2048, 32 heads, 8 KV heads of 64, FFN 8192, 16 layers) with a byte vocab."""
    config = byte_llama_config(2048, 8192, layers, 32, 8, 64, max_positions)
    return build_random_model(config, seed=0, dtype=torch.float32)
