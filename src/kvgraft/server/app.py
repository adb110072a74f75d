"""The app factory: OpenAI-compatible completions and chat over one Engine, with grafting per request, plus the
graft library, receipts, health and metrics.

Every handler is thin: it validates, hands model work to the one worker thread, and shapes the reply.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from fastapi import Depends, FastAPI, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from kvgraft import __version__
from kvgraft.engine import Engine, GenerationResult
from kvgraft.errors import KvgraftError, NotFoundError
from kvgraft.hashing import sha256_json
from kvgraft.receipt import SamplingParams
from kvgraft.retrieval import Retriever
from kvgraft.server.auth import require_read, require_write
from kvgraft.server.body import read_json
from kvgraft.server.config import ServerConfig
from kvgraft.server.errors import INTERNAL, ApiError, from_kvgraft, install_handlers
from kvgraft.server.grafting import GraftChoice, GraftPlan, LibraryView, plan_grafts
from kvgraft.server.metrics import CONTENT_TYPE, Metrics, RequestGuard
from kvgraft.server.prompts import TextStream, chat_prompt
from kvgraft.server.receipts import ReceiptBook
from kvgraft.server.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    GraftCreated,
    GraftCreateRequest,
    GraftDetail,
    GraftList,
    GraftSummary,
    GraftUsed,
    KvgraftInfo,
    KvgraftOptions,
    PromptTokensDetails,
    Usage,
    _GenerationRequest,
)
from kvgraft.server.worker import CancelledJobError, ModelWorker, QueueFullError, Ticket, WorkerUnavailableError
from kvgraft.store import LocalStore
from kvgraft.store.cache import CachedStore
from kvgraft.store.index import load_index

log = logging.getLogger("uvicorn.error")
COMPOSITION_NOT_SUPPORTED = "composing several grafts is not supported yet; name one graft"


@dataclass(frozen=True)
class GenerationJob:
    """What a request asks the model for, decided before it reaches the worker."""

    prompt: str | None
    """The text to continue (completions); None for chat, whose prompt is rendered on the worker."""
    messages: list[dict[str, str]] | None
    query: str
    """What retrieval searches the library with."""
    params: SamplingParams
    choice: GraftChoice
    include_receipt: bool


@dataclass(frozen=True)
class Outcome:
    result: GenerationResult
    plan: GraftPlan
    receipt: dict[str, Any]
    queued_s: float
    tail: str
    """What a stream still has to send after its last delta (the final text's unsent end)."""


class ServerState:
    def __init__(self, engine: Engine, config: ServerConfig, retriever: Retriever | None) -> None:
        self.engine = engine
        self.config = config
        self.metrics = Metrics()
        self.worker = ModelWorker(engine, config.max_queue, self.metrics.queue_depth.set)
        inner = engine.store.inner if isinstance(engine.store, CachedStore) else engine.store
        self.local_store = inner if isinstance(inner, LocalStore) else None
        receipts_dir = config.receipts_dir
        if receipts_dir is None and self.local_store is not None:
            receipts_dir = self.local_store.root / "receipts"
        self.receipts = ReceiptBook(receipts_dir, config.receipts_in_memory)
        self.library = LibraryView(engine.store, config.library_refresh_s, retriever)
        self.model_id = engine.model_name
        self.created = int(time.time())
        self.system_fingerprint = "kvgraft-" + sha256_json(engine.fingerprint.to_json())[:16]
        location = engine.store.location
        self._redact = sorted({location, str(Path(location).resolve())}, key=len, reverse=True)

    def redact(self, message: str) -> str:
        """Messages from the store name its directory; a client has no business knowing it."""
        for path in self._redact:
            message = message.replace(path, "<store>")
        return message

    def api_error(self, exc: BaseException, param: str | None = None) -> ApiError:
        if isinstance(exc, ApiError):
            return exc
        if isinstance(exc, KvgraftError):
            error = from_kvgraft(exc, param)
            error.message = self.redact(error.message)
            return error
        self.metrics.errors.inc()
        log.error("unexpected error in a request", exc_info=exc)
        return INTERNAL

    def submit(self, fn: Callable[[Engine], Any], cancelled: threading.Event | None = None) -> Ticket[Any]:
        try:
            return self.worker.submit(fn, cancelled)
        except QueueFullError:
            self.metrics.rejected.labels("queue_full").inc()
            raise ApiError(
                429,
                f"the server is busy: {self.config.max_queue} requests are already waiting; retry shortly",
                code="queue_full",
                headers={"Retry-After": "1"},
            ) from None
        except WorkerUnavailableError:
            self.metrics.rejected.labels("unavailable").inc()
            raise ApiError(503, "the server is shutting down or its model worker stopped", code="unavailable") from None

    async def run(self, fn: Callable[[Engine], Any]) -> Any:
        ticket = self.submit(fn)
        try:
            return await ticket.future
        except asyncio.CancelledError:
            ticket.cancel()
            raise
        except BaseException as exc:
            raise self.api_error(exc) from None


def create_app(engine: Engine, config: ServerConfig | None = None, retriever: Retriever | None = None) -> FastAPI:
    """An app serving `engine`. The model worker starts and stops with the app's lifespan (uvicorn runs it)."""
    config = config or ServerConfig()
    config.check()
    state = ServerState(engine, config, retriever)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(state.worker.close)

    app = FastAPI(
        title="kvgraft", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.kvgraft = state
    install_handlers(app, state.redact)
    app.add_middleware(RequestGuard, metrics=state.metrics)

    def reads(request: Request) -> None:
        require_read(request, config)

    def writes(request: Request) -> None:
        require_write(request, config)

    # --- health and metrics (always open: probes and scrapers carry no token) -----------------------------------

    @app.get("/health")
    async def health() -> JSONResponse:
        alive = state.worker.alive
        body = {
            "status": "ok" if alive else "unavailable",
            "model": state.model_id,
            "queue_depth": state.worker.depth,
            "max_queue": config.max_queue,
        }
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    # --- models -------------------------------------------------------------------------------------------------

    def model_card() -> dict[str, Any]:
        return {"id": state.model_id, "object": "model", "created": state.created, "owned_by": "kvgraft"}

    @app.get("/v1/models", dependencies=[Depends(reads)])
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(reads)])
    async def get_model(model_id: str) -> dict[str, Any]:
        if model_id != state.model_id:
            raise _unknown_model(model_id, state.model_id)
        return model_card()

    # --- generation ---------------------------------------------------------------------------------------------

    @app.post("/v1/completions", dependencies=[Depends(reads)])
    async def completions(request: Request) -> Response:
        body = await read_json(request, CompletionRequest, config.max_body_bytes)
        max_tokens = _max_tokens(body.max_tokens, config.default_completion_tokens, config, "max_tokens")
        prompt = body.prompt_text()
        job = _job(state, body, prompt, None, prompt, max_tokens)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return await _stream(state, job, "completion", include_usage)
        outcome: Outcome = await state.run(_generation(state, job, None))
        return _json(
            CompletionResponse(
                id=_new_id("cmpl"),
                created=int(time.time()),
                model=state.model_id,
                system_fingerprint=state.system_fingerprint,
                choices=[CompletionChoice(text=outcome.result.text, finish_reason=_finish(outcome.result))],
                usage=_usage(outcome),
                kvgraft=_info(outcome, job.include_receipt),
            )
        )

    @app.post("/v1/chat/completions", dependencies=[Depends(reads)])
    async def chat_completions(request: Request) -> Response:
        body = await read_json(request, ChatCompletionRequest, config.max_body_bytes)
        if body.max_completion_tokens is not None and body.max_tokens is not None:
            raise ApiError(400, "give max_tokens or max_completion_tokens, not both", param="max_tokens")
        asked, name = (body.max_completion_tokens, "max_completion_tokens")
        if asked is None:
            asked, name = body.max_tokens, "max_tokens"
        max_tokens = _max_tokens(asked, config.max_tokens_limit, config, name)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        query = "\n".join(m["content"] for m in messages if m["role"] == "user")
        job = _job(state, body, None, messages, query, max_tokens)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return await _stream(state, job, "chat", include_usage)
        outcome = await state.run(_generation(state, job, None))
        return _json(
            ChatCompletionResponse(
                id=_new_id("chatcmpl"),
                created=int(time.time()),
                model=state.model_id,
                system_fingerprint=state.system_fingerprint,
                choices=[
                    ChatChoice(
                        message=AssistantMessage(content=outcome.result.text), finish_reason=_finish(outcome.result)
                    )
                ],
                usage=_usage(outcome),
                kvgraft=_info(outcome, job.include_receipt),
            )
        )

    # --- receipts -----------------------------------------------------------------------------------------------

    @app.get("/v1/receipts/{receipt_id}", dependencies=[Depends(reads)])
    def get_receipt(receipt_id: str) -> JSONResponse:
        try:
            return JSONResponse(state.receipts.get(receipt_id))
        except KvgraftError as exc:
            raise state.api_error(exc, "receipt_id") from None

    # --- the graft library --------------------------------------------------------------------------------------

    @app.get("/v1/grafts", dependencies=[Depends(reads)])
    def list_grafts(
        limit: int = Query(100, ge=1, le=1000), after: str | None = Query(None, max_length=64)
    ) -> JSONResponse:
        rows = _summaries(state)
        if after is not None:
            rows = [r for r in rows if r.id > after]
        return _json(GraftList(data=rows[:limit], has_more=len(rows) > limit))

    @app.get("/v1/grafts/{graft_id}", dependencies=[Depends(reads)])
    def get_graft(graft_id: str) -> JSONResponse:
        try:
            manifest = engine.store.manifest(graft_id)
            size = engine.store.size_bytes(manifest.id)
        except KvgraftError as exc:
            raise state.api_error(exc, "graft_id") from None
        meta = manifest.metadata
        return _json(
            GraftDetail(
                id=manifest.id,
                tokens=len(manifest.tokens),
                aligned_tokens=manifest.aligned_tokens,
                bytes=size,
                model=manifest.model_name,
                kind=_str_or_none(meta.get("kind")),
                title=_str_or_none(meta.get("title")),
                manifest=manifest.to_json(),
            )
        )

    @app.post("/v1/grafts", dependencies=[Depends(writes)])
    async def create_graft(request: Request) -> JSONResponse:
        body = await read_json(request, GraftCreateRequest, config.max_body_bytes)

        def put(engine: Engine) -> GraftCreated:
            result = engine.put(body.text, body.metadata)
            state.library.invalidate()
            return GraftCreated(
                id=result.id,
                tokens=result.tokens,
                aligned_tokens=result.aligned_tokens,
                bytes=result.bytes,
                model=engine.model_name,
                kind=_str_or_none(body.metadata.get("kind")),
                title=_str_or_none(body.metadata.get("title")),
                created=result.created,
            )

        created: GraftCreated = await state.run(put)
        return _json(created, status=201 if created.created else 200)

    @app.delete("/v1/grafts/{graft_id}", dependencies=[Depends(writes)])
    async def delete_graft(graft_id: str) -> JSONResponse:
        def delete(engine: Engine) -> str:
            try:
                full = engine.store.resolve(graft_id)
            except NotFoundError as exc:
                raise state.api_error(exc, "graft_id") from None
            engine.store.delete(full)
            state.library.invalidate()
            return full

        full: str = await state.run(delete)
        return JSONResponse({"id": full, "object": "graft.deleted", "deleted": True})

    return app


