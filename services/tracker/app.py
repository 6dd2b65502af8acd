"""The tracker's ASGI app: the one address a user knows.

Routes, each group in its own module:

- the service (:mod:`.service_api`): ``GET /health`` (200 once the tracker serves; 503 with
  the reason while its shared store is away), ``GET /metrics`` (Prometheus), ``GET /`` (the
  live mesh page);
- the OpenAI front door (:mod:`.openai_api`): ``POST /v1/chat/completions``, ``POST /v1/completions``,
  ``GET /v1/models``;
- the mesh (:mod:`.mesh_api`): ``POST|GET /v1/nodes``, ``DELETE /v1/nodes/{id}``,
  ``POST /v1/nodes/{id}/failures``, ``GET /v1/route``, ``GET /v1/mesh``
  (the three ``GET`` views need an API key, a join token or the mesh secret when
  ``MESHNET_API_KEYS`` is set);
- placement (:mod:`.placement_api`): ``POST /v1/placement`` (a node's credential): the layers a node
  started without ``--layers`` should load (:mod:`.placement`);
- trust (:mod:`.admin_api`): ``GET /v1/keys`` (the route-signing public keys),
  ``POST /v1/tokens/check`` (the relay asks whether a join token admits a peer),
  and the operator's ``/v1/admin/tokens`` and ``/v1/admin/keys/rotate``.

Every error, including unknown paths and wrong methods, is answered in the
OpenAI error shape (:mod:`.error_answers`). ``uvicorn services.tracker.app:app`` builds the app from
the ``MESHNET_*`` environment on first access; importing this module has no
side effects.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Final

import httpx
from fastapi import FastAPI

from meshwire import exposure, tls
from meshwire.body_guard import BodyGuard
from meshwire.logs import configure_logging

from . import admin_api, mesh_api, openai_api, placement_api, service_api, verify_api
from .error_answers import add_error_handlers
from .healing import PlacementBook
from .key_limits import KeyLimits
from .settings import TrackerSettings
from .state import TrackerState
from .store import MEMORY
from .store_fence import StoreFence

logger = logging.getLogger(__name__)

POOL_TIMEOUT_S: Final = 10.0
"""Longest wait for a free connection to a head node."""
KEEPALIVE_CONNECTIONS: Final = 32


def create_app(settings: TrackerSettings | None = None, *, clock: Callable[[], float] = time.monotonic) -> FastAPI:
    """Build a tracker app; ``clock`` (monotonic seconds) drives node expiry and backoffs."""
    settings = settings or TrackerSettings()
    configure_logging()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per proxied request is noise
    state = TrackerState.create(settings, clock=clock)
    app = FastAPI(title="meshnet tracker", lifespan=_lifespan(state), docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.tracker = state
    book = app.state.placement_book = PlacementBook()
    state.may_heal = book.may_heal
    for router in (service_api.router, openai_api.router, mesh_api.router, placement_api.router, admin_api.router,
                   verify_api.router):
        app.include_router(router)
    _add_middleware(app, state)
    add_error_handlers(app)
    return app


def _lifespan(state: TrackerState) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The app's lifespan: the client to head nodes, the store and the route keys opened, then closed."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        settings = state.settings
        async with _head_client(settings) as client:
            state.client = client
            await state.store.start()
            await state.trust.start()
            logger.info("tracker serving at %s (store %s, node TTL %.1f s, heartbeat %.1f s, API keys %s)",
                        settings.url, state.store.kind, settings.node_ttl_s, settings.heartbeat_s,
                        "on" if settings.api_keys else "off")
            try:
                yield
            finally:
                state.client = None
                if state.key_limiter is not None:
                    await state.key_limiter.close()
                await state.trust.close()
                await state.store.close()

    return lifespan


def _add_middleware(app: FastAPI, state: TrackerState) -> None:
    """In front of every route, outermost first: the body guard, the API keys' limits, the store's fence."""
    settings = state.settings
    if state.store.kind != MEMORY:
        app.add_middleware(StoreFence, store=state.store, retry_after_s=settings.heartbeat_s)
    if state.key_limiter is not None:
        app.add_middleware(KeyLimits, api_keys=settings.api_keys, limiter=state.key_limiter,
                           count=lambda kid, status: state.metrics.key_requests.labels(kid, str(status)).inc(),
                           secret=settings.secret)
    app.add_middleware(BodyGuard, timeout_s=settings.body_timeout_s)


def _head_client(settings: TrackerSettings) -> httpx.AsyncClient:
    """The client to head nodes: bounded connections, and a read timeout long enough for a prefill."""
    timeout = httpx.Timeout(connect=settings.proxy_connect_timeout_s, read=settings.proxy_read_timeout_s,
                            write=settings.proxy_write_timeout_s, pool=POOL_TIMEOUT_S)
    limits = httpx.Limits(max_connections=settings.max_connections,
                          max_keepalive_connections=min(KEEPALIVE_CONNECTIONS, settings.max_connections))
    return httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False,
                             verify=tls.httpx_verify(settings.tls_ca))


def __getattr__(name: str) -> FastAPI:
    """Build ``app`` from the environment on first access (``uvicorn services.tracker.app:app``)."""
    if name != "app":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    settings = TrackerSettings()
    exposure.require_private_secret("the tracker", settings.host, settings.secret)
    app = create_app(settings)
    globals()["app"] = app
    return app
