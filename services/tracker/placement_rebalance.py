"""Rebalancing: new ranges for live placed nodes so that layers nobody holds are held again.

Pure, like :mod:`.placement`: it receives the live placed nodes that may move
(each with its own layer costs and memory budget), the ranges that stay where
they are (pinned nodes, nodes placed by another tracker, nodes cooling down
after a move, moves already under way), and answers new ranges for some of the
movable nodes, or why no plan covers the model.

How a plan is found, cheapest first:

1. **Spares first.** A node whose every layer another live node also holds (a
   replica) moves wholly onto an uncovered run (:func:`.placement.place`'s
   choice), one spare after another, while gaps are left. Where that covers the
   model, nobody else moves.
2. **Re-cut the chain.** Otherwise the movable nodes, in the order of their
   current ranges, are given consecutive ranges that cover every layer the
   staying nodes leave (a dynamic programme over "the first layer not yet
   covered"): a node keeps its range where that fits the cut, else it is given
   the next run from the first uncovered layer, as long as its budget holds.
   Among the plans that cover, the one that moves the fewest nodes wins, then
   the one whose slowest node is fastest (faster nodes take more layers, see
   :func:`recut`), then the one whose busiest node uses the smallest share of
   its budget. So after a death the survivors may both grow, or one
   may shrink at one end and grow at the other; the order of the nodes along
   the model never changes, which is what lets the tracker carry the moves out
   without a cycle (see :mod:`.healing`).
3. **KV room gives way to coverage.** Each plan is first sought with
   :data:`.placement.DEFAULT_KV_RESERVE_TOKENS` tokens of KV room a layer, then
   with less (:data:`KV_RESERVE_LEVELS`), down to :data:`MIN_KV_RESERVE_TOKENS`:
   a model served with a short KV cache beats a model not served. Below that
   floor no plan is made: :class:`CannotCover` names what the model needs and
   what the live nodes' budgets hold together.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from .placement import (
    DEFAULT_KV_RESERVE_TOKENS,
    DEFAULT_SECONDS_PER_LAYER,
    CannotHoldLayer,
    Holder,
    LayerCosts,
    Placement,
    clamp_speed,
    format_bytes,
    place,
    uncovered_runs,
)

MIN_KV_RESERVE_TOKENS: Final = 256
"""Fewest tokens of KV room a layer a rebalancing plan leaves (below it the model is not worth covering)."""
KV_RESERVE_LEVELS: Final = (DEFAULT_KV_RESERVE_TOKENS, DEFAULT_KV_RESERVE_TOKENS // 2, MIN_KV_RESERVE_TOKENS)
"""KV room a layer a plan is sought with, most first."""
MAX_SPEEDUP: Final = 4.0
"""Most times faster than the median placed node of its model a node is believed to be when layers are cut
by speed (a node that claims a microsecond a layer among honest milliseconds is weighed at a quarter of them)."""
MAX_PLAN_NODES: Final = 256
"""Most movable nodes one plan weighs (the rest stay where they are)."""


@dataclass(frozen=True)
class Movable:
    """A live placed node the tracker may move: where it is, what a layer costs it, and its budget."""

    holder: Holder
    costs: LayerCosts
    budget_bytes: int


@dataclass(frozen=True)
class Plan:
    """New ranges for some nodes (by node id) that cover the model, with the KV room a layer they leave."""

    moves: dict[str, Placement]
    kv_reserve_tokens: int


class CannotCover(ValueError):
    """No plan covers the model with the live nodes' budgets; the message says what is missing and why."""


def _needed_at_least(costs: LayerCosts, kv_tokens: int) -> int:
    """Bytes the whole model takes spread over nodes: every layer once, the embedding and the LM head."""
    return costs.needed_bytes(0, costs.num_layers - 1, kv_tokens)


def _spares_first(movable: Sequence[Movable], fixed: Sequence[Holder], num_layers: int,
                  kv_tokens: int) -> dict[str, Placement] | None:
    """Moves of spare replicas alone that cover the model, or ``None`` (see the module doc, rule 1)."""
    where = {m.holder.node_id: m.holder for m in movable}
    moves: dict[str, Placement] = {}
    for node in movable:
        others = [*fixed, *(h for node_id, h in where.items() if node_id != node.holder.node_id)]
        if not uncovered_runs([*others, where[node.holder.node_id]], num_layers):
            break
        own = node.holder
        if not all(any(o.start <= layer <= o.end for o in others) for layer in range(own.start, own.end + 1)):
            continue  # it holds some layers alone: not a spare
        try:
            moved = place(node.costs, node.budget_bytes, others, kv_tokens)
        except CannotHoldLayer:
            continue
        if moved.reason == "covering":
            moves[own.node_id] = Placement(moved.start, moved.end, "covering")
            where[own.node_id] = Holder(own.node_id, moved.start, moved.end, own.seconds_per_layer)
    return moves if not uncovered_runs([*fixed, *where.values()], num_layers) else None


_Best = tuple[tuple[float, ...], tuple[tuple[str, int, int] | None, ...]]
"""A partial cut: its key (see :func:`recut`) and each node's choice so far (``None``: it stays)."""


def _offer(step: dict[int, _Best], first: int, value: _Best) -> None:
    """Keep ``value`` as the way to reach ``first`` where its key is smaller."""
    if first not in step or value[0] < step[first][0]:
        step[first] = value


