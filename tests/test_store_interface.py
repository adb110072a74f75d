"""Every store implements the whole `GraftStore` interface, with the same signatures, and behaves the same through it.

Remote stores join the parametrization below (S3 against a real moto server, see conftest_s3.py); nothing outside
`kvgraft.store` may need to know which store it has.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from pathlib import Path

import pytest

from kvgraft.core.errors import NotFoundError
from kvgraft.engine.engine import Engine
from kvgraft.format.manifest import expected_block_shapes
from kvgraft.library.index import load_index
from kvgraft.store import GraftStore, LocalStore
from kvgraft.store.base import GcReport
from kvgraft.store.cache import CachedStore

from conftest import TEXT, cached_model

STORES: dict[str, Callable[[Path], GraftStore]] = {
    "local": lambda root: LocalStore(root),
    "cached": lambda root: CachedStore(LocalStore(root), max_bytes=1 << 30),
}
REMOTE_STORES = ["s3"]
"""Stores that need a live endpoint: opened from their URL fixture instead of a directory."""


def _s3_store_class() -> type:
    try:
        return importlib.import_module("kvgraft.store.s3").S3Store  # type: ignore[no-any-return]
    except ImportError as exc:
        pytest.skip(f"S3Store needs obstore ({exc.name} is missing)")


def _redis_tier_class() -> type:
    try:
        return importlib.import_module("kvgraft.store.redis_tier").RedisTier  # type: ignore[no-any-return]
    except ImportError as exc:
        pytest.skip(f"RedisTier needs redis ({exc.name} is missing)")


def _interface() -> dict[str, inspect.Signature | None]:
    """Public members of the Protocol: methods with their signatures, properties as None."""
    members: dict[str, inspect.Signature | None] = {}
    for name, member in vars(GraftStore).items():
        if name.startswith("_"):
            continue
        members[name] = None if isinstance(member, property) else inspect.signature(member)
    return members


@pytest.mark.parametrize("kind", [LocalStore, CachedStore, "S3Store", "RedisTier"])
def test_every_store_has_every_member_of_the_interface_with_its_signature(kind: type | str) -> None:
    if kind == "S3Store":
        kind = _s3_store_class()
    elif kind == "RedisTier":
        kind = _redis_tier_class()
    assert isinstance(kind, type)
    for name, signature in _interface().items():
        member = inspect.getattr_static(kind, name, None)
        assert member is not None, f"{kind.__name__} lacks {name}"
        if signature is None:
            assert isinstance(member, property), f"{kind.__name__}.{name} is not a property"
        else:
            mine = inspect.signature(member)
            assert list(mine.parameters) == list(signature.parameters), f"{kind.__name__}.{name} has other parameters"
            defaults = [p.default for p in mine.parameters.values()]
            assert defaults == [p.default for p in signature.parameters.values()], f"{kind.__name__}.{name} defaults"


def _engine(store: GraftStore) -> Engine:
    model, tokenizer = cached_model("random:gemma4")
    return Engine(model, tokenizer, "random:gemma4", 16, store)


@pytest.mark.parametrize("name", [*sorted(STORES), "redis", *REMOTE_STORES])
def test_a_store_behaves_the_same_through_the_interface(
    name: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    store: GraftStore
    if name == "s3":
        store = _s3_store_class()(request.getfixturevalue("s3_url"))
    elif name == "redis":  # the shared RAM tier (a real redis-server, see conftest_redis.py) over a local store
        store = _redis_tier_class()(LocalStore(tmp_path / "s"), request.getfixturevalue("redis_url"))
    else:
        store = STORES[name](tmp_path / "s")
    empty = store.change_token()
    assert store.ids() == [] and load_index(store) == {}
    put = _engine(store).put(TEXT, metadata={"title": "t"})
    after_put = store.change_token()
    assert after_put != empty and after_put is not None
    assert store.ids() == [put.id] and store.resolve(put.id[:8]) == put.id
    manifest = store.manifest(put.id)
    ref = manifest.blocks[0]
    assert store.has_block(ref.key)
    read_ref, block = store.read_block(ref.key, ref, expected_block_shapes(manifest), manifest.dtype)
    assert read_ref == ref and set(block) == set(expected_block_shapes(manifest))
    assert store.get(put.id).manifest == manifest
    assert store.size_bytes(put.id) == put.bytes and store.disk_bytes() >= put.bytes
    assert isinstance(store.prefetch(put.id), bool)
    assert load_index(store)[put.id].title == "t"
    assert store.read_sidecar("index.json") is not None
    assert store.directory == (None if name in REMOTE_STORES else tmp_path / "s")
    store.delete(put.id)
    assert store.change_token() not in (after_put, empty)
    assert store.ids() == []
    with pytest.raises(NotFoundError):
        store.manifest(put.id)
    assert store.gc(0.0) == GcReport(0, 0, 0)  # delete removed the graft's blocks already