# --- request to job --------------------------------------------------------------------------------------------


def _unknown_model(asked: str, served: str) -> ApiError:
    return ApiError(
        404, f"model '{asked}' is not served here; this server serves '{served}'", param="model", code="model_not_found"
    )


def _max_tokens(asked: int | None, default: int, config: ServerConfig, name: str) -> int:
    value = default if asked is None else asked
    if value > config.max_tokens_limit:
        raise ApiError(
            400,
            f"{name} is {value}; this server allows at most {config.max_tokens_limit}",
            param=name,
            code="max_tokens_too_large",
        )
    return value


def _job(
    state: ServerState,
    body: _GenerationRequest,
    prompt: str | None,
    messages: list[dict[str, str]] | None,
    query: str,
    max_tokens: int,
) -> GenerationJob:
    if body.model != state.model_id:
        raise _unknown_model(body.model, state.model_id)
    if body.n != 1:
        raise ApiError(400, "n must be 1: this server returns one choice per request", param="n", code="unsupported")
    unsupported = body.unsupported()
    if unsupported:
        name = unsupported[0]
        raise ApiError(400, f"'{name}' is not supported by this server", param=name, code="unsupported_parameter")
    options = body.kvgraft or KvgraftOptions()
    grafts = tuple(options.grafts or ())
    if len(grafts) > 1:
        raise ApiError(400, COMPOSITION_NOT_SUPPORTED, param="kvgraft.grafts", code="composition_not_supported")
    params = SamplingParams(
        max_new_tokens=max_tokens,
        temperature=body.temperature or 0.0,
        top_p=1.0 if body.top_p is None else body.top_p,
        seed=body.seed or 0,
        stop=body.stops(),
    )
    choice = GraftChoice(grafts, options.retrieve, options.min_score, options.min_match)
    return GenerationJob(prompt, messages, query, params, choice, options.include_receipt)


