"""Shared fixtures. Models are built once per session: random models are deterministic, so sharing is safe."""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import cache
from pathlib import Path

import pytest
from transformers import PreTrainedModel, PreTrainedTokenizerBase

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvgraft.engine.engine import Engine
from kvgraft.models.loading import load_model
from kvgraft.store import LocalStore

pytest_plugins = ["conftest_s3", "conftest_redis"]  # a real moto server, a real redis-server


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--campaign",
        action="store_true",
        help="run the fault-injection suite's long campaign (tests/faults/) instead of its CI-sized form",
    )


TEST_CHUNK = 16
TEXT = (
    "Grafts keep the state of a model after it has read a text, so that the text need not be read again. "
    "A restored state continues exactly as the fresh one would, byte for byte, under the fixed schedule."
)


@cache
def cached_model(spec: str, dtype: str = "float32") -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    return load_model(spec, dtype=dtype)


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "store")


EngineFactory = Callable[..., Engine]


@pytest.fixture
def make_engine(store: LocalStore) -> EngineFactory:
    def make(
        spec: str = "random:llama", dtype: str = "float32", chunk_size: int = TEST_CHUNK, **kwargs: object
    ) -> Engine:
        model, tokenizer = cached_model(spec, dtype)
        return Engine(model, tokenizer, spec, chunk_size, store, **kwargs)  # type: ignore[arg-type]

    return make
