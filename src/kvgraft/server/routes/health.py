"""Health, metrics and the served model. Health and metrics are always open: probes and scrapers carry no token."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Response
from fastapi.responses import JSONResponse, PlainTextResponse

from kvgraft.server.generation import json_reply, unknown_model
from kvgraft.server.metrics import CONTENT_TYPE
from kvgraft.server.openapi import auth, errors
from kvgraft.server.routes.deps import State, reads
from kvgraft.server.schemas import Health, ModelCard, ModelList
from kvgraft.server.state import ServerState

router = APIRouter()


@router.get("/health", responses={200: {"model": Health}, 503: {"model": Health, "description": "worker stopped"}})
async def health(state: State) -> JSONResponse:
    """200 while the model worker runs, 503 once it stopped; with the model and the queue's depth."""
    alive = state.worker.alive
    body = Health(
        status="ok" if alive else "unavailable",
        model=state.model_id,
        queue_depth=state.worker.depth,
        max_queue=state.config.max_queue,
    )
    return json_reply(body, status=200 if alive else 503)


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Prometheus text"}},
)
async def metrics(state: State) -> Response:
    """The server's metrics in Prometheus' text format."""
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


@router.get(
    "/v1/models", dependencies=[Depends(reads)], responses={200: {"model": ModelList}}, openapi_extra=auth("read")
)
async def list_models(state: State) -> JSONResponse:
    """The one model this server serves, as OpenAI's model list."""
    return json_reply(ModelList(data=[_model_card(state)]))


@router.get(
    "/v1/models/{model_id:path}",
    dependencies=[Depends(reads)],
    responses={200: {"model": ModelCard}, **errors(404)},
    openapi_extra=auth("read"),
)
async def get_model(model_id: str, state: State) -> JSONResponse:
    """The served model's card; 404 for any other model."""
    if model_id != state.model_id:
        raise unknown_model(model_id, state.model_id)
    return json_reply(_model_card(state))


def _model_card(state: ServerState) -> ModelCard:
    return ModelCard(id=state.model_id, created=state.created, owned_by="kvgraft")
