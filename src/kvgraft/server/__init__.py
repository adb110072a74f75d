"""`kvgraft serve`: an OpenAI-compatible HTTP server over one Engine, with grafting per request.

A thin layer: the app factory (`app`), its endpoints, one router per concern (`routes`), request and response
schemas (`schemas`), the one worker thread all model work runs on (`worker`), grafting and retrieval per request
(`grafting`), one generation from request to reply (`generation`, `streaming`), receipts kept for re-checking
(`receipts`), prompt rendering and incremental text (`prompts`), auth, errors and metrics.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvgraft.server.config import ServerConfig

if TYPE_CHECKING:
    from kvgraft.server.app import create_app

__all__ = ["ServerConfig", "create_app"]


def __getattr__(name: str) -> Any:
    # The app pulls in FastAPI; the CLI reads ServerConfig's defaults for every command without paying for it.
    if name == "create_app":
        from kvgraft.server.app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
