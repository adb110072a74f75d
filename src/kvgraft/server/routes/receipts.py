"""The receipts of served generations, for re-checking with `kvgraft verify --receipt`."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path
from fastapi.responses import JSONResponse

from kvgraft.core.errors import KvgraftError
from kvgraft.server.openapi import auth, errors
from kvgraft.server.routes.deps import State, reads
from kvgraft.server.schemas import RECEIPT_ID_PATTERN

router = APIRouter(dependencies=[Depends(reads)])


_RECEIPT: dict[str, Any] = {"model": dict[str, Any], "description": "the receipt, as its file holds it"}


@router.get(
    "/v1/receipts/{receipt_id}",
    responses={200: _RECEIPT, **errors(400, 404, 503)},
    openapi_extra=auth("read"),
)
def get_receipt(
    receipt_id: Annotated[
        str, Path(description="64 lowercase hex digits", json_schema_extra={"pattern": RECEIPT_ID_PATTERN})
    ],
    state: State,
) -> JSONResponse:
    """A receipt's JSON, exactly as the file `kvgraft verify --receipt` reads."""
    try:
        return JSONResponse(state.receipts.get(receipt_id))
    except KvgraftError as exc:
        raise state.api_error(exc, "receipt_id") from None
