"""The node service: one shard of the model behind HTTP.

Routes:

* ``GET /health`` — 200 with the node's figures once its layers are loaded and
  warm; 503 while starting or draining.
* ``GET /metrics`` — Prometheus metrics.
* ``POST /forward`` — node-to-node frames (:mod:`services.node.api.forward`).
* ``POST /kv/prefill``, ``POST /kv/pull`` — on a prefill node (``--role prefill``), the
  prefill/decode handoff (:mod:`services.node.api.kv_serve`), signed with the caller's hop key
  (:mod:`services.node.pd.kv_auth`); 409 ``not_prefill`` elsewhere.
* ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/responses`` — on a head node
  (one holding layer 0) the OpenAI-compatible API (:mod:`services.node.api.openai_api`);
  any other node answers 409 ``not_head``.

``create_app(settings)`` builds the app, one small function per group of routes;
``uvicorn services.node.app:app`` builds it from ``MESHNET_*`` environment variables
(module ``__getattr__``, so importing this module has no side effects).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from meshwire import errors, exposure
from meshwire.body_guard import BodyGuard
from meshwire.frames import DTYPE_NAMES
from meshwire.kv_handoff import PREFILL_PATH, PULL_PATH
from meshwire.logs import configure_logging
from meshwire.row_batch import ROWS_PATH
from services.node.api.api_error import ApiError
from services.node.api.openai_api import OpenAIService
from services.node.engine import openmp
from services.node.metrics import CONTENT_TYPE
from services.node.pd.kv_auth import KvRefusal, caller_claim
from services.node.runtime import NodeRuntime
from services.node.settings import NodeSettings

logger = logging.getLogger(__name__)

Handler = Callable[[Request], Awaitable[Response]]
ExceptionHandler = Callable[[Request, Exception], Awaitable[Response]]


def _json(status: int, payload: dict[str, Any], headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type="application/json", headers=headers)


def _not_ready() -> Response:
    return ApiError(503, "this node is still loading its layers", "not_ready", retry_after="2").response()


def create_app(settings: NodeSettings | None = None) -> Starlette:
    """Build a node app; its layers load when the app starts (lifespan).

    A plain Starlette app: every endpoint reads its request itself, so
    FastAPI's per-request parameter machinery would only add latency to each
    hop of each token.
    """
    configure_logging()
    settings = settings or NodeSettings()
    node = NodeRuntime(settings)
    app = Starlette(
        routes=[*_status_routes(node), *_forward_routes(node), *_kv_routes(node), *_openai_routes(node)],
        exception_handlers=_error_handlers(),
        middleware=[Middleware(BodyGuard, timeout_s=settings.body_timeout_s)],
        lifespan=_lifespan(node),
    )
    app.state.node = node
    return app


def _lifespan(node: NodeRuntime) -> Callable[[Starlette], AbstractAsyncContextManager[None]]:
    """The node's layers load when the app starts; it drains and stops when the app stops."""

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await node.start(app)
        try:
            yield
        finally:
            await node.stop()

    return lifespan


def _counted(node: NodeRuntime, endpoint: str, handler: Handler) -> Handler:
    """``handler``, each answer counted in ``meshnet_node_requests_total`` by endpoint and status."""

    async def wrapper(request: Request) -> Response:
        response = await handler(request)
        node.metrics.requests.labels(endpoint=endpoint, status=str(response.status_code)).inc()
        return response

    return wrapper


def _status_routes(node: NodeRuntime) -> list[Route]:
    """``GET /health`` and ``GET /metrics``: what the tracker, operators and Prometheus read."""

    async def health(_: Request) -> Response:
        if node.state != "ready" or node.shard is None or node.runner is None:
            return _json(503, {"status": node.state, "node_id": node.node_id})
        shard = node.shard
        return _json(200, {
            "status": "ok", "node_id": node.node_id, "model": node.model_id,
            "shard_start": shard.start, "shard_end": shard.end, "num_layers": shard.num_layers,
            "head": shard.is_head, "tail": shard.is_tail,
            "dtype": DTYPE_NAMES[shard.dtype], "device": str(shard.device),
            "sessions": len(node.sessions), "kv_budget_tokens": node.sessions.kv_budget_tokens,
            "kv_free_tokens": node.sessions.free_tokens, "kv_used_tokens": node.sessions.used_tokens,
            "decode_tokens_per_s": round(node.runner.decode_tokens_per_s, 3),
            "role": node.settings.role, "bootstrap": node.settings.bootstrap is not None,
            **({} if node.membership is None else {
                "prefill_group": None if node.membership.assignment is None
                else node.membership.assignment.model_dump(mode="json"),
                "pd_rank": node.membership.pd_rank, "bootstrap_error": node.membership.error}),
        })

    async def metrics(_: Request) -> Response:
        return Response(node.metrics.render(), media_type=CONTENT_TYPE)

    return [Route("/health", health, methods=["GET"]), Route("/metrics", metrics, methods=["GET"])]


