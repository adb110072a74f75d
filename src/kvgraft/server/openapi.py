"""The OpenAPI document at `/openapi.json`: every status code, content type and request body the server really has.

Handlers read their bodies themselves (`body.py`: size limit first, then JSON, then the schema), so FastAPI cannot
see them; each body route names its model with `json_body`, and `document` puts the models' validation schemas
in the document. The document is the served app's own: the model it serves, its token limit and its auth are
written into it, so a client (or a fuzzer) that follows it is never refused for a request it calls valid.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from kvgraft.server.config import ServerConfig
from kvgraft.server.schemas import ChatCompletionRequest, CompletionRequest, ErrorResponse, GraftCreateRequest

REQUEST_MODELS: dict[str, type[BaseModel]] = {
    m.__name__: m for m in (CompletionRequest, ChatCompletionRequest, GraftCreateRequest)
}
"""Every request body a handler reads itself, by its component name."""

AUTH_KEY = "x-kvgraft-auth"
"""Operation key naming a route's auth ("read" or "write"); `document` turns it into 401/403 and `security`."""

_WHY: dict[int, str] = {
    400: "The request is malformed, or asks for something this server does not do (OpenAI-style error).",
    401: "The API key is missing or wrong.",
    403: "Library writes are disabled: the server was started without an API key.",
    404: "No such model, graft or receipt.",
    413: "The body is larger than the server's limit (--max-body-bytes).",
    429: "The model's queue is full (--max-queue); retry after Retry-After seconds.",
    500: "A stored graft is damaged, or the server failed unexpectedly; the message says which.",
    503: "The store is out of reach (store_unavailable), or the model worker has stopped (unavailable).",
}
_HEADERS: dict[int, dict[str, Any]] = {
    401: {"WWW-Authenticate": {"schema": {"type": "string"}, "required": True, "description": "Bearer challenge"}},
    429: {"Retry-After": {"schema": {"type": "string"}, "required": True, "description": "seconds to wait"}},
}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The error replies of a route, for its `responses=`.

    Args:
        *statuses: the error statuses the route can answer (401 and 403 are added by `document`, per config).

    Returns:
        One OpenAI-style error response per status, with the headers it always carries.
    """
    return {status: _error_response(status) for status in statuses}


def _error_response(status: int) -> dict[str, Any]:
    response: dict[str, Any] = {"model": ErrorResponse, "description": _WHY[status]}
    if status in _HEADERS:
        response["headers"] = _HEADERS[status]
    return response


def json_body(model: type[BaseModel], auth: str = "read") -> dict[str, Any]:
    """The `openapi_extra` of a route that reads a JSON body itself.

    Args:
        model: the body's model (one of `REQUEST_MODELS`).
        auth: "read" or "write": which token check the route makes.

    Returns:
        The operation's requestBody (a reference to the model's component) and its auth key.
    """
    assert model.__name__ in REQUEST_MODELS, model
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
        AUTH_KEY: auth,
    }


def auth(kind: str) -> dict[str, Any]:
    """The `openapi_extra` of a route without a body.

    Args:
        kind: "read" or "write".

    Returns:
        The auth key `document` reads.
    """
    return {AUTH_KEY: kind}


def install(app: FastAPI, config: ServerConfig, model_id: str) -> None:
    """Serve the app's true document at `app.openapi_url` (built once, on the first request for it).

    Args:
        app: the app, its routes included.
        config: the server's config (auth and limits go into the document).
        model_id: the one model the server serves.
    """

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = document(app, config, model_id)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def document(app: FastAPI, config: ServerConfig, model_id: str) -> dict[str, Any]:
    """The OpenAPI document of an app.

    Args:
        app: the app.
        config: the server's config.
        model_id: the served model.

    Returns:
        The document: FastAPI's, with the request bodies, this server's limits and auth, and no 422 (the server
        answers 400 for every invalid request).
    """
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    components = doc.setdefault("components", {})
    schemas: dict[str, Any] = components.setdefault("schemas", {})
    _, defs = models_json_schema(
        [(m, "validation") for m in REQUEST_MODELS.values()], ref_template="#/components/schemas/{model}"
    )
    schemas.update(defs.get("$defs", {}))
    _limit_requests(schemas, config, model_id)
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    secured = False
    for item in doc.get("paths", {}).values():
        for operation in item.values():
            operation["responses"].pop("422", None)
            secured |= _apply_auth(operation, config)
            if "requestBody" in operation:
                operation["requestBody"]["description"] = (
                    f"A JSON object of at most {config.max_body_bytes} bytes (larger: 413), whatever the "
                    "Content-Type says."
                )
    if secured:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return doc


def _apply_auth(operation: dict[str, Any], config: ServerConfig) -> bool:
    """Add the 401/403 a route really answers under this config; True when it needs the bearer token."""
    kind = operation.pop(AUTH_KEY, None)
    responses = operation["responses"]
    if kind == "write" and not config.api_key:
        responses["403"] = _error_json(403)
        return False
    if (kind == "write" and config.api_key) or (kind == "read" and config.protect_reads and config.api_key):
        responses["401"] = _error_json(401)
        operation["security"] = [{"bearer": []}]
        return True
    return False


def _error_json(status: int) -> dict[str, Any]:
    response: dict[str, Any] = {
        "description": _WHY[status],
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
    }
    if status in _HEADERS:
        response["headers"] = _HEADERS[status]
    return response


def _limit_requests(schemas: dict[str, Any], config: ServerConfig, model_id: str) -> None:
    """Write this server's model and token limit into the request schemas."""
    budgets = {"CompletionRequest": ("max_tokens",), "ChatCompletionRequest": ("max_tokens", "max_completion_tokens")}
    for name, fields in budgets.items():
        properties = schemas[name]["properties"]
        properties["model"] = {
            "type": "string",
            "enum": [model_id],
            "description": "The served model (GET /v1/models); any other is answered 404 model_not_found.",
        }
        for field in fields:
            integer = next(branch for branch in properties[field]["anyOf"] if branch.get("type") == "integer")
            integer["maximum"] = config.max_tokens_limit
