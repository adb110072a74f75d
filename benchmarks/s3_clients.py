"""Which S3 client kvgraft's object store should use: obstore, s3fs (fsspec) or boto3, measured side by side.

Usage: python benchmarks/s3_clients.py [--small 64] [--big 4] [--big-mb 4] [--rounds 5] [--workers 8]
                                       [--mem-mb 32] [--endpoint URL] [--json]

The S3 server is `--endpoint` (or $KVGRAFT_TEST_S3_ENDPOINT; credentials from the usual AWS environment), else moto
in server mode started here on a free loopback port and always stopped. One bucket gets `--small` objects of a small
kvgraft block (2 layers x K,V x 4 kv-heads x head_dim 64 x 64 tokens in fp32: 256 KiB) and `--big` objects of
`--big-mb` MiB (a block of a larger model), random bytes (fp32 KV does not compress). Then, round-robin over the
clients in every round so drift hits them all alike, medians over `--rounds` rounds (after one warm-up round whose
bytes are checked):

- GET: all small objects fetched concurrently, at most `--workers` at once (a thread pool, or a semaphore for the
  async APIs), then all big ones; PUT: the same bytes written back the same way; HEAD: sequential calls, ms each;
- conditional create (`If-None-Match: *`): does the client expose it, and does the server reject a second create;
- memory: in a fresh process per client, the peak RSS growth while one `--mem-mb` MiB GET is received, and after
  making it a writable buffer (what `torch.frombuffer` wants), in multiples of the object's size.

Clients: obstore (sync API in a thread pool, as kvgraft's S3Store does, and its asyncio API), s3fs (its sync
`cat_file` from a thread pool, and fsspec's own batched `cat`/`pipe` concurrency, with s3fs's defaults and with
`max_concurrency=1`, which skips the HEAD that s3fs's `cat_file` makes before each GET) and boto3 (threads). Two
ceilings: "raw HTTP" (stdlib http.client GET/PUT/HEAD of presigned URLs of the same objects, each body read into
one preallocated buffer: close to the server's own limit, almost no client work) and "local file" (the same bytes
from the page cache). moto is a Python server sharing the machine's cores with the client, so the absolute MB/s are
moto's, and a client that burns CPU also slows the server; hence a second table, the client process's own CPU time
per request (server excluded), which does not depend on the server. s3fs is measured when it imports (install it in
a venv: `python3 -m venv --system-site-packages V && V/bin/pip install s3fs`, then run this with V/bin/python); else
its rows say it is missing.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import http.client
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import boto3
import obstore
from botocore.config import Config
from botocore.exceptions import ClientError
from obstore.exceptions import AlreadyExistsError, PreconditionError
from obstore.store import S3Store

ENDPOINT_ENV = "KVGRAFT_TEST_S3_ENDPOINT"
SMALL_BLOCK = 2 * 2 * 4 * 64 * 64 * 4
"""Bytes of a small block: 2 layers x (K, V) x 4 kv-heads x 64 tokens x head_dim 64 x 4 bytes (fp32)."""
MiB = 1 << 20
HEADS_PER_ROUND = 20
REGION = "us-east-1"


class NoConditionalCreate(Exception):
    """The client has no way to send `If-None-Match: *`."""


@dataclass
class Objects:
    """The benchmark's objects: keys and the bytes each holds."""

    small: dict[str, bytes]
    big: dict[str, bytes]

    def total(self, which: str) -> int:
        """Bytes in the `which` ("small" or "big") set."""
        return sum(len(data) for data in getattr(self, which).values())


class Client:
    """One way of talking to the bucket: the operations measured, all on keys of one bucket."""

    name = "?"

    def get_many(self, keys: Sequence[str]) -> list[Any]:
        """Fetch every key, at most `workers` at once; returns the objects' bytes (any buffer) in key order."""
        raise NotImplementedError

    def put_many(self, items: dict[str, bytes]) -> None:
        """Write every (key, bytes), at most `workers` at once."""
        raise NotImplementedError

    def head(self, key: str) -> int:
        """One HEAD; returns the object's size."""
        raise NotImplementedError

    def create(self, key: str, data: bytes) -> bool:
        """Write only if no object is there (`If-None-Match: *`); False when the server refused (one was there).

        Raises NoConditionalCreate when the client cannot send the condition.
        """
        raise NoConditionalCreate

    def close(self) -> None:
        """Release the client's pools."""


