"""Restoring the same graft from local disk, S3 and S3 behind the Redis block tier, side by side in one run.

Usage: python benchmarks/remote_store.py [--tokens 4096] [--layers 4] [--reps 5] [--endpoint URL] [--redis URL]
                                         [--json]

For each backend it reports the restore throughput (`store.get`: every block fetched, hash-checked and assembled)
next to the raw throughput of the same bytes from the same backend (local: read + SHA-256 of each file; S3: a
concurrent GET + SHA-256 of each object, with the store's own pool size; for the Redis rows the raw figure is S3's,
what the tier stands in for), their ratio, and the time to first token
of a one-token generation from the graft against recomputing the prefix. S3 is a real S3-compatible server: the
`--endpoint` given, else moto in server mode started on loopback (a Python server, so its absolute GB/s says little
about a real service; the ratio to a raw GET from the same server is what this measures). Redis is `--redis`, else a
`redis-server` started on loopback; "cold" empties Redis before each read, "warm" reads what the previous read left.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvgraft.core.sampling import SamplingParams
from kvgraft.engine.engine import Engine
from kvgraft.models.byte_tokenizer import build_byte_tokenizer
from kvgraft.store import GraftStore, LocalStore
from kvgraft.store.s3 import FETCH_WORKERS, S3Store

from _shapes import llama_1b_like

PROMPT = " What follows from this?"
ONE_TOKEN = SamplingParams(max_new_tokens=1)
CHUNK = 64


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for(port: int, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server on port {port} did not start") from None
            time.sleep(0.2)


@contextmanager
def _service(command: list[str], port: int) -> Iterator[None]:
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for(port, process)
        yield
    finally:
        process.terminate()
        process.wait(timeout=30)


@contextmanager
def _endpoints(endpoint: str | None, redis_url: str | None) -> Iterator[tuple[str, str | None]]:
    """The S3 endpoint and Redis URL given, or servers started here on loopback for the run."""
    if endpoint is None:
        port = _free_port()
        moto = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
        with _service(moto, port), _endpoints(f"http://127.0.0.1:{port}", redis_url) as found:
            yield found
        return
    if redis_url is None and subprocess.run(["which", "redis-server"], capture_output=True).returncode == 0:
        port = _free_port()
        command = ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"]
        with _service(command, port):
            yield endpoint, f"redis://127.0.0.1:{port}/0"
        return
    yield endpoint, redis_url


def _median_s(fn: Callable[[], Any], reps: int, before: Callable[[], None] | None = None) -> float:
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _raw_local(store: LocalStore, graft_id: str) -> Callable[[], None]:
    paths = [store.block_path(ref.key) for ref in store.manifest(graft_id).blocks]

    def read() -> None:
        for path in paths:
            hashlib.sha256(path.read_bytes()).digest()

    return read


def _raw_s3(store: S3Store, graft_id: str) -> Callable[[], None]:
    import obstore

    paths = [store.block_path(ref.key) for ref in store.manifest(graft_id).blocks]
    pool = ThreadPoolExecutor(max_workers=FETCH_WORKERS)

    def one(path: str) -> None:
        hashlib.sha256(obstore.get(store._store, path).bytes()).digest()

    def read() -> None:
        list(pool.map(one, paths))

    return read


def _ttft(engine: Engine, graft_id: str, text: str, reps: int) -> tuple[float, float]:
    grafted = statistics.median(
        engine.generate(PROMPT, graft_id=graft_id, params=ONE_TOKEN).timings["ttft_s"] for _ in range(reps)
    )
    fresh = statistics.median(engine.generate(text + PROMPT, params=ONE_TOKEN).timings["ttft_s"] for _ in range(reps))
    return grafted, fresh


def run(tokens: int, layers: int, reps: int, endpoint: str | None, redis_url: str | None) -> dict[str, Any]:
    model = llama_1b_like(layers=layers)
    tokenizer = build_byte_tokenizer()
    text = "".join(random.Random(0).choice("abcdefghij klmnopqrst") for _ in range(tokens - 1))
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp, _endpoints(endpoint, redis_url) as (s3_endpoint, redis):
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
        os.environ.setdefault("AWS_REGION", "us-east-1")
        bucket = f"kvgraft-bench-{uuid.uuid4().hex[:8]}"
        import boto3

        boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=bucket)
        local = LocalStore(Path(tmp) / "local")
        s3 = S3Store(f"s3://{bucket}/lib", endpoint=s3_endpoint)
        built = Engine(model, tokenizer, "bench", CHUNK, local).build(text)
        graft_id = local.put(built.manifest, built.tensors, built.blocks)[0]
        assert s3.put(built.manifest, built.tensors, built.blocks)[0] == graft_id
        size = sum(local.block_path(ref.key).stat().st_size for ref in built.manifest.blocks)
        backends: list[tuple[str, GraftStore, Callable[[], None], Callable[[], None] | None]] = [
            ("local", local, _raw_local(local, graft_id), None),
            ("s3", s3, _raw_s3(s3, graft_id), None),
        ]
        if redis is not None:
            import redis as redis_client

            from kvgraft.store.redis_tier import with_shared_cache

            flush = redis_client.Redis.from_url(redis).flushdb
            tier = with_shared_cache(s3, redis)
            backends += [
                ("s3+redis cold", tier, _raw_s3(s3, graft_id), lambda: flush()),
                ("s3+redis warm", tier, _raw_s3(s3, graft_id), None),
            ]
        for name, store, raw, before in backends:
            store.get(graft_id)  # one warm-up read (and, warm, the fill)
            restore_s = _median_s(lambda store=store: store.get(graft_id), reps, before)
            raw_s = _median_s(raw, reps)
            grafted, fresh = _ttft(Engine(model, tokenizer, "bench", CHUNK, store), graft_id, text, max(1, reps // 2))
            rows.append(
                {
                    "backend": name,
                    "bytes": size,
                    "restore_gb_s": size / restore_s / 1e9,
                    "raw_gb_s": size / raw_s / 1e9,
                    "raw_over_restore": restore_s / raw_s,
                    "ttft_graft_s": grafted,
                    "ttft_recompute_s": fresh,
                    "recompute_over_graft": fresh / grafted,
                }
            )
    return {"tokens": tokens, "layers": layers, "chunk": CHUNK, "reps": reps, "graft_id": graft_id, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--endpoint", default=None, help="an S3-compatible endpoint (default: moto on loopback)")
    parser.add_argument("--redis", default=None, help="redis://HOST:PORT/DB (default: redis-server on loopback)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = run(args.tokens, args.layers, args.reps, args.endpoint, args.redis)
    if args.json:
        print(json.dumps(result))
        return
    print(f"graft of {result['tokens']} tokens, {result['layers']} layers, medians of {result['reps']} reads")
    print(
        f"{'backend':<15}{'MB':>8}{'restore GB/s':>14}{'raw GB/s':>10}{'restore/raw':>13}{'TTFT graft':>12}"
        f"{'recompute':>11}{'speed-up':>10}"
    )
    for r in result["rows"]:
        print(
            f"{r['backend']:<15}{r['bytes'] / 1e6:>8.1f}{r['restore_gb_s']:>14.3f}{r['raw_gb_s']:>10.3f}"
            f"{r['raw_over_restore']:>12.2f}x{r['ttft_graft_s']:>11.3f}s{r['ttft_recompute_s']:>10.3f}s"
            f"{r['recompute_over_graft']:>9.1f}x"
        )


if __name__ == "__main__":
    main()
