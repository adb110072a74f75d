"""The server under bad input, overload and failure: each a precise 4xx/5xx with an OpenAI-style body, and the
server still serving afterwards. Plain httpx, so that malformed bodies reach the server as sent."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI
from typer.testing import CliRunner

from kvgraft.cli import app as cli_app
from kvgraft.engine.engine import Engine
from kvgraft.server import ServerConfig, create_app
from kvgraft.server.background import RunningServer, serve_in_thread
from kvgraft.store import LocalStore

from conftest import TEST_CHUNK, TEXT, cached_model

MODEL = "random:llama"
KEY = "limits-key"
LIMIT_TOKENS = 32
BODY_LIMIT = 16 * 1024
ROOT = Path(__file__).resolve().parents[1]


def make_engine(store: Path) -> Engine:
    model, tokenizer = cached_model(MODEL)
    return Engine(model, tokenizer, MODEL, TEST_CHUNK, LocalStore(store))


@contextmanager
def running(engine: Engine, **config: Any) -> Iterator[tuple[RunningServer, Any]]:
    app = create_app(engine, ServerConfig(**config))
    with serve_in_thread(app) as server:
        yield server, app.state.kvgraft


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(url, id of a stored graft)"""
    engine = make_engine(tmp_path_factory.mktemp("limits") / "store")
    graft = engine.put(TEXT).id
    with running(
        engine, api_key=KEY, max_tokens_limit=LIMIT_TOKENS, max_body_bytes=BODY_LIMIT, default_completion_tokens=4
    ) as (srv, _):
        yield srv.url, graft


def error(message: str, param: str | None, code: str, type_: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 2} | fields


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2} | fields


