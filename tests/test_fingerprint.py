from __future__ import annotations

import dataclasses

import pytest

from kvgraft.core.errors import EnvironmentMismatchError, FingerprintMismatchError
from kvgraft.core.fingerprint import (
    Fingerprint,
    check_fingerprint,
    compute_fingerprint,
    recorded_threads,
    with_threads,
)
from kvgraft.core.sampling import SamplingParams
from kvgraft.engine.engine import Engine
from kvgraft.engine.verify import verify_receipt

from conftest import TEXT, EngineFactory, cached_model


def test_a_graft_from_seed_0_is_refused_by_seed_1(make_engine: EngineFactory) -> None:
    put = make_engine("random:llama").put(TEXT)
    other = make_engine("random:llama:1")
    with pytest.raises(FingerprintMismatchError, match=r"another model or schedule .*weights_sha256"):
        other.generate(" x", graft_id=put.id)


def test_another_chunk_size_is_refused(make_engine: EngineFactory) -> None:
    put = make_engine(chunk_size=16).put(TEXT)
    with pytest.raises(FingerprintMismatchError, match="chunk_size 16 vs 32"):
        make_engine(chunk_size=32).generate(" x", graft_id=put.id)


def test_another_dtype_is_refused(make_engine: EngineFactory) -> None:
    put = make_engine(dtype="float32").put(TEXT)
    with pytest.raises(FingerprintMismatchError, match="dtype 'float32' vs 'bfloat16'"):
        make_engine(dtype="bfloat16").generate(" x", graft_id=put.id)


def _on_another_cpu(engine: Engine) -> None:
    """The engine's fingerprint as if it ran on a CPU of another capability (the thread count is not such a
    difference: any run can switch to a graft's count, see tests/test_threads.py)."""
    fp = engine.fingerprint
    env = dict(fp.environment) | {"cpu_capability": "OTHER"}
    engine.__dict__["_loaded_fingerprint"] = dataclasses.replace(fp, environment=env)


def test_environment_difference_is_refused_unless_allowed(make_engine: EngineFactory) -> None:
    put = make_engine().put(TEXT)
    strict = make_engine()
    _on_another_cpu(strict)
    with pytest.raises(
        EnvironmentMismatchError, match=r"numeric environment differs .*cpu_capability.*exactness is not guaranteed"
    ):
        strict.generate(" x", graft_id=put.id)
    lenient = make_engine(allow_environment_mismatch=True)
    _on_another_cpu(lenient)
    result = lenient.generate(" x", graft_id=put.id, params=SamplingParams(max_new_tokens=3))
    assert result.exact is False and result.receipt.exact is False
    assert any("cpu_capability" in d for d in result.receipt.environment_differences)
    # the rerun in this (real) environment reports the difference too, so it is not called exact
    assert verify_receipt(make_engine(), result.receipt).exact is False


def test_with_threads_changes_the_count_only() -> None:
    model, tokenizer = cached_model("random:llama")
    fp = compute_fingerprint(model, tokenizer, 16)
    other = with_threads(fp, fp.environment["threads"] + 1)
    assert other.environment == fp.environment | {"threads": fp.environment["threads"] + 1}
    assert (other.model, other.schedule) == (fp.model, fp.schedule) and other.digest != fp.digest
    assert with_threads(other, fp.environment["threads"]) == fp


def test_recorded_threads_agree_or_are_refused() -> None:
    model, tokenizer = cached_model("random:llama")
    fp = compute_fingerprint(model, tokenizer, 16)
    one, two = with_threads(fp, 1), with_threads(fp, 2)
    assert recorded_threads({}) is None
    assert recorded_threads({"a": two, "b": two}) == 2
    unrecorded = dataclasses.replace(fp, environment={k: v for k, v in fp.environment.items() if k != "threads"})
    assert recorded_threads({"a": unrecorded}) is None  # nothing to switch to: the check compares as it is
    with pytest.raises(EnvironmentMismatchError) as raised:
        recorded_threads({"a": one, "b": two})
    assert str(raised.value) == (
        "the grafts were made with different thread counts (a 1, b 2); one run computes with one count, so they "
        "cannot be used together exactly"
    )
    assert recorded_threads({"a": one, "b": two}, allow_environment_mismatch=True) == 2


def test_fingerprint_is_stable_and_json_round_trips() -> None:
    model, tokenizer = cached_model("random:gemma4")
    a = compute_fingerprint(model, tokenizer, 64)
    b = compute_fingerprint(model, tokenizer, 64)
    assert a == b == Fingerprint.from_json(a.to_json())
    assert check_fingerprint(a, b) == []
    assert set(a.environment) >= {"torch", "transformers", "mkl", "onednn", "cpu_capability", "threads", "device"}
    assert set(a.model) == {"weights_sha256", "config_sha256", "tokenizer_sha256", "dtype", "attn_implementation"}
