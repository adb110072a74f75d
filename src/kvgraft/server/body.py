"""Reading a request body: bounded in size, valid JSON, a JSON object, then a schema, each failure its own 4xx."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from kvgraft.server.errors import ApiError, validation_error

M = TypeVar("M", bound=BaseModel)


def _refuse_constant(name: str) -> Any:
    raise ApiError(400, f"request body is not valid JSON: {name} is not a JSON number", code="invalid_json")


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body is larger than this server's limit of {limit} bytes", code="body_too_large")


async def read_body(request: Request, limit: int) -> bytes:
    """A request's body, refused as soon as it is known to be too large.

    Args:
        request: the request.
        limit: the most bytes accepted.

    Returns:
        The body.

    Raises:
        ApiError: 413 when it is larger than `limit`, 400 for a malformed Content-Length or a client that closed
            the connection before the whole body came (nobody reads that reply; it is counted, never logged as an
            unexpected error).
    """
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise _too_large(limit)
        except ValueError:
            raise ApiError(400, "malformed Content-Length header", code="bad_header") from None
    # Counted while reading too: a chunked body declares no length.
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise ApiError(
            400, "the client closed the connection before the whole body came", code="client_disconnected"
        ) from None
    return b"".join(chunks)


async def read_json(request: Request, schema: type[M], limit: int) -> M:
    """A request's body as a JSON object, validated against a schema.

    Args:
        request: the request.
        schema: the body's model.
        limit: the most bytes accepted.

    Returns:
        The validated body.

    Raises:
        ApiError: 413 for a body over `limit`; 400 for a body that is not UTF-8 JSON (NaN and lone surrogates
            included), nested too deeply, not an object, or not valid for `schema`.
    """
    raw = await read_body(request, limit)
    try:
        data: Any = json.loads(raw, parse_constant=_refuse_constant)
        # Lone surrogates (\ud800) parse but cannot be encoded, hashed or tokenized: refuse them here.
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except RecursionError:
        # Python's parser recurses once per level: a body of 50,000 "[" is valid JSON no request needs.
        raise ApiError(400, "request body is not valid JSON: nested too deeply", code="invalid_json") from None
    except UnicodeEncodeError:
        raise ApiError(
            400, "request body holds a lone surrogate escape, which is not valid Unicode", code="invalid_json"
        ) from None
    except UnicodeDecodeError:
        raise ApiError(400, "request body is not UTF-8 encoded JSON", code="invalid_json") from None
    except json.JSONDecodeError as exc:
        raise ApiError(
            400, f"request body is not valid JSON: {exc.msg} at position {exc.pos}", code="invalid_json"
        ) from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    try:
        return schema.model_validate_json(raw)
    except ValidationError as exc:
        raise validation_error(exc, data) from None
    except RecursionError:
        raise ApiError(400, "request body is nested too deeply", code="invalid_json") from None
