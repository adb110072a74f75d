"""A uvicorn server on a background thread, for tests and the load benchmark (the CLI runs uvicorn itself)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI


@dataclass(frozen=True)
class RunningServer:
    """Where a server started by `serve_in_thread` listens."""

    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@contextmanager
def serve_in_thread(
    app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning", start_timeout: float = 30.0
) -> Iterator[RunningServer]:
    """Serve `app` until the block ends.

    Args:
        app: the app.
        host: the address to bind.
        port: the port to bind; 0 takes a free one.
        log_level: uvicorn's log level.
        start_timeout: seconds to wait for the server to start, and for it to stop.

    Returns:
        A context manager giving where the server listens (the port actually bound).

    Raises:
        RuntimeError: the server did not start in time.
    """
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on"))
    thread = threading.Thread(target=server.run, name="kvgraft-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"the server did not start on {host}:{port}")
        time.sleep(0.01)
    bound = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield RunningServer(host, int(bound))
    finally:
        server.should_exit = True
        thread.join(start_timeout)