class Pooled(Client):
    """A client whose blocking calls run in a bounded thread pool (kvgraft's S3Store does this with obstore)."""

    def __init__(self, workers: int) -> None:
        self.pool = ThreadPoolExecutor(workers)

    def get_one(self, key: str) -> Any:
        raise NotImplementedError

    def put_one(self, key: str, data: bytes) -> None:
        raise NotImplementedError

    def get_many(self, keys: Sequence[str]) -> list[Any]:
        return list(self.pool.map(self.get_one, keys))

    def put_many(self, items: dict[str, bytes]) -> None:
        list(self.pool.map(self.put_one, items.keys(), items.values()))

    def close(self) -> None:
        self.pool.shutdown()


class LocalFiles(Pooled):
    """The same bytes from files in the page cache: the ceiling of any network client on this machine."""

    name = "local file (ceiling)"

    def __init__(self, workers: int, directory: Path) -> None:
        super().__init__(workers)
        self.directory = directory

    def get_one(self, key: str) -> bytes:
        return (self.directory / key).read_bytes()

    def put_one(self, key: str, data: bytes) -> None:
        path = self.directory / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    def head(self, key: str) -> int:
        return (self.directory / key).stat().st_size


class RawHttp(Pooled):
    """http.client on presigned URLs, a kept-alive connection per thread, each body read straight into one
    preallocated buffer: one request per operation and as little client work as Python allows, the server's ceiling.
    """

    name = "raw HTTP (http.client, ceiling)"

    def __init__(self, workers: int, endpoint: str, bucket: str) -> None:
        super().__init__(workers)
        self.signer = _boto3_client(endpoint, workers)
        self.bucket = bucket
        self.endpoint = urlsplit(endpoint)
        self.local = threading.local()
        self._urls: dict[tuple[str, str], str] = {}

    def path(self, method: str, key: str) -> str:
        """A presigned path and query, made once per (method, key) so signing stays out of the timings."""
        if (method, key) not in self._urls:
            params = {"Bucket": self.bucket, "Key": key}
            url = urlsplit(self.signer.generate_presigned_url(method, Params=params, ExpiresIn=3600))
            self._urls[method, key] = f"{url.path}?{url.query}"
        return self._urls[method, key]

    def request(self, verb: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None) -> Any:
        """One request on this thread's connection; the response, its body not read yet."""
        connection = getattr(self.local, "connection", None)
        if connection is None:
            kind = http.client.HTTPSConnection if self.endpoint.scheme == "https" else http.client.HTTPConnection
            connection = self.local.connection = kind(self.endpoint.netloc, timeout=120)
        connection.request(verb, path, body=body, headers=headers or {})
        return connection.getresponse()

    def get_one(self, key: str) -> bytearray:
        response = self.request("GET", self.path("get_object", key))
        buffer = bytearray(int(response.getheader("content-length")))
        view, got = memoryview(buffer), 0
        while got < len(buffer):
            n = response.readinto(view[got:])
            if not n:
                raise OSError(f"GET {key}: connection closed after {got} of {len(buffer)} bytes")
            got += n
        response.read()
        if response.status != 200:
            raise OSError(f"GET {key}: HTTP {response.status}")
        return buffer

    def _put(self, key: str, data: bytes, headers: dict[str, str]) -> int:
        response = self.request("PUT", self.path("put_object", key), data, headers)
        response.read()
        return int(response.status)

    def put_one(self, key: str, data: bytes) -> None:
        status = self._put(key, data, {})
        if status != 200:
            raise OSError(f"PUT {key}: HTTP {status}")

    def head(self, key: str) -> int:
        response = self.request("HEAD", self.path("head_object", key))
        response.read()
        if response.status != 200:
            raise OSError(f"HEAD {key}: HTTP {response.status}")
        return int(response.getheader("content-length"))

    def create(self, key: str, data: bytes) -> bool:
        status = self._put(key, data, {"If-None-Match": "*"})
        if status in (409, 412):
            return False
        if status != 200:
            raise OSError(f"PUT {key}: HTTP {status}")
        return True


def _obstore(endpoint: str, bucket: str) -> S3Store:
    """An obstore S3Store configured as kvgraft's (credentials and region from the AWS environment)."""
    return S3Store(
        bucket,
        config={"endpoint": endpoint, "region": os.environ.get("AWS_REGION", REGION)},
        client_options={"allow_http": endpoint.startswith("http://")},
    )