def _generation(
    state: ServerState,
    job: GenerationJob,
    deltas: Callable[[str], None] | None,
    cancelled: threading.Event | None = None,
) -> Callable[[Engine], Outcome]:
    """The work of one generation, run on the model worker. With `deltas`, text is streamed as it is decoded
    (decoding runs here too: a fast tokenizer must not be used from two threads at once)."""
    enqueued = time.perf_counter()

    def run(engine: Engine) -> Outcome:
        queued_s = time.perf_counter() - enqueued
        prompt = job.prompt if job.prompt is not None else chat_prompt(engine.tokenizer, job.messages or [])
        try:
            plan = plan_grafts(
                engine,
                state.library.get,
                job.choice,
                job.query,
                prompt,
                job.params.max_new_tokens,
                state.config.retrieval_candidates,
            )
        except NotFoundError as exc:
            if job.choice.grafts:
                raise ApiError(404, state.redact(str(exc)), param="kvgraft.grafts", code="graft_not_found") from None
            raise
        stream = TextStream(engine.tokenizer, job.params.stop) if deltas is not None else None

        def on_token(token: int) -> None:
            if cancelled is not None and cancelled.is_set():
                raise CancelledJobError
            if stream is not None and deltas is not None:
                delta = stream.push(token)
                if delta:
                    deltas(delta)

        result = engine.generate(prompt, plan.graft_id, job.params, on_token=on_token)
        receipt = result.receipt.to_json()
        state.receipts.add(result.receipt)
        _record(state.metrics, result, plan, queued_s)
        tail = stream.finish(result.text) if stream is not None else ""
        return Outcome(result, plan, receipt, queued_s, tail)

    return run


