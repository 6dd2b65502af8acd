"""How fast each node is, as the tracker measures it: the planner's speeds come from here, not from claims.

A node reports ``decode_tokens_per_s`` in its heartbeat, but that is its own
word: a node that registered ``1e300`` headed every route. So the speed the
planner (:mod:`.planner`) weighs a node by is this module's estimate:

- **Measured.** Every stream the tracker relays through one route, start to
  finish, is a measurement: the seconds from sending the request to the last
  token, over the tokens (time to first token and decode together), divided
  by the model's layers, is one observation of *seconds per layer* for every
  node of that route (each hop is charged alike: the tracker cannot see
  inside a route, and an even charge is the one a node's own claim cannot
  shift). A node's estimate is the moving average of its observations
  (:data:`SMOOTHING`), so the nodes of slow routes fall behind those of fast
  ones over a few requests. A stream that moved to another route midway, or
  that ended without tokens, measures nothing.
- **Claimed.** A node not measured yet is weighed by its claim, clamped to
  :data:`MAX_CLAIMED_TOKENS_PER_S` (a figure no honest node of a LAN mesh
  reaches), so a new node gets routes to be measured on; its first
  measurement replaces the claim, and the claim is never used again while
  the tracker remembers the node.

Measurements are per node id (a node that restarts keeps its record). With
one tracker they live in its memory; with a shared store (Redis) each
observation is also folded into the node's record there, atomically, and
published, so every tracker of the store plans with the same speeds
(:mod:`.store.redis_judgement`). Every size is bounded (:data:`MAX_NODES`).
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from .planner import Candidate

MAX_CLAIMED_TOKENS_PER_S: Final = 10_000.0
"""The most decode steps a second a node's own claim is believed for (its layers together)."""
SMOOTHING: Final = 0.3
"""Weight of the newest observation in a node's moving average of seconds per layer."""
MAX_NODES: Final = 4096
"""Most nodes whose measurements are kept (the least recently measured forgotten first)."""
MIN_OBSERVED_S: Final = 1e-6
"""Smallest seconds-per-layer observation kept (a clock that did not move is not infinite speed)."""


@dataclass
class _Measured:
    layer_s: float
    """Moving average of seconds per layer per token."""
    streams: int
    ttft_s: float
    """Moving average of the time to first token of routes through the node."""


@dataclass(frozen=True)
class NodeRating:
    """What ``GET /v1/nodes`` shows of a node's speed: what the tracker measured."""

    measured_tokens_per_s: float | None
    """Decode steps a second through the node's layers as measured (``None``: not measured yet)."""
    measured_streams: int
    measured_ttft_s: float | None


class Ratings:
    """Per-node speed estimates from the streams the tracker relays (see the module doc)."""

    def __init__(self) -> None:
        self._nodes: OrderedDict[str, _Measured] = OrderedDict()

    def observe(self, node_ids: Iterable[str], num_layers: int, ttft_s: float, total_s: float,
                tokens: int) -> None:
        """One stream through the route of ``node_ids`` (``num_layers`` layers): first token after
        ``ttft_s``, ``tokens`` tokens after ``total_s`` seconds. Nothing is learnt from no tokens."""
        if tokens <= 0 or num_layers <= 0 or not math.isfinite(total_s) or total_s < 0:
            return
        layer_s = max(total_s / tokens / num_layers, MIN_OBSERVED_S)
        ids = list(dict.fromkeys(node_ids))
        self._fold(ids, layer_s, max(ttft_s, 0.0))
        self.observed(ids, layer_s, max(ttft_s, 0.0))

    def observed(self, node_ids: list[str], layer_s: float, ttft_s: float) -> None:
        """One observation was folded in here (a shared store's ratings write it on; here: nothing more)."""

    def set_measured(self, node_id: str, layer_s: float, streams: int, ttft_s: float) -> None:
        """Make ``node_id``'s record what the shared store holds (its moving averages, folded there)."""
        if not (math.isfinite(layer_s) and layer_s > 0 and math.isfinite(ttft_s)) or streams < 0:
            return
        self._nodes.pop(node_id, None)
        self._nodes[node_id] = _Measured(layer_s=max(layer_s, MIN_OBSERVED_S), streams=streams,
                                         ttft_s=max(ttft_s, 0.0))
        while len(self._nodes) > MAX_NODES:
            self._nodes.popitem(last=False)

    def _fold(self, node_ids: list[str], layer_s: float, ttft_s: float) -> None:
        for node_id in node_ids:
            known = self._nodes.pop(node_id, None)
            if known is None:
                known = _Measured(layer_s=layer_s, streams=0, ttft_s=max(ttft_s, 0.0))
            else:
                known.layer_s += SMOOTHING * (layer_s - known.layer_s)
                known.ttft_s += SMOOTHING * (max(ttft_s, 0.0) - known.ttft_s)
            known.streams += 1
            self._nodes[node_id] = known
        while len(self._nodes) > MAX_NODES:
            self._nodes.popitem(last=False)

    def rating(self, node_id: str, layers_held: int) -> NodeRating:
        known = self._nodes.get(node_id)
        if known is None:
            return NodeRating(None, 0, None)
        return NodeRating(round(1.0 / (known.layer_s * max(layers_held, 1)), 3), known.streams,
                          round(known.ttft_s, 4))

    def rated(self, candidates: Sequence[Candidate]) -> list[Candidate]:
        """``candidates`` with the speed the planner should weigh them by: measured, else the clamped claim."""
        out: list[Candidate] = []
        for candidate in candidates:
            known = self._nodes.get(candidate.node_id)
            if known is not None:
                speed = 1.0 / (known.layer_s * candidate.layers_held)
            else:
                speed = min(candidate.decode_tokens_per_s, MAX_CLAIMED_TOKENS_PER_S)
            out.append(dataclasses.replace(candidate, decode_tokens_per_s=speed))
        return out
