"""kvgraft: byte-exact KV-cache grafts for frozen language models."""

__version__ = "0.1.0"

# Before anything below imports torch and computes: MKL and OpenMP read their reproducibility settings once.
from kvgraft.reproducibility import configure as _configure_reproducibility

_configure_reproducibility()

from kvgraft.engine import Engine, GenerationResult, PutResult  # noqa: E402
from kvgraft.errors import KvgraftError  # noqa: E402
from kvgraft.models.loading import load_model  # noqa: E402
from kvgraft.receipt import Receipt, SamplingParams  # noqa: E402

__all__ = [
    "Engine",
    "GenerationResult",
    "KvgraftError",
    "PutResult",
    "Receipt",
    "SamplingParams",
    "__version__",
    "load_model",
]
