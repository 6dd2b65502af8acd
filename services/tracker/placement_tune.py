"""Tuning: once every layer is held, re-cut the placed nodes so that faster nodes hold more layers.

Pure, like :mod:`.placement_rebalance`. Nodes are placed one at a time as they
ask, each covering what it can of what is left, so the first plan follows the
order they started in, not their speed: a slow node that asked first holds as
much as its memory allows. Once the model is covered and nobody is joining or
moving, :func:`tune` re-cuts the chain of movable placed nodes (their order along
the model kept, as healing keeps it: :func:`.placement_rebalance.recut` with the
slowest stage first) so that the slowest stage is as fast as the nodes' speeds
and budgets allow, each node keeping room for
:data:`.placement.DEFAULT_KV_RESERVE_TOKENS` tokens of KV cache a layer.

Speeds are the nodes' own start figures (seconds of a decode row through one
layer, measured on their device), clamped and never believed more than
:data:`.placement_rebalance.MAX_SPEEDUP` times the median
(:func:`.placement_rebalance.believed_speeds`), so a node that lies about its
speed takes at most a bounded share more, and never more than its memory holds.
(The tracker's route measurements (:mod:`.ratings`) charge every hop of a route
alike, so within one chain they cannot tell its nodes apart: they steer routes,
not cuts.)

Only the chain is re-cut: a node all of whose layers another node also holds
(a replica, placed on the slowest stage to serve beside it) stays where it is.

Damped so placement never flaps: a plan is made only where it makes the mesh's
slowest stage (:func:`.placement.stage_times`, replicas counted, the LM head's
cost on the last stage) at least :data:`TUNE_GAIN` times faster than it is now;
the moves are then carried out as healing's are (growers first, a node that drops
layers only once others hold them, a cooldown after each move: see :mod:`.healing`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from .placement import DEFAULT_KV_RESERVE_TOKENS, Holder, stage_times, uncovered_runs
from .placement_rebalance import MAX_PLAN_NODES, Movable, Plan, believed_speeds, recut

TUNE_GAIN: Final = 1.25
"""How many times faster a re-cut must make the slowest stage before live nodes are moved for speed."""


def slowest_stage_s(holders: Sequence[Holder], num_layers: int, tail_extra_layers: float) -> float:
    """Seconds a decode row spends in the mesh's slowest stage (see the module doc)."""
    times = stage_times(holders, num_layers, tail_extra_layers)
    return max(times.values()) if times else float("inf")


def tune(movable: Sequence[Movable], fixed: Sequence[Holder], num_layers: int) -> Plan:
    """Moves that make the covered mesh's slowest stage :data:`TUNE_GAIN` times faster, or an empty plan."""
    movable = sorted(movable, key=lambda m: (m.holder.start, m.holder.end, m.holder.node_id))[:MAX_PLAN_NODES]
    empty = Plan({}, DEFAULT_KV_RESERVE_TOKENS)
    if not movable or uncovered_runs([*fixed, *(m.holder for m in movable)], num_layers):
        return empty
    holders = [*fixed, *(m.holder for m in movable)]
    replicas = [m for m in movable if all(any(o.start <= layer <= o.end for o in holders if o is not m.holder)
                                          for layer in range(m.holder.start, m.holder.end + 1))]
    if replicas:  # a replica was placed on the slowest stage to serve beside it: it stays there
        fixed = [*fixed, *(m.holder for m in replicas)]
        movable = [m for m in movable if m not in replicas]
        if not movable:
            return empty
    speeds = believed_speeds([m.holder for m in movable])
    median = sorted(speeds.values())[len(speeds) // 2]  # a fixed node of unknown speed counts at it
    fixed_at = [h if h.seconds_per_layer > 0 else Holder(h.node_id, h.start, h.end, median) for h in fixed]
    moves = recut(movable, fixed, num_layers, DEFAULT_KV_RESERVE_TOKENS, speed_first=True)
    if not moves:
        return empty
    tail_extra = max(m.costs.tail_extra_layers for m in movable)
    now = [*fixed_at, *(Holder(m.holder.node_id, m.holder.start, m.holder.end, speeds[m.holder.node_id])
                        for m in movable)]
    after = [*fixed_at, *(Holder(m.holder.node_id, moves[m.holder.node_id].start, moves[m.holder.node_id].end,
                                 speeds[m.holder.node_id]) if m.holder.node_id in moves
                          else Holder(m.holder.node_id, m.holder.start, m.holder.end, speeds[m.holder.node_id])
                          for m in movable)]
    if slowest_stage_s(now, num_layers, tail_extra) < TUNE_GAIN * slowest_stage_s(after, num_layers, tail_extra):
        return empty
    return Plan(moves, DEFAULT_KV_RESERVE_TOKENS)
