"""The app factory: OpenAI-compatible completions and chat over one Engine, with grafting per request, plus the
graft library, receipts, health and metrics.

The endpoints live in `kvgraft.server.routes`, one router per concern. Every handler is thin: it validates, hands
model work to the one worker thread, and shapes the reply.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from kvgraft.core.version import __version__
from kvgraft.engine.engine import Engine
from kvgraft.library.retrieval import Retriever
from kvgraft.server import openapi
from kvgraft.server.config import ServerConfig
from kvgraft.server.errors import install_handlers
from kvgraft.server.metrics import RequestGuard
from kvgraft.server.routes import ROUTERS
from kvgraft.server.routes.deps import attach, state_of
from kvgraft.server.state import ServerState

OPENAPI_URL = "/openapi.json"


def create_app(engine: Engine, config: ServerConfig | None = None, retriever: Retriever | None = None) -> FastAPI:
    """An app serving `engine`. The model worker starts and stops with the app's lifespan (uvicorn runs it).

    Args:
        engine: the engine every request runs on, with its store (the graft library).
        config: auth, limits and where receipts go (`ServerConfig()` when None).
        retriever: how the library is searched (BM25 when None).

    Returns:
        The app, its `ServerState` at `app.state.kvgraft`.

    Raises:
        BadInputError: the config is inconsistent (`ServerConfig.check`).
    """
    config = config or ServerConfig()
    config.check()
    state = ServerState(engine, config, retriever)
    # The document is served (clients and fuzzers need it, and it is true: `openapi.document`); no docs UI.
    app = FastAPI(
        title="kvgraft", version=__version__, lifespan=_lifespan, docs_url=None, redoc_url=None, openapi_url=OPENAPI_URL
    )
    attach(app, state)
    install_handlers(app, state.redact)
    app.add_middleware(RequestGuard, metrics=state.metrics)
    for router in ROUTERS:
        app.include_router(router)
    openapi.install(app, config, state.model_id)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    worker = state_of(app).worker
    worker.start()
    try:
        yield
    finally:
        await asyncio.to_thread(worker.close)