class ObstoreSync(Pooled):
    """obstore's blocking API in a thread pool: what kvgraft's S3Store does (it releases the GIL while it waits)."""

    name = "obstore (sync, threads)"

    def __init__(self, workers: int, endpoint: str, bucket: str) -> None:
        super().__init__(workers)
        self.store = _obstore(endpoint, bucket)

    def get_one(self, key: str) -> obstore.Bytes:
        return obstore.get(self.store, key).bytes()

    def put_one(self, key: str, data: bytes) -> None:
        obstore.put(self.store, key, data)

    def head(self, key: str) -> int:
        return int(obstore.head(self.store, key)["size"])

    def create(self, key: str, data: bytes) -> bool:
        try:
            obstore.put(self.store, key, data, mode="create")
        except (AlreadyExistsError, PreconditionError):
            return False
        return True


class ObstoreAsync(Client):
    """obstore's asyncio API: every request in one event loop, at most `workers` in flight."""

    name = "obstore (asyncio)"

    def __init__(self, workers: int, endpoint: str, bucket: str) -> None:
        self.workers = workers
        self.store = _obstore(endpoint, bucket)
        self.loop = asyncio.new_event_loop()

    def _bounded(self, calls: list[Callable[[], Any]]) -> list[Any]:
        async def run_all() -> list[Any]:
            gate = asyncio.Semaphore(self.workers)

            async def one(call: Callable[[], Any]) -> Any:
                async with gate:
                    return await call()

            return await asyncio.gather(*(one(call) for call in calls))

        return self.loop.run_until_complete(run_all())

    async def _get(self, key: str) -> obstore.Bytes:
        result = await obstore.get_async(self.store, key)
        return await result.bytes_async()

    def get_many(self, keys: Sequence[str]) -> list[Any]:
        return self._bounded([lambda key=key: self._get(key) for key in keys])

    def put_many(self, items: dict[str, bytes]) -> None:
        self._bounded([lambda k=k, d=d: obstore.put_async(self.store, k, d) for k, d in items.items()])

    def _in_loop(self, call: Callable[[], Any]) -> Any:
        # obstore's async calls need a running loop when called, not only when awaited.
        async def run() -> Any:
            return await call()

        return self.loop.run_until_complete(run())

    def head(self, key: str) -> int:
        return int(self._in_loop(lambda: obstore.head_async(self.store, key))["size"])

    def create(self, key: str, data: bytes) -> bool:
        try:
            self._in_loop(lambda: obstore.put_async(self.store, key, data, mode="create"))
        except (AlreadyExistsError, PreconditionError):
            return False
        return True

    def close(self) -> None:
        self.loop.close()


def _s3fs(endpoint: str, workers: int, max_concurrency: int | None) -> Any:
    import s3fs  # optional: measured only where installed

    options: dict[str, Any] = {"max_concurrency": max_concurrency} if max_concurrency else {}
    return s3fs.S3FileSystem(
        endpoint_url=endpoint,
        client_kwargs={"region_name": os.environ.get("AWS_REGION", REGION)},
        config_kwargs={"max_pool_connections": workers * 2},
        skip_instance_cache=True,
        use_listings_cache=False,
        **options,
    )


def _s3fs_create(fs: Any, path: str, data: bytes) -> bool:
    """s3fs's exclusive write (`pipe_file(mode="create")`, s3fs >= 2024.12); False when the object was there."""
    try:
        fs.pipe_file(path, data, mode="create")
    except FileExistsError:
        return False
    except OSError as exc:  # s3fs maps some S3 errors to a plain OSError
        if "PreconditionFailed" in str(exc) or "412" in str(exc):
            return False
        raise
    except TypeError as exc:  # an s3fs without the mode argument
        raise NoConditionalCreate from exc
    return True


class S3fsThreads(Pooled):
    """s3fs's blocking `cat_file`/`pipe_file` from a thread pool (each call runs on fsspec's event loop thread)."""

    name = "s3fs cat_file (threads)"

    def __init__(self, workers: int, endpoint: str, bucket: str) -> None:
        super().__init__(workers)
        self.fs = _s3fs(endpoint, workers, None)
        self.bucket = bucket

    def get_one(self, key: str) -> bytes:
        return self.fs.cat_file(f"{self.bucket}/{key}")

    def put_one(self, key: str, data: bytes) -> None:
        self.fs.pipe_file(f"{self.bucket}/{key}", data)

    def head(self, key: str) -> int:
        return int(self.fs.info(f"{self.bucket}/{key}")["size"])

    def create(self, key: str, data: bytes) -> bool:
        return _s3fs_create(self.fs, f"{self.bucket}/{key}", data)


