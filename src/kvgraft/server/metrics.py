"""Prometheus metrics of one app, in its own registry (so that a process can hold several apps, as tests do)."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvgraft.server.errors import INTERNAL

CONTENT_TYPE = CONTENT_TYPE_LATEST
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_FAST_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

log = logging.getLogger("uvicorn.error")


class Metrics:
    """The counters, gauges and histograms `/metrics` shows."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "kvgraft_http_requests",
            "HTTP requests by route, method and status.",
            ["route", "method", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "kvgraft_http_request_duration_seconds",
            "Time from request to the end of the reply (the whole stream for streamed replies).",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "kvgraft_tokens",
            "Tokens by kind: prompt (every input token), restored (input tokens restored from a graft instead of "
            "computed), completion (generated).",
            ["kind"],
            registry=r,
        )
        self.generations = Counter(
            "kvgraft_generations", "Generations by graft source: request, retrieval or none.", ["graft"], registry=r
        )
        self.graft_hits = Counter(
            "kvgraft_graft_hits", "Generations that restored a graft, by how it was chosen.", ["source"], registry=r
        )
        self.retrieval_misses = Counter(
            "kvgraft_retrieval_misses", "Retrievals that found no usable block (the request ran bare).", registry=r
        )
        self.restore_seconds = Histogram(
            "kvgraft_graft_restore_seconds",
            "Loading (with every tensor hash checked) and restoring a graft into a cache.",
            buckets=_FAST_BUCKETS,
            registry=r,
        )
        self.ttft_seconds = Histogram(
            "kvgraft_time_to_first_token_seconds",
            "From the start of the model's work on a request to its first token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait_seconds = Histogram(
            "kvgraft_queue_wait_seconds", "Time a request waited for the model.", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.queue_depth = Gauge("kvgraft_queue_depth", "Requests waiting for the model.", registry=r)
        self.rejected = Counter(
            "kvgraft_rejected_requests",
            "Requests refused before reaching the model: queue_full (429) or unavailable (503).",
            ["reason"],
            registry=r,
        )
        self.errors = Counter(
            "kvgraft_unexpected_errors", "Requests that failed with an unexpected server error (500).", registry=r
        )

    def render(self) -> bytes:
        """Returns: every metric in Prometheus' text format."""
        return generate_latest(self.registry)


class RequestGuard:
    """Outermost layer of the app: counts and times every request by its route template (not its raw path, which
    would grow the label set without bound), and turns any exception that escaped the app into a generic 500
    while the server keeps serving."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500
        response_started = False

        async def send_tracked(message: Message) -> None:
            nonlocal status, response_started
            if message["type"] == "http.response.start":
                status = int(message["status"])
                response_started = True
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception:
            self.metrics.errors.inc()
            log.exception("unexpected error serving %s %s", scope.get("method"), scope.get("path"))
            if not response_started:
                status = 500
                await _send_json(send, 500, INTERNAL.body())
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            method = str(scope.get("method", ""))
            self.metrics.requests.labels(template, method, str(status)).inc()
            self.metrics.latency.labels(template).observe(time.perf_counter() - started)


async def _send_json(send: Send, status: int, body: dict[str, Any]) -> None:
    payload = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
