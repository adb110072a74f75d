"""`kvgraft serve`: the HTTP server, started with the server's and the engine's own defaults."""

from __future__ import annotations

from typing import Annotated

import typer

from kvgraft.cli.engines import load_engine
from kvgraft.cli.options import (
    ChunkOpt,
    DeviceOpt,
    DtypeOpt,
    EnvOpt,
    ModelOpt,
    SharedCacheOpt,
    StoreOpt,
    ThreadsOpt,
    TrustedKeysOpt,
    apply_threads,
)
from kvgraft.server.config import API_KEY_ENV, ServerConfig

# The limits' defaults are ServerConfig's own, so that the flags and the server cannot disagree.
_DEFAULTS = ServerConfig()


def serve(
    model: ModelOpt = None,
    store: StoreOpt = None,
    host: Annotated[str, typer.Option(help="Address to listen on (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port to listen on.")] = 8000,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key",
            envvar=API_KEY_ENV,
            show_envvar=True,
            help="Bearer token that library writes need (without one, writes are refused).",
        ),
    ] = _DEFAULTS.api_key,
    protect_reads: Annotated[
        bool, typer.Option("--protect-reads", help="Require the API key on every /v1 endpoint, reads included.")
    ] = _DEFAULTS.protect_reads,
    max_queue: Annotated[
        int, typer.Option(min=1, help="Requests that may wait for the model; more get 429.")
    ] = _DEFAULTS.max_queue,
    max_tokens: Annotated[
        int, typer.Option(min=1, help="The largest max_tokens a request may ask for.")
    ] = _DEFAULTS.max_tokens_limit,
    max_body_bytes: Annotated[
        int, typer.Option(min=1, help="The largest request body; larger get 413.")
    ] = _DEFAULTS.max_body_bytes,
    cache_bytes: Annotated[
        int | None, typer.Option(min=0, help="Keep restored grafts in an LRU of this many bytes of RAM.")
    ] = None,
    shared_cache: SharedCacheOpt = None,
    dense_model: Annotated[
        str | None,
        typer.Option("--dense-model", help="Retrieve with this local sentence-transformers directory (default: BM25)."),
    ] = None,
    chunk_size: ChunkOpt = None,
    dtype: DtypeOpt = None,
    allow_env_mismatch: EnvOpt = False,
    trusted_keys: TrustedKeysOpt = None,
    threads: ThreadsOpt = None,
    device: DeviceOpt = "cpu",
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "info",
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API, grafting per request (see the README's Server section)."""
    import uvicorn

    from kvgraft.library.retrieval import make_retriever
    from kvgraft.server import create_app

    config = ServerConfig(
        api_key=api_key or None,
        protect_reads=protect_reads,
        max_queue=max_queue,
        max_tokens_limit=max_tokens,
        default_completion_tokens=min(_DEFAULTS.default_completion_tokens, max_tokens),
        max_body_bytes=max_body_bytes,
        hidden_paths=(str(trusted_keys),) if trusted_keys else (),
    )
    config.check()  # before the model loads: a bad flag fails at once
    apply_threads(threads)  # the model worker pins this count; a graft made with another runs at its own
    retriever = make_retriever(dense_model)
    engine = load_engine(
        model,
        store,
        chunk_size,
        dtype,
        allow_env_mismatch=allow_env_mismatch,
        cache_bytes=cache_bytes,
        shared_cache=shared_cache,
        trusted_keys=trusted_keys,
        device=device,
    )
    uvicorn.run(create_app(engine, config, retriever), host=host, port=port, log_level=log_level)
