"""The receipts of served generations, for re-checking with `kvgraft verify --receipt`."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from kvgraft.core.errors import KvgraftError
from kvgraft.server.routes.deps import State, reads

router = APIRouter(dependencies=[Depends(reads)])


@router.get("/v1/receipts/{receipt_id}")
def get_receipt(receipt_id: str, state: State) -> JSONResponse:
    """A receipt's JSON, exactly as the file `kvgraft verify --receipt` reads."""
    try:
        return JSONResponse(state.receipts.get(receipt_id))
    except KvgraftError as exc:
        raise state.api_error(exc, "receipt_id") from None
