"""The demo model: a small Gemma 4 decoder kvgraft trains (scripts/train_demo_model.py) and ships.

Its weights lie inside the package with their SHA-256, so `--model demo` loads offline and the bytes are
checked before use. It reads and writes the problem family of `kvgraft.flywheel.problems` with the byte tokenizer.
"""

from __future__ import annotations

import hashlib
import json
from importlib import resources
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Gemma4TextConfig, PreTrainedModel, PreTrainedTokenizerBase

from kvgraft.core.errors import IntegrityError, NotFoundError
from kvgraft.models.byte_tokenizer import BOS_ID, BYTE_VOCAB_SIZE, EOS_ID, PAD_ID, build_byte_tokenizer

WEIGHTS_FILE = "model.safetensors"
SHA_FILE = "model.sha256"
CONTEXT = 1024


def demo_config() -> Gemma4TextConfig:
    """Hidden 128, four layers (sliding, full, sliding, full; window 128), 4 heads of 32, 2 KV heads, FFN 512."""
    return Gemma4TextConfig(  # type: ignore[call-arg]  # global_head_dim is popped in __post_init__
        vocab_size=BYTE_VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        global_head_dim=32,
        sliding_window=128,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        max_position_embeddings=CONTEXT,
        vocab_size_per_layer_input=BYTE_VOCAB_SIZE,
        hidden_size_per_layer_input=16,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        tie_word_embeddings=True,
    )


def _data_dir() -> Any:
    return resources.files("kvgraft").joinpath("data/demo_model")


def demo_weights_sha256() -> str:
    """The SHA-256 the package records for the shipped weights file."""
    return _data_dir().joinpath(SHA_FILE).read_text().split()[0]


def load_demo_model(dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    weights = _data_dir().joinpath(WEIGHTS_FILE)
    if not weights.is_file():
        raise NotFoundError("the demo model's weights are not in this install; run scripts/train_demo_model.py")
    raw = weights.read_bytes()
    if hashlib.sha256(raw).hexdigest() != demo_weights_sha256():
        raise IntegrityError(f"{weights}: demo weights do not match their recorded SHA-256; reinstall kvgraft")
    with resources.as_file(weights) as path:
        state = load_file(str(path))
    model = AutoModelForCausalLM.from_config(demo_config(), dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or any(not name.endswith("lm_head.weight") for name in missing):
        raise IntegrityError(f"demo weights do not fit the demo config (missing {missing}, unexpected {unexpected})")
    model.tie_weights()
    model.config.name_or_path = "demo"
    return model.to(dtype).eval(), build_byte_tokenizer()


def describe() -> dict[str, Any]:
    """Size facts of the demo model, for reports."""
    meta = _data_dir().joinpath("training.json")
    return json.loads(meta.read_text()) if meta.is_file() else {}
