"""OpenAI-style error bodies, and the one place kvgraft's errors become HTTP statuses.

Every error a client sees is `{"error": {"message", "type", "param", "code"}}`; nothing a request sends can turn
into a traceback in a reply.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Match

from kvgraft.core.errors import (
    BadInputError,
    EnvironmentMismatchError,
    FingerprintMismatchError,
    FormatError,
    IntegrityError,
    KvgraftError,
    NotAChainError,
    NotFoundError,
    ReproducibilityError,
    StoreError,
)

log = logging.getLogger("uvicorn.error")

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_unavailable",
}


class ApiError(Exception):
    """An error reply: status, OpenAI-style body and optional headers."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type_: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or _TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """Returns: the OpenAI-style error body, `{"error": {"message", "type", "param", "code"}}`."""
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        """Returns: the reply: the body with the error's status and headers."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """An OpenAI-style error body.

    Args:
        message: what went wrong, one line.
        type_: OpenAI's error type, e.g. "invalid_request_error".
        param: the request field at fault, if any.
        code: kvgraft's error code, e.g. "graft_not_found".

    Returns:
        `{"error": {"message", "type", "param", "code"}}`.
    """
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


INTERNAL = ApiError(500, "internal server error; the request was not completed", code="internal_error")


_HINTS: dict[type[KvgraftError], str] = {
    EnvironmentMismatchError: (
        "; the server does not allow environment mismatches (started without --allow-env-mismatch)"
    ),
    NotAChainError: '; build them as one chain (POST /v1/grafts with "after"), or set kvgraft.approximate to true',
}
"""What a client can do about an error, by its type (core messages say what went wrong, never how to fix it)."""


def hint_for(exc: KvgraftError) -> str:
    """The server's hint for a client, to append to the error's message.

    Args:
        exc: an error kvgraft raised.

    Returns:
        The hint, starting with "; ", or "" when the server has none for this kind of error.
    """
    return next((hint for kind, hint in _HINTS.items() if isinstance(exc, kind)), "")


def client_message(exc: KvgraftError) -> str:
    """The message a client gets for `exc` (not yet redacted).

    Args:
        exc: an error kvgraft raised.

    Returns:
        The error's message followed by the server's hint, if it has one.
    """
    return str(exc) + hint_for(exc)


def from_kvgraft(exc: KvgraftError, param: str | None = None) -> ApiError:
    """The reply to a kvgraft error: the caller's mistakes are 4xx, a damaged graft is 500, a store out of reach 503.

    Args:
        exc: the error.
        param: the request field the error is about, if any (not reported for the server's own failures).

    Returns:
        The error reply, its message with the server's hint (`hint_for`) but not yet redacted.
    """
    message = client_message(exc)
    if isinstance(exc, BadInputError):
        return ApiError(400, message, param=param, code="bad_input")
    if isinstance(exc, NotFoundError):
        return ApiError(404, message, param=param, code="not_found")
    if isinstance(exc, FingerprintMismatchError):
        return ApiError(400, message, param=param, code="fingerprint_mismatch")
    if isinstance(exc, EnvironmentMismatchError):
        return ApiError(400, message, param=param, code="environment_mismatch")
    if isinstance(exc, FormatError | IntegrityError):
        # The stored graft is damaged: the server's problem, but the message is one safe line worth showing.
        return ApiError(500, message, param=param, code="graft_damaged")
    if isinstance(exc, StoreError):
        # The store cannot be reached or used right now (endpoint down, credentials refused, bucket missing): the
        # request was fine and may succeed later, so 503, as for an overloaded server, not 500.
        return ApiError(503, message, code="store_unavailable")
    if isinstance(exc, ReproducibilityError):
        return ApiError(500, message, code="not_reproducible")
    return ApiError(500, message, code="kvgraft_error")


def validation_error(exc: ValidationError, data: Any) -> ApiError:
    """The reply to a body that does not fit its schema.

    Args:
        exc: pydantic's error.
        data: the body as parsed JSON (to name the field at fault).

    Returns:
        A 400 error with the first pydantic error as one line naming the field, e.g. `max_tokens: Input should be
        a valid integer`.
    """
    errors = exc.errors(include_url=False)
    # A value that fails a union (`str | list[str]`) fails every branch; a branch that matched the value's type
    # but not a constraint ("at most 4 items") says more than "Input should be a valid string".
    first = next((e for e in errors if not str(e.get("type", "")).endswith("_type")), errors[0])
    param = _param_of(first.get("loc", ()), data)
    if first.get("type") == "extra_forbidden":
        return ApiError(400, f"unsupported field '{param}'", param=param, code="unsupported_field")
    message = str(first.get("msg", "invalid value"))
    if first.get("type") == "missing":
        message = "field required"
    return ApiError(400, f"{param}: {message}" if param else message, param=param or None, code="invalid_value")


def _param_of(loc: tuple[Any, ...], data: Any) -> str:
    """Dotted path of the offending field, walked through the request data so that pydantic's union tags
    ('str', 'list[str]') never show up as field names."""
    parts: list[str] = []
    current = data
    for item in loc:
        if isinstance(current, dict) and isinstance(item, str):
            parts.append(item)
            current = current.get(item)
        elif isinstance(current, list) and isinstance(item, int):
            parts[-1:] = [f"{parts[-1]}[{item}]" if parts else f"[{item}]"]
            current = current[item] if 0 <= item < len(current) else None
        else:
            break
    return ".".join(parts)


def install_handlers(app: FastAPI, redact: Callable[[str], str] = str) -> None:
    """Make every error an app raises an OpenAI-style error reply.

    Args:
        app: the app.
        redact: cleans kvgraft's messages (they may name the store's directory) before a client sees them.
    """

    async def api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return exc.response()

    async def kvgraft_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, KvgraftError)
        error = from_kvgraft(exc)
        error.message = redact(error.message)
        return error.response()

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        message = {404: "no such endpoint", 405: "method not allowed on this endpoint"}.get(
            exc.status_code, str(exc.detail)
        )
        headers = dict(exc.headers) if exc.headers else {}
        if exc.status_code == 405:
            headers["Allow"] = _allowed_methods(app, request)
        return ApiError(exc.status_code, message, code="http_error", headers=headers or None).response()

    async def request_validation(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        message = f"{param}: {first.get('msg', 'invalid value')}" if param else "invalid request"
        return ApiError(400, message, param=param, code="invalid_value").response()

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(KvgraftError, kvgraft_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, request_validation)


def _allowed_methods(app: FastAPI, request: Request) -> str:
    """Every method some route of the app serves on the request's path (Starlette's own 405 names only the first
    route whose path matched, e.g. GET alone for /v1/grafts, which also takes POST)."""
    methods: set[str] = set()
    for route in _leaf_routes(app.router.routes):
        match, _ = route.matches(request.scope)
        if match is not Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return ", ".join(sorted(methods))


def _leaf_routes(routes: list[BaseRoute]) -> Iterator[BaseRoute]:
    """The app's routes, those of included routers flattened (newer FastAPI keeps an included router as one
    route; kvgraft's routers have no prefix, so their routes match the request's path as they are)."""
    for route in routes:
        inner = getattr(route, "original_router", None)
        if inner is not None:
            yield from _leaf_routes(inner.routes)
        else:
            yield route
