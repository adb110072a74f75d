"""Load a model and its tokenizer: a local Hugging Face directory, a hub id (real use), or `random:<arch>[:<seed>]`.

Also the device a model runs on: `cpu` (the default), `cuda`, `cuda:N` or `mps`, parsed and checked once here
(`resolve_device`), and the dtype that goes with it when the user names none (`default_dtype`).
"""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

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
        BadInputError: an unknown dtype, device or random model; a device this machine does not have; a local path
            that is a file, or a directory that is not a causal language model with its tokenizer and weights; a hub
            model that is not a causal language model.
        NotFoundError: a local model directory that does not exist (the hub is not asked), or a hub id that does
            not load.
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


_HUB_ID_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*(/[A-Za-z0-9_][A-Za-z0-9_.-]*)?")
"""A hub id's shape: `name` or `namespace/name` (the hub's own rule, less its length and `--`/`..` limits)"""
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")
"""Any of these makes a directory one AutoTokenizer may load (the first two are what save_pretrained writes)"""
_WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")
_LOAD_ERRORS = (OSError, ValueError, RuntimeError, KeyError, SafetensorError, pickle.UnpicklingError)
"""What a malformed checkpoint makes transformers, torch or safetensors raise (a one-line message is made of it)"""


def is_local_spec(spec: str) -> bool:
    """Whether a model spec names a local path rather than a hub id.

    A path that exists is local; so is one that starts with `.`, `~` or a path separator, or that cannot be a hub
    id (`name` or `namespace/name` of letters, digits, `_`, `-` and `.`: two `/` or a backslash make a path). A
    missing `namespace/name` is a hub id, as transformers reads it.

    Args:
        spec: a model spec other than `demo` and `random:...`.

    Returns:
        True for a local path.
    """
    if spec.startswith((".", "~", "/", os.sep)) or (os.altsep is not None and spec.startswith(os.altsep)):
        return True
    if _HUB_ID_PATTERN.fullmatch(spec) is None:
        return True
    return Path(spec).exists()


def _first_line(exc: BaseException) -> str:
    """The first line of an error's message (its type's name when the message is empty)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _check_causal(spec: str, config: PretrainedConfig) -> None:
    """Refuse a config that is not a causal language model before any weight loads.

    Args:
        spec: the model spec, as the user gave it (for the message).
        config: the model's config.

    Raises:
        BadInputError: AutoModelForCausalLM has no class for the config, or the config is an encoder's (BERT and
            its kin map to a causal-LM head, but attend both ways unless `is_decoder` is set).
    """
    kind = type(config).__name__
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise BadInputError(
            f"model {spec} is not a causal language model (its config is {kind}); "
            "kvgraft needs one that AutoModelForCausalLM loads"
        )
    # Only configs of models that can be either side carry `is_decoder`; an encoder-decoder's causal-LM class
    # takes its decoder, so only a plain encoder is refused.
    if getattr(config, "is_decoder", True) is False and not getattr(config, "is_encoder_decoder", False):
        raise BadInputError(
            f"model {spec} is not a causal language model (its config is {kind}, an encoder: is_decoder is false); "
            "kvgraft needs one that AutoModelForCausalLM loads as a decoder"
        )


def _check_local_dir(spec: str, path: Path) -> None:
    """Check a local model directory from its files and config alone, before any tokenizer or weight loads.

    Args:
        spec: the model spec, as the user gave it (for the messages).
        path: the directory it names (`~` expanded).

    Raises:
        NotFoundError: the path does not exist.
        BadInputError: it is not a directory, or has no readable config.json, no tokenizer or no weights, or its
            config is not a causal language model.
    """
    if not path.exists():
        raise NotFoundError(f"model directory {spec} does not exist")
    if not path.is_dir():
        raise BadInputError(f"model {spec} is a file, not a directory; give the directory that holds config.json")
    if not (path / "config.json").is_file():
        raise BadInputError(f"model directory {spec} has no config.json; it is not a Hugging Face model directory")
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise BadInputError(f"model directory {spec} has a config.json that does not load: {_first_line(exc)}") from exc
    _check_causal(spec, config)
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise BadInputError(
            f"model directory {spec} has no tokenizer (tokenizer.json or tokenizer_config.json); "
            "save the tokenizer beside the weights"
        )
    if not any(next(path.glob(pattern), None) is not None for pattern in _WEIGHT_PATTERNS):
        raise BadInputError(f"model directory {spec} has no weights (model.safetensors or pytorch_model.bin)")


def _load_pretrained(
    spec: str, dtype: torch.dtype, attn_implementation: str | None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a local model directory or a hub id; every failure is one line that names the spec and the fault.

    Args:
        spec: a local model directory or a hub id.
        dtype: the weights' dtype.
        attn_implementation: transformers' attention implementation; None for the model's default.

    Returns:
        The model (on the CPU) and its tokenizer.

    Raises:
        NotFoundError: a local path that does not exist (the hub is never asked), or a hub id that does not load.
        BadInputError: a local path that is not a causal LM directory (see `_check_local_dir`) or whose tokenizer
            or weights do not load; a hub model that is not a causal language model.
    """
    if not spec.strip():
        raise BadInputError("model is empty; give a model directory, a hub id, random:<arch> or demo")
    if is_local_spec(spec):
        # transformers does not expand `~`; every other spelling is passed on as given (it becomes name_or_path).
        source = str(Path(spec).expanduser()) if spec.startswith("~") else spec
        _check_local_dir(spec, Path(source))
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
        except _LOAD_ERRORS as exc:
            raise BadInputError(
                f"model directory {spec} has a tokenizer that does not load: {_first_line(exc)}"
            ) from exc
        try:
            model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation=attn_implementation)
        except _LOAD_ERRORS as exc:
            raise BadInputError(f"model directory {spec} has weights that do not load: {_first_line(exc)}") from exc
        return model, tokenizer
    where = "model id (no such local directory; hub access may be offline)"
    try:
        config = AutoConfig.from_pretrained(spec)
    except (OSError, ValueError) as exc:
        raise NotFoundError(f"cannot load model {spec!r} as a {where}: {_first_line(exc)}") from exc
    _check_causal(spec, config)
    try:
        tokenizer = AutoTokenizer.from_pretrained(spec)
        model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype, attn_implementation=attn_implementation)
    except (OSError, ValueError) as exc:
        raise NotFoundError(f"cannot load model {spec!r} as a {where}: {_first_line(exc)}") from exc
    return model, tokenizer


def max_positions(model: PreTrainedModel) -> int | None:
    """The longest sequence the model's position encoding supports, when its config says."""
    config = model.config
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None
