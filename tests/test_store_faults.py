"""Faults of the remote stores against real servers: an S3 endpoint that is not there or never answers, wrong
credentials (a moto server of our own that enforces them), a missing bucket, a connection dropped mid-upload (a
loopback TCP proxy that cuts it), Redis killed with SIGKILL mid-run (a redis-server of our own), and the server's
reply when its store goes away.

Each fault ends in one clear `error:` line (CLI), a StoreError (API) or a 503 with an OpenAI-style body (server),
never a traceback or a hang, and nothing partial is left visible.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import shutil
import socket
import threading
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from conftest_redis import RedisServer, _start, _stop, _wait_for_ping
from conftest_s3 import _free_port, _missing, moto_server
from typer.testing import CliRunner

from kvgraft.cli import app
from kvgraft.core.errors import NotFoundError, StoreError
from kvgraft.core.sampling import SamplingParams
from kvgraft.engine.engine import Engine
from kvgraft.format.blocks import assemble
from kvgraft.server import ServerConfig, create_app
from kvgraft.server.background import serve_in_thread
from kvgraft.store import GraftStore
from kvgraft.store.base import GcReport

from conftest import TEST_CHUNK, TEXT, cached_model

pytest.importorskip("obstore", reason="the S3 store needs obstore: pip install obstore")

from kvgraft.store.s3 import S3Store  # after the skip: obstore may be missing

MODEL = "random:llama"
PARAMS = SamplingParams(max_new_tokens=6)
KEY = "test-key"


def _engine(store: GraftStore) -> Engine:
    model, tokenizer = cached_model(MODEL)
    return Engine(model, tokenizer, MODEL, TEST_CHUNK, store)


def _cli(*args: object) -> Any:
    return CliRunner().invoke(app, [str(a) for a in args])


def _one_error_line(result: Any) -> str:
    """The CLI's one `error:` line (exit code 1, no traceback, nothing else printed)."""
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert "Traceback" not in result.output
    line: str = lines[0]
    return line


def _aws_env(monkeypatch: pytest.MonkeyPatch, endpoint: str, key_id: str = "testing", secret: str = "testing") -> None:
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)


def _same_graft(store: GraftStore, graft_id: str, built: Any) -> None:
    """The stored graft's tensors are the built ones, bit for bit."""
    got = store.get(graft_id)
    expected = assemble([built.blocks[ref.key] for ref in built.manifest.blocks]) | built.tensors
    assert set(got.tensors) == set(expected)
    for name, tensor in expected.items():
        assert got.tensors[name].equal(tensor), name


# --- a TCP proxy that drops connections -------------------------------------------------------------------------


