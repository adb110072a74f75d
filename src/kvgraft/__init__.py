"""kvgraft: byte-exact KV-cache grafts for frozen language models."""

# Before anything below imports torch and computes: MKL and OpenMP read their reproducibility settings once.
from kvgraft.core.reproducibility import configure as _configure_reproducibility

_configure_reproducibility()

from kvgraft.core.errors import KvgraftError  # noqa: E402
from kvgraft.core.sampling import SamplingParams  # noqa: E402
from kvgraft.core.version import __version__  # noqa: E402
from kvgraft.engine.engine import Engine, GenerationResult, PutResult  # noqa: E402
from kvgraft.format.receipt import Receipt  # noqa: E402
from kvgraft.models.loading import load_model  # noqa: E402

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
