"""Prometheus metrics of one tracker, served at ``GET /metrics``.

Each app owns its own :class:`~prometheus_client.CollectorRegistry`, so
several trackers in one process (tests) do not share counters. Node and model
gauges are computed from the registry at scrape time, so they are never stale.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from meshwire.registry import NodeState

from .node_views import ModelCoverage, NodeInfo

CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"
NODE_STATES: Final[tuple[NodeState, ...]] = ("joining", "online", "suspect", "offline")
FIRST_BYTE_BUCKETS: Final = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _MeshCollector(Collector):
    """Gauges read from the registry when Prometheus scrapes."""

    def __init__(self, nodes: Callable[[], tuple[NodeInfo, ...]],
                 coverage: Callable[[], tuple[ModelCoverage, ...]], store_up: Callable[[], bool]) -> None:
        self._nodes = nodes
        self._coverage = coverage
        self._store_up = store_up

    def collect(self) -> Iterator[Metric]:
        by_state = GaugeMetricFamily("meshnet_tracker_nodes", "Listed nodes by state", labels=["state"])
        nodes = self._nodes()
        for state in NODE_STATES:
            by_state.add_metric([state], sum(node.state == state for node in nodes))
        yield by_state
        complete = GaugeMetricFamily("meshnet_tracker_model_complete",
                                     "1 when a model's layers are all held by routable nodes", labels=["model"])
        missing = GaugeMetricFamily("meshnet_tracker_model_missing_layers",
                                    "Layers of a model no routable node holds", labels=["model"])
        for model in self._coverage():
            complete.add_metric([model.model], float(model.complete))
            missing.add_metric([model.model], float(sum(b - a + 1 for a, b in model.missing)))
        yield complete
        yield missing
        yield GaugeMetricFamily("meshnet_tracker_store_up",
                                "1 while the registry's store answers (always 1 for the memory store)",
                                value=float(self._store_up()))


class TrackerMetrics:
    """The tracker's counters and histograms, plus the scrape-time mesh gauges."""

    def __init__(self, nodes: Callable[[], tuple[NodeInfo, ...]],
                 coverage: Callable[[], tuple[ModelCoverage, ...]],
                 store_up: Callable[[], bool] = lambda: True) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("meshnet_tracker_requests", "Front-door requests by endpoint and HTTP status",
                                ["endpoint", "status"], registry=self.registry)
        self.routes = Counter("meshnet_tracker_routes", "Routes planned, by outcome (planned or incomplete)",
                              ["outcome"], registry=self.registry)
        self.registrations = Counter("meshnet_tracker_registrations",
                                     "Registrations by outcome (new, heartbeat or refused)", ["outcome"],
                                     registry=self.registry)
        self.failure_reports = Counter("meshnet_tracker_failure_reports", "Node failure reports received",
                                       registry=self.registry)
        self.proxy_retries = Counter("meshnet_tracker_proxy_retries",
                                     "Front-door requests sent to a second route after the first head failed",
                                     registry=self.registry)
        self.first_byte = Histogram("meshnet_tracker_head_first_byte_seconds",
                                    "Time from forwarding a request to the head's response headers",
                                    buckets=FIRST_BYTE_BUCKETS, registry=self.registry)
        self.key_requests = Counter("meshnet_tracker_key_requests",
                                    "Front-door requests by API key id (a hash, never the key) and HTTP status",
                                    ["key", "status"], registry=self.registry)
        self.key_tokens = Counter("meshnet_tracker_key_tokens",
                                  "Tokens by API key id and kind: completion tokens of chats and completions; "
                                  "prompt tokens where the answer carried usage (non-streamed, or include_usage)",
                                  ["key", "kind"], registry=self.registry)
        self.registry.register(_MeshCollector(nodes, coverage, store_up))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
