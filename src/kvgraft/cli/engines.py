"""Loading the engine a command runs on, with the engine's own defaults for whatever the user left out."""

from __future__ import annotations

from pathlib import Path

from kvgraft.core.schedule import DEFAULT_CHUNK_SIZE
from kvgraft.engine.engine import Engine
from kvgraft.models.loading import DEFAULT_DEVICE, DEFAULT_DTYPE, resolve_device
from kvgraft.store import GraftStore, open_store
from kvgraft.store.trust import TrustedStore, TrustPolicy

__all__ = ["DEFAULT_CHUNK_SIZE", "DEFAULT_DTYPE", "FALLBACK_MODEL", "load_engine", "open_trusted_store"]

FALLBACK_MODEL = "random:gemma4"
"""The model when neither the user nor a graft names one."""


def load_engine(
    model: str | None,
    store: str | None,
    chunk_size: int | None = None,
    dtype: str | None = None,
    graft: str | None = None,
    allow_env_mismatch: bool = False,
    cache_bytes: int | None = None,
    shared_cache: str | None = None,
    trusted_keys: str | Path | None = None,
    device: str = DEFAULT_DEVICE,
) -> Engine:
    """Load the engine; unspecified model, dtype and chunk size default to the graft's own when there is one.

    Args:
        model: a model spec (`random:<arch>[:<seed>]`, a directory, a hub id); None for the graft's, else
            `FALLBACK_MODEL`.
        store: the store directory; None for the default store.
        chunk_size: chunk size C of the schedule; None (or 0) for the graft's, else the engine's default.
        dtype: the model's dtype; None (or empty) for the graft's, else the device's default (float32 on cpu and
            mps, bfloat16 on cuda).
        graft: a graft id or prefix whose manifest supplies the defaults above.
        allow_env_mismatch: use grafts made under another numeric environment (reported as not exact).
        cache_bytes: size of the RAM tier of restored grafts in front of the store; None for none.
        shared_cache: redis://HOST:PORT/DB of a block cache shared between processes; None for none.
        trusted_keys: a directory of trusted public keys (`*.pub`): only grafts one of them signed are used (the
            graft above included); None for no policy.
        device: cpu, cuda, cuda:N or mps; checked before the store is opened.

    Returns:
        The loaded engine, on the opened store.
    """
    resolve_device(device)  # an unknown or absent device is the first error, before any store or model work
    graft_store = open_trusted_store(store, trusted_keys)
    if graft is not None and (model is None or chunk_size is None or dtype is None):
        manifest = graft_store.manifest(graft)
        model = model or manifest.model_name
        chunk_size = chunk_size or manifest.chunk_size
        dtype = dtype or manifest.dtype
    return Engine.load(
        model or FALLBACK_MODEL,
        dtype=dtype or None,
        device=device,
        chunk_size=chunk_size or DEFAULT_CHUNK_SIZE,
        store=graft_store,
        allow_environment_mismatch=allow_env_mismatch,
        cache_bytes=cache_bytes,
        shared_cache=shared_cache,
    )


def open_trusted_store(store: str | None, trusted_keys: str | Path | None, must_exist: bool = False) -> GraftStore:
    """The store, seen through the trust policy of `trusted_keys` when one is given.

    Args:
        store: the store directory or URL; None for the default store.
        trusted_keys: a directory of trusted public keys (`*.pub`); None (or empty) for no policy.
        must_exist: refuse a local store that does not exist.

    Returns:
        The store, or a `TrustedStore` over it. BadInputError for a keys directory that is missing or holds no key.
    """
    graft_store = open_store(store, must_exist=must_exist)
    if not trusted_keys:
        return graft_store
    return TrustedStore(graft_store, TrustPolicy.load(Path(trusted_keys)))
