"""A real S3-compatible endpoint for the store tests: $KVGRAFT_TEST_S3_ENDPOINT when set (CI may start one), else
moto in server mode started here on a free loopback port for the session and stopped at its end.

Each test gets its own bucket and dummy credentials in the environment (moto accepts any); without moto[server] (and
obstore) the S3 tests are skipped, saying what to install.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

ENDPOINT_ENV = "KVGRAFT_TEST_S3_ENDPOINT"
_NEEDED = ("moto", "flask", "boto3", "obstore")  # flask: moto's server mode (the moto[server] extra)


def _missing() -> list[str]:
    return [name for name in _NEEDED if importlib.util.find_spec(name) is None]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _wait_until_answering(url: str, server: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"moto server exited with code {server.returncode} before answering")
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except urllib.error.HTTPError:
            return  # an HTTP answer, even an error, means it is serving
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"moto server at {url} did not answer within {timeout_s:.0f} s")


@contextmanager
def moto_server() -> Iterator[str]:
    """A moto server on a free loopback port for the `with` block: yields its URL, always stopped at the end."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_until_answering(url, server)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """The endpoint URL of a live S3-compatible server."""
    given = os.environ.get(ENDPOINT_ENV)
    if given:
        yield given
        return
    missing = _missing()
    if missing:
        pytest.skip(f"S3 tests need {', '.join(missing)}: pip install 'moto[server]' obstore (or set {ENDPOINT_ENV})")
    with moto_server() as url:
        yield url


@pytest.fixture
def s3_client(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A boto3 client of the endpoint, with dummy credentials and the endpoint set for kvgraft too."""
    if _missing():
        pytest.skip(f"S3 tests need {', '.join(_missing())}: pip install 'moto[server]' obstore")
    import boto3

    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    return boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")


@pytest.fixture
def s3_bucket(s3_client: Any) -> str:
    """A fresh, empty bucket for one test."""
    name = f"kvgraft-test-{uuid.uuid4().hex[:12]}"
    s3_client.create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3_url(s3_bucket: str) -> str:
    """An s3:// store URL, under a prefix of a fresh bucket."""
    return f"s3://{s3_bucket}/lib"
