"""What every handler shares: the engine, its worker, metrics, receipts and library, and the mapping of any error
to the reply a client gets."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvgraft.core.errors import KvgraftError
from kvgraft.core.hashing import sha256_json
from kvgraft.engine.engine import Engine
from kvgraft.library.retrieval import Retriever
from kvgraft.server.config import ServerConfig
from kvgraft.server.errors import INTERNAL, ApiError, from_kvgraft
from kvgraft.server.grafting import LibraryView
from kvgraft.server.metrics import Metrics
from kvgraft.server.receipts import ReceiptBook
from kvgraft.server.worker import ModelWorker, QueueFullError, Ticket, WorkerUnavailableError
from kvgraft.store import LocalStore
from kvgraft.store.cache import CachedStore

log = logging.getLogger("uvicorn.error")


class ServerState:
    def __init__(self, engine: Engine, config: ServerConfig, retriever: Retriever | None) -> None:
        self.engine = engine
        self.config = config
        self.metrics = Metrics()
        self.worker = ModelWorker(engine, config.max_queue, self.metrics.queue_depth.set)
        inner = engine.store.inner if isinstance(engine.store, CachedStore) else engine.store
        self.local_store = inner if isinstance(inner, LocalStore) else None
        receipts_dir = config.receipts_dir
        if receipts_dir is None and self.local_store is not None:
            receipts_dir = self.local_store.root / "receipts"
        self.receipts = ReceiptBook(receipts_dir, config.receipts_in_memory)
        self.library = LibraryView(engine.store, config.library_refresh_s, retriever)
        self.model_id = engine.model_name
        self.created = int(time.time())
        self.system_fingerprint = "kvgraft-" + sha256_json(engine.fingerprint.to_json())[:16]
        location = engine.store.location
        self._redact = sorted({location, str(Path(location).resolve())}, key=len, reverse=True)

    def redact(self, message: str) -> str:
        """Messages from the store name its directory; a client has no business knowing it."""
        for path in self._redact:
            message = message.replace(path, "<store>")
        return message

    def api_error(self, exc: BaseException, param: str | None = None) -> ApiError:
        if isinstance(exc, ApiError):
            return exc
        if isinstance(exc, KvgraftError):
            error = from_kvgraft(exc, param)
            error.message = self.redact(error.message)
            return error
        self.metrics.errors.inc()
        log.error("unexpected error in a request", exc_info=exc)
        return INTERNAL

    def submit(self, fn: Callable[[Engine], Any], cancelled: threading.Event | None = None) -> Ticket[Any]:
        try:
            return self.worker.submit(fn, cancelled)
        except QueueFullError:
            self.metrics.rejected.labels("queue_full").inc()
            raise ApiError(
                429,
                f"the server is busy: {self.config.max_queue} requests are already waiting; retry shortly",
                code="queue_full",
                headers={"Retry-After": "1"},
            ) from None
        except WorkerUnavailableError:
            self.metrics.rejected.labels("unavailable").inc()
            raise ApiError(503, "the server is shutting down or its model worker stopped", code="unavailable") from None

    async def run(self, fn: Callable[[Engine], Any]) -> Any:
        ticket = self.submit(fn)
        try:
            return await ticket.future
        except asyncio.CancelledError:
            ticket.cancel()
            raise
        except BaseException as exc:
            raise self.api_error(exc) from None
