from __future__ import annotations

import dataclasses

import pytest

from kvgraft.core.errors import EnvironmentMismatchError, FingerprintMismatchError
from kvgraft.core.fingerprint import Fingerprint, check_fingerprint, compute_fingerprint
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


def _with_other_threads(engine: Engine) -> None:
    fp = engine.fingerprint
    env = dict(fp.environment) | {"threads": fp.environment["threads"] + 7}
    engine.__dict__["fingerprint"] = dataclasses.replace(fp, environment=env)


def test_environment_difference_is_refused_unless_allowed(make_engine: EngineFactory) -> None:
    put = make_engine().put(TEXT)
    strict = make_engine()
    _with_other_threads(strict)
    with pytest.raises(
        EnvironmentMismatchError, match=r"numeric environment differs .*threads.*exactness is not guaranteed"
    ):
        strict.generate(" x", graft_id=put.id)
    lenient = make_engine(allow_environment_mismatch=True)
    _with_other_threads(lenient)
    result = lenient.generate(" x", graft_id=put.id, params=SamplingParams(max_new_tokens=3))
    assert result.exact is False and result.receipt.exact is False
    assert any("threads" in d for d in result.receipt.environment_differences)
    # the rerun in this (real) environment reports the difference too, so it is not called exact
    assert verify_receipt(make_engine(), result.receipt).exact is False


def test_fingerprint_is_stable_and_json_round_trips() -> None:
    model, tokenizer = cached_model("random:gemma4")
    a = compute_fingerprint(model, tokenizer, 64)
    b = compute_fingerprint(model, tokenizer, 64)
    assert a == b == Fingerprint.from_json(a.to_json())
    assert check_fingerprint(a, b) == []
    assert set(a.environment) >= {"torch", "transformers", "mkl", "onednn", "cpu_capability", "threads", "device"}
    assert set(a.model) == {"weights_sha256", "config_sha256", "tokenizer_sha256", "dtype", "attn_implementation"}