class CuttingProxy:
    """A loopback TCP proxy in front of `target_port` that can drop connections mid-request and go away.

    Armed with `arm(after_bytes, cuts)`, it forwards `after_bytes` more bytes from clients to the target, summed over
    every connection, then closes the connection that carries the next byte without forwarding it, `cuts` times at
    most (each retry is a fresh connection that is cut again until then). `stop` closes the listener and every
    connection (the endpoint is gone: connections are refused); `start` listens again on the same port.
    """

    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.port = _free_port()
        self.cuts = 0
        self._budget = math.inf
        self._cuts_left = 0.0
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def arm(self, after_bytes: int, cuts: float = math.inf) -> None:
        with self._lock:
            self._budget, self._cuts_left, self.cuts = after_bytes, cuts, 0

    def disarm(self) -> None:
        with self._lock:
            self._budget, self._cuts_left = math.inf, 0.0

    def start(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", self.port))  # SO_REUSEADDR: the same port again
        threading.Thread(target=self._accept, args=(self._listener,), daemon=True).start()

    def stop(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        with self._lock:
            open_sockets, self._sockets = list(self._sockets), set()
        for sock in open_sockets:
            _close(sock)

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # stopped
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                _close(client)
                continue
            with self._lock:
                self._sockets |= {client, upstream}
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _passing(self, size: int) -> tuple[int, bool]:
        """How many of `size` bytes from a client pass, and whether the connection is then cut."""
        with self._lock:
            if size <= self._budget or self._cuts_left <= 0:
                self._budget -= size
                return size, False
            self._cuts_left -= 1
            self.cuts += 1
            passing, self._budget = int(self._budget), 0
            return passing, True

    def _pump(self, source: socket.socket, sink: socket.socket, from_client: bool) -> None:
        try:
            while data := source.recv(65536):
                passing, cut = self._passing(len(data)) if from_client else (len(data), False)
                sink.sendall(data[:passing])
                if cut:
                    break  # mid-request: the rest never arrives
        except OSError:
            pass
        _close(source)
        _close(sink)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


@pytest.fixture
def proxy(s3_endpoint: str) -> Iterator[CuttingProxy]:
    """A cutting proxy in front of the session's S3 endpoint."""
    port = int(s3_endpoint.rsplit(":", 1)[1].split("/")[0])
    running = CuttingProxy(port)
    try:
        yield running
    finally:
        running.stop()


# --- 1. an endpoint that is not there, or never answers ---------------------------------------------------------


def test_an_unreachable_endpoint_is_one_error_line_on_the_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    port = _free_port()  # bound, then closed: nothing listens on it
    _aws_env(monkeypatch, f"http://127.0.0.1:{port}")
    line = _one_error_line(_cli("ls", "--store", "s3://kvgraft-faults/lib"))
    # A few retries with backoff, then the error: measured 0.4-0.7 s on loopback.
    assert re.fullmatch(
        rf"error: cannot reach http://127\.0\.0\.1:{port} for store s3://kvgraft-faults/lib "
        r"\(connection failed; gave up after 3 retries in \d+\.\d s\)",
        line,
    ), line


def test_an_endpoint_that_never_answers_fails_after_bounded_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    # It accepts connections (the kernel's backlog) but never answers: only the read timeout ends each attempt.
    with socket.create_server(("127.0.0.1", 0), backlog=64) as silent:
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        _aws_env(monkeypatch, endpoint)
        with pytest.raises(StoreError) as caught:
            S3Store("s3://kvgraft-faults/lib").ids()
    message = str(caught.value)
    assert message.startswith(f"cannot reach {endpoint} for store s3://kvgraft-faults/lib (no answer in time; gave up")
    assert "\n" not in message


# --- 2. wrong credentials ------------------------------------------------------------------------------------------


@dataclass
class AuthServer:
    """A moto server of our own that checks every request's credentials and the IAM policies behind them."""

    endpoint: str
    bucket: str
    writer: tuple[str, str]
    """An access key id and secret allowed s3:* on every bucket."""
    nobody: tuple[str, str]
    """A valid key of a user with no policy at all."""


@pytest.fixture(scope="module")
def auth_server() -> Iterator[AuthServer]:
    if _missing():
        pytest.skip(f"S3 tests need {', '.join(_missing())}: pip install 'moto[server]' obstore")
    import boto3

    with moto_server() as endpoint:
        # Set up without auth (moto's default), then turn it on: /moto-api/reset-auth with 0 makes every later
        # request check its signature against the IAM users' keys, and the action against their policies.
        session = {"endpoint_url": endpoint, "region_name": "us-east-1"}
        keys = {"aws_access_key_id": "setup", "aws_secret_access_key": "setup"}
        bucket = "kvgraft-auth"
        boto3.client("s3", **session, **keys).create_bucket(Bucket=bucket)
        iam = boto3.client("iam", **session, **keys)
        allow = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
        made = {}
        for user in ("writer", "nobody"):
            iam.create_user(UserName=user)
            if user == "writer":
                iam.put_user_policy(UserName=user, PolicyName="s3", PolicyDocument=json.dumps(allow))
            key = iam.create_access_key(UserName=user)["AccessKey"]
            made[user] = (key["AccessKeyId"], key["SecretAccessKey"])
        request = urllib.request.Request(
            f"{endpoint}/moto-api/reset-auth", data=b"0", method="POST", headers={"Content-Type": "text/plain"}
        )
        with urllib.request.urlopen(request, timeout=10):
            pass
        yield AuthServer(endpoint, bucket, made["writer"], made["nobody"])


def test_wrong_credentials_are_one_clear_error(auth_server: AuthServer, monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"s3://{auth_server.bucket}/lib"
    # The right key works (the control: this server does accept a correctly signed request)...
    _aws_env(monkeypatch, auth_server.endpoint, *auth_server.writer)
    store = S3Store(url)
    engine = _engine(store)
    built = engine.build(TEXT)
    graft_id, created = store.put(built.manifest, built.tensors, built.blocks)
    assert created
    _same_graft(store, graft_id, built)
    # ... a key it does not know, a wrong secret and a key without permissions are refused, each with one line.
    denied = f"access to store {url} denied"
    hint = "check the AWS credentials and their permissions"
    _aws_env(monkeypatch, auth_server.endpoint, "AKIAIOSFODNN7EXAMPLE", "wrong")
    line = _one_error_line(_cli("ls", "--store", url))
    assert line == f"error: {denied} (InvalidAccessKeyId): {hint}"
    _aws_env(monkeypatch, auth_server.endpoint, auth_server.writer[0], "wrong")
    with pytest.raises(StoreError, match=re.escape(f"{denied} (SignatureDoesNotMatch): {hint}")):
        S3Store(url).read_sidecar("index.json")
    _aws_env(monkeypatch, auth_server.endpoint, *auth_server.nobody)
    with pytest.raises(StoreError, match=re.escape(f"{denied} (AccessDenied): {hint}")):
        S3Store(url).read_sidecar("index.json")
    with pytest.raises(StoreError, match=re.escape(f"{denied} (HTTP 403): {hint}")):
        S3Store(url).get(graft_id)  # a HEAD first: its 403 has no body to name the code
    # moto also refuses the right key on a listing with a prefix (its signature check differs from boto3's and
    # obstore's there), so the control above puts and gets by id rather than listing.


# --- 3. a missing bucket ---------------------------------------------------------------------------------------------


def test_a_missing_bucket_is_one_line_naming_it(s3_client: Any) -> None:
    url = "s3://kvgraft-no-such-bucket/lib"
    expected = f"bucket kvgraft-no-such-bucket does not exist (store {url})"
    assert _one_error_line(_cli("ls", "--store", url)) == f"error: {expected}"
    store = S3Store(url)
    with pytest.raises(StoreError, match=re.escape(expected)):
        store.get("ab" * 32)  # a full id is looked up with a HEAD, whose bare 404 would read as "no graft"
    built = _engine(store).build(TEXT)
    with pytest.raises(StoreError, match=re.escape(expected)):
        store.put(built.manifest, built.tensors, built.blocks)


# --- 4. a connection dropped mid-upload ---------------------------------------------------------------------------


def test_a_connection_dropped_once_mid_upload_is_retried(s3_url: str, proxy: CuttingProxy) -> None:
    store = S3Store(s3_url, endpoint=proxy.url)
    built = _engine(store).build(TEXT)
    proxy.arm(after_bytes=100_000, cuts=1)  # past the first block or so, one upload is cut mid-body
    graft_id, created = store.put(built.manifest, built.tensors, built.blocks)
    assert created and proxy.cuts == 1
    proxy.disarm()
    _same_graft(store, graft_id, built)
    assert store.gc(0.0) == GcReport(0, 0, 0)  # nothing left over from the cut attempt


def test_a_connection_dropped_for_good_mid_upload_leaves_no_graft_and_gc_cleans_up(
    s3_url: str, s3_client: Any, proxy: CuttingProxy
) -> None:
    # One upload at a time, so that the blocks before the cut are whole and the ones after it never are.
    store = S3Store(s3_url, endpoint=proxy.url, fetch_workers=1)
    built = _engine(store).build(TEXT)
    proxy.arm(after_bytes=250_000)  # about three blocks of 66 kB, then every connection is cut, retries included
    with pytest.raises(StoreError) as caught:
        store.put(built.manifest, built.tensors, built.blocks)
    message = str(caught.value)
    assert re.fullmatch(
        rf"connection to {re.escape(proxy.url)} dropped while trying to write blocks/[0-9a-f]{{2}}/[0-9a-f]{{64}}"
        rf"\.safetensors in store {re.escape(s3_url)} \(gave up after 3 retries in \d+\.\d s\)",
        message,
    ), message
    assert proxy.cuts >= 4  # the first attempt and its three retries, each on a fresh connection, all cut
    proxy.disarm()  # the connection is back
    assert store.ids() == []
    with pytest.raises(NotFoundError):
        store.resolve(built.manifest.id)
    with pytest.raises(NotFoundError):
        store.get(built.manifest.id)
    listed = s3_client.list_objects_v2(Bucket=store.bucket, Prefix=f"{store.prefix}/blocks/").get("Contents", [])
    orphans = {item["Key"]: item["Size"] for item in listed}
    assert 0 < len(orphans) < len(built.manifest.blocks)  # the whole blocks before the cut, no partial object
    assert set(orphans.values()) == {max(orphans.values())}
    assert store.gc(grace_s=0.0) == GcReport(len(orphans), sum(orphans.values()), 0)
    assert s3_client.list_objects_v2(Bucket=store.bucket).get("KeyCount", 0) == 0
    graft_id, created = store.put(built.manifest, built.tensors, built.blocks)
    assert created and store.ids() == [graft_id]
    _same_graft(store, graft_id, built)


# --- 5. Redis killed mid-run ---------------------------------------------------------------------------------------


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A redis-server of this test's own on a free port (killed and restarted by the test), stopped at the end."""
    pytest.importorskip("redis", reason="the Redis tier needs the redis package: pip install redis")
    if shutil.which("redis-server") is None:
        pytest.skip("needs redis-server on PATH (apt-get install redis-server)")
    port = _free_port()
    server = RedisServer(f"redis://127.0.0.1:{port}/0", _start(port))
    try:
        _wait_for_ping(server)
        yield server
    finally:
        if server.process is not None:
            _stop(server.process)


def test_redis_killed_mid_run_fails_no_restore_and_is_used_again_once_back(
    s3_url: str, s3_client: Any, own_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    from kvgraft.store.redis_tier import RedisTier

    durable = S3Store(s3_url)
    tier = RedisTier(durable, own_redis.url, retry_after_s=0.0)  # no pause between tries: every request tries it
    engine = _engine(tier)
    put = engine.put(TEXT)
    direct = _engine(durable).generate(" and", put.id, PARAMS)
    expected = durable.get(put.id).tensors

    def restore(_: int) -> bool:
        got = tier.get(put.id).tensors
        return set(got) == set(expected) and all(got[name].equal(t) for name, t in expected.items())

    assert restore(0) and restore(0) and tier.hits > 0 and tier.errors == 0
    assert own_redis.process is not None
    own_redis.process.kill()  # SIGKILL: no goodbye on the open connections
    own_redis.process.wait(timeout=10)
    with caplog.at_level(logging.WARNING, logger="kvgraft.store.redis_tier"):
        with ThreadPoolExecutor(4) as pool:
            assert all(pool.map(restore, range(8)))  # concurrent restores, none fails
        result = engine.generate(" and", put.id, PARAMS)
    assert result.exact and result.receipt.logits_chain_sha256 == direct.receipt.logits_chain_sha256
    assert tier.errors > 0  # every failed Redis call counted
    warnings = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING  # one per outage, not one per request
    port = int(own_redis.url.rsplit(":", 1)[1].split("/")[0])
    own_redis.process = _start(port)  # back, empty (no persistence)
    _wait_for_ping(own_redis)
    errors = tier.errors
    with caplog.at_level(logging.INFO, logger="kvgraft.store.redis_tier"):
        assert restore(0)  # refills Redis
    assert any("is back" in r.getMessage() for r in caplog.records)
    hits = tier.hits
    assert restore(0) and tier.hits > hits and tier.errors == errors
    assert own_redis.client().dbsize() > 0


# --- 6. the server when its store goes away --------------------------------------------------------------------------


def test_the_server_answers_503_when_its_store_is_out_of_reach_and_recovers(
    s3_url: str, s3_client: Any, proxy: CuttingProxy
) -> None:
    engine = _engine(S3Store(s3_url, endpoint=proxy.url))
    graft_id = engine.put(TEXT).id
    body = {
        "model": MODEL,
        "prompt": " and",
        "max_tokens": 4,
        "kvgraft": {"grafts": [graft_id], "retrieve": False},
    }
    with (
        serve_in_thread(create_app(engine, ServerConfig(api_key=KEY))) as server,
        httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http,
    ):
        assert http.post("/v1/completions", json=body).status_code == 200
        proxy.stop()  # the endpoint goes away
        reply = http.post("/v1/completions", json=body)
        assert reply.status_code == 503, reply.text
        error = reply.json()["error"]
        assert (error["type"], error["code"], error["param"]) == ("server_unavailable", "store_unavailable", None)
        assert re.fullmatch(
            rf"cannot reach {re.escape(proxy.url)} for store <store> \(connection failed; gave up after 3 retries "
            r"in \d+\.\d s\)",
            error["message"],
        ), error["message"]
        assert s3_url not in reply.text  # the store's location is redacted, as a directory is
        health = http.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        proxy.start()  # back
        assert http.post("/v1/completions", json=body).status_code == 200
