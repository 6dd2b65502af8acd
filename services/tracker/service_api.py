"""The tracker as a service: its health, its metrics, and the page a person opens.

Routes:

- ``GET /health``: 200 once the tracker serves (with its store, a count of nodes and servable
  models); 503 with the reason while its shared store (Redis) is away.
- ``GET /metrics``: Prometheus metrics.
- ``GET /``: the live mesh page (``page.html`` beside this module) when it
  exists, else a short text pointer to the API.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Final

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response

from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .settings import TrackerSettings
from .state import tracker_state
from .store import StoreUnavailable

PAGE_PATH: Final = Path(__file__).with_name("page.html")
"""The live mesh page, served at ``/`` when present."""

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """Ready to serve (200), or why not (503, with ``Retry-After``)."""
    state = tracker_state(request)
    store = await state.store.health()
    reason = store.reason
    if store.ok:
        try:
            await state.store.fresh()
        except StoreUnavailable as exc:
            reason = str(exc)
    if reason is not None:
        return JSONResponse({"status": "unavailable", "store": state.store.kind, "reason": reason},
                            status_code=503,
                            headers={"Retry-After": str(max(math.ceil(state.settings.heartbeat_s), 1))})
    coverage = state.registry.coverage(state.now())
    live = sum(node.routable for node in state.registry.snapshot(state.now()))
    return JSONResponse({"status": "ok", "store": state.store.kind, "nodes": live,
                         "models_servable": sum(model.complete for model in coverage)})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """The tracker's Prometheus metrics."""
    return Response(tracker_state(request).metrics.render(), media_type=METRICS_CONTENT_TYPE)


@router.get("/")
async def index(request: Request) -> Response:
    """The live mesh page, or a pointer to the API where the page is not installed."""
    if PAGE_PATH.is_file():
        return HTMLResponse(PAGE_PATH.read_text(encoding="utf-8"))
    return PlainTextResponse(_text_page(tracker_state(request).settings))


def _text_page(settings: TrackerSettings) -> str:
    return (
        "meshnet tracker\n\n"
        f"OpenAI API:  {settings.url}/v1  (POST /chat/completions, POST /completions, GET /models)\n"
        f"Mesh:        {settings.url}/v1/nodes, {settings.url}/v1/mesh, {settings.url}/v1/route?model=M\n"
        f"Health:      {settings.url}/health   Metrics: {settings.url}/metrics\n"
    )
