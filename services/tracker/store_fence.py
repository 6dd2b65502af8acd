"""Before a request plans a route or shows the mesh, bring the tracker's view of a shared store up to date.

:class:`StoreFence` is a plain ASGI middleware in front of the app, so it
sees every request before its handler and never touches a streamed answer. For
the paths that read the registry (:data:`FENCED_PATHS`) it awaits
:meth:`~.store.NodeStore.fresh`: with Redis, one round trip that proves the
view holds every change another tracker has acknowledged (see
:mod:`.store.redis`). While the store is away these paths answer 503
``store_unavailable`` with ``Retry-After`` in the OpenAI error shape rather
than plan from a view that may be wrong. The memory store needs no fence, and
the app installs none.
"""

from __future__ import annotations

import logging
from typing import Final

from starlette.types import ASGIApp, Receive, Scope, Send

from .state import store_unavailable
from .store import NodeStore, StoreUnavailable

logger = logging.getLogger(__name__)

FENCED_PATHS: Final = ("/v1/route", "/v1/nodes", "/v1/mesh", "/v1/models", "/v1/chat/completions",
                       "/v1/completions")
"""Paths whose answers are computed from the registry (``/v1/nodes`` only when read)."""


class StoreFence:
    """ASGI middleware: :meth:`NodeStore.fresh` before every registry read, 503 while the store is away."""

    def __init__(self, app: ASGIApp, store: NodeStore, retry_after_s: float) -> None:
        self.app = app
        self.store = store
        self.retry_after_s = retry_after_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _fenced(scope["method"], scope["path"]):
            try:
                await self.store.fresh()
            except StoreUnavailable as exc:
                response = store_unavailable(str(exc), self.retry_after_s).response()
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _fenced(method: str, path: str) -> bool:
    if path == "/v1/nodes":
        return method == "GET"
    if path.startswith("/v1/models/"):
        return True
    return path in FENCED_PATHS