class S3fsBatch(Client):
    """fsspec's own concurrency: one `cat(paths, batch_size=workers)` / `pipe({...}, batch_size=workers)` call."""

    def __init__(self, workers: int, endpoint: str, bucket: str, max_concurrency: int | None) -> None:
        self.workers = workers
        self.fs = _s3fs(endpoint, workers, max_concurrency)
        self.bucket = bucket
        self.name = "s3fs cat (batch)" + (f", max_concurrency={max_concurrency}" if max_concurrency else "")

    def get_many(self, keys: Sequence[str]) -> list[Any]:
        found = self.fs.cat([f"{self.bucket}/{key}" for key in keys], batch_size=self.workers, on_error="raise")
        return [found[f"{self.bucket}/{key}"] for key in keys]

    def put_many(self, items: dict[str, bytes]) -> None:
        self.fs.pipe({f"{self.bucket}/{k}": d for k, d in items.items()}, batch_size=self.workers)

    def head(self, key: str) -> int:
        return int(self.fs.info(f"{self.bucket}/{key}")["size"])

    def create(self, key: str, data: bytes) -> bool:
        return _s3fs_create(self.fs, f"{self.bucket}/{key}", data)


def _boto3_client(endpoint: str, workers: int) -> Any:
    config = Config(max_pool_connections=workers * 2, region_name=os.environ.get("AWS_REGION", REGION))
    return boto3.client("s3", endpoint_url=endpoint, config=config)


class Boto3Threads(Pooled):
    """boto3's client (thread-safe) from a thread pool."""

    name = "boto3 (threads)"

    def __init__(self, workers: int, endpoint: str, bucket: str) -> None:
        super().__init__(workers)
        self.s3 = _boto3_client(endpoint, workers)
        self.bucket = bucket

    def get_one(self, key: str) -> bytes:
        return self.s3.get_object(Bucket=self.bucket, Key=key)["Body"].read()

    def put_one(self, key: str, data: bytes) -> None:
        self.s3.put_object(Bucket=self.bucket, Key=key, Body=data)

    def head(self, key: str) -> int:
        return int(self.s3.head_object(Bucket=self.bucket, Key=key)["ContentLength"])

    def create(self, key: str, data: bytes) -> bool:
        try:
            self.s3.put_object(Bucket=self.bucket, Key=key, Body=data, IfNoneMatch="*")
        except ClientError as exc:
            if exc.response["Error"]["Code"] in ("PreconditionFailed", "ConditionalRequestConflict"):
                return False
            raise
        return True


HAVE_S3FS = importlib.util.find_spec("s3fs") is not None
CLIENT_KINDS = ("local", "raw", "obstore", "obstore-async", "s3fs", "s3fs-cat", "s3fs-cat-mc1", "boto3")
KIND_NAMES = {
    "local": LocalFiles.name,
    "raw": RawHttp.name,
    "obstore": ObstoreSync.name,
    "obstore-async": ObstoreAsync.name,
    "s3fs": S3fsThreads.name,
    "s3fs-cat": "s3fs cat (batch)",
    "s3fs-cat-mc1": "s3fs cat (batch), max_concurrency=1",
    "boto3": Boto3Threads.name,
}


def make_client(kind: str, workers: int, endpoint: str, bucket: str, local_dir: Path) -> Client | None:
    """The client of a kind; None for an s3fs kind when s3fs is not installed."""
    if kind.startswith("s3fs") and not HAVE_S3FS:
        return None
    factories: dict[str, Callable[[], Client]] = {
        "local": lambda: LocalFiles(workers, local_dir),
        "raw": lambda: RawHttp(workers, endpoint, bucket),
        "obstore": lambda: ObstoreSync(workers, endpoint, bucket),
        "obstore-async": lambda: ObstoreAsync(workers, endpoint, bucket),
        "s3fs": lambda: S3fsThreads(workers, endpoint, bucket),
        "s3fs-cat": lambda: S3fsBatch(workers, endpoint, bucket, None),
        "s3fs-cat-mc1": lambda: S3fsBatch(workers, endpoint, bucket, 1),
        "boto3": lambda: Boto3Threads(workers, endpoint, bucket),
    }
    return factories[kind]()


