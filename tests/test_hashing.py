"""Property tests of kvgraft.core.hashing: every hash is over a canonical byte encoding, the same in every process."""

from __future__ import annotations

import hashlib
import json
import os
import random
import struct
import subprocess
import sys
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgraft.core import hashing
from kvgraft.core.hashing import (
    LogitsChain,
    canonical_json,
    sha256_json,
    sha256_tensor,
    sha256_token_ids,
    tensor_bytes,
)

FAST = settings(max_examples=50, deadline=None)

text = st.text(st.characters(exclude_categories=("Cs",)), max_size=10)
scalars = (
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False) | text
)
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4), max_leaves=20
)
shapes = st.lists(st.integers(1, 4), min_size=1, max_size=3)
int64 = st.integers(-(2**63), 2**63 - 1)


@st.composite
def float_tensors(draw: st.DrawFn, dtype: torch.dtype) -> torch.Tensor:
    shape = draw(shapes)
    count = 1
    for dim in shape:
        count *= dim
    values = draw(st.lists(st.floats(width=32), min_size=count, max_size=count))
    return torch.tensor(values, dtype=torch.float32).to(dtype).reshape(shape)


def _shuffled(obj: Any, rng: random.Random) -> Any:
    """The same JSON value with every object's keys inserted in a random order."""
    if isinstance(obj, dict):
        items = list(obj.items())
        rng.shuffle(items)
        return {k: _shuffled(v, rng) for k, v in items}
    if isinstance(obj, list):
        return [_shuffled(v, rng) for v in obj]
    return obj


@FAST
@given(float_tensors(torch.float32))
def test_sha256_tensor_float32_is_sha256_of_numpy_bytes(tensor: torch.Tensor) -> None:
    assert sha256_tensor(tensor) == hashlib.sha256(tensor.numpy().tobytes()).hexdigest()
    assert bytes(tensor_bytes(tensor)) == tensor.numpy().tobytes()


@FAST
@given(float_tensors(torch.bfloat16))
def test_sha256_tensor_bfloat16_is_sha256_of_int16_view(tensor: torch.Tensor) -> None:
    raw = tensor.view(torch.int16).numpy().tobytes()
    assert len(raw) == 2 * tensor.numel()
    assert sha256_tensor(tensor) == hashlib.sha256(raw).hexdigest()


@FAST
@given(float_tensors(torch.float32).filter(lambda t: t.dim() >= 2))
def test_sha256_tensor_hashes_row_major_order_of_non_contiguous_views(tensor: torch.Tensor) -> None:
    view = tensor.transpose(0, -1)
    assert sha256_tensor(view) == hashlib.sha256(view.contiguous().numpy().tobytes()).hexdigest()
    assert sha256_tensor(view) == hashlib.sha256(view.numpy().tobytes(order="C")).hexdigest()


@FAST
@given(json_values, st.randoms(use_true_random=False))
def test_canonical_json_is_key_order_independent(obj: Any, rng: random.Random) -> None:
    shuffled = _shuffled(obj, rng)
    assert canonical_json(shuffled) == canonical_json(obj)
    assert sha256_json(shuffled) == sha256_json(obj)
    expected = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    assert canonical_json(obj) == expected
    assert json.loads(canonical_json(obj)) == obj


@pytest.mark.parametrize("value", [float("nan"), float("inf"), {"x": [float("-inf")]}])
def test_canonical_json_refuses_non_finite_numbers(value: object) -> None:
    with pytest.raises(ValueError):
        canonical_json(value)


@FAST
@given(st.lists(int64, max_size=50))
def test_sha256_token_ids_is_sha256_of_little_endian_int64(tokens: list[int]) -> None:
    packed = b"".join(struct.pack("<q", t) for t in tokens)
    assert sha256_token_ids(tokens) == hashlib.sha256(packed).hexdigest()


@FAST
@given(st.lists(st.one_of(float_tensors(torch.float32), float_tensors(torch.bfloat16)), max_size=6))
def test_logits_chain_equals_the_manual_chain(steps: list[torch.Tensor]) -> None:
    chain = LogitsChain()
    digest = hashlib.sha256(b"kvgraft/logits-chain/v1").digest()
    for logits in steps:
        chain.update(logits.reshape(-1))
        raw = (logits.view(torch.int16) if logits.dtype == torch.bfloat16 else logits).numpy().tobytes()
        digest = hashlib.sha256(digest + hashlib.sha256(raw).digest()).digest()
    assert chain.steps == len(steps)
    assert chain.hexdigest == digest.hex()


