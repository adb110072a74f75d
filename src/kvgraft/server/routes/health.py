"""Health, metrics and the served model. Health and metrics are always open: probes and scrapers carry no token."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Response
from fastapi.responses import JSONResponse

from kvgraft.server.generation import unknown_model
from kvgraft.server.metrics import CONTENT_TYPE
from kvgraft.server.routes.deps import State, reads
from kvgraft.server.state import ServerState

router = APIRouter()


@router.get("/health")
async def health(state: State) -> JSONResponse:
    """200 while the model worker runs, 503 once it stopped; with the model and the queue's depth."""
    alive = state.worker.alive
    body = {
        "status": "ok" if alive else "unavailable",
        "model": state.model_id,
        "queue_depth": state.worker.depth,
        "max_queue": state.config.max_queue,
    }
    return JSONResponse(body, status_code=200 if alive else 503)


@router.get("/metrics")
async def metrics(state: State) -> Response:
    """The server's metrics in Prometheus' text format."""
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


@router.get("/v1/models", dependencies=[Depends(reads)])
async def list_models(state: State) -> dict[str, Any]:
    """The one model this server serves, as OpenAI's model list."""
    return {"object": "list", "data": [_model_card(state)]}


@router.get("/v1/models/{model_id:path}", dependencies=[Depends(reads)])
async def get_model(model_id: str, state: State) -> dict[str, Any]:
    """The served model's card; 404 for any other model."""
    if model_id != state.model_id:
        raise unknown_model(model_id, state.model_id)
    return _model_card(state)


def _model_card(state: ServerState) -> dict[str, Any]:
    return {"id": state.model_id, "object": "model", "created": state.created, "owned_by": "kvgraft"}
