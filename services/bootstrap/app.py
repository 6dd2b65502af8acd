"""The bootstrap service's ASGI app: the HTTP face of :class:`~services.bootstrap.registry.BootstrapRegistry`.

Routes (``reference/bootstrap-spec.md``):

* ``GET /health``: 200 ``OK`` (text/plain).
* ``PUT /route``: a source rank registers; 200 ``OK`` or a text/plain refusal.
  Meshnet's addition beside the reference wire: a registration may carry a
  credential, the mesh secret (``Authorization: Bearer``, when the service has
  ``MESHNET_SECRET``) or a signature by the rank's own key
  (:mod:`meshwire.rank_proof`); a slot so registered is held, and only the same
  key or the mesh secret may register over it (403 otherwise). A credential
  that does not hold is 403 before anything is recorded.
* ``GET /route?engine_rank=-1&target_dp_group=-1``: the node's parallel sizes
  (and, for ``cache-layouts``, its layout and stage placement), JSON.
* ``GET /route?engine_rank=R&target_dp_group=G``: one rank's address, JSON.
* ``GET /metrics``: Prometheus metrics (meshnet's addition).
* ``/route``, ``/health`` or ``/metrics`` with another method: 405
  ``Method not allowed``; any other path: 404 ``Not Found``.

Every refusal is text/plain, as the reference's clients expect: FastAPI's
JSON error bodies never leave this app. Every request body is read under a
cap and a deadline (:mod:`meshwire.body_guard`).

``uvicorn services.bootstrap.app:app`` serves an app configured from the
environment; :func:`services.bootstrap.server.serve` adds the deadline on
request heads, the bound on connections per address (:mod:`meshwire.slow_clients`),
TLS and the bind checks.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Final

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from meshwire.auth import DEFAULT_SECRET, check_bearer
from meshwire.body_guard import BodyGuard, plain_text
from meshwire.hop_proof import ProofProblem
from meshwire.logs import configure_logging
from meshwire.rank_proof import registration_key
from services.bootstrap import refusals
from services.bootstrap.metrics import METRICS_CONTENT_TYPE, BootstrapMetrics, MetricsMiddleware
from services.bootstrap.refusals import Refusal
from services.bootstrap.registry import FORBIDDEN, BootstrapRegistry
from services.bootstrap.settings import BootstrapSettings

logger = logging.getLogger(__name__)

HEALTHY: Final = "OK"
ACCEPTED: Final = "OK"


def text(status: int, message: str, headers: Mapping[str, str] | None = None) -> PlainTextResponse:
    """A text/plain answer, the shape of every answer here but the JSON look-ups."""
    return PlainTextResponse(message, status_code=status, headers=headers)


def create_app(settings: BootstrapSettings | None = None) -> FastAPI:
    """Build a bootstrap app with its own empty table.

    ``settings`` defaults to :class:`BootstrapSettings` read from the
    environment. The table is ``app.state.registry``.
    """
    configure_logging()
    settings = settings if settings is not None else BootstrapSettings()
    table = BootstrapRegistry(settings.registry, max_ranks=settings.max_ranks, hold_s=settings.slot_hold_s)
    metrics = BootstrapMetrics(table)
    app = FastAPI(
        title="meshnet bootstrap", docs_url=None, redoc_url=None, openapi_url=None,
        redirect_slashes=False,
    )
    app.state.settings = settings
    app.state.registry = table

    @app.get("/health")
    async def health() -> PlainTextResponse:
        return text(200, HEALTHY)

    secret = None if settings.secret in (None, DEFAULT_SECRET) else settings.secret  # the published one proves nothing

    def bears_secret(authorization: str | None) -> bool:
        """Whether a request bears the mesh secret (``False`` for no credential); 403 for any other."""
        if authorization is None:
            return False
        if secret is None or check_bearer(authorization, secret) is not None:
            raise Refusal(FORBIDDEN, "invalid credential")
        return True

    @app.put("/route")
    async def register(request: Request) -> PlainTextResponse:
        secret = bears_secret(request.headers.get("authorization"))  # before the body is read
        body = await request.body()
        try:
            key = registration_key(request.headers, body)
        except ProofProblem as exc:
            raise Refusal(FORBIDDEN, str(exc)) from None
        table.register(body, key=key, secret=secret)
        return text(200, ACCEPTED)

    @app.get("/route")
    async def route(request: Request) -> JSONResponse:
        answer: dict[str, Any] = table.route(request.query_params)
        return JSONResponse(answer)

    @app.get("/metrics")
    async def metrics_page() -> Response:
        return Response(metrics.exposition(), media_type=METRICS_CONTENT_TYPE)

    @app.exception_handler(Refusal)
    async def refused(request: Request, refusal: Refusal) -> PlainTextResponse:
        # A decode rank polls for a rank not registered yet: routine, not worth a warning.
        level = logging.DEBUG if refusal.message == refusals.RANK_NOT_FOUND else logging.WARNING
        logger.log(level, "refused %s %s: %d %s", request.method, request.url.path,
                   refusal.status, refusal.message)
        return text(refusal.status, refusal.message)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> PlainTextResponse:
        message = {
            refusals.METHOD_NOT_ALLOWED: refusals.WRONG_METHOD,
            refusals.NOT_FOUND: refusals.PATH_NOT_FOUND,
        }.get(error.status_code, str(error.detail))
        return text(error.status_code, message, error.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> PlainTextResponse:
        return text(refusals.BAD_REQUEST, "the request is invalid")

    app.add_middleware(BodyGuard, max_bytes=settings.max_body_bytes, timeout_s=settings.read_timeout_s,
                       render=plain_text)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    return app


def __getattr__(name: str) -> FastAPI:
    """Build ``app`` from the environment on first access (``uvicorn services.bootstrap.app:app``)."""
    if name != "app":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    app = create_app()
    globals()["app"] = app
    return app
