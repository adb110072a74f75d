"""What makes a graft's bytes what they are, and the check that a run may use a graft exactly.

A fingerprint has three parts:
- `model`: weights, config, tokenizer, dtype and attention implementation. Any difference: refused.
- `schedule`: the chunk size C. Any difference: refused (KV bytes depend on it).
- `environment`: torch / transformers / MKL / oneDNN versions, CPU capability, thread count, the reproducibility
  settings in force (MKL's CNR mode, MKL's and OpenMP's dynamic threading: see kvgraft.core.reproducibility),
  device; on a CUDA device also the GPU's name, the CUDA and cuDNN versions and the CUDA reproducibility switches
  (deterministic algorithms, cuBLAS workspace, TF32, cuDNN, the SDPA backends allowed). These change the last
  bits of floating-point results; a difference is refused unless the caller overrides it, and then the result is
  reported as not exact. A graft made on one device is thus refused on another (`device` differs). CPU
  fingerprints hold no CUDA entry, so the grafts made before devices existed stay valid.

The thread count is the one environment entry any machine can match: a run that uses a graft switches torch to
the graft's count (`recorded_threads` finds it; the engine switches) and then compares fingerprints as usual.
"""

from __future__ import annotations

import json
import re
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
import transformers
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from kvgraft.core import reproducibility
from kvgraft.core.attention import bytes_family
from kvgraft.core.errors import EnvironmentMismatchError, FingerprintMismatchError
from kvgraft.core.hashing import Sha256Hex, sha256_json, sha256_tensor

# Keys of config.to_dict() that name or describe a checkout rather than define the computation.
_VOLATILE_CONFIG_KEYS = {"transformers_version", "_name_or_path", "dtype", "torch_dtype", "_commit_hash"}
MODEL_KEYS = ("weights_sha256", "config_sha256", "tokenizer_sha256", "dtype", "attn_implementation")
THREADS_KEY = "threads"
"""The environment entry holding torch's thread count."""
_weights_cache: weakref.WeakKeyDictionary[PreTrainedModel, Sha256Hex] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Fingerprint:
    model: dict[str, str]
    schedule: dict[str, int]
    environment: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"model": dict(self.model), "schedule": dict(self.schedule), "environment": dict(self.environment)}

    @property
    def digest(self) -> Sha256Hex:
        """SHA-256 of the canonical fingerprint: what block keys commit to and servers report."""
        return sha256_json(self.to_json())

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Fingerprint:
        """Parse and type-check; raises KeyError, TypeError or ValueError on a malformed fingerprint."""
        model = {str(k): str(v) for k, v in dict(data["model"]).items()}
        missing = sorted(set(MODEL_KEYS) - set(model))
        if missing:
            raise KeyError(f"fingerprint.model lacks {', '.join(missing)}")
        chunk_size = data["schedule"]["chunk_size"]
        if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
            raise ValueError(f"fingerprint.schedule.chunk_size must be a positive integer, got {chunk_size!r}")
        return cls(model=model, schedule={"chunk_size": chunk_size}, environment=dict(data["environment"]))


def weights_sha256(model: PreTrainedModel) -> Sha256Hex:
    """SHA-256 of the canonical JSON list [[name, dtype, shape, sha256(raw bytes)], ...] sorted by name.

    Computed once per model object (a 1B-parameter model takes a few seconds).
    """
    cached = _weights_cache.get(model)
    if cached is not None:
        return cached
    entries = [
        [name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), sha256_tensor(tensor)]
        for name, tensor in sorted(model.state_dict().items())
    ]
    digest = sha256_json(entries)
    _weights_cache[model] = digest
    return digest


def config_sha256(config: PretrainedConfig) -> Sha256Hex:
    data = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS and not k.startswith("_")}
    return sha256_json(json.loads(json.dumps(data, default=str)))


