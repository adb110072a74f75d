"""The app factory: OpenAI-compatible completions and chat over one Engine, with grafting per request, plus the
graft library, receipts, health and metrics.

Every handler is thin: it validates, hands model work to the one worker thread, and shapes the reply.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Query, Request, Response
from fastapi.responses import JSONResponse

from kvgraft.core.errors import KvgraftError, NotFoundError
from kvgraft.core.version import __version__
from kvgraft.engine.engine import Engine
from kvgraft.library.index import load_index
from kvgraft.library.retrieval import Retriever
from kvgraft.server.auth import require_read, require_write
from kvgraft.server.body import read_json
from kvgraft.server.config import ServerConfig
from kvgraft.server.errors import ApiError, install_handlers
from kvgraft.server.generation import (
    finish_reason,
    generation,
    json_reply,
    kvgraft_info,
    make_job,
    new_id,
    token_budget,
    unknown_model,
    usage,
)
from kvgraft.server.metrics import CONTENT_TYPE, RequestGuard
from kvgraft.server.schemas import (
    AssistantMessage,
    ChatChoice,
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
)
from kvgraft.server.state import ServerState
from kvgraft.server.streaming import stream


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
            raise unknown_model(model_id, state.model_id)
        return model_card()

    # --- generation ---------------------------------------------------------------------------------------------

    @app.post("/v1/completions", dependencies=[Depends(reads)])
    async def completions(request: Request) -> Response:
        body = await read_json(request, CompletionRequest, config.max_body_bytes)
        max_tokens = token_budget(body.max_tokens, config.default_completion_tokens, config, "max_tokens")
        prompt = body.prompt_text()
        job = make_job(state, body, prompt, None, prompt, max_tokens)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return await stream(state, job, "completion", include_usage)
        outcome = await state.run(generation(state, job, None))
        return json_reply(
            CompletionResponse(
                id=new_id("cmpl"),
                created=int(time.time()),
                model=state.model_id,
                system_fingerprint=state.system_fingerprint,
                choices=[CompletionChoice(text=outcome.result.text, finish_reason=finish_reason(outcome.result))],
                usage=usage(outcome),
                kvgraft=kvgraft_info(outcome, job.include_receipt),
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
        max_tokens = token_budget(asked, config.max_tokens_limit, config, name)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        query = "\n".join(m["content"] for m in messages if m["role"] == "user")
        job = make_job(state, body, None, messages, query, max_tokens)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return await stream(state, job, "chat", include_usage)
        outcome = await state.run(generation(state, job, None))
        message = AssistantMessage(content=outcome.result.text)
        return json_reply(
            ChatCompletionResponse(
                id=new_id("chatcmpl"),
                created=int(time.time()),
                model=state.model_id,
                system_fingerprint=state.system_fingerprint,
                choices=[ChatChoice(message=message, finish_reason=finish_reason(outcome.result))],
                usage=usage(outcome),
                kvgraft=kvgraft_info(outcome, job.include_receipt),
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
        return json_reply(GraftList(data=rows[:limit], has_more=len(rows) > limit))

    @app.get("/v1/grafts/{graft_id}", dependencies=[Depends(reads)])
    def get_graft(graft_id: str) -> JSONResponse:
        try:
            manifest = engine.store.manifest(graft_id)
            size = engine.store.size_bytes(manifest.id)
        except KvgraftError as exc:
            raise state.api_error(exc, "graft_id") from None
        meta = manifest.metadata
        return json_reply(
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
            result = engine.put(body.text, body.metadata, after=body.after)
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
        return json_reply(created, status=201 if created.created else 200)

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
