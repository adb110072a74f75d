"""Several grafts in one context: exact as one chain, approximate (and labelled so) otherwise."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from click.testing import Result
from transformers import DynamicCache
from typer.testing import CliRunner

from kvgraft.cli import app
from kvgraft.core.cache_state import record_kv
from kvgraft.core.errors import BadInputError
from kvgraft.core.sampling import SamplingParams
from kvgraft.engine.compose import Rerotator
from kvgraft.engine.verify import measure_composition, verify_receipt
from kvgraft.format.receipt import Composition, CompositionMode, parse_receipt

from conftest import TEST_CHUNK, EngineFactory

ROPE_ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "gemma4"]
FIRST = "Alice keeps the red key in the blue box. "
SECOND = "Bob keeps the green key under the old mat. "
PARAMS = SamplingParams(max_new_tokens=6)


@pytest.mark.parametrize("arch", ROPE_ARCHS)
def test_rerotated_keys_match_keys_computed_at_the_offset(make_engine: EngineFactory, arch: str) -> None:
    """RoPE attention depends on relative positions only, so a text read at offset d has the keys of the same text
    read at 0, rotated by d. The re-rotation reproduces them up to float rounding (which is why it is approximate)."""
    engine = make_engine(f"random:{arch}")
    tokens = engine.encode_context("Positions move; relative distances stay.")[:24]  # shorter than the windows
    offset = 100
    recorded = []
    for start in (0, offset):
        cache = DynamicCache(config=engine.model.config)
        with record_kv(cache) as recording, torch.inference_mode():
            positions = torch.arange(start, start + len(tokens)).unsqueeze(0)
            engine.model(input_ids=torch.tensor([tokens]), position_ids=positions, cache=cache, use_cache=True)
        recorded.append(recording)
    rerotator = Rerotator(engine.model)
    checked = 0
    for layer in range(len(recorded[0].chunks)):
        at_zero, at_offset = recorded[0].layer_kv(layer, 0, len(tokens)), recorded[1].layer_kv(layer, 0, len(tokens))
        if at_zero is None or at_offset is None:
            continue
        moved = rerotator.move(at_zero[0], layer, offset)
        torch.testing.assert_close(moved, at_offset[0], rtol=1e-4, atol=1e-4)
        assert not torch.allclose(at_zero[0], at_offset[0], atol=1e-3)  # the rotation did something
        torch.testing.assert_close(at_zero[1], at_offset[1], rtol=1e-4, atol=1e-4)  # values carry no position
        checked += 1
    assert checked > 0


@pytest.mark.parametrize("arch", ["llama", "gemma4"])
def test_a_chain_of_grafts_is_exact_and_shares_its_blocks(make_engine: EngineFactory, arch: str) -> None:
    engine = make_engine(f"random:{arch}")
    first = engine.put(FIRST * 3)
    second = engine.put(SECOND * 3, after=first.id)
    assert second.reused_blocks == first.aligned_tokens // TEST_CHUNK
    manifest = engine.store.manifest(second.id)
    assert manifest.metadata["after"] == first.id
    assert manifest.tokens[: first.tokens] == engine.store.manifest(first.id).tokens
    result = engine.generate(" Who has a key?", graft_ids=[first.id, second.id], params=PARAMS)
    assert result.exact and not result.approximate
    assert result.receipt.composition == Composition(mode=CompositionMode.CHAIN, grafts=(first.id, second.id))
    assert result.to_json()["composition"] == {"mode": "chain", "grafts": [first.id, second.id]}
    fresh = engine.run_fresh(result.receipt.input_tokens, PARAMS)
    assert fresh.output_tokens == result.output_tokens
    assert fresh.logits_chain == result.receipt.logits_chain_sha256
    assert verify_receipt(engine, result.receipt).exact


def test_grafts_that_are_not_a_chain_are_refused_unless_approximate(make_engine: EngineFactory) -> None:
    engine = make_engine("random:llama")
    a, b = engine.put(FIRST * 3), engine.put(SECOND * 3)
    with pytest.raises(BadInputError, match=f"graft {b.id[:12]} does not begin with the tokens of graft {a.id[:12]}"):
        engine.generate(" x", graft_ids=[a.id, b.id], params=PARAMS)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_approximate_composition_is_labelled_and_its_error_measured(make_engine: EngineFactory, arch: str) -> None:
    engine = make_engine(f"random:{arch}")
    a, b = engine.put(FIRST * 3), engine.put(SECOND * 3)  # 124 and 130 tokens: tails of 12 and 2 recomputed
    result = engine.generate(" Who has a key?", graft_ids=[a.id, b.id], params=PARAMS, approximate=True)
    assert result.approximate and not result.exact
    assert result.receipt.composition == Composition(
        mode=CompositionMode.APPROXIMATE, grafts=(a.id, b.id), offsets=(0, a.tokens)
    )
    # The receipt says so in its JSON, survives a round trip, and a fresh rerun does not call it exact.
    data = result.receipt.to_json()
    assert (data["approximate"], data["exact"]) == (True, False)
    assert data["composition"] == {"mode": "approximate", "grafts": [a.id, b.id], "offsets": [0, a.tokens]}
    assert parse_receipt(json.dumps(data), "test") == result.receipt
    assert not verify_receipt(engine, result.receipt).logits_equal
    # Against the exact recompute of the same tokens: finite, small-ish KL, reported rather than hidden.
    error = measure_composition(engine, [a.id, b.id], " Who has a key?", PARAMS)
    assert error.approximate_tokens == result.output_tokens
    assert math.isfinite(error.kl_first) and error.kl_first >= 0.0
    assert error.kl_first > 0.0  # the second graft never saw the first: not the exact state


def test_composition_json_round_trips_and_is_checked() -> None:
    approximate = {"mode": "approximate", "grafts": ["a", "b"], "offsets": [0, 7]}
    read = Composition.from_json(approximate)
    assert read == Composition(mode=CompositionMode.APPROXIMATE, grafts=("a", "b"), offsets=(0, 7))
    assert read is not None and read.to_json() == approximate and read.approximate
    chain = Composition.from_json({"mode": "chain", "grafts": ["a", "b"]})
    assert chain is not None and chain.to_json() == {"mode": "chain", "grafts": ["a", "b"]} and not chain.approximate
    assert Composition.from_json(None) is None
    with pytest.raises(ValueError, match="an object with mode 'chain' or 'approximate'"):
        Composition.from_json({"mode": "stacked", "grafts": ["a", "b"]})
    with pytest.raises(ValueError, match="must list at least two grafts"):
        Composition.from_json({"mode": "chain", "grafts": ["a"]})


def test_models_without_rope_cannot_be_repositioned(make_engine: EngineFactory) -> None:
    engine = make_engine("random:gpt2")
    a, b = engine.put(FIRST * 3), engine.put(SECOND * 3)
    with pytest.raises(BadInputError, match="cannot be re-positioned"):
        engine.generate(" x", graft_ids=[a.id, b.id], params=PARAMS, approximate=True)


def test_an_approximate_composition_needs_a_prompt_or_a_tail(make_engine: EngineFactory) -> None:
    engine = make_engine("random:llama")
    a = engine.put(FIRST * 3)
    aligned = engine.put("x" * (2 * TEST_CHUNK - 1))  # BOS + 31 bytes: every token has KV, no tail to compute
    with pytest.raises(BadInputError, match="has no tail to compute needs a prompt"):
        engine.generate("", graft_ids=[a.id, aligned.id], params=PARAMS, approximate=True)
    # With a tail, its forward gives the first logits: no prompt needed.
    result = engine.generate("", graft_ids=[aligned.id, a.id], params=PARAMS, approximate=True)
    assert result.approximate and len(result.output_tokens) == PARAMS.max_new_tokens


def test_cli_composes_a_chain_and_labels_an_approximate_run(tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    common = ["--model", "random:llama", "--store", store, "-C", str(TEST_CHUNK), "--json"]
    a = json.loads(_ok(["build", "--text", FIRST * 3, *common]).stdout)["id"]
    b = json.loads(_ok(["build", "--text", SECOND * 3, "--after", a, *common]).stdout)
    c = json.loads(_ok(["build", "--text", SECOND * 3, *common]).stdout)["id"]
    assert b["reused_blocks"] == 7
    chain = json.loads(_ok(["generate", "-g", a, "-g", b["id"], "-p", " x", "-n", "3", *common]).stdout)
    assert (chain["exact"], chain["approximate"], chain["composition"]["mode"]) == (True, False, "chain")
    refused = CliRunner().invoke(app, ["generate", "-g", a, "-g", c, "-p", " x", "-n", "3", *common])
    assert refused.exit_code == 1 and refused.stdout == ""
    assert refused.stderr.startswith(f"error: graft {c[:12]} does not begin with the tokens of graft {a[:12]}")
    receipt = tmp_path / "r.json"
    approx = _ok(
        ["generate", "-g", a, "-g", c, "-p", " x", "-n", "3", "--approximate", "--receipt", str(receipt), *common]
    )
    data = json.loads(approx.stdout)
    assert (data["exact"], data["approximate"], data["composition"]["mode"]) == (False, True, "approximate")
    verified = CliRunner().invoke(app, ["verify", "--receipt", str(receipt), "--store", store, "--json"])
    assert verified.exit_code == 1
    assert json.loads(verified.stdout)["approximate"] is True
    assert "an approximate composition of re-positioned grafts is never exact" in verified.stderr


def _ok(args: list[str]) -> Result:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return result