def believed_speeds(holders: Sequence[Holder]) -> dict[str, float]:
    """Seconds a layer each holder is weighed at when layers are cut by speed: its figure clamped
    (:func:`.placement.clamp_speed`) and never more than :data:`MAX_SPEEDUP` times faster than the median of
    the known figures, so one node's claim cannot make it take every layer its memory holds because
    it says it is a million times faster; an unknown speed (0) counts at the median."""
    known = sorted(clamp_speed(h.seconds_per_layer) for h in holders if h.seconds_per_layer > 0)
    median = statistics.median(known) if known else DEFAULT_SECONDS_PER_LAYER
    return {h.node_id: max(clamp_speed(h.seconds_per_layer), median / MAX_SPEEDUP)
            if h.seconds_per_layer > 0 else median for h in holders}


def recut(movable: Sequence[Movable], fixed: Sequence[Holder], num_layers: int, kv_tokens: int,
          speed_first: bool = False) -> dict[str, Placement] | None:
    """The chain of ``movable`` (in layer order) re-cut to cover every layer ``fixed`` leaves, or ``None``.

    Each node stays or is given the next run from the first layer not yet covered, within its budget. A
    cut's key is, compared in order: nodes moved, then the slowest node's seconds a decode row (its layers,
    and the LM head's :attr:`.placement.LayerCosts.tail_extra_layers` where it holds the last layer, at
    :func:`believed_speeds`), then the busiest node's share of its budget; with ``speed_first`` the slowest
    node's seconds come first (tuning a covered mesh, :mod:`.placement_tune`). Slowest-first is exact: a
    cut's slowest node is the slower of the cut so far and the rest.
    """
    speeds = believed_speeds([m.holder for m in movable])
    covered = [False] * num_layers
    for holder in fixed:
        for layer in range(max(holder.start, 0), min(holder.end, num_layers - 1) + 1):
            covered[layer] = True
    after = [num_layers] * (num_layers + 1)  # after[f]: the first layer >= f that staying nodes leave
    for layer in range(num_layers - 1, -1, -1):
        after[layer] = after[layer + 1] if covered[layer] else layer

    def key(moves: int, slowest: float, share: float) -> tuple[float, ...]:
        return (slowest, moves, share) if speed_first else (moves, slowest, share)

    def unpack(k: tuple[float, ...]) -> tuple[int, float, float]:
        return (int(k[1]), k[0], k[2]) if speed_first else (int(k[0]), k[1], k[2])

    def seconds(node: Movable, first: int, end: int) -> float:
        extra = node.costs.tail_extra_layers if end == num_layers - 1 else 0.0
        return (end - first + 1 + extra) * speeds[node.holder.node_id]

    # best[f]: the key and choices of the nodes seen so far, with every layer below f covered
    best: dict[int, _Best] = {after[0]: (key(0, 0.0, 0.0), ())}
    for node in movable:
        own = node.holder
        step: dict[int, _Best] = {}
        for first, (k, chosen) in best.items():
            moves, slowest, share = unpack(k)
            # It stays: it carries the cover on where the cut has reached its range, else it adds nothing here.
            reach = after[own.end + 1] if own.start <= first <= own.end else first
            own_share = node.costs.needed_bytes(own.start, own.end, kv_tokens) / node.budget_bytes
            _offer(step, reach, (key(moves, max(slowest, seconds(node, own.start, own.end)),
                                     max(share, own_share) if speed_first else share), (*chosen, None)))
            if first == num_layers:
                continue
            for end in range(first, num_layers):
                needed = node.costs.needed_bytes(first, end, kv_tokens)
                if needed > node.budget_bytes:
                    break
                if (first, end) == (own.start, own.end):
                    continue  # that is staying, offered above
                _offer(step, after[end + 1], (key(moves + 1, max(slowest, seconds(node, first, end)),
                                                  max(share, needed / node.budget_bytes)),
                                              (*chosen, (own.node_id, first, end))))
        best = step
    if num_layers not in best:
        return None
    return {choice[0]: Placement(choice[1], choice[2], "covering") for choice in best[num_layers][1] if choice}


def rebalance(movable: Sequence[Movable], fixed: Sequence[Holder], num_layers: int) -> Plan:
    """New ranges for some of ``movable`` so that, with ``fixed``, every layer is held (see the module doc).

    An empty plan when every layer is held already; :class:`CannotCover` when no plan covers the model.
    """
    movable = sorted(movable, key=lambda m: (m.holder.start, m.holder.end, m.holder.node_id))[:MAX_PLAN_NODES]
    if not uncovered_runs([*fixed, *(m.holder for m in movable)], num_layers):
        return Plan({}, DEFAULT_KV_RESERVE_TOKENS)
    for kv_tokens in KV_RESERVE_LEVELS:
        for planner in (_spares_first, recut):
            moves = planner(movable, fixed, num_layers, kv_tokens)  # type: ignore[operator]
            if moves is not None:
                return Plan(moves, kv_tokens)
    missing = ", ".join(f"{a}-{b}" for a, b in uncovered_runs([*fixed, *(m.holder for m in movable)], num_layers))
    together = sum(m.budget_bytes for m in movable)
    if movable:
        needs = format_bytes(_needed_at_least(movable[0].costs, MIN_KV_RESERVE_TOKENS))
        why = (f"the {len(movable)} movable placed node(s) hold {format_bytes(together)} together and the model "
               f"needs {needs} (its {num_layers} layers with {MIN_KV_RESERVE_TOKENS} tokens of KV room each, the "
               f"embedding and the LM head), less what pinned nodes hold")
    else:
        why = "no live placed node may move (pinned nodes stay where their operators put them)"
    raise CannotCover(f"coverage of layers {missing} cannot be restored: {why}")