def tokenizer_sha256(tokenizer: PreTrainedTokenizerBase) -> Sha256Hex:
    """Hash of the tokenizer's full definition (fast tokenizers) or its vocabulary, plus special tokens and template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    definition: Any = json.loads(backend.to_str()) if backend is not None else sorted(tokenizer.get_vocab().items())
    return sha256_json(
        {
            "definition": definition,
            "special_tokens": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
            "chat_template": getattr(tokenizer, "chat_template", None),
        }
    )


def model_identity(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> dict[str, str]:
    return {
        "weights_sha256": weights_sha256(model),
        "config_sha256": config_sha256(model.config),
        "tokenizer_sha256": tokenizer_sha256(tokenizer),
        "dtype": str(model.dtype).removeprefix("torch."),
        "attn_implementation": bytes_family(str(model.config._attn_implementation)),
    }


def _library_version(pattern: str) -> str:
    match = re.search(pattern, torch.__config__.show())
    return match.group(1).strip() if match else "none"


def numeric_environment(device: torch.device) -> dict[str, Any]:
    """The environment part of a fingerprint for a model on `device`.

    Args:
        device: the model's device.

    Returns:
        The entries; on CUDA, `cuda_environment`'s too.
    """
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "mkl": _library_version(r"Math Kernel Library Version ([^\n]+?) for"),
        "onednn": _library_version(r"MKL-DNN (v[0-9.]+)"),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        THREADS_KEY: torch.get_num_threads(),
        **reproducibility.settings(),
        "device": device.type,
    }
    if device.type == "cuda":
        env.update(
            cuda_environment(
                torch.cuda.get_device_name(device),
                torch.version.cuda,
                torch.backends.cudnn.version(),
                reproducibility.cuda_settings(),
            )
        )
    return env


def cuda_environment(
    device_name: str, cuda: str | None, cudnn: int | None, settings: reproducibility.CudaSettings
) -> dict[str, Any]:
    """The entries a CUDA device adds to the environment (the facts are arguments, so any machine can check them).

    Args:
        device_name: the GPU's name (`torch.cuda.get_device_name`).
        cuda: the CUDA version torch was built with.
        cudnn: cuDNN's version number, None without cuDNN.
        settings: the reproducibility switches in force (`reproducibility.cuda_settings()`).

    Returns:
        `device_name`, `cuda`, `cudnn` and each of `settings.to_json()`'s entries.
    """
    return {"device_name": device_name, "cuda": cuda, "cudnn": cudnn, **settings.to_json()}


def compute_fingerprint(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, chunk_size: int) -> Fingerprint:
    return Fingerprint(
        model=model_identity(model, tokenizer),
        schedule={"chunk_size": chunk_size},
        environment=numeric_environment(model.device),
    )


def with_threads(fingerprint: Fingerprint, threads: int) -> Fingerprint:
    """The same fingerprint with another thread count (what this run computes once switched to it).

    Args:
        fingerprint: a fingerprint.
        threads: the thread count to record.

    Returns:
        A copy whose `environment["threads"]` is `threads`.
    """
    return replace(fingerprint, environment={**fingerprint.environment, THREADS_KEY: threads})


def recorded_threads(fingerprints: Mapping[str, Fingerprint], allow_environment_mismatch: bool = False) -> int | None:
    """The thread count a run must use to continue these grafts exactly.

    Args:
        fingerprints: each graft's fingerprint by the name the user knows it by (its id), in context order.
        allow_environment_mismatch: with grafts of different counts, take the last graft's count instead of
            refusing (the others then differ from the run, and the check reports them as not exact).

    Returns:
        The count the grafts record; None when there is no graft, or none records a usable count (the check
        then compares the environments as they are).

    Raises:
        EnvironmentMismatchError: the grafts record different thread counts.
    """
    counts = {
        name: value
        for name, fp in fingerprints.items()
        if isinstance(value := fp.environment.get(THREADS_KEY), int) and not isinstance(value, bool) and value > 0
    }
    if not counts:
        return None
    if len(set(counts.values())) > 1 and not allow_environment_mismatch:
        listed = ", ".join(f"{name} {count}" for name, count in counts.items())
        raise EnvironmentMismatchError(
            f"the grafts were made with different thread counts ({listed}); one run computes with one count, so "
            "they cannot be used together exactly"
        )
    return list(counts.values())[-1]


def _differences(stored: dict[str, Any], current: dict[str, Any]) -> list[str]:
    keys = sorted(set(stored) | set(current))
    return [f"{k} {stored.get(k)!r} vs {current.get(k)!r}" for k in keys if stored.get(k) != current.get(k)]


def check_fingerprint(stored: Fingerprint, current: Fingerprint, allow_environment_mismatch: bool = False) -> list[str]:
    """Raise if the graft cannot be used by this run; return the environment differences that were allowed.

    An empty list means the run is exact.
    """
    model_diff = _differences(stored.model, current.model) + _differences(stored.schedule, current.schedule)
    if model_diff:
        raise FingerprintMismatchError(
            "graft was built for another model or schedule (graft vs this run: " + "; ".join(model_diff) + ")"
        )
    env_diff = _differences(stored.environment, current.environment)
    if env_diff and not allow_environment_mismatch:
        late = current.environment.get("mkl_cbwr") == "OFF" and stored.environment.get("mkl_cbwr") not in (None, "OFF")
        hint = " (import kvgraft before torch computes anything, so that MKL starts in CNR mode)" if late else ""
        made_on, run_on = stored.environment.get("device"), current.environment.get("device")
        if made_on != run_on and isinstance(made_on, str):
            hint = f" (the graft was made on {made_on}, this run is on {run_on}: run on {made_on} to use it exactly)"
        raise EnvironmentMismatchError(
            "numeric environment differs (graft vs this run: "
            + "; ".join(env_diff)
            + f"){hint}; exactness is not guaranteed under another environment"
        )
    return env_diff
