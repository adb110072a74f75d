"""kvgraft: byte-exact KV-cache grafts for frozen language models."""

__version__ = "0.1.0"

from kvgraft.engine import Engine, GenerationResult, PutResult
from kvgraft.errors import KvgraftError
from kvgraft.models.loading import load_model
from kvgraft.receipt import Receipt, SamplingParams

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
