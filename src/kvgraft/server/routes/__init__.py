"""The server's endpoints, one router per concern; `create_app` includes them in this order.

Handlers get the app's `ServerState` through the `State` dependency (`routes.deps`), never from a closure.
"""

from fastapi import APIRouter

from kvgraft.server.routes import completions, grafts, health, receipts

ROUTERS: tuple[APIRouter, ...] = (health.router, completions.router, receipts.router, grafts.router)
"""every router of the app: health, metrics and models; completions and chat; receipts; the graft library"""

__all__ = ["ROUTERS"]