GRAFT = "<graft>"  # replaced by the stored graft's id
# (method, path, body: JSON-able or raw bytes, status, error body)
BAD_INPUT: list[tuple[str, str, Any, int, dict[str, Any]]] = [
    (
        "POST",
        "/v1/completions",
        b'{"model": ',
        400,
        error("request body is not valid JSON: Expecting value at position 10", None, "invalid_json"),
    ),
    (
        "POST",
        "/v1/completions",
        b"",
        400,
        error("request body is not valid JSON: Expecting value at position 0", None, "invalid_json"),
    ),
    ("POST", "/v1/completions", b"[1, 2]", 400, error("request body must be a JSON object", None, "invalid_json")),
    (
        "POST",
        "/v1/completions",
        b"[" * 8_000 + b"]" * 8_000,
        400,
        error("request body is not valid JSON: nested too deeply", None, "invalid_json"),
    ),
    (
        "POST",
        "/v1/completions",
        b'{"model": "random:llama", "prompt": "x", "stop": ' + b"[" * 900 + b"]" * 900 + b"}",
        400,
        error("Invalid JSON: recursion limit exceeded at line 1 column 250", None, "invalid_value"),
    ),
    (
        "POST",
        "/v1/completions",
        b'{"model": "random:llama", "prompt": "x", "temperature": NaN}',
        400,
        error("request body is not valid JSON: NaN is not a JSON number", None, "invalid_json"),
    ),
    (
        "POST",
        "/v1/completions",
        b'{"model": "random:llama", "prompt": "\\ud800"}',
        400,
        error("request body holds a lone surrogate escape, which is not valid Unicode", None, "invalid_json"),
    ),
    (
        "POST",
        "/v1/completions",
        completion(max_tokens="ten"),
        400,
        error("max_tokens: Input should be a valid integer", "max_tokens", "invalid_value"),
    ),
    (
        "POST",
        "/v1/completions",
        completion(max_tokens="8"),
        400,
        error("max_tokens: Input should be a valid integer", "max_tokens", "invalid_value"),
    ),
    (
        "POST",
        "/v1/completions",
        completion(max_tokens=0),
        400,
        error("max_tokens: Input should be greater than or equal to 1", "max_tokens", "invalid_value"),
    ),
    (
        "POST",
        "/v1/completions",
        completion(max_tokens=100_000),
        400,
        error(f"max_tokens is 100000; this server allows at most {LIMIT_TOKENS}", "max_tokens", "max_tokens_too_large"),
    ),
    (
        "POST",
        "/v1/chat/completions",
        chat(max_tokens=None, max_completion_tokens=LIMIT_TOKENS + 1),
        400,
        error(
            f"max_completion_tokens is {LIMIT_TOKENS + 1}; this server allows at most {LIMIT_TOKENS}",
            "max_completion_tokens",
            "max_tokens_too_large",
        ),
    ),
    (
        "POST",
        "/v1/completions",
        completion(temperature="hot"),
        400,
        error("temperature: Input should be a valid number", "temperature", "invalid_value"),
    ),
    (
        "POST",
        "/v1/completions",
        completion(stream="yes"),
        400,
        error("stream: Input should be a valid boolean", "stream", "invalid_value"),
    ),
    (
        "POST",
        "/v1/completions",
        completion(top_p=0),
        400,
        error("top_p: Input should be greater than 0", "top_p", "invalid_value"),
    ),
    (
        "POST",
        "/v1/completions",
        {"model": MODEL, "max_tokens": 2},
        400,
        error("prompt: field required", "prompt", "invalid_value"),
    ),
    ("POST", "/v1/completions", {"prompt": "x"}, 400, error("model: field required", "model", "invalid_value")),
    (
        "POST",
        "/v1/completions",
        completion(prompt=5),
        400,
        error("prompt: Input should be a valid string", "prompt", "invalid_value"),
    ),
    (
        "POST",
        "/v1/completions",
        completion(frobnicate=1),
        400,
        error("unsupported field 'frobnicate'", "frobnicate", "unsupported_field"),
    ),
    (
        "POST",
        "/v1/completions",
        completion(model="gpt-4o"),
        404,
        error(
            f"model 'gpt-4o' is not served here; this server serves '{MODEL}'",
            "model",
            "model_not_found",
            "not_found_error",
        ),
    ),
    (
        "POST",
        "/v1/completions",
        completion(n=2),
        400,
        error("n must be 1: this server returns one choice per request", "n", "unsupported"),
    ),
    (
        "POST",
        "/v1/completions",
        completion(logprobs=1),
        400,
        error("'logprobs' is not supported by this server", "logprobs", "unsupported_parameter"),
    ),
    (
        "POST",
        "/v1/completions",
        completion(stop=["a", "b", "c", "d", "e"]),
        400,
        error("stop: List should have at most 4 items after validation, not 5", "stop", "invalid_value"),
    ),
    (
        "POST",
        "/v1/completions",
        completion(kvgraft={"grafts": "abc"}),
        400,
        error("kvgraft.grafts: Input should be a valid array", "kvgraft.grafts", "invalid_value"),
    ),
    (
        "POST",
        "/v1/completions",
        completion(kvgraft={"graft": ["abc"]}),
        400,
        error("unsupported field 'kvgraft.graft'", "kvgraft.graft", "unsupported_field"),
    ),
    (
        "POST",
        "/v1/completions",
        completion(kvgraft={"min_match": 2}),
        400,
        error("kvgraft.min_match: Input should be less than or equal to 1", "kvgraft.min_match", "invalid_value"),
    ),
    (
        "POST",
        "/v1/completions",
        completion(kvgraft={"grafts": [GRAFT], "approximate": "yes"}),
        400,
        error("kvgraft.approximate: Input should be a valid boolean", "kvgraft.approximate", "invalid_value"),
    ),
    (
        "POST",
        "/v1/completions",
        completion(kvgraft={"grafts": ["f" * 64]}),
        404,
        error(f"no graft {'f' * 64} in store <store>", "kvgraft.grafts", "graft_not_found", "not_found_error"),
    ),
    (
        "POST",
        "/v1/completions",
        completion(kvgraft={"grafts": ["not-hex"]}),
        404,
        error(
            "'not-hex' is not a graft id (hex digits expected)", "kvgraft.grafts", "graft_not_found", "not_found_error"
        ),
    ),
    (
        "POST",
        "/v1/completions",
        completion(prompt="", kvgraft={"retrieve": False}),
        400,
        error("prompt is empty; give a prompt or a graft", None, "bad_input"),
    ),
    (
        "POST",
        "/v1/completions",
        completion(prompt="x" * 4100, kvgraft={"retrieve": False}),
        400,
        error("input plus max new tokens is 4103 tokens; the model supports at most 4096 positions", None, "bad_input"),
    ),
    (
        "POST",
        "/v1/completions",
        completion(prompt="x" * (BODY_LIMIT + 1)),
        413,
        error(f"request body is larger than this server's limit of {BODY_LIMIT} bytes", None, "body_too_large"),
    ),
    (
        "POST",
        "/v1/chat/completions",
        chat(messages=[]),
        400,
        error("messages: List should have at least 1 item after validation, not 0", "messages", "invalid_value"),
    ),
    (
        "POST",
        "/v1/chat/completions",
        chat(messages=[{"role": "wizard", "content": "hi"}]),
        400,
        error(
            "messages[0].role: Input should be 'system', 'developer', 'user', 'assistant' or 'tool'",
            "messages[0].role",
            "invalid_value",
        ),
    ),
    (
        "POST",
        "/v1/chat/completions",
        chat(max_completion_tokens=2),
        400,
        error("give max_tokens or max_completion_tokens, not both", "max_tokens", None),
    ),
    (
        "GET",
        "/v1/receipts/not-a-receipt",
        None,
        400,
        error("malformed receipt id 'not-a-receipt': expected 64 lowercase hex digits", "receipt_id", "bad_input"),
    ),
    (
        "GET",
        "/v1/receipts/" + "0" * 64,
        None,
        404,
        error(f"no receipt {'0' * 64} on this server", "receipt_id", "not_found", "not_found_error"),
    ),
    (
        "GET",
        "/v1/grafts/" + "e" * 64,
        None,
        404,
        error(f"no graft {'e' * 64} in store <store>", "graft_id", "not_found", "not_found_error"),
    ),
    (
        "GET",
        "/v1/grafts?limit=0",
        None,
        400,
        error("limit: Input should be greater than or equal to 1", "limit", "invalid_value"),
    ),
    ("GET", "/v1/nowhere", None, 404, error("no such endpoint", None, "http_error", "not_found_error")),
    ("PUT", "/v1/completions", None, 405, error("method not allowed on this endpoint", None, "http_error")),
    (
        "POST",
        "/v1/grafts",
        {"text": "   "},
        400,
        error("text is empty; a graft needs some text", None, "bad_input"),
    ),
    (
        "POST",
        "/v1/grafts",
        {"text": "fine", "metadata": ["not", "an", "object"]},
        400,
        error("metadata: Input should be an object", "metadata", "invalid_value"),
    ),
]


