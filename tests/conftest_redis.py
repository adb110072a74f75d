"""A real Redis for the shared-cache tests: $KVGRAFT_TEST_REDIS_URL when set (CI may start one), else a redis-server
started here on a free loopback port for the session (no persistence) and stopped at its end.

Each test gets the database flushed; without redis-server (and the redis package) the tests are skipped, saying what
to install.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

REDIS_URL_ENV = "KVGRAFT_TEST_REDIS_URL"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class RedisServer:
    """A live Redis: its URL, and the process when this session started it (None for one given by CI)."""

    url: str
    process: subprocess.Popen[bytes] | None

    def client(self) -> Any:
        import redis

        return redis.Redis.from_url(self.url, socket_timeout=2)


def _start(port: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _wait_for_ping(server: RedisServer, timeout_s: float = 15.0) -> None:
    import redis

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process is not None and server.process.poll() is not None:
            raise RuntimeError(f"redis-server exited with code {server.process.returncode} before answering")
        try:
            if server.client().ping():
                return
        except redis.RedisError:
            time.sleep(0.05)
    raise RuntimeError(f"redis at {server.url} did not answer PING within {timeout_s:.0f} s")


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A live Redis for the session."""
    if importlib.util.find_spec("redis") is None:
        pytest.skip("Redis tests need the redis package: pip install redis")
    given = os.environ.get(REDIS_URL_ENV)
    if given:
        server = RedisServer(_worker_database(given), None)
        _wait_for_ping(server)
        yield server
        return
    if shutil.which("redis-server") is None:
        pytest.skip(f"Redis tests need redis-server on PATH (apt-get install redis-server) or {REDIS_URL_ENV}")
    port = _free_port()
    server = RedisServer(_worker_database(f"redis://127.0.0.1:{port}/0"), _start(port))
    try:
        _wait_for_ping(server)
        yield server
    finally:
        assert server.process is not None
        _stop(server.process)


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The URL of the live Redis, its database emptied for this test."""
    server = redis_server
    if server.process is not None and server.process.poll() is not None:  # a test stopped it: start it again
        port = int(server.url.rsplit(":", 1)[1].split("/")[0])
        server.process = _start(port)
        _wait_for_ping(server)
    server.client().flushdb()
    return server.url


def _worker_database(url: str) -> str:
    """The URL with a database of this pytest-xdist worker's own (gw0 -> 0, gw1 -> 1, ...), so that workers running
    at once never flush each other's keys; the URL as given without xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        return url
    return f"{url.rsplit('/', 1)[0]}/{int(worker[2:]) % 16}"
