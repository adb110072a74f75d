"""Bearer-token checks: library writes always need the token, reads only when the server protects them."""

from __future__ import annotations

import hmac

from fastapi import Request

from kvgraft.server.config import API_KEY_ENV, ServerConfig
from kvgraft.server.errors import ApiError

_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="kvgraft"'}


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _check(request: Request, key: str) -> None:
    token = _bearer(request)
    if token is None:
        raise ApiError(
            401, "missing API key: send 'Authorization: Bearer <key>'", code="missing_api_key", headers=_CHALLENGE
        )
    # Constant-time comparison, so response timing says nothing about how much of a guess was right.
    if not hmac.compare_digest(token.encode(), key.encode()):
        raise ApiError(401, "invalid API key", code="invalid_api_key", headers=_CHALLENGE)


def require_write(request: Request, config: ServerConfig) -> None:
    if not config.api_key:
        raise ApiError(
            403,
            f"library writes are disabled: start the server with --api-key or ${API_KEY_ENV} to allow them",
            code="writes_disabled",
        )
    _check(request, config.api_key)


def require_read(request: Request, config: ServerConfig) -> None:
    if config.protect_reads and config.api_key:
        _check(request, config.api_key)
