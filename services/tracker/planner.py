"""Route planning: choose live nodes whose layer ranges together run a whole model.

This module is pure (no clock, no I/O): it receives the candidate nodes with
their load figures and answers the hops of the best route, or the layer ranges
nobody eligible holds.

How a route is chosen. Layer boundaries ``0..L`` are the vertices of a small
graph; a candidate holding ``a..b`` is an edge from every boundary ``p`` with
``a <= p <= b`` to ``b + 1`` (a hop that overlaps the previous one starts at
``p``, its ``start_layer``). The cheapest path from ``0`` to ``L`` is the
route, found by one pass over the boundaries in order (the graph is acyclic).
A path's cost is compared component by component:

1. hops through a node in failure backoff (fewest first) and how recent those
   failures were: a backed-off node is used only where nobody else holds its
   layers, and then the one that failed least recently;
2. a head reached only through a relay (``relay_addr``): the tracker forwards
   requests to the head's endpoint, so a directly reachable head is preferred;
3. hops through a node that reported no free KV cache (it would refuse the session);
4. the estimated seconds per decoded token: for each hop, the share of its
   layers it runs, divided by its decode rate (the tracker passes the rate it
   measured, or a new node's clamped claim: see :mod:`.ratings`), times its load
   (sessions, counting the tracker's own in-flight requests, plus one) and its
   KV fill; plus a fixed cost per network hop;

and ties go to the path found first over candidates sorted by first layer,
then node id, so the answer is deterministic. Excluded nodes, and nodes whose
range does not fit the model, are never used.
"""

from __future__ import annotations

import statistics
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from meshwire import limits
from meshwire.routes import RouteNode

HOP_COST_S: Final = 0.002
"""Estimated network cost of one more hop, seconds per token (a LAN round trip)."""
DEFAULT_LAYER_COST_S: Final = 0.001
"""Seconds per layer per token assumed when no candidate has reported a decode rate."""

LayerRange = tuple[int, int]
"""An inclusive range of layers ``(first, last)``."""


class IncompleteCoverage(ValueError):
    """No route exists: the eligible nodes leave ``missing`` layer ranges uncovered."""

    def __init__(self, missing: Sequence[LayerRange], num_layers: int) -> None:
        self.missing: tuple[LayerRange, ...] = tuple(missing)
        self.num_layers = num_layers
        super().__init__(f"no live node holds layers {format_ranges(self.missing)} "
                         f"(the model has {num_layers} layers)")


class RouteTooLong(ValueError):
    """The cheapest route would have more hops than a route may carry."""


@dataclass(frozen=True)
class Candidate:
    """A node the planner may use, with the load figures it last reported."""

    node_id: str
    endpoint: str
    shard_start: int
    shard_end: int
    relay_addr: str | None = None
    hop_key: str | None = None
    """The node's public hop key, named in the route so the next hop can check its frames."""
    active_sessions: int = 0
    """Sessions open on the node (the larger of its report and the tracker's in-flight count)."""
    kv_free_tokens: int = 0
    kv_capacity_tokens: int = 0
    """0 when the node did not report a KV budget: then KV is not considered."""
    decode_tokens_per_s: float = 0.0
    """Decode steps a second through the node's layers; 0 when not measured yet."""
    backoff: bool = False
    """True while the node serves a failure backoff."""
    failure_age_s: float | None = None
    """Seconds since the node's last reported failure, ``None`` if it never failed."""
    role: str = "both"
    """``prefill``, ``decode`` or ``both`` (``meshnet node --role``)."""
    pd_rank: int | None = None
    """A prefill node: the bootstrap ``engine_rank`` it registered under, ``None`` before."""

    @property
    def layers_held(self) -> int:
        return self.shard_end - self.shard_start + 1

    @property
    def kv_full(self) -> bool:
        return self.kv_capacity_tokens > 0 and self.kv_free_tokens <= 0

    @property
    def kv_fill(self) -> float:
        """Fraction of the KV budget in use, 0 when no budget was reported."""
        if self.kv_capacity_tokens <= 0:
            return 0.0
        free = min(max(self.kv_free_tokens, 0), self.kv_capacity_tokens)
        return 1.0 - free / self.kv_capacity_tokens


@dataclass(frozen=True, order=True)
class _Cost:
    """A path's cost; compared component by component (see the module doc)."""

    backoff_hops: int = 0
    backoff_recency: float = 0.0
    relayed_head: int = 0
    kv_full_hops: int = 0
    seconds: float = 0.0

    def __add__(self, other: _Cost) -> _Cost:
        return _Cost(self.backoff_hops + other.backoff_hops, self.backoff_recency + other.backoff_recency,
                     self.relayed_head + other.relayed_head, self.kv_full_hops + other.kv_full_hops,
                     self.seconds + other.seconds)


def format_ranges(ranges: Iterable[LayerRange]) -> str:
    """``[(0, 1), (3, 3)]`` -> ``"0-1, 3"``."""
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in ranges)


