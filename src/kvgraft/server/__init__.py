"""`kvgraft serve`: an OpenAI-compatible HTTP server over one Engine, with grafting per request.

A thin layer: the app factory (`app`), request and response schemas (`schemas`), the one worker thread all model
work runs on (`worker`), grafting and retrieval per request (`grafting`), receipts kept for re-checking
(`receipts`), prompt rendering and incremental text (`prompts`), auth, errors and metrics.
"""

from kvgraft.server.app import create_app
from kvgraft.server.config import ServerConfig

__all__ = ["ServerConfig", "create_app"]
