"""The tracker's ASGI app: the one address a user knows.

Routes (the rest live in :mod:`.openai_api` and :mod:`.mesh_api`):

- ``GET /health``: 200 once the tracker serves (with its store, a count of nodes and servable
  models); 503 with the reason while its shared store (Redis) is away.
- ``GET /metrics``: Prometheus metrics.
- ``GET /``: the live mesh page (``page.html`` beside this module) when it
  exists, else a short text pointer to the API.
- the OpenAI front door: ``POST /v1/chat/completions``, ``POST /v1/completions``,
  ``GET /v1/models``;
- the mesh: ``POST|GET /v1/nodes``, ``DELETE /v1/nodes/{id}``,
  ``POST /v1/nodes/{id}/failures``, ``GET /v1/route``, ``GET /v1/mesh``
  (the three ``GET`` views need an API key, a join token or the mesh secret when
  ``MESHNET_API_KEYS`` is set);
- trust (:mod:`.admin_api`): ``GET /v1/keys`` (the route-signing public keys),
  ``POST /v1/tokens/check`` (the relay asks whether a join token admits a peer),
  and the operator's ``/v1/admin/tokens`` and ``/v1/admin/keys/rotate``.

Every error, including unknown paths and wrong methods, is answered in the
OpenAI error shape. ``uvicorn services.tracker.app:app`` builds the app from
the ``MESHNET_*`` environment on first access; importing this module has no
side effects.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Final

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from meshwire import errors, exposure, tls
from meshwire.body_guard import BodyGuard
from meshwire.logs import configure_logging

from . import admin_api, mesh_api, openai_api
from .key_limits import KeyLimits
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .responses import HTTPError, error_response
from .settings import TrackerSettings
from .state import TrackerState, tracker_state
from .store import MEMORY, StoreUnavailable
from .store_fence import StoreFence

logger = logging.getLogger(__name__)

PAGE_PATH: Final = Path(__file__).with_name("page.html")
"""The live mesh page, served at ``/`` when present."""
POOL_TIMEOUT_S: Final = 10.0
"""Longest wait for a free connection to a head node."""
KEEPALIVE_CONNECTIONS: Final = 32


def _head_client(settings: TrackerSettings) -> httpx.AsyncClient:
    """The client to head nodes: bounded connections, and a read timeout long enough for a prefill."""
    timeout = httpx.Timeout(connect=settings.proxy_connect_timeout_s, read=settings.proxy_read_timeout_s,
                            write=settings.proxy_write_timeout_s, pool=POOL_TIMEOUT_S)
    limits = httpx.Limits(max_connections=settings.max_connections,
                          max_keepalive_connections=min(KEEPALIVE_CONNECTIONS, settings.max_connections))
    return httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False,
                             verify=tls.httpx_verify(settings.tls_ca))


def _text_page(settings: TrackerSettings) -> str:
    return (
        "meshnet tracker\n\n"
        f"OpenAI API:  {settings.url}/v1  (POST /chat/completions, POST /completions, GET /models)\n"
        f"Mesh:        {settings.url}/v1/nodes, {settings.url}/v1/mesh, {settings.url}/v1/route?model=M\n"
        f"Health:      {settings.url}/health   Metrics: {settings.url}/metrics\n"
    )


def create_app(settings: TrackerSettings | None = None, *, clock: Callable[[], float] = time.monotonic) -> FastAPI:
    """Build a tracker app; ``clock`` (monotonic seconds) drives node expiry and backoffs."""
    settings = settings or TrackerSettings()
    configure_logging()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per proxied request is noise
    state = TrackerState.create(settings, clock=clock)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
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

    app = FastAPI(title="meshnet tracker", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.tracker = state
    app.include_router(openai_api.router)
    app.include_router(mesh_api.router)
    app.include_router(admin_api.router)
    if state.store.kind != MEMORY:
        app.add_middleware(StoreFence, store=state.store, retry_after_s=settings.heartbeat_s)
    if state.key_limiter is not None:
        app.add_middleware(KeyLimits, api_keys=settings.api_keys, limiter=state.key_limiter,
                           count=lambda kid, status: state.metrics.key_requests.labels(kid, str(status)).inc(),
                           secret=settings.secret)
    app.add_middleware(BodyGuard, timeout_s=settings.body_timeout_s)

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        current = tracker_state(request)
        store = await current.store.health()
        reason = store.reason
        if store.ok:
            try:
                await current.store.fresh()
            except StoreUnavailable as exc:
                reason = str(exc)
        if reason is not None:
            return JSONResponse({"status": "unavailable", "store": current.store.kind, "reason": reason},
                                status_code=503,
                                headers={"Retry-After": str(max(math.ceil(settings.heartbeat_s), 1))})
        coverage = current.registry.coverage(current.now())
        live = sum(node.routable for node in current.registry.snapshot(current.now()))
        return JSONResponse({"status": "ok", "store": current.store.kind, "nodes": live,
                             "models_servable": sum(model.complete for model in coverage)})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(tracker_state(request).metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/")
    async def index() -> Response:
        if PAGE_PATH.is_file():
            return HTMLResponse(PAGE_PATH.read_text(encoding="utf-8"))
        return PlainTextResponse(_text_page(settings))

    @app.exception_handler(HTTPError)
    async def http_error(request: Request, exc: HTTPError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def starlette_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path[:200]}"
            return error_response(404, message, errors.NOT_FOUND, "not_found")
        if exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path[:200]}"
            return error_response(405, message, errors.INVALID_REQUEST, "method_not_allowed",
                                  headers=exc.headers)
        return error_response(exc.status_code, str(exc.detail), errors.INVALID_REQUEST, None, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
        return error_response(400, f"invalid request: {first.get('msg', 'bad input')}", errors.INVALID_REQUEST,
                              "invalid_request", param)

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_response(500, "internal error in the tracker", errors.SERVER_ERROR, "internal_error")

    return app


def __getattr__(name: str) -> FastAPI:
    """Build ``app`` from the environment on first access (``uvicorn services.tracker.app:app``)."""
    if name != "app":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    settings = TrackerSettings()
    exposure.require_private_secret("the tracker", settings.host, settings.secret)
    app = create_app(settings)
    globals()["app"] = app
    return app