def missing_layers(ranges: Iterable[LayerRange], num_layers: int) -> tuple[LayerRange, ...]:
    """The maximal layer ranges of ``0..num_layers-1`` that no range in ``ranges`` covers."""
    missing: list[LayerRange] = []
    next_layer = 0
    for start, end in sorted(ranges):
        if start > next_layer:
            missing.append((next_layer, min(start, num_layers) - 1))
        next_layer = max(next_layer, end + 1)
        if next_layer >= num_layers:
            break
    if next_layer < num_layers:
        missing.append((next_layer, num_layers - 1))
    return tuple((a, b) for a, b in missing if a <= b)


def layer_holders(ranges: Iterable[LayerRange], num_layers: int) -> tuple[int, ...]:
    """How many ranges hold each layer ``0..num_layers-1``."""
    delta = [0] * (num_layers + 1)
    for start, end in ranges:
        first, last = max(start, 0), min(end, num_layers - 1)
        if first <= last:
            delta[first] += 1
            delta[last + 1] -= 1
    counts: list[int] = []
    running = 0
    for layer in range(num_layers):
        running += delta[layer]
        counts.append(running)
    return tuple(counts)


def _layer_cost_fallback(candidates: Sequence[Candidate]) -> float:
    """Seconds per layer assumed for a node without a rate: the median of those that have one."""
    known = [1.0 / (c.decode_tokens_per_s * c.layers_held) for c in candidates if c.decode_tokens_per_s > 0]
    return statistics.median(known) if known else DEFAULT_LAYER_COST_S


def _hop_cost(candidate: Candidate, start_layer: int, fallback_layer_s: float) -> _Cost:
    """The cost of ``candidate`` running layers ``start_layer..shard_end`` (the head when it starts at 0)."""
    layers_run = candidate.shard_end - start_layer + 1
    if candidate.decode_tokens_per_s > 0:
        layer_s = 1.0 / (candidate.decode_tokens_per_s * candidate.layers_held)
    else:
        layer_s = fallback_layer_s
    load = max(candidate.active_sessions, 0) + 1
    seconds = layers_run * layer_s * load * (1.0 + candidate.kv_fill) + HOP_COST_S
    recency = 0.0
    if candidate.backoff:
        age = candidate.failure_age_s if candidate.failure_age_s is not None else 0.0
        recency = 1.0 / (1.0 + max(age, 0.0))
    return _Cost(backoff_hops=int(candidate.backoff), backoff_recency=recency,
                 relayed_head=int(start_layer == 0 and candidate.relay_addr is not None),
                 kv_full_hops=int(candidate.kv_full), seconds=seconds)


def plan_route(candidates: Iterable[Candidate], num_layers: int,
               exclude: Collection[str] = frozenset(),
               max_hops: int = limits.MAX_ROUTE_HOPS) -> tuple[RouteNode, ...]:
    """The cheapest hops that run layers ``0..num_layers-1`` in order, ``start_layer`` set.

    Raises :class:`IncompleteCoverage` naming the missing ranges when the
    candidates not in ``exclude`` leave a gap, and :class:`RouteTooLong` when
    the route would need more than ``max_hops`` hops.
    """
    if num_layers < 1:
        raise ValueError(f"num_layers must be at least 1, got {num_layers}")
    usable = sorted(
        (c for c in candidates if c.node_id not in exclude and 0 <= c.shard_start <= c.shard_end < num_layers),
        key=lambda c: (c.shard_start, c.node_id),
    )
    gaps = missing_layers(((c.shard_start, c.shard_end) for c in usable), num_layers)
    if gaps:
        raise IncompleteCoverage(gaps, num_layers)
    fallback = _layer_cost_fallback(usable)
    # best[p]: cheapest way found to reach boundary p, and the (candidate, start) hop that ends there.
    best: dict[int, tuple[_Cost, int, Candidate | None]] = {0: (_Cost(), -1, None)}
    for boundary in sorted({0, *(c.shard_end + 1 for c in usable)}):
        if boundary not in best or boundary >= num_layers:
            continue
        cost_here = best[boundary][0]
        for candidate in usable:
            if candidate.shard_start > boundary:
                break
            if boundary > candidate.shard_end:
                continue
            end = candidate.shard_end + 1
            cost = cost_here + _hop_cost(candidate, boundary, fallback)
            if end not in best or cost < best[end][0]:
                best[end] = (cost, boundary, candidate)
    hops: list[RouteNode] = []
    boundary = num_layers
    while boundary > 0:
        _, start, candidate = best[boundary]
        assert candidate is not None  # every boundary but 0 was reached through a hop
        hops.append(RouteNode(node_id=candidate.node_id, endpoint=candidate.endpoint,
                              shard_start=candidate.shard_start, shard_end=candidate.shard_end,
                              start_layer=start, relay_addr=candidate.relay_addr, hop_key=candidate.hop_key))
        boundary = start
    hops.reverse()
    if len(hops) > max_hops:
        raise RouteTooLong(f"the best route needs {len(hops)} hops, more than the {max_hops} a route may carry")
    return tuple(hops)
