"""What the routers depend on: the app's one `ServerState`, and the bearer-token checks."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, FastAPI, Request

from kvgraft.server.auth import require_read, require_write
from kvgraft.server.state import ServerState


def attach(app: FastAPI, state: ServerState) -> None:
    """Store the state on the app, where every handler finds it (and tests too: `app.state.kvgraft`).

    Args:
        app: the app.
        state: the state its handlers share.
    """
    app.state.kvgraft = state


def state_of(app: FastAPI) -> ServerState:
    """The state `attach` stored on an app.

    Args:
        app: the app.

    Returns:
        Its state.
    """
    state: ServerState = app.state.kvgraft
    return state


async def server_state(request: Request) -> ServerState:
    """The dependency that hands a handler the state of the app serving it.

    Args:
        request: the request being served.

    Returns:
        The app's state.
    """
    return state_of(request.app)


State = Annotated[ServerState, Depends(server_state)]
"""A handler parameter of this type receives the app's state."""


def reads(request: Request) -> None:
    """The dependency of every /v1 read: the bearer token, when the server protects reads.

    Args:
        request: the request being served.

    Raises:
        ApiError: 401 when the token is missing or wrong.
    """
    require_read(request, state_of(request.app).config)


def writes(request: Request) -> None:
    """The dependency of every library write: the bearer token, always.

    Args:
        request: the request being served.

    Raises:
        ApiError: 403 when the server has no API key (writes are disabled), 401 when the token is missing or wrong.
    """
    require_write(request, state_of(request.app).config)
