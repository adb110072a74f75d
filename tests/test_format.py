"""Property tests of the manifest (graft format v2): round trip, the id rule, and what a reader refuses."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgraft.core.errors import FormatError, IntegrityError
from kvgraft.core.fingerprint import Fingerprint
from kvgraft.core.hashing import Sha256Hex
from kvgraft.format.blocks import block_keys
from kvgraft.format.manifest import BlockRef, LayerEntry, Manifest, graft_id, manifest_bytes, parse_manifest

FAST = settings(max_examples=25, deadline=None)

sha256_hex = st.binary(max_size=16).map(lambda b: Sha256Hex(hashlib.sha256(b).hexdigest()))
# Text without lone surrogates: they cannot be encoded as UTF-8, so no manifest written by kvgraft holds one.
text = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)
scalars = (
    st.none() | st.booleans() | st.integers(-(2**63), 2**63) | st.floats(allow_nan=False, allow_infinity=False) | text
)
# What model_identity() writes; a fingerprint without one of them is malformed.
MODEL_KEYS = ("weights_sha256", "config_sha256", "tokenizer_sha256", "dtype", "attn_implementation")
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3), max_leaves=8
)


@st.composite
def layer_entries(draw: st.DrawFn, aligned: int, chunk: int) -> LayerEntry:
    kind = draw(st.sampled_from(["full", "sliding", "shared"]))
    if kind == "shared" or aligned == 0:
        return LayerEntry(kind)
    shape = [1, draw(st.integers(1, 8)), chunk, draw(st.integers(1, 256))]
    return LayerEntry(kind, shape, [*shape[:3], draw(st.integers(1, 256))])


@st.composite
def manifests(draw: st.DrawFn) -> Manifest:
    tokens = draw(st.lists(st.integers(0, 2**40), max_size=80))
    chunk = draw(st.integers(1, 32))
    aligned = len(tokens) // chunk * chunk
    n_layers = draw(st.integers(0, 6))
    layers = [draw(layer_entries(aligned, chunk)) for _ in range(n_layers)]
    dtype = draw(st.sampled_from(["float32", "bfloat16", "float16"]))
    model = {key: draw(text) for key in MODEL_KEYS} | draw(st.dictionaries(text, text, max_size=2))
    fingerprint = Fingerprint(
        model=model | {"dtype": dtype},
        schedule={"chunk_size": chunk},
        environment=draw(st.dictionaries(text, scalars, max_size=4)),
    )
    blocks = [BlockRef(key, draw(sha256_hex)) for key in block_keys(fingerprint, tokens, chunk)]
    return Manifest(
        tokens=tokens,
        aligned_tokens=aligned,
        chunk_size=chunk,
        dtype=dtype,
        fingerprint=fingerprint,
        layers=layers,
        blocks=blocks,
        source_sha256=draw(sha256_hex),
        model_name=draw(text),
        kvgraft_version=draw(text),
        created_at=draw(text),
        metadata=draw(st.dictionaries(text, json_values, max_size=4)),
        next_logits_sha256=draw(sha256_hex) if 0 < aligned == len(tokens) else None,
    )


def _resigned(m: Manifest, **changes: Any) -> bytes:
    """Manifest bytes with top-level fields changed and the id recomputed, so only the change can be refused."""
    data = m.to_json() | changes
    data["id"] = graft_id(data)
    return json.dumps(data, ensure_ascii=False).encode()


@FAST
@given(manifests())
def test_manifest_round_trips(m: Manifest) -> None:
    parsed = parse_manifest(manifest_bytes(m), "test")
    assert parsed == m
    assert parsed.id == m.id


@FAST
@given(manifests())
def test_id_is_sha256_of_canonical_manifest_without_id_and_created_at(m: Manifest) -> None:
    body = {k: v for k, v in json.loads(manifest_bytes(m)).items() if k not in ("id", "created_at")}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    assert m.id == hashlib.sha256(canonical).hexdigest()


@FAST
@given(manifests(), text)
def test_id_excludes_created_at(m: Manifest, created_at: str) -> None:
    assert dataclasses.replace(m, created_at=created_at).id == m.id


@FAST
@given(manifests().filter(lambda m: len(m.tokens) > 0), st.data())
def test_id_changes_with_any_token(m: Manifest, data: st.DataObject) -> None:
    index = data.draw(st.integers(0, len(m.tokens) - 1))
    new = data.draw(st.integers(0, 2**40).filter(lambda t: t != m.tokens[index]))
    tokens = list(m.tokens)
    tokens[index] = new
    changed = dataclasses.replace(m, tokens=tokens)
    assert changed.id != m.id
    # And a manifest claiming the old id for the new tokens is refused.
    data_json = json.loads(manifest_bytes(m))
    data_json["tokens"] = tokens
    with pytest.raises(IntegrityError, match="does not match its content hash"):
        parse_manifest(json.dumps(data_json).encode(), "test")


@FAST
@given(manifests(), st.integers(1, 40))
def test_truncated_manifest_is_not_json(m: Manifest, cut: int) -> None:
    raw = manifest_bytes(m)
    with pytest.raises(FormatError, match="not valid JSON"):
        parse_manifest(raw[: max(0, len(raw) - 1 - cut)], "test")


@pytest.mark.parametrize("raw", [b"", b"{", b"\xff\xfe\xfd", b"{'id': 1}", b"NaN]"])
def test_invalid_json_is_a_format_error(raw: bytes) -> None:
    with pytest.raises(FormatError, match="not valid JSON"):
        parse_manifest(raw, "test")


@pytest.mark.parametrize("raw", [b"[]", b"1", b'"manifest"', b"null"])
def test_a_manifest_must_be_an_object(raw: bytes) -> None:
    with pytest.raises(FormatError, match="must be a JSON object"):
        parse_manifest(raw, "test")


@FAST
@given(manifests(), st.sampled_from([1, 3, 0, "2", None, 1.5]))
def test_unknown_format_version_is_refused(m: Manifest, version: object) -> None:
    with pytest.raises(FormatError, match="unknown format_version"):
        parse_manifest(_resigned(m, format_version=version), "test")


@FAST
@given(manifests(), sha256_hex)
def test_wrong_id_is_an_integrity_error(m: Manifest, other: str) -> None:
    data = m.to_json() | {"id": other}
    raw = json.dumps(data).encode()
    if other == m.id:
        assert parse_manifest(raw, "test") == m
    else:
        with pytest.raises(IntegrityError, match="does not match its content hash"):
            parse_manifest(raw, "test")


@FAST
@given(manifests(), st.integers(-64, 64).filter(lambda d: d != 0))
def test_aligned_tokens_must_follow_the_rule(m: Manifest, delta: int) -> None:
    with pytest.raises(FormatError, match="aligned_tokens"):
        parse_manifest(_resigned(m, aligned_tokens=m.aligned_tokens + delta), "test")


@FAST
@given(manifests(), st.integers(-3, 0))
def test_chunk_size_must_be_positive(m: Manifest, chunk: int) -> None:
    with pytest.raises(FormatError):
        parse_manifest(_resigned(m, chunk_size=chunk), "test")


@FAST
@given(manifests(), sha256_hex)
def test_next_token_logits_must_follow_the_rule(m: Manifest, sha: str) -> None:
    flipped = None if m.next_logits_sha256 else {"tensor": "next_token_logits", "sha256": sha}
    with pytest.raises(FormatError, match="next_token_logits"):
        parse_manifest(_resigned(m, next_token_logits=flipped), "test")


@FAST
@given(
    manifests(),
    st.sampled_from(["sub/tensors.safetensors", "../tensors.safetensors", "/etc/passwd", "a\\b", ".hidden", ".."]),
)
def test_tensors_file_must_be_a_plain_name(m: Manifest, name: str) -> None:
    with pytest.raises(FormatError, match="tensors_file"):
        parse_manifest(_resigned(m, tensors_file=name), "test")


@FAST
@given(manifests(), st.sampled_from([[-1], [1.0], ["1"], "123", None]))
def test_tokens_must_be_non_negative_integers(m: Manifest, tokens: object) -> None:
    with pytest.raises(FormatError, match="tokens"):
        parse_manifest(_resigned(m, tokens=tokens), "test")


@FAST
@given(manifests().filter(lambda m: len(m.layers) > 0))
def test_unknown_layer_kind_is_refused(m: Manifest) -> None:
    layers = [layer.to_json() for layer in m.layers]
    layers[0]["kind"] = "global"
    with pytest.raises(FormatError, match="unknown layer kind"):
        parse_manifest(_resigned(m, layers=layers), "test")


@FAST
@given(manifests(), st.sampled_from(["format_version", "tokens", "layers", "fingerprint", "provenance", "metadata"]))
def test_missing_field_is_a_format_error(m: Manifest, field: str) -> None:
    data = m.to_json()
    del data[field]
    data["id"] = graft_id(data)
    with pytest.raises(FormatError):
        parse_manifest(json.dumps(data).encode(), "test")


@FAST
@given(manifests(), json_values)
def test_an_unknown_field_fails_the_id_check(m: Manifest, value: object) -> None:
    """Version 2 has no extension fields: the id is recomputed from the known fields only."""
    with pytest.raises(IntegrityError):
        parse_manifest(_resigned(m, extension=value), "test")


@FAST
@given(manifests().filter(lambda m: len(m.blocks) > 0), st.data())
def test_block_keys_must_chain_over_the_tokens(m: Manifest, data: st.DataObject) -> None:
    """A block key commits to its tokens, every token before them and the fingerprint: a manifest whose key for
    some block is anything else (a block of another text, or of the same tokens in another place) is refused."""
    index = data.draw(st.integers(0, len(m.blocks) - 1))
    blocks = [b.to_json() for b in m.blocks]
    blocks[index]["key"] = data.draw(sha256_hex.filter(lambda h: h != m.blocks[index].key))
    with pytest.raises(FormatError, match="block keys do not chain"):
        parse_manifest(_resigned(m, blocks=blocks), "test")


@FAST
@given(manifests().filter(lambda m: len(m.blocks) > 0))
def test_one_block_per_chunk(m: Manifest) -> None:
    blocks = [b.to_json() for b in m.blocks][:-1]
    with pytest.raises(FormatError, match="one block per chunk"):
        parse_manifest(_resigned(m, blocks=blocks), "test")


def test_block_keys_are_chained_sha256_of_canonical_json() -> None:
    fingerprint = Fingerprint(model={k: "x" for k in MODEL_KEYS}, schedule={"chunk_size": 2}, environment={})
    fp = hashlib.sha256(json.dumps(fingerprint.to_json(), sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    first = hashlib.sha256(
        json.dumps({"fingerprint": fp, "parent": None, "tokens": [5, 6]}, separators=(",", ":")).encode()
    ).hexdigest()
    second = hashlib.sha256(
        json.dumps({"fingerprint": fp, "parent": first, "tokens": [7, 8]}, separators=(",", ":")).encode()
    ).hexdigest()
    assert block_keys(fingerprint, [5, 6, 7, 8, 9], 2) == [first, second]
