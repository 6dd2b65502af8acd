"""Prometheus metrics of one bootstrap service, served at ``GET /metrics``.

* ``meshnet_bootstrap_requests_total{route, method, status}``: requests answered;
* ``meshnet_bootstrap_request_seconds{route}``: time to answer;
* ``meshnet_bootstrap_registered_ranks``: slots of the table holding an address.

Each app has its own :class:`~prometheus_client.CollectorRegistry`, so
several services in one process (tests, an embedded mesh) do not collide.
The ``route`` and ``method`` labels are known values or ``other``, never
the raw request's: a client cannot grow the label set.
"""

from __future__ import annotations

import time
from typing import Final

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.bootstrap.registry import BootstrapRegistry

KNOWN_ROUTES: Final = frozenset({"/health", "/route", "/metrics"})
KNOWN_METHODS: Final = frozenset({"GET", "HEAD", "PUT", "POST", "DELETE", "PATCH", "OPTIONS"})
OTHER: Final = "other"
METRICS_CONTENT_TYPE: Final = CONTENT_TYPE_LATEST


class BootstrapMetrics:
    """The collectors of one bootstrap service."""

    def __init__(self, table: BootstrapRegistry) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "meshnet_bootstrap_requests", "Requests answered by the bootstrap service.",
            ("route", "method", "status"), registry=self.registry,
        )
        self.latency = Histogram(
            "meshnet_bootstrap_request_seconds", "Time to answer a bootstrap request.",
            ("route",), registry=self.registry,
        )
        self.ranks = Gauge(
            "meshnet_bootstrap_registered_ranks", "Source rank slots holding an address.",
            registry=self.registry,
        )
        self.ranks.set_function(lambda: table.registered_ranks)

    def observe(self, path: str, method: str, status: int, seconds: float) -> None:
        """Count one answered request."""
        route = path if path in KNOWN_ROUTES else OTHER
        method = method if method in KNOWN_METHODS else OTHER
        self.requests.labels(route, method, str(status)).inc()
        self.latency.labels(route).observe(seconds)

    def exposition(self) -> bytes:
        """The text exposition format of every collector."""
        return generate_latest(self.registry)


class MetricsMiddleware:
    """ASGI middleware that counts and times every HTTP request."""

    def __init__(self, app: ASGIApp, *, metrics: BootstrapMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def send_counting(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counting)
        finally:
            self.metrics.observe(scope["path"], scope["method"], status, time.perf_counter() - started)
