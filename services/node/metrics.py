"""Prometheus metrics of a node, served at ``GET /metrics``.

Each app gets its own registry (several nodes may live in one test process).
Session and KV figures are read from the session table at scrape time, so
they are never stale. ``meshnet_node_frame_tokens`` counts the tokens each
received frame carried: after a generation, the frames of one token are the
decode steps, which is how a test proves that decoding moves one token's
hidden state per hop.
"""

from __future__ import annotations

from typing import Final, Protocol

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["CONTENT_TYPE", "NodeMetrics"]

LATENCY_BUCKETS_S: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TOKEN_BUCKETS: Final = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
BATCH_BUCKETS: Final = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128, 256)


class SessionFigures(Protocol):
    """What the metrics read from the session table at scrape time (``engine.sessions.SessionTable``).

    A protocol rather than the table itself, so that metrics stay a leaf every wing may import.
    """

    @property
    def reserved_tokens(self) -> int: ...
    @property
    def free_tokens(self) -> int: ...
    @property
    def used_tokens(self) -> int: ...
    @property
    def handoffs(self) -> int: ...
    def __len__(self) -> int: ...
    def cache_bytes(self) -> int: ...
    def handoff_bytes(self) -> int: ...


class NodeMetrics:
    """The metrics of one node and the registry that serves them."""

    def __init__(self, sessions: SessionFigures) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("meshnet_node_requests", "HTTP requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.forward_latency = Histogram("meshnet_node_forward_seconds",
                                         "Time to answer one /forward frame, later hops included",
                                         buckets=LATENCY_BUCKETS_S, registry=r)
        self.compute_latency = Histogram("meshnet_node_compute_seconds",
                                         "Time this node's layers took for one frame",
                                         buckets=LATENCY_BUCKETS_S, registry=r)
        self.cpu_gate_wait = Histogram("meshnet_node_cpu_gate_wait_seconds",
                                       "Time a forward waited for other nodes on this machine's CPU",
                                       buckets=LATENCY_BUCKETS_S, registry=r)
        self.frame_tokens = Histogram("meshnet_node_frame_tokens", "Tokens carried by each accepted frame",
                                      buckets=TOKEN_BUCKETS, registry=r)
        self.frame_bytes_sent = Counter("meshnet_node_frame_bytes_sent",
                                        "Body bytes of the frames this node sent to next hops, by encoding",
                                        ["encoding"], registry=r)
        self.frame_tokens_sent = Counter("meshnet_node_frame_tokens_sent",
                                         "Positions carried by the frames this node sent to next hops, by encoding",
                                         ["encoding"], registry=r)
        self.decode_steps = Counter("meshnet_node_decode_steps",
                                    "Decode steps this head sent along its routes, by whether they carried drafted "
                                    "tokens", ["speculative"], registry=r)
        self.drafted_tokens = Counter("meshnet_node_drafted_tokens", "Tokens this head drafted (speculation)",
                                      registry=r)
        self.accepted_tokens = Counter("meshnet_node_accepted_tokens",
                                       "Drafted tokens the tail accepted (speculation)", registry=r)
        self.decode_step_seconds = Counter("meshnet_node_decode_step_seconds",
                                           "Wall time of the decode steps this head sent along its routes, by "
                                           "whether they carried drafted tokens", ["speculative"], registry=r)
        self.decode_compute_seconds = Counter("meshnet_node_decode_compute_seconds",
                                              "Compute of every node in those decode steps (the rest of their wall "
                                              "time is the wire: round trips, HTTP, queues)", ["speculative"],
                                              registry=r)
        self.batch_rows = Histogram("meshnet_node_batch_rows", "Decode rows (sessions) in each decode step run",
                                    buckets=BATCH_BUCKETS, registry=r)
        self.frames_refused = Counter("meshnet_node_frames_refused", "Frames refused, by error code",
                                      ["code"], registry=r)
        self.tokens_generated = Counter("meshnet_node_tokens_generated",
                                        "Tokens generated by requests this node headed", registry=r)
        self.failovers = Counter("meshnet_node_failovers",
                                 "Sessions this head moved to a new route, by why (failed, busy or quarantined "
                                 "node) "
                                 "and how it ended (moved, gave_up)", ["reason", "outcome"], registry=r)
        self.sessions_expired = Counter("meshnet_node_sessions_expired",
                                        "Sessions closed by the idle sweeper", registry=r)
        self.positions_computed = Counter("meshnet_node_positions_computed",
                                          "Token positions this node ran through its layers (prompts and decode steps)",
                                          registry=r)
        # --- n > 1 from one prefill (meshwire.fork) ---
        self.forks = Counter("meshnet_node_forks",
                             "Sessions opened as a fork of another's prompt, by outcome (forked, refused)",
                             ["outcome"], registry=r)
        self.fork_positions = Counter("meshnet_node_fork_positions",
                                      "Prompt positions copied from another session's KV instead of computed",
                                      registry=r)
        # --- prefill/decode handoffs (meshwire.kv_handoff) ---
        self.handoffs_held = Counter("meshnet_node_kv_handoffs_held",
                                     "Prompts this prefill node ran and held the KV of for decode nodes", registry=r)
        self.handoffs_freed = Counter("meshnet_node_kv_handoffs_freed",
                                      "Held handoffs freed, by how (pulled whole, or expired unpulled)", ["how"],
                                      registry=r)
        self.kv_served_bytes = Counter("meshnet_node_kv_served_bytes", "Bytes of KV served to decode nodes' pulls",
                                       registry=r)
        self.kv_pulls = Counter("meshnet_node_kv_pulls", "Handoff KV pulls by this node, by outcome (ok, failed)",
                                ["outcome"], registry=r)
        self.kv_pulled_bytes = Counter("meshnet_node_kv_pulled_bytes", "Bytes of KV pulled from prefill nodes",
                                       registry=r)
        self.kv_pull_seconds = Histogram("meshnet_node_kv_pull_seconds", "Time to pull one handoff's KV",
                                         buckets=LATENCY_BUCKETS_S, registry=r)
        self.quarantined_known = Gauge("meshnet_node_quarantined_known",
                                       "Nodes the tracker's last heartbeat answer named quarantined (a head moves "
                                       "its streams off them)", registry=r)
        self.faults_injected = Counter("meshnet_node_faults_injected",
                                       "Outputs this node perturbed on purpose (--fault, tests only), by kind "
                                       "(corrupt-output, wrong-token)", ["kind"], registry=r)
        self.pd_requests = Counter("meshnet_node_pd_requests",
                                   "Requests this head prefilled on prefill nodes, by outcome (handoff: decoded on "
                                   "the pulled KV; fallback: the decode route prefilled itself)", ["outcome"],
                                   registry=r)
        self.pd_fallbacks = Counter("meshnet_node_pd_fallbacks",
                                    "Handoffs given up for the decode route's own prefill, by reason", ["reason"],
                                    registry=r)
        Gauge("meshnet_node_kv_handoffs_holding", "Handoffs held (or being prefilled) now",
              registry=r).set_function(lambda: sessions.handoffs)
        Gauge("meshnet_node_kv_handoff_bytes", "Bytes of KV held for handoffs now",
              registry=r).set_function(sessions.handoff_bytes)
        Gauge("meshnet_node_sessions", "Open sessions", registry=r).set_function(lambda: len(sessions))
        Gauge("meshnet_node_kv_tokens_used", "KV tokens held in caches", registry=r).set_function(
            lambda: sessions.used_tokens)
        Gauge("meshnet_node_kv_tokens_reserved", "KV tokens reserved by open sessions", registry=r).set_function(
            lambda: sessions.reserved_tokens)
        Gauge("meshnet_node_kv_tokens_free", "KV tokens a new session could reserve", registry=r).set_function(
            lambda: sessions.free_tokens)
        Gauge("meshnet_node_kv_bytes", "Bytes of key/value tensors held", registry=r).set_function(
            sessions.cache_bytes)
        self.weight_bytes = Gauge("meshnet_node_weight_bytes",
                                  "Bytes the node's weights take in memory (packed where --weights int8/int4)",
                                  registry=r)

    def render(self) -> bytes:
        """The text exposition of every metric."""
        return generate_latest(self.registry)
