"""The graft library: list, show, create (reads need the token only when reads are protected; writes always)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse

from kvgraft.core.errors import KvgraftError, NotFoundError
from kvgraft.engine.engine import Engine
from kvgraft.library.index import IndexEntry, load_index
from kvgraft.server.body import read_json
from kvgraft.server.generation import json_reply
from kvgraft.server.routes.deps import State, reads, writes
from kvgraft.server.schemas import GraftCreated, GraftCreateRequest, GraftDetail, GraftList, GraftSummary
from kvgraft.store import GraftStore

router = APIRouter()


@router.get("/v1/grafts", dependencies=[Depends(reads)])
def list_grafts(
    state: State, limit: int = Query(100, ge=1, le=1000), after: str | None = Query(None, max_length=64)
) -> JSONResponse:
    """The grafts, sorted by id, `limit` at a time: the next page starts `after` the last id of this one."""
    rows = summaries(state.engine.store)
    if after is not None:
        rows = [r for r in rows if r.id > after]
    return json_reply(GraftList(data=rows[:limit], has_more=len(rows) > limit))


@router.get("/v1/grafts/{graft_id}", dependencies=[Depends(reads)])
def get_graft(graft_id: str, state: State) -> JSONResponse:
    """One graft (by id or unique prefix) with its manifest."""
    store = state.engine.store
    try:
        manifest = store.manifest(graft_id)
        size = store.size_bytes(manifest.id)
    except KvgraftError as exc:
        raise state.api_error(exc, "graft_id") from None
    return json_reply(GraftDetail.of(IndexEntry.of(manifest, size), manifest=manifest.to_json()))


@router.post("/v1/grafts", dependencies=[Depends(writes)])
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


@router.delete("/v1/grafts/{graft_id}", dependencies=[Depends(writes)])
async def delete_graft(graft_id: str, state: State) -> JSONResponse:
    """Delete a graft (by id or unique prefix) and the blocks no other graft names."""

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


def summaries(store: GraftStore) -> list[GraftSummary]:
    """Every graft of a store, from its index (no manifest read).

    Args:
        store: the engine's store.

    Returns:
        One row per graft, sorted by id.
    """
    return [GraftSummary.of(entry) for _, entry in sorted(load_index(store).items())]