def _record(metrics: Metrics, result: GenerationResult, plan: GraftPlan, queued_s: float) -> None:
    receipt = result.receipt
    metrics.queue_wait_seconds.observe(queued_s)
    metrics.ttft_seconds.observe(result.timings["ttft_s"])
    metrics.tokens.labels("prompt").inc(len(receipt.input_tokens))
    metrics.tokens.labels("restored").inc(receipt.graft_aligned_tokens)
    metrics.tokens.labels("completion").inc(len(result.output_tokens))
    metrics.generations.labels(plan.source or "none").inc()
    if plan.source is not None:
        metrics.graft_hits.labels(plan.source).inc()
        metrics.restore_seconds.observe(
            result.timings.get("graft_load_s", 0.0) + result.timings.get("graft_restore_s", 0.0)
        )
    elif plan.searched:
        metrics.retrieval_misses.inc()


# --- replies ---------------------------------------------------------------------------------------------------


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _finish(result: GenerationResult) -> Literal["stop", "length"]:
    return "length" if result.stop_reason == "length" else "stop"


def _usage(outcome: Outcome) -> Usage:
    receipt = outcome.receipt
    prompt = len(receipt["input_tokens"])
    completion = len(receipt["output_tokens"])
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=receipt["graft_aligned_tokens"]),
    )


def _info(outcome: Outcome, include_receipt: bool) -> KvgraftInfo:
    plan, result = outcome.plan, outcome.result
    grafts = []
    if plan.graft_id is not None and plan.manifest is not None and plan.source in ("request", "retrieval"):
        grafts.append(
            GraftUsed(
                id=plan.graft_id,
                source="request" if plan.source == "request" else "retrieval",
                tokens=len(plan.manifest.tokens),
                restored_tokens=plan.manifest.aligned_tokens,
            )
        )
    receipt_id = str(outcome.receipt["id"])
    return KvgraftInfo(
        grafts=grafts,
        retrieval=[c.to_json() for c in plan.retrieval],
        exact=result.exact,
        approximate=False,
        environment_differences=list(result.receipt.environment_differences),
        receipt_id=receipt_id,
        receipt_url=f"/v1/receipts/{receipt_id}",
        timings=dict(result.timings) | {"queue_s": outcome.queued_s},
        receipt=outcome.receipt if include_receipt else None,
    )


def _dump(model: BaseModel) -> dict[str, Any]:
    data = model.model_dump(mode="json")
    for key in ("usage", "kvgraft"):
        if key in data and data[key] is None:
            del data[key]  # absent rather than null in chunks that do not carry them
    if isinstance(data.get("kvgraft"), dict) and data["kvgraft"].get("receipt") is None:
        data["kvgraft"].pop("receipt", None)
    return data


