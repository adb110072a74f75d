"""Load a model and its tokenizer: a local Hugging Face directory, a hub id (real use), or `random:<arch>[:<seed>]`."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from kvgraft.core.errors import BadInputError, NotFoundError
from kvgraft.models.byte_tokenizer import build_byte_tokenizer
from kvgraft.models.random_models import RANDOM_ARCHS, build_random_model, random_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_DTYPE = "float32"


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise BadInputError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}") from None


def load_model(
    spec: str,
    dtype: str = DEFAULT_DTYPE,
    device: str = "cpu",
    attn_implementation: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Returns (model in eval mode, tokenizer).

    `spec` is `demo` (the small Gemma 4 model kvgraft trains and ships), `random:<arch>` or
    `random:<arch>:<seed>` (arch: llama, mistral, qwen2, qwen3, gemma2, gemma3, gemma4, gpt2; seed defaults to
    0), a local model directory, or a hub id (needs network or a warm HF cache).
    """
    torch_dtype = parse_dtype(dtype)
    if spec == "demo":
        from kvgraft.models.demo_model import load_demo_model

        model, tokenizer = load_demo_model(torch_dtype)
    elif spec.startswith("random:"):
        model, tokenizer = _load_random(spec, torch_dtype)
        if attn_implementation is not None:
            model.set_attn_implementation(attn_implementation)
    else:
        model, tokenizer = _load_pretrained(spec, torch_dtype, attn_implementation)
    return model.to(device).eval(), tokenizer  # type: ignore[arg-type]  # transformers' decorator hides `to`


def _load_random(spec: str, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    parts = spec.split(":")
    arch = parts[1] if len(parts) > 1 else ""
    if arch not in RANDOM_ARCHS or len(parts) > 3:
        raise BadInputError(
            f"unknown model {spec!r}; random models are random:<arch>[:<seed>], arch one of {', '.join(RANDOM_ARCHS)}"
        )
    try:
        seed = int(parts[2]) if len(parts) == 3 else 0
    except ValueError:
        raise BadInputError(f"seed in {spec!r} must be an integer") from None
    model = build_random_model(random_config(arch), seed, dtype)
    model.config.name_or_path = spec
    return model, build_byte_tokenizer()


def _load_pretrained(
    spec: str, dtype: torch.dtype, attn_implementation: str | None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    try:
        tokenizer = AutoTokenizer.from_pretrained(spec)
        model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype, attn_implementation=attn_implementation)
    except (OSError, ValueError) as exc:
        where = "directory" if Path(spec).exists() else "model id (no such local directory; hub access may be offline)"
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise NotFoundError(f"cannot load model {spec!r} as a {where}: {first_line}") from exc
    return model, tokenizer


def max_positions(model: PreTrainedModel) -> int | None:
    """The longest sequence the model's position encoding supports, when its config says."""
    config = model.config
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None
