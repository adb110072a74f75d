"""Load a model and its tokenizer: a local Hugging Face directory, a hub id (real use), or `random:<arch>[:<seed>]`.

Also the device a model runs on: `cpu` (the default), `cuda`, `cuda:N` or `mps`, parsed and checked once here
(`resolve_device`), and the dtype that goes with it when the user names none (`default_dtype`).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from kvgraft.core import reproducibility
from kvgraft.core.errors import BadInputError, NotFoundError
from kvgraft.models.byte_tokenizer import build_byte_tokenizer
from kvgraft.models.random_models import RANDOM_ARCHS, build_random_model, random_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_DTYPE = "float32"
"""The dtype on the CPU (and on mps) when the user names none."""
CUDA_DTYPE = "bfloat16"
"""The dtype on a CUDA device when the user names none: what GPU checkpoints are made and served in."""
DEFAULT_DEVICE = "cpu"
DEVICES_HELP = "cpu, cuda, cuda:N or mps"
_DEVICE_PATTERN = re.compile(r"(cpu|mps|cuda)(?::(\d{1,4}))?")


def parse_device(name: str) -> torch.device:
    """The device a name means, checked for its spelling only (not whether this machine has it).

    Args:
        name: `cpu`, `cuda`, `cuda:N` or `mps` (case and surrounding spaces ignored).

    Returns:
        The torch device; `cuda` is `cuda:0`.

    Raises:
        BadInputError: any other name (`cpu:1`, `mps:1`, `xpu`, ...).
    """
    match = _DEVICE_PATTERN.fullmatch(name.strip().lower())
    if match is None or (match.group(2) is not None and match.group(1) != "cuda"):
        raise BadInputError(f"unknown device {name!r}; use {DEVICES_HELP}")
    if match.group(1) == "cuda":
        return torch.device("cuda", int(match.group(2) or 0))
    return torch.device(match.group(1))


def check_device(device: torch.device, cuda_built: bool, cuda_devices: int, mps_available: bool) -> None:
    """Refuse a device this machine does not have, in one line that says what it has.

    The machine's facts are arguments so that every answer can be checked on any machine; `resolve_device`
    passes this machine's.

    Args:
        device: a device from `parse_device`.
        cuda_built: whether this torch was built with CUDA.
        cuda_devices: how many CUDA devices torch sees.
        mps_available: whether torch can use Apple's MPS here.

    Raises:
        BadInputError: the device is not on this machine.
    """
    if device.type == "cuda":
        if not cuda_built or cuda_devices == 0:
            why = "built without CUDA" if not cuda_built else "no GPU found"
            raise BadInputError(f"CUDA is not available on this machine (torch {torch.__version__}, {why})")
        index = device.index or 0
        if index >= cuda_devices:
            last = cuda_devices - 1
            have = "1 CUDA device (cuda:0)" if last == 0 else f"{cuda_devices} CUDA devices (cuda:0 to cuda:{last})"
            raise BadInputError(f"no device cuda:{index}: this machine has {have}")
    elif device.type == "mps" and not mps_available:
        raise BadInputError(
            f"MPS is not available on this machine (torch {torch.__version__}; MPS needs Apple silicon and macOS)"
        )


def resolve_device(name: str | torch.device) -> torch.device:
    """Parse a device name, check this machine has it, and make a CUDA device's arithmetic repeatable.

    Args:
        name: `cpu`, `cuda`, `cuda:N`, `mps`, or a torch device.

    Returns:
        The device. For CUDA, `reproducibility.configure_cuda()` has run (before the model reaches the GPU).

    Raises:
        BadInputError: an unknown name, or a device this machine does not have.
    """
    device = parse_device(str(name))
    if device.type != "cpu":
        # Only now: asking torch about CUDA on a machine without it costs nothing, but starts nothing either.
        check_device(
            device,
            cuda_built=torch.version.cuda is not None,
            cuda_devices=torch.cuda.device_count() if torch.version.cuda is not None else 0,
            mps_available=bool(torch.backends.mps.is_available()),
        )
    if device.type == "cuda":
        reproducibility.configure_cuda()
    return device


def default_dtype(device: torch.device | str) -> str:
    """The dtype a model runs in when the user names none: bfloat16 on CUDA, float32 on the CPU and on mps.

    Args:
        device: the model's device (or its name).

    Returns:
        A name of `DTYPES`.
    """
    kind = device.type if isinstance(device, torch.device) else parse_device(device).type
    return CUDA_DTYPE if kind == "cuda" else DEFAULT_DTYPE


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise BadInputError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}") from None


def load_model(
    spec: str,
    dtype: str | None = None,
    device: str | torch.device = DEFAULT_DEVICE,
    attn_implementation: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Returns (model in eval mode on `device`, tokenizer).

    Args:
        spec: `demo` (the small Gemma 4 model kvgraft trains and ships), `random:<arch>` or
            `random:<arch>:<seed>` (arch: llama, mistral, qwen2, qwen3, gemma2, gemma3, gemma4, gpt2; seed
            defaults to 0), a local model directory, or a hub id (needs network or a warm HF cache).
        dtype: a name of `DTYPES`; None for `default_dtype(device)`.
        device: `cpu`, `cuda`, `cuda:N` or `mps` (checked by `resolve_device` before anything loads).
        attn_implementation: transformers' attention implementation; None for the model's default.

    Returns:
        The model and its tokenizer.

    Raises:
        BadInputError: an unknown dtype, device or random model; a device this machine does not have.
        NotFoundError: a model directory or hub id that does not load.
    """
    torch_device = resolve_device(device)
    torch_dtype = parse_dtype(dtype if dtype else default_dtype(torch_device))
    if spec == "demo":
        from kvgraft.models.demo_model import load_demo_model

        model, tokenizer = load_demo_model(torch_dtype)
    elif spec.startswith("random:"):
        model, tokenizer = _load_random(spec, torch_dtype)
        if attn_implementation is not None:
            model.set_attn_implementation(attn_implementation)
    else:
        model, tokenizer = _load_pretrained(spec, torch_dtype, attn_implementation)
    return model.to(torch_device).eval(), tokenizer  # type: ignore[arg-type]  # transformers' decorator hides `to`


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
