"""The relay's ASGI app: reach nodes behind NAT through one outbound WebSocket each.

Routes::

    GET  /health             200 {"status": "ok", "peers": n, "callers": m, "anonymous_callers": a}
    GET  /metrics            Prometheus text: peers, callers, requests, bytes, latency, refusals
    WS   /peer/{peer_id}     a peer's outbound link (Bearer auth; one live connection per id)
    WS   /rpc/{peer_id}      callers, the reference's JSON envelope, one text message each way
                             (with Bearer auth: everything; without: the peer's GET /health only)
    WS   /mux/{peer_id}      callers, binary and multiplexed (Bearer auth, or a node's signed proof bound to
                             this peer: ``services.relay.hop_callers``)

The message formats are documented in :mod:`meshwire.relay_client` (binary)
and :mod:`meshwire.envelope` (JSON). Run it with ``meshnet relay`` or
``uvicorn services.relay.app:app``; importing this module builds nothing:
``app`` is made from the environment on first access.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Response, WebSocket

from meshwire import exposure
from meshwire.body_guard import BodyGuard
from meshwire.logs import configure_logging
from services.relay.caller_socket import serve_mux, serve_rpc
from services.relay.metrics import CONTENT_TYPE
from services.relay.peer_socket import serve_peer
from services.relay.settings import RelaySettings
from services.relay.state import RelayState
from services.relay.transport import install_denial_log_filter


def create_app(settings: RelaySettings | None = None) -> FastAPI:
    """Build a relay app from ``settings`` (default: from the ``MESHNET_*`` environment)."""
    settings = settings or RelaySettings()
    configure_logging(settings.log_level)
    install_denial_log_filter()
    state = RelayState.build(settings)
    app = FastAPI(title="meshnet relay", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.relay = state
    app.add_middleware(BodyGuard, timeout_s=settings.body_timeout_s)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "peers": len(state.peers), "callers": state.callers.total,
                "anonymous_callers": state.callers.anonymous}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.websocket("/peer/{peer_id}")
    async def peer(websocket: WebSocket, peer_id: str) -> None:
        await serve_peer(websocket, peer_id, state)

    @app.websocket("/rpc/{peer_id}")
    async def rpc(websocket: WebSocket, peer_id: str) -> None:
        await serve_rpc(websocket, peer_id, state)

    @app.websocket("/mux/{peer_id}")
    async def mux(websocket: WebSocket, peer_id: str) -> None:
        await serve_mux(websocket, peer_id, state)

    return app


def __getattr__(name: str) -> FastAPI:
    """Build ``app`` from the environment on first access (``uvicorn services.relay.app:app``)."""
    if name == "app":
        settings = RelaySettings()
        exposure.require_private_secret("the relay", settings.host, settings.secret)
        built = create_app(settings)
        globals()["app"] = built
        return built
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