@FAST
@given(st.lists(float_tensors(torch.float32), min_size=2, max_size=4))
def test_logits_chain_depends_on_order(steps: list[torch.Tensor]) -> None:
    forward, backward = LogitsChain(), LogitsChain()
    for logits in steps:
        forward.update(logits.reshape(-1))
    for logits in reversed(steps):
        backward.update(logits.reshape(-1))
    same = [sha256_tensor(x) for x in steps] == [sha256_tensor(x) for x in reversed(steps)]
    assert (forward.hexdigest == backward.hexdigest) == same


# The test vectors of docs/FORMAT.md section 8.
def test_known_answers() -> None:
    obj = {"b": [1, 2.5, None], "a": "é", "c": True}
    assert canonical_json(obj) == '{"a":"é","b":[1,2.5,null],"c":true}'.encode()
    assert sha256_json(obj) == "baf815c2c5723dde28d7704755020e44a7c8fc4b3d6bb2cb27baa34b8162d39a"
    assert sha256_token_ids([2, 3, 258]) == "f2b208e0eb991920b70bf90e63cc3807dd739d70a4a0dbc586254955e804f844"
    assert sha256_token_ids([]) == hashlib.sha256(b"").hexdigest()
    f32 = torch.tensor([0.0, 1.0, -2.5])
    bf16 = f32.to(torch.bfloat16)
    assert bytes(tensor_bytes(f32)).hex() == "000000000000803f000020c0"
    assert sha256_tensor(f32) == "4356516ed57de986ba8080c557e8856871336d6a17b170fb946df125605466c9"
    assert bytes(tensor_bytes(bf16)).hex() == "0000803f20c0"
    assert sha256_tensor(bf16) == "b541c3992bb5fecf16a1632883dd16da579208ec1d60edf5135907a37751fac6"
    chain = LogitsChain()
    assert chain.hexdigest == "114a4f9e9d39fbec3febc83a7420bdb89d5856085dce84cb5dc0c8009c70dd9d"
    chain.update(f32)
    assert chain.hexdigest == "c2a8955bc00125c7b810306f0fed28ece08a8e57e0a919157e05df58ef1fb81b"


# --- determinism across processes -----------------------------------------------------------------------------

# Run here (with kvgraft.core.hashing as `hashing`) and in fresh interpreters with other PYTHONHASHSEEDs. The dict is
# built from a set, so its insertion order (and a naive json.dumps of it) changes with the hash seed; its canonical
# hash must not.
_FIXED_VALUES = """
import json, torch
words = {"graft", "kv", "exact", "schedule", "chunk", "logits", "receipt", "manifest", "tensor", "bf16"}
obj = {"words": {w: len(w) for w in words}, "nested": [{"z": 1, "a": [2.5, None, True]}, "é"]}
ramp = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) / 7 - 1
chain = hashing.LogitsChain()
chain.update(ramp.reshape(-1))
chain.update(ramp.to(torch.bfloat16).reshape(-1))
VALUES = {
    "json": hashing.sha256_json(obj),
    "tensor_f32": hashing.sha256_tensor(ramp),
    "tensor_bf16": hashing.sha256_tensor(ramp.to(torch.bfloat16)),
    "token_ids": hashing.sha256_token_ids([0, 1, 2, 258, 2**40, -1]),
    "chain": chain.hexdigest,
}
print(json.dumps(VALUES))
"""
# The child loads src/kvgraft/hashing.py by itself (it needs only numpy and torch), which starts several times
# faster than importing the kvgraft package with transformers.
_LOAD_HASHING = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("kvgraft_hashing", sys.argv[1])
hashing = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hashing)
"""


def test_hashes_are_the_same_in_other_processes(capsys: pytest.CaptureFixture[str]) -> None:
    """Two fresh interpreters with different hash seeds (run side by side) agree with this one."""
    exec(_FIXED_VALUES, {"hashing": hashing})
    expected = json.loads(capsys.readouterr().out)
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", _LOAD_HASHING + _FIXED_VALUES, hashing.__file__],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ, PYTHONHASHSEED=seed),
        )
        for seed in ("0", "20260")
    ]
    for process in processes:
        stdout, stderr = process.communicate(timeout=120)
        assert process.returncode == 0, stderr
        assert json.loads(stdout) == expected