def _forward_routes(node: NodeRuntime) -> list[Route]:
    """``POST /forward`` and ``POST /forward/rows``: the hop side of a step (503 until the layers are loaded)."""

    async def forward(request: Request) -> Response:
        if node.forward is None or node.state == "starting":
            return _not_ready()
        return await node.forward.handle(request)

    async def forward_rows(request: Request) -> Response:
        if node.forward is None or node.state == "starting":
            return _not_ready()
        return await node.forward.handle_rows(request)

    return [Route("/forward", _counted(node, "forward", forward), methods=["POST"]),
            Route(ROWS_PATH, _counted(node, "forward_rows", forward_rows), methods=["POST"])]


def _kv_routes(node: NodeRuntime) -> list[Route]:
    """``POST /kv/prefill`` and ``POST /kv/pull``: a prefill node's side of a handoff (409 on any other node)."""

    async def kv_endpoint(request: Request, pull: bool) -> Response:
        try:  # the proof's form first, whatever this node is (kv_serve checks it against the routes)
            caller_claim(request.headers)
        except KvRefusal as exc:
            return ApiError(exc.status, str(exc), exc.code).response()
        if node.state == "starting":
            return _not_ready()
        if node.kv_serve is None:
            return ApiError(409, f"node {node.node_id} is not a prefill node with a bootstrap registry "
                                 "(--role prefill --bootstrap URL)", "not_prefill").response()
        return await (node.kv_serve.handle_pull(request) if pull else node.kv_serve.handle_prefill(request))

    async def kv_prefill(request: Request) -> Response:
        return await kv_endpoint(request, pull=False)

    async def kv_pull(request: Request) -> Response:
        return await kv_endpoint(request, pull=True)

    return [Route(PREFILL_PATH, _counted(node, "kv_prefill", kv_prefill), methods=["POST"]),
            Route(PULL_PATH, _counted(node, "kv_pull", kv_pull), methods=["POST"])]


def _openai_routes(node: NodeRuntime) -> list[Route]:
    """The OpenAI-compatible API a head serves (:class:`OpenAIService`)."""
    api = OpenAIService(node)
    return [Route("/v1/chat/completions", _counted(node, "chat", api.chat), methods=["POST"]),
            Route("/v1/completions", _counted(node, "completions", api.completions), methods=["POST"]),
            Route("/v1/responses", _counted(node, "responses", api.responses), methods=["POST"])]


def _error_handlers() -> dict[Any, ExceptionHandler]:
    """OpenAI-shaped answers for Starlette's HTTP errors (404, 405...) and for anything unexpected (500)."""

    async def http_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        kind = errors.NOT_FOUND if exc.status_code == 404 else errors.INVALID_REQUEST
        return _json(exc.status_code, errors.error_body(str(exc.detail), kind, None))

    async def internal_error(request: Request, exc: Exception) -> Response:
        logger.exception("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
        return _json(500, errors.error_body("internal error; see the node's log", errors.SERVER_ERROR, "internal"))

    return {StarletteHTTPException: http_error, Exception: internal_error}


@functools.cache
def _app_from_env() -> Starlette:
    unset = openmp.missing()
    if unset:  # torch has loaded by now: too late to set them for this process
        logging.getLogger(__name__).warning(
            "%s not set: OpenMP threads wait torch's default way, which makes decode steps slower; start the "
            "node with %s (as `meshnet node` does)", ", ".join(unset),
            " ".join(f"{k}={v}" for k, v in openmp.OPENMP_DEFAULTS.items()))
    settings = NodeSettings()
    if not settings.join_token:  # a node that joins by token holds no secret: nothing to leak
        exposure.require_private_secret("the node", settings.host, settings.secret)
    return create_app(settings)


def __getattr__(name: str) -> Any:
    """``services.node.app:app`` for uvicorn: built from the environment on first access."""
    if name == "app":
        return _app_from_env()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
