"""The graft library: list, show, create (reads need the token only when reads are protected; writes always)."""

from __future__ import annotations

import re
from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.responses import JSONResponse

from kvgraft.core.errors import KvgraftError, NotFoundError
from kvgraft.engine.engine import Engine
from kvgraft.library.index import IndexEntry, load_index
from kvgraft.server.body import read_json
from kvgraft.server.generation import json_reply
from kvgraft.server.openapi import auth, errors, json_body
from kvgraft.server.routes.deps import State, reads, writes
from kvgraft.server.schemas import (
    GRAFT_ID_PATTERN,
    GraftCreated,
    GraftCreateRequest,
    GraftDeleted,
    GraftDetail,
    GraftList,
    GraftSummary,
)
from kvgraft.store import GraftStore

router = APIRouter()

GraftIdParam = Annotated[
    str,
    Path(
        description="A graft id or a unique prefix of one (hex digits)", json_schema_extra={"pattern": GRAFT_ID_PATTERN}
    ),
]


def checked_id(graft_id: str) -> str:
    """A graft id from a path, refused before the store sees it unless it is hex digits (no `..`, no `/`, no
    whitespace the store would strip).

    Args:
        graft_id: the path parameter.

    Returns:
        It, unchanged.

    Raises:
        NotFoundError: it is not 1 to 64 hex digits.
    """
    if not re.fullmatch(GRAFT_ID_PATTERN, graft_id):
        raise NotFoundError(f"{graft_id[:80]!r} is not a graft id (hex digits expected)")
    return graft_id


@router.get(
    "/v1/grafts",
    dependencies=[Depends(reads)],
    responses={200: {"model": GraftList}, **errors(400, 500, 503)},
    openapi_extra=auth("read"),
)
def list_grafts(
    state: State, limit: int = Query(100, ge=1, le=1000), after: str | None = Query(None, max_length=64)
) -> JSONResponse:
    """The grafts, sorted by id, `limit` at a time: the next page starts `after` the last id of this one."""
    rows = summaries(state.engine.store)
    if after is not None:
        rows = [r for r in rows if r.id > after]
    return json_reply(GraftList(data=rows[:limit], has_more=len(rows) > limit))


@router.get(
    "/v1/grafts/{graft_id}",
    dependencies=[Depends(reads)],
    responses={200: {"model": GraftDetail}, **errors(404, 500, 503)},
    openapi_extra=auth("read"),
)
def get_graft(graft_id: GraftIdParam, state: State) -> JSONResponse:
    """One graft (by id or unique prefix) with its manifest."""
    store = state.engine.store
    try:
        manifest = store.manifest(checked_id(graft_id))
        size = store.size_bytes(manifest.id)
    except KvgraftError as exc:
        raise state.api_error(exc, "graft_id") from None
    return json_reply(GraftDetail.of(IndexEntry.of(manifest, size), manifest=manifest.to_json()))


@router.post(
    "/v1/grafts",
    dependencies=[Depends(writes)],
    status_code=201,
    responses={
        201: {"model": GraftCreated, "description": "stored now"},
        200: {"model": GraftCreated, "description": "stored already"},
        **errors(400, 404, 413, 429, 500, 503),
    },
    openapi_extra=json_body(GraftCreateRequest, auth="write"),
)
async def create_graft(request: Request, state: State) -> JSONResponse:
    """Build and store a graft of a text (201), or find it stored already (200)."""
    body = await read_json(request, GraftCreateRequest, state.config.max_body_bytes)

    def put(engine: Engine) -> GraftCreated:
        result = engine.put(body.text, body.metadata, after=body.after)
        state.library.invalidate()
        assert result.manifest is not None  # Engine.put always gives it
        entry = IndexEntry.of(result.manifest, result.bytes)
        return GraftCreated.of(entry, created=result.created)

    created: GraftCreated = await state.run(put)
    return json_reply(created, status=201 if created.created else 200)


@router.delete(
    "/v1/grafts/{graft_id}",
    dependencies=[Depends(writes)],
    responses={200: {"model": GraftDeleted}, **errors(404, 429, 500, 503)},
    openapi_extra=auth("write"),
)
async def delete_graft(graft_id: GraftIdParam, state: State) -> JSONResponse:
    """Delete a graft (by id or unique prefix) and the blocks no other graft names."""

    def delete(engine: Engine) -> str:
        try:
            full = engine.store.resolve(checked_id(graft_id))
        except NotFoundError as exc:
            raise state.api_error(exc, "graft_id") from None
        engine.store.delete(full)
        state.library.invalidate()
        return full

    full: str = await state.run(delete)
    return json_reply(GraftDeleted(id=full, deleted=True))


def summaries(store: GraftStore) -> list[GraftSummary]:
    """Every graft of a store, from its index (no manifest read).

    Args:
        store: the engine's store.

    Returns:
        One row per graft, sorted by id.
    """
    return [GraftSummary.of(entry) for _, entry in sorted(load_index(store).items())]