# --- the S3 server ---


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def s3_endpoint(given: str | None) -> Iterator[str]:
    """The endpoint given, else moto in server mode on a free loopback port, stopped on exit (errors included)."""
    if given:
        yield given
        return
    for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing")):
        os.environ.setdefault(name, value)  # moto accepts any credentials
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("moto server did not start (pip install 'moto[server]')") from None
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


@contextmanager
def fresh_bucket(endpoint: str) -> Iterator[str]:
    """A new bucket, emptied and removed on exit (so a real endpoint is left as it was)."""
    s3 = _boto3_client(endpoint, 4)
    bucket = f"kvgraft-bench-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=bucket)
    try:
        yield bucket
    finally:
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            for item in page.get("Contents", []):
                s3.delete_object(Bucket=bucket, Key=item["Key"])
        s3.delete_bucket(Bucket=bucket)


# --- measurements ---


@dataclass
class Row:
    """One client's medians."""

    name: str
    seconds: dict[str, list[float]] = field(default_factory=dict)
    cpu: dict[str, list[float]] = field(default_factory=dict)
    """Process CPU seconds (every thread of this client process, the server excluded) per operation."""
    head_ms: list[float] = field(default_factory=list)
    create: str = "-"
    memory: str = "-"
    missing: str | None = None

    def median(self, op: str) -> float:
        return statistics.median(self.seconds[op])


def upload(objects: Objects, endpoint: str, bucket: str, local_dir: Path, workers: int) -> None:
    """Put every object in the bucket (with boto3, a client outside the comparison's hot path) and on disk."""
    uploader = Boto3Threads(workers, endpoint, bucket)
    local = LocalFiles(workers, local_dir)
    try:
        for items in (objects.small, objects.big):
            uploader.put_many(items)
            local.put_many(items)
    finally:
        uploader.close()
        local.close()


def _same_bytes(got: list[Any], expected: dict[str, bytes], name: str) -> None:
    for buffer, (key, data) in zip(got, expected.items(), strict=True):
        if memoryview(buffer).tobytes() != data:
            raise SystemExit(f"{name} returned wrong bytes for {key}")


