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
    """Check that a library write carries the server's token.

    Args:
        request: the request.
        config: the server's config (its API key).

    Raises:
        ApiError: 403 when the server has no key (writes are disabled), 401 when the token is missing or wrong.
    """
    if not config.api_key:
        raise ApiError(
            403,
            f"library writes are disabled: start the server with --api-key or ${API_KEY_ENV} to allow them",
            code="writes_disabled",
        )
    _check(request, config.api_key)


def require_read(request: Request, config: ServerConfig) -> None:
    """Check that a read carries the server's token, when the server protects reads.

    Args:
        request: the request.
        config: the server's config (its API key, whether reads are protected).

    Raises:
        ApiError: 401 when reads are protected and the token is missing or wrong.
    """
    if config.protect_reads and config.api_key:
        _check(request, config.api_key)
