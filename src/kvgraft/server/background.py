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
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@contextmanager
def serve_in_thread(
    app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning", start_timeout: float = 30.0
) -> Iterator[RunningServer]:
    """Serve `app` until the block ends; port 0 takes a free port (the one bound is in the result)."""
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
