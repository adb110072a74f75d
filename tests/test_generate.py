from __future__ import annotations

import pytest

from kvgraft.core.errors import BadInputError
from kvgraft.core.sampling import SamplingParams
from kvgraft.engine.verify import verify_receipt

from conftest import TEST_CHUNK, EngineFactory


def test_fully_aligned_graft_with_empty_prompt_uses_stored_logits(make_engine: EngineFactory) -> None:
    engine = make_engine("random:gemma4")
    text = "x" * (4 * TEST_CHUNK - 1)  # + BOS = 4C tokens: every token has stored KV
    put = engine.put(text)
    assert put.aligned_tokens == put.tokens == 4 * TEST_CHUNK
    assert engine.store.manifest(put.id).next_logits_sha256 is not None
    result = engine.generate("", graft_id=put.id, params=SamplingParams(max_new_tokens=5))
    assert result.generation.prefill_tokens == 0
    assert verify_receipt(engine, result.receipt).exact


def test_stop_strings_and_max_new_tokens(make_engine: EngineFactory) -> None:
    engine = make_engine("random:llama")
    sampled = SamplingParams(max_new_tokens=12, temperature=0.7, seed=1)
    base = engine.generate("Once upon a time", params=sampled)
    assert len(base.output_tokens) == 12 and base.stop_reason == "length"
    assert "}I" in base.text  # this seed's text on random:llama, seed 0 weights
    stopped = engine.generate("Once upon a time", params=SamplingParams(12, 0.7, 1.0, 1, ("}I",)))
    assert stopped.stop_reason == "stop"
    assert stopped.text == base.text[: base.text.index("}I")]
    assert len(stopped.output_tokens) < 12
    assert verify_receipt(engine, stopped.receipt).exact


def test_stop_token_ids_end_decoding_and_travel_in_the_receipt(make_engine: EngineFactory) -> None:
    engine = make_engine("random:llama")
    sampled = SamplingParams(max_new_tokens=12, temperature=0.7, seed=1)
    base = engine.generate("Once upon a time", params=sampled)
    assert "stop_token_ids" not in base.receipt.sampling.to_json()  # older receipts keep their ids
    stop_at = base.output_tokens[4]
    first = base.output_tokens.index(stop_at)
    params = SamplingParams(12, 0.7, 1.0, 1, stop_token_ids=(stop_at,))
    stopped = engine.generate("Once upon a time", params=params)
    assert stopped.stop_reason == "stop"
    assert stopped.output_tokens == base.output_tokens[: first + 1]
    assert stopped.receipt.sampling.to_json()["stop_token_ids"] == [stop_at]
    assert stopped.receipt.sampling == params
    assert verify_receipt(engine, stopped.receipt).exact


def test_streaming_callback_sees_every_token(make_engine: EngineFactory) -> None:
    engine = make_engine()
    seen: list[int] = []
    result = engine.generate("abc", params=SamplingParams(max_new_tokens=7), on_token=seen.append)
    assert seen == result.output_tokens


def test_bad_requests(make_engine: EngineFactory) -> None:
    engine = make_engine()
    with pytest.raises(BadInputError, match="prompt is empty; give a prompt or a graft"):
        engine.generate("")
    with pytest.raises(BadInputError, match="text is empty"):
        engine.put("   \n")
    with pytest.raises(BadInputError, match="text is 5001 tokens; the model supports at most 4096 positions"):
        engine.put("y" * 5000)
    with pytest.raises(BadInputError, match="input plus max new tokens is 4101 tokens"):
        engine.generate("z" * 4000, params=SamplingParams(max_new_tokens=100))
    with pytest.raises(BadInputError, match="max new tokens must be at least 1"):
        engine.generate("z", params=SamplingParams(max_new_tokens=0))
