"""Two `kvgraft serve` replicas on one shared store (S3, with the Redis tier) behave as one service.

A graft POSTed to replica A is usable on replica B at once (B's library view reloads when the store's change token
moves: one HEAD per request, no timer); the receipt of a generation B served is answered by A from the store; a
delete on B is seen on A. Driven by the official `openai` client against two real server processes.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from kvgraft.engine.engine import Engine
from kvgraft.engine.verify import verify_receipt
from kvgraft.format.receipt import parse_receipt
from kvgraft.server import ServerConfig, create_app
from kvgraft.store.s3 import S3Store

from conftest import TEST_CHUNK, TEXT, cached_model

MODEL = "random:llama"
KEY = "replica-key"


@dataclass
class Replica:
    url: str
    process: subprocess.Popen[bytes]
    client: OpenAI
    http: httpx.Client


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _start(store: str, redis_url: str, log: Path) -> Replica:
    port = _free_port()
    command = [sys.executable, "-m", "kvgraft.cli", "serve", "--model", MODEL, "--store", store, "-C", str(TEST_CHUNK)]
    command += ["--shared-cache", redis_url, "--port", str(port), "--log-level", "warning"]
    env = os.environ | {"KVGRAFT_API_KEY": KEY, "HF_HUB_OFFLINE": "1"}
    with log.open("wb") as sink:
        process = subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    deadline = time.monotonic() + 120
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"replica exited with {process.returncode}: {log.read_text()[-2000:]}")
        try:
            if http.get("/health").status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"replica did not answer within 120 s: {log.read_text()[-2000:]}")
        time.sleep(0.2)
    client = OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
    return Replica(url, process, client, http)


def _stop(replica: Replica) -> None:
    replica.http.close()
    replica.process.terminate()
    try:
        replica.process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        replica.process.kill()
        replica.process.wait()


@pytest.fixture
def replicas(s3_url: str, redis_url: str, tmp_path: Path) -> Iterator[tuple[Replica, Replica]]:
    started: list[Replica] = []
    try:
        for name in ("a", "b"):
            started.append(_start(s3_url, redis_url, tmp_path / f"replica-{name}.log"))
        yield started[0], started[1]
    finally:
        for replica in started:
            _stop(replica)


def _kv(reply: Any) -> dict[str, Any]:
    return dict(reply.model_extra["kvgraft"])


def test_two_serve_replicas_on_s3_and_redis_are_one_service(
    replicas: tuple[Replica, Replica], s3_url: str, tmp_path: Path
) -> None:
    a, b = replicas
    posted = a.http.post("/v1/grafts", json={"text": TEXT, "metadata": {"title": "grafts"}})
    assert posted.status_code == 201, posted.text
    made = posted.json()
    other = a.http.post("/v1/grafts", json={"text": "Glaciers carve valleys.", "metadata": {"title": "ice"}})
    assert other.status_code == 201, other.text

    # B lists it and completes from it at once: its library view follows the store's change token.
    assert b.http.get(f"/v1/grafts/{made['id']}").status_code == 200
    prompt = " And so the reader"
    grafted = b.client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=8,
        extra_body={"kvgraft": {"grafts": [made["id"][:12]], "include_receipt": True}},
    )
    info = _kv(grafted)
    assert info["exact"] is True and [g["id"] for g in info["grafts"]] == [made["id"]]
    fresh = a.client.completions.create(
        model=MODEL,
        prompt=TEXT + prompt,
        max_tokens=8,
        extra_body={"kvgraft": {"retrieve": False, "include_receipt": True}},
    )
    assert _kv(fresh)["receipt"]["logits_chain_sha256"] == info["receipt"]["logits_chain_sha256"]
    assert grafted.choices[0].text == fresh.choices[0].text

    # A answers the receipt B wrote to the shared store, and it re-verifies.
    receipt_id = info["receipt"]["id"]
    got = a.http.get(f"/v1/receipts/{receipt_id}")
    assert got.status_code == 200 and got.json() == info["receipt"]
    saved = tmp_path / "receipt.json"
    saved.write_text(got.text)
    model, tokenizer = cached_model(MODEL)
    checked = verify_receipt(Engine(model, tokenizer, MODEL, TEST_CHUNK), parse_receipt(saved.read_text(), "r"))
    assert checked.tokens_equal and checked.logits_equal

    # Retrieval on B finds the graft A stored; a delete on B is seen on A.
    retrieved = b.client.completions.create(
        model=MODEL,
        prompt=" How does a restored state continue?",
        max_tokens=2,
        extra_body={"kvgraft": {"min_score": 0}},
    )
    assert [g["id"] for g in _kv(retrieved)["grafts"]] == [made["id"]]
    assert b.http.delete(f"/v1/grafts/{made['id']}").status_code in (200, 204)
    assert a.http.get(f"/v1/grafts/{made['id']}").status_code == 404
    with pytest.raises(openai.NotFoundError):
        a.client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=2, extra_body={"kvgraft": {"grafts": [made["id"]]}}
        )
    assert S3Store(s3_url).ids() == [other.json()["id"]]


def test_receipts_live_in_the_store_so_every_app_on_it_answers(s3_url: str) -> None:
    from fastapi.testclient import TestClient

    model, tokenizer = cached_model(MODEL)
    apps = [
        create_app(Engine(model, tokenizer, MODEL, TEST_CHUNK, S3Store(s3_url)), ServerConfig(api_key=KEY))
        for _ in range(2)
    ]
    with TestClient(apps[0]) as first, TestClient(apps[1]) as second:
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "kvgraft": {"include_receipt": True}}
        receipt = first.post("/v1/completions", json=body).json()["kvgraft"]["receipt"]
        assert second.get(f"/v1/receipts/{receipt['id']}").json() == receipt
        stored = S3Store(s3_url).read_sidecar(f"receipts/{receipt['id']}.json")
        assert stored is not None and parse_receipt(stored.decode(), "s3").id == receipt["id"]
        assert second.get(f"/v1/receipts/{'0' * 64}").status_code == 404