def _timed(call: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process, all threads) of one call."""
    start, cpu = time.perf_counter(), time.process_time()
    call()
    return time.perf_counter() - start, time.process_time() - cpu


def measure_round(client: Client, row: Row, objects: Objects, warmup: bool) -> None:
    """One round of every timed operation for one client (the warm-up round checks bytes and records nothing)."""
    ops: dict[str, Callable[[], object]] = {}
    for which in ("small", "big"):
        items: dict[str, bytes] = getattr(objects, which)
        puts = {f"put/{uuid.uuid5(uuid.NAMESPACE_URL, row.name).hex[:8]}/{key}": data for key, data in items.items()}
        ops[f"get_{which}"] = lambda items=items: client.get_many(list(items))
        ops[f"put_{which}"] = lambda puts=puts: client.put_many(puts)
    if warmup:
        for which in ("small", "big"):
            items = getattr(objects, which)
            _same_bytes(client.get_many(list(items)), items, row.name)
        ops["put_small"]()
        ops["put_big"]()
        client.head(next(iter(objects.small)))
        return
    for op, call in ops.items():
        wall, cpu = _timed(call)
        row.seconds.setdefault(op, []).append(wall)
        row.cpu.setdefault(op, []).append(cpu)
    key = next(iter(objects.small))
    heads_cpu = 0.0
    for _ in range(HEADS_PER_ROUND):
        wall, cpu = _timed(lambda: client.head(key))
        row.head_ms.append(wall * 1000)
        heads_cpu += cpu
    row.cpu.setdefault("head", []).append(heads_cpu / HEADS_PER_ROUND)


def check_create(client: Client) -> str:
    """Whether the client sends `If-None-Match: *` and the server refuses a second create of one key."""
    key = f"create/{uuid.uuid4().hex}"
    try:
        first = client.create(key, b"one")
    except NoConditionalCreate:
        return "no API"
    second = client.create(key, b"two")
    if first and not second:
        return "yes (2nd refused)"
    return f"sent, but server answered created={first}, {second}"


# --- memory, in a fresh process per client ---


def _proc_kib(field_name: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field_name} in /proc/self/status")


def _reset_peak() -> None:
    # Writing 5 to clear_refs resets VmHWM (peak RSS) to the current RSS (Linux >= 4.0).
    Path("/proc/self/clear_refs").write_text("5")


def peak_rss_child(args: argparse.Namespace) -> dict[str, float]:
    """In this (fresh) process: peak RSS growth of one GET of `key`, and after making it writable, per object byte."""
    key, warm_key = args.key, args.warm_key
    client = make_client(args.peak_rss, args.workers, args.endpoint, args.bucket, Path(args.local_dir))
    assert client is not None
    get_one: Callable[[str], Any] = getattr(client, "get_one", lambda k: client.get_many([k])[0])
    get_one(warm_key)  # connections, lazy imports and the client's buffers are in place before the baseline
    gc.collect()
    _reset_peak()
    base = _proc_kib("VmRSS")
    buffer = get_one(key)
    size = memoryview(buffer).nbytes
    received = _proc_kib("VmHWM") - base
    held = _proc_kib("VmRSS") - base
    _reset_peak()
    writable = buffer if isinstance(buffer, bytearray) else bytearray(buffer)
    as_writable = _proc_kib("VmHWM") - base
    del writable, buffer
    client.close()
    return {"received": received * 1024 / size, "held": held * 1024 / size, "writable": as_writable * 1024 / size}


def peak_rss(kind: str, workers: int, endpoint: str, bucket: str, local_dir: Path, keys: tuple[str, str]) -> str:
    """The child's figures as table text ("peak x / held x / writable x" of the object's size).

    Args:
        keys: (the object measured, a small object fetched first to warm the client up).
    """
    command = [sys.executable, __file__, "--peak-rss", kind, "--workers", str(workers), "--endpoint", endpoint]
    command += ["--bucket", bucket, "--local-dir", str(local_dir), "--key", keys[0], "--warm-key", keys[1]]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        return "n/a (" + (done.stderr.strip().splitlines() or ["failed"])[-1][:40] + ")"
    figures = json.loads(done.stdout)
    return f"{figures['received']:.1f} / {figures['held']:.1f} / {figures['writable']:.1f}"


# --- the run ---


def run(args: argparse.Namespace) -> list[Row]:
    """Every measurement, on the endpoint given or a moto server of its own."""
    rng = os.urandom
    objects = Objects(
        small={f"blocks/{i:02x}/small-{i:04d}.safetensors": rng(SMALL_BLOCK) for i in range(args.small)},
        big={f"blocks/{i:02x}/big-{i:04d}.safetensors": rng(args.big_mb * MiB) for i in range(args.big)},
    )
    mem_key, warm_key = "mem/one.bin", next(iter(objects.small))
    endpoint_given = args.endpoint or os.environ.get(ENDPOINT_ENV)
    os.environ.setdefault("AWS_REGION", REGION)
    os.environ.setdefault("AWS_DEFAULT_REGION", REGION)
    with (
        s3_endpoint(endpoint_given) as endpoint,
        fresh_bucket(endpoint) as bucket,
        tempfile.TemporaryDirectory() as local,
    ):
        local_dir = Path(local)
        upload(objects, endpoint, bucket, local_dir, args.workers)
        upload(Objects(small={mem_key: rng(args.mem_mb * MiB)}, big={}), endpoint, bucket, local_dir, args.workers)
        rows = [Row(KIND_NAMES[kind]) for kind in CLIENT_KINDS]
        clients = [make_client(kind, args.workers, endpoint, bucket, local_dir) for kind in CLIENT_KINDS]
        try:
            for row, client in zip(rows, clients, strict=True):
                if client is None:
                    row.missing = "s3fs not installed"
                    continue
                measure_round(client, row, objects, warmup=True)
                row.create = "n/a" if isinstance(client, LocalFiles) else check_create(client)
            live = [(row, client) for row, client in zip(rows, clients, strict=True) if client is not None]
            for round_no in range(args.rounds):
                shift = round_no % len(live)  # a different client goes first each round
                for row, client in live[shift:] + live[:shift]:
                    measure_round(client, row, objects, warmup=False)
        finally:
            for client in clients:
                if client is not None:
                    client.close()
        for kind, row in zip(CLIENT_KINDS, rows, strict=True):
            if row.missing is None and kind not in ("obstore-async", "s3fs-cat", "s3fs-cat-mc1"):
                row.memory = peak_rss(kind, args.workers, endpoint, bucket, local_dir, (mem_key, warm_key))
    return rows


def print_table(lines: list[list[str]]) -> None:
    """Rows of cells in aligned columns, the first row a header."""
    widths = [max(len(line[i]) for line in lines if len(line) > i) for i in range(len(lines[0]))]
    for n, line in enumerate(lines):
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=False)).rstrip())
        if n == 0:
            print("  ".join("-" * width for width in widths))


def report(rows: list[Row], objects_desc: str, args: argparse.Namespace) -> None:
    """Two tables: MB/s (10^6 bytes/s) and client CPU per request, each with the ratio to obstore's sync API."""
    reference = next(row for row in rows if row.name == ObstoreSync.name)
    counts = {"get_small": args.small, "get_big": args.big, "put_small": args.small, "put_big": args.big}
    sizes = {op: count * (SMALL_BLOCK if op.endswith("small") else args.big_mb * MiB) for op, count in counts.items()}
    print(objects_desc)
    print("\nThroughput: MB/s = 10^6 B/s, medians over rounds; (Nx) = speed relative to obstore sync, >1 is faster")
    lines = [["client", "GET small", "GET big", "PUT small", "PUT big", "HEAD ms", "If-None-Match:*", "RSS/GET"]]
    for row in rows:
        if row.missing:
            continue
        cells = [row.name]
        for op, size in sizes.items():
            rate = size / row.median(op) / 1e6
            cells.append(f"{rate:6.0f} ({reference.median(op) / row.median(op):.2f}x)")
        head = statistics.median(row.head_ms)
        cells.append(f"{head:5.2f} ({statistics.median(reference.head_ms) / head:.2f}x)")
        lines.append([*cells, row.create, row.memory])
    print_table(lines)
    for row in rows:
        if row.missing:
            print(f"skipped {row.name}: {row.missing}")
    print(
        f"RSS/GET: peak RSS growth while one {args.mem_mb} MiB GET is received / RSS held after it / peak once made"
        " writable (bytearray), in multiples of the object size, a fresh process per client"
    )
    print(
        "\nClient CPU per request: ms of this process's CPU time (all threads, the server excluded), medians;"
        " (Nx) = obstore's CPU / this one's, >1 is cheaper"
    )
    lines = [["client", "GET small", "GET big", "PUT small", "PUT big", "HEAD"]]
    for row in rows:
        if row.missing:
            continue
        cells = [row.name]
        for op, count in [*counts.items(), ("head", 1)]:
            mine, theirs = statistics.median(row.cpu[op]) / count, statistics.median(reference.cpu[op]) / count
            cells.append(f"{mine * 1000:6.2f} ({theirs / mine:.2f}x)" if mine > 0 else "0")
        lines.append(cells)
    print_table(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=int, default=64, help="small objects (256 KiB each)")
    parser.add_argument("--big", type=int, default=4, help="big objects")
    parser.add_argument("--big-mb", type=int, default=4, help="MiB per big object")
    parser.add_argument("--mem-mb", type=int, default=32, help="MiB of the object the memory figure GETs")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workers", type=int, default=8, help="requests in flight at once")
    parser.add_argument("--endpoint", help=f"an S3 endpoint URL (default ${ENDPOINT_ENV}, else moto started here)")
    parser.add_argument("--json", action="store_true", help="print the raw timings as JSON too")
    for hidden in ("--peak-rss", "--bucket", "--local-dir", "--key", "--warm-key"):  # the memory child's arguments
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peak_rss:
        figures = peak_rss_child(args)
        print(json.dumps(figures))
        return
    started = time.perf_counter()
    rows = run(args)
    describe = (
        f"{args.small} x {SMALL_BLOCK // 1024} KiB + {args.big} x {args.big_mb} MiB objects, {args.workers} in flight,"
        f" {args.rounds} rounds, endpoint {args.endpoint or os.environ.get(ENDPOINT_ENV) or 'moto (loopback)'},"
        f" {os.cpu_count()} CPUs, {time.perf_counter() - started:.0f} s"
    )
    report(rows, describe, args)
    if args.json:
        print(json.dumps([row.__dict__ for row in rows]))


if __name__ == "__main__":
    main()
