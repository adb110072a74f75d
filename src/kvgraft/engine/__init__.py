"""One loaded model and its operations on grafts: build, store, restore, compose, generate, verify."""

from kvgraft.engine.engine import Engine, GenerationResult, PutResult

__all__ = ["Engine", "GenerationResult", "PutResult"]