def _json(model: BaseModel, status: int = 200) -> JSONResponse:
    return JSONResponse(_dump(model), status_code=status)


def _sse(data: dict[str, Any] | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _summaries(state: ServerState) -> list[GraftSummary]:
    """Every graft, sorted by id: from the local store's index (no manifest read), else from the manifests."""
    if state.local_store is not None:
        return [
            GraftSummary(
                id=e.id,
                tokens=e.tokens,
                aligned_tokens=e.aligned_tokens,
                bytes=e.bytes,
                model=e.model_name,
                kind=e.kind,
                title=_str_or_none(e.title),
            )
            for _, e in sorted(load_index(state.local_store).items())
        ]
    store = state.engine.store
    rows = []
    for graft_id in sorted(store.ids()):
        manifest = store.manifest(graft_id)
        rows.append(
            GraftSummary(
                id=graft_id,
                tokens=len(manifest.tokens),
                aligned_tokens=manifest.aligned_tokens,
                bytes=store.size_bytes(graft_id),
                model=manifest.model_name,
                kind=_str_or_none(manifest.metadata.get("kind")),
                title=_str_or_none(manifest.metadata.get("title")),
            )
        )
    return rows


# --- streaming -------------------------------------------------------------------------------------------------


async def _stream(
    state: ServerState, job: GenerationJob, kind: Literal["completion", "chat"], include_usage: bool
) -> Response:
    """Server-sent events in OpenAI's chunk shapes. The reply starts once the first text exists, so that every
    error before it (unknown graft, prompt too long, queue full) is still an ordinary 4xx/5xx reply."""
    loop = asyncio.get_running_loop()
    channel: asyncio.Queue[str | None] = asyncio.Queue()
    cancelled = threading.Event()

    def push(delta: str) -> None:
        try:
            loop.call_soon_threadsafe(channel.put_nowait, delta)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            cancelled.set()

    ticket = state.submit(_generation(state, job, push, cancelled), cancelled)
    # Settled after every delta was queued (same thread, same loop queue), so None always comes last.
    ticket.future.add_done_callback(lambda _: channel.put_nowait(None))
    try:
        first = await channel.get()
    except asyncio.CancelledError:
        ticket.cancel()
        raise
    if first is None:
        try:
            ticket.future.result()
        except BaseException as exc:
            raise state.api_error(exc) from None

    response_id = _new_id("chatcmpl" if kind == "chat" else "cmpl")
    created = int(time.time())

    def chunk(
        text: str | None, finish: Literal["stop", "length"] | None = None, outcome: Outcome | None = None
    ) -> bytes:
        info = _info(outcome, job.include_receipt) if outcome is not None else None
        common: dict[str, Any] = {
            "id": response_id,
            "created": created,
            "model": state.model_id,
            "system_fingerprint": state.system_fingerprint,
        }
        if kind == "chat":
            delta = {} if text is None else {"content": text}
            if text == "" and finish is None:
                delta = {"role": "assistant", "content": ""}
            choice = ChatChunkChoice(delta=delta, finish_reason=finish)
            return _sse(_dump(ChatCompletionChunk(**common, choices=[choice], kvgraft=info)))
        completion_choice = CompletionChoice(text=text or "", finish_reason=finish)
        return _sse(_dump(CompletionResponse(**common, choices=[completion_choice], kvgraft=info)))

    async def events() -> AsyncIterator[bytes]:
        try:
            if kind == "chat":
                yield chunk("")
            delta = first
            while delta is not None:
                yield chunk(delta)
                delta = await channel.get()
            try:
                outcome: Outcome = ticket.future.result()
            except BaseException as exc:
                # Headers are sent: the error travels as an event, which the OpenAI client raises as APIError.
                yield _sse(state.api_error(exc).body())
                return
            yield chunk(outcome.tail or None, _finish(outcome.result), outcome)
            if include_usage:
                yield _sse(
                    {
                        "id": response_id,
                        "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
                        "created": created,
                        "model": state.model_id,
                        "system_fingerprint": state.system_fingerprint,
                        "choices": [],
                        "usage": _usage(outcome).model_dump(mode="json"),
                    }
                )
            yield _sse("[DONE]")
        finally:
            if not ticket.future.done():
                ticket.cancel()  # the client went away: stop generating for it

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(events(), media_type="text/event-stream", headers=headers)