def _send(url: str, method: str, path: str, body: Any, graft: str) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=url, timeout=60) as http:
        if isinstance(body, bytes):
            return http.request(method, path, content=body, headers=headers | {"Content-Type": "application/json"})
        if body is None:
            return http.request(method, path, headers=headers)
        raw = httpx.Request(method, "/", json=body).content.decode().replace(GRAFT, graft)
        return http.request(method, path, content=raw, headers=headers | {"Content-Type": "application/json"})


@pytest.mark.parametrize(("method", "path", "body", "status", "expected"), BAD_INPUT)
def test_bad_input(
    server: tuple[str, str], method: str, path: str, body: Any, status: int, expected: dict[str, Any]
) -> None:
    url, graft = server
    reply = _send(url, method, path, body, graft)
    assert reply.status_code == status, reply.text
    assert reply.json() == expected


def test_the_server_still_serves_after_the_bad_input_table(server: tuple[str, str]) -> None:
    reply = _send(server[0], "POST", "/v1/completions", completion(), server[1])
    assert reply.status_code == 200 and reply.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_a_chunked_body_over_the_limit_is_413(server: tuple[str, str]) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"model": "random:llama", "prompt": "'
        for _ in range(BODY_LIMIT // 1024 + 1):
            yield b"x" * 1024
        yield b'"}'

    with httpx.Client(base_url=server[0], timeout=60) as http:
        reply = http.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "body_too_large"


@pytest.mark.parametrize(
    ("path", "allow"),
    [("/v1/grafts", "GET, POST"), ("/v1/completions", "POST"), ("/v1/grafts/abc", "DELETE, GET")],
)
def test_a_405_names_every_method_the_path_takes(server: tuple[str, str], path: str, allow: str) -> None:
    with httpx.Client(base_url=server[0], timeout=60) as http:
        reply = http.put(path, headers={"Authorization": f"Bearer {KEY}"})
    assert reply.status_code == 405 and reply.headers["allow"] == allow
    assert reply.json() == error("method not allowed on this endpoint", None, "http_error")


# --- auth variants ------------------------------------------------------------------------------------------------


def test_without_an_api_key_writes_are_disabled(tmp_path: Path) -> None:
    with running(make_engine(tmp_path / "store")) as (srv, _), httpx.Client(base_url=srv.url) as http:
        reply = http.post("/v1/grafts", json={"text": "some text"}, headers={"Authorization": "Bearer anything"})
        assert reply.status_code == 403
        assert reply.json() == error(
            "library writes are disabled: start the server with --api-key or $KVGRAFT_API_KEY to allow them",
            None,
            "writes_disabled",
            "permission_error",
        )
        assert http.get("/v1/models").status_code == 200


def test_protected_reads_need_the_key(tmp_path: Path) -> None:
    with running(make_engine(tmp_path / "store"), api_key=KEY, protect_reads=True) as (srv, _):
        with httpx.Client(base_url=srv.url) as http:
            for path in ("/v1/models", "/v1/grafts", "/v1/receipts/" + "0" * 64):
                assert http.get(path).status_code == 401, path
            assert http.post("/v1/completions", json=completion()).status_code == 401
            assert http.get("/health").status_code == 200 and http.get("/metrics").status_code == 200
        client = OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0)
        assert [m.id for m in client.models.list()] == [MODEL]
        with pytest.raises(openai.AuthenticationError):
            OpenAI(base_url=f"{srv.url}/v1", api_key="wrong", max_retries=0).models.list()


