"""What every handler shares: the engine, its worker, metrics, receipts and library, and the mapping of any error
to the reply a client gets."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvgraft.core.errors import KvgraftError
from kvgraft.engine.engine import Engine
from kvgraft.library.retrieval import Retriever
from kvgraft.server.config import ServerConfig
from kvgraft.server.errors import INTERNAL, ApiError, from_kvgraft
from kvgraft.server.grafting import LibraryView
from kvgraft.server.metrics import Metrics
from kvgraft.server.receipts import DirectoryShelf, ReceiptBook, StoreShelf
from kvgraft.server.worker import ModelWorker, QueueFullError, Ticket, WorkerUnavailableError

log = logging.getLogger("uvicorn.error")


class ServerState:
    """One app's engine, model worker, metrics, receipts and library view (created by `create_app`)."""

    def __init__(self, engine: Engine, config: ServerConfig, retriever: Retriever | None) -> None:
        self.engine = engine
        self.config = config
        self.metrics = Metrics()
        self.worker = ModelWorker(engine, config.max_queue, self.metrics.queue_depth.set)
        shelf = DirectoryShelf(config.receipts_dir) if config.receipts_dir is not None else StoreShelf(engine.store)
        self.receipts = ReceiptBook(shelf, config.receipts_in_memory)
        self.library = LibraryView(engine.store, config.library_refresh_s, retriever)
        self.model_id = engine.model_name
        self.created = int(time.time())
        self.system_fingerprint = "kvgraft-" + engine.fingerprint.digest[:16]
        location = engine.store.location
        # An S3 store's endpoint too: an unreachable store's message names it, and it is no client's business.
        endpoints = {os.environ.get(name) for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")} - {None, ""}
        hidden = {location, str(Path(location).resolve()), *(e for e in endpoints if e)}
        self._redact = [(path, "<store>") for path in sorted(hidden, key=len, reverse=True)]
        own = {p for path in config.hidden_paths for p in (path, str(Path(path).resolve()))}
        # Longest first, whichever the placeholder: a path inside another is replaced whole.
        self._redact = sorted([*self._redact, *((p, "<hidden>") for p in own)], key=lambda r: len(r[0]), reverse=True)

    def redact(self, message: str) -> str:
        """A message with the store's directory replaced by `<store>`: a client has no business knowing it.

        Args:
            message: an error message.

        Returns:
            The message a client may see.
        """
        for path, placeholder in self._redact:
            message = message.replace(path, placeholder)
        return message

    def api_error(self, exc: BaseException, param: str | None = None) -> ApiError:
        """The reply to any error a request ran into.

        Args:
            exc: the error.
            param: the request field a kvgraft error is about, if any.

        Returns:
            An ApiError as it is; a kvgraft error's reply (`from_kvgraft`, redacted); for anything else a generic
            500, the error logged and counted.
        """
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
        """Queue work for the model worker.

        Args:
            fn: the work, called on the worker with the engine.
            cancelled: set it to stop the work early (the work polls it).

        Returns:
            The ticket whose future settles with the work's result.

        Raises:
            ApiError: 429 when the queue is full, 503 when the worker is stopping or stopped.
        """
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
        """Run work on the model worker and wait for it (cancelled with the request).

        Args:
            fn: the work, called on the worker with the engine.

        Returns:
            What `fn` returned.

        Raises:
            ApiError: the queue is full, the worker is gone, or the work failed (`api_error`).
        """
        ticket = self.submit(fn)
        try:
            return await ticket.future
        except asyncio.CancelledError:
            ticket.cancel()
            raise
        except BaseException as exc:
            raise self.api_error(exc) from None
