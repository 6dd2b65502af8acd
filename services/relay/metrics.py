"""Prometheus metrics of one relay: peers, requests, bytes.

Each app owns its own :class:`~prometheus_client.CollectorRegistry`, so two
relays built in one process (tests) never share counters. Served as text at
``GET /metrics``.
"""

from __future__ import annotations

from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

Transport = Literal["rpc", "mux"]
Direction = Literal["to_peer", "from_peer"]

CONTENT_TYPE = CONTENT_TYPE_LATEST
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class RelayMetrics:
    """The relay's counters and gauges, registered in a private registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.peers = Gauge("meshnet_relay_peers", "Peers connected now.", registry=self.registry)
        self.callers = Gauge("meshnet_relay_callers", "Caller connections open now.", ["transport"],
                             registry=self.registry)
        self.inflight = Gauge("meshnet_relay_inflight_requests", "Requests waiting for a peer's answer.",
                              registry=self.registry)
        self.requests = Counter("meshnet_relay_requests", "Requests relayed, by transport and outcome.",
                                ["transport", "outcome"], registry=self.registry)
        self.bytes = Counter("meshnet_relay_bytes", "Body bytes relayed, by direction.", ["direction"],
                             registry=self.registry)
        self.peer_connections = Counter("meshnet_relay_peer_connections",
                                        "Peer connection attempts, by result.", ["result"],
                                        registry=self.registry)
        self.caller_refusals = Counter("meshnet_relay_caller_refusals",
                                       "Caller handshakes refused and connections closed, by reason.", ["reason"],
                                       registry=self.registry)
        self.latency = Histogram("meshnet_relay_request_seconds", "Time from a request's arrival to its answer.",
                                 ["transport"], buckets=LATENCY_BUCKETS, registry=self.registry)

    def count_request(self, transport: Transport, outcome: str, seconds: float) -> None:
        """Record one finished request; ``outcome`` is ``ok``, ``cancelled`` or a relay error code."""
        self.requests.labels(transport, outcome).inc()
        self.latency.labels(transport).observe(seconds)

    def count_bytes(self, direction: Direction, n: int) -> None:
        self.bytes.labels(direction).inc(n)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