def test_protecting_reads_without_a_key_is_refused(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli_app, ["serve", "--store", str(tmp_path / "s"), "--protect-reads"])
    assert result.exit_code == 1
    assert "protecting reads needs an API key" in result.output


# --- overload and failure -------------------------------------------------------------------------------------------


class Gate:
    """Wraps engine.generate so that a test decides when the worker may proceed."""

    def __init__(self, engine: Engine) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.calls = 0
        original = engine.generate

        def generate(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            self.entered.set()
            assert self.release.wait(30)
            return original(*args, **kwargs)

        engine.generate = generate  # type: ignore[method-assign]


def test_a_full_queue_is_429_and_the_queued_requests_complete(tmp_path: Path) -> None:
    engine = make_engine(tmp_path / "store")
    gate = Gate(engine)
    with running(engine, max_queue=1) as (srv, state):

        async def scenario() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as http:
                running_one = asyncio.create_task(http.post("/v1/completions", json=completion()))
                await asyncio.to_thread(gate.entered.wait, 30)  # the worker holds the first request
                queued = asyncio.create_task(http.post("/v1/completions", json=completion()))
                while state.worker.depth < 1:
                    await asyncio.sleep(0.01)
                refused = await http.post("/v1/completions", json=completion())
                refused_stream = await http.post("/v1/completions", json=completion(stream=True))
                gate.release.set()
                return [refused, refused_stream, await running_one, await queued]

        refused, refused_stream, first, second = asyncio.run(scenario())
        for reply in (refused, refused_stream):
            assert reply.status_code == 429
            assert reply.headers["retry-after"] == "1"
            assert reply.json() == error(
                "the server is busy: 1 requests are already waiting; retry shortly",
                None,
                "queue_full",
                "rate_limit_error",
            )
        assert first.status_code == second.status_code == 200
        assert first.json()["choices"][0]["text"] == second.json()["choices"][0]["text"]
        metrics = httpx.get(f"{srv.url}/metrics").text
        assert 'kvgraft_rejected_requests_total{reason="queue_full"} 2.0' in metrics


def test_a_stopped_worker_is_503(tmp_path: Path) -> None:
    with running(make_engine(tmp_path / "store")) as (srv, state):
        state.worker.close()
        with httpx.Client(base_url=srv.url) as http:
            reply = http.post("/v1/completions", json=completion())
            assert reply.status_code == 503
            assert reply.json() == error(
                "the server is shutting down or its model worker stopped", None, "unavailable", "server_unavailable"
            )
            assert http.get("/health").status_code == 503


def test_an_unexpected_error_is_a_generic_500_and_the_server_goes_on(tmp_path: Path) -> None:
    engine = make_engine(tmp_path / "store")
    original = engine.generate
    failures = {"left": 1}

    def flaky(*args: Any, **kwargs: Any) -> Any:
        if failures["left"]:
            failures["left"] -= 1
            raise RuntimeError("secret internal detail")
        return original(*args, **kwargs)

    engine.generate = flaky  # type: ignore[method-assign]
    with running(engine) as (srv, _), httpx.Client(base_url=srv.url, timeout=60) as http:
        reply = http.post("/v1/completions", json=completion())
        assert reply.status_code == 500
        assert reply.json() == error(
            "internal server error; the request was not completed", None, "internal_error", "server_error"
        )
        assert "secret" not in reply.text
        assert http.post("/v1/completions", json=completion()).status_code == 200
        assert "kvgraft_unexpected_errors_total 1.0" in http.get("/metrics").text


def test_an_error_after_the_first_token_ends_the_stream_with_an_error_event(tmp_path: Path) -> None:
    engine = make_engine(tmp_path / "store")
    original = engine.generate

    def fails_midway(*args: Any, **kwargs: Any) -> Any:
        on_token: Callable[[int], None] = kwargs["on_token"]
        engine.generate = original  # type: ignore[method-assign]  # fail once only

        def first_then_fail(token: int) -> None:
            on_token(3 + ord("A"))  # a byte-tokenizer token that decodes to visible text, so a chunk goes out
            raise RuntimeError("midway")

        return original(*args, **(kwargs | {"on_token": first_then_fail}))

    engine.generate = fails_midway  # type: ignore[method-assign]
    with running(engine) as (srv, _):
        client = OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
        stream = client.completions.create(
            model=MODEL, prompt="Hello, hello", max_tokens=8, stream=True, extra_body={"kvgraft": {"retrieve": False}}
        )
        with pytest.raises(openai.APIError, match="internal server error"):
            list(stream)
        assert client.completions.create(model=MODEL, prompt="again", max_tokens=2).choices


def test_a_client_that_leaves_a_stream_stops_its_generation(tmp_path: Path) -> None:
    engine = make_engine(tmp_path / "store")
    original = engine.generate
    produced: list[int] = []

    def counting(*args: Any, **kwargs: Any) -> Any:
        on_token: Callable[[int], None] = kwargs["on_token"]

        def count(token: int) -> None:
            produced.append(token)
            time.sleep(0.02)  # slow enough that the disconnect lands mid-generation
            on_token(token)

        return original(*args, **(kwargs | {"on_token": count}))

    engine.generate = counting  # type: ignore[method-assign]
    with running(engine, max_tokens_limit=512) as (srv, state):
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            body = completion(prompt="Hi", max_tokens=400, stream=True, kvgraft={"retrieve": False})
            with http.stream("POST", "/v1/completions", json=body) as reply:
                assert reply.status_code == 200
                next(reply.iter_lines())
        deadline = time.monotonic() + 30
        while len(produced) < 400 and time.monotonic() < deadline:
            settled = len(produced)
            time.sleep(0.3)
            if len(produced) == settled:
                break
        assert 0 < len(produced) < 400
        assert state.worker.depth == 0


# --- the command ------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_kvgraft_serve_starts_serves_and_stops(tmp_path: Path) -> None:
    port = _free_port()
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        "KVGRAFT_API_KEY": "from-env",
        "HF_HUB_OFFLINE": "1",
    }
    command = [sys.executable, "-m", "kvgraft.cli", "serve", "--model", MODEL, "--store", str(tmp_path / "s")]
    command += ["--port", str(port), "--log-level", "warning", "--max-tokens", "8"]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            assert process.poll() is None, process.communicate()[1][-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "kvgraft serve did not come up"
            time.sleep(0.2)
        client = OpenAI(base_url=f"{url}/v1", api_key="from-env", max_retries=0)
        assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=3).usage is not None
        with pytest.raises(openai.BadRequestError, match="at most 8"):
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=9)
        created = httpx.post(f"{url}/v1/grafts", json={"text": "env key"}, headers={"Authorization": "Bearer from-env"})
        assert created.status_code == 201
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    assert process.returncode == 0
