"""Prefill routes: which of the mesh's prefill nodes prefill a long prompt (pure, no I/O).

The prefill nodes (``role`` prefill) form one group (:mod:`meshwire.pd_group`):
stages that tile the model's layers, and replicas (DP groups) of them. A
prefill route is one replica's members in stage order, and only a replica
whose every member is live, out of failure backoff and registered in the
bootstrap registry under the rank the group gives it (``pd_rank``): a decode
node finds the KV it pulls by that rank. Among those, the least loaded.
"""

from __future__ import annotations

from collections.abc import Sequence

from meshwire.pd_group import PrefillGroup, PrefillMember, plan_prefill_group
from meshwire.routes import RouteNode

from .planner import Candidate

PREFILL_ROLE = "prefill"


def prefill_group(candidates: Sequence[Candidate], num_layers: int) -> PrefillGroup | None:
    """The group the live prefill nodes among ``candidates`` form, or ``None``."""
    members = [PrefillMember(c.node_id, c.shard_start, c.shard_end) for c in candidates if c.role == PREFILL_ROLE]
    return plan_prefill_group(members, num_layers)


def plan_prefill_route(candidates: Sequence[Candidate], num_layers: int) -> tuple[RouteNode, ...] | None:
    """The hops of the least loaded ready replica of the prefill group, or ``None`` when none is ready."""
    group = prefill_group(candidates, num_layers)
    if group is None:
        return None
    by_id = {c.node_id: c for c in candidates}
    best: tuple[int, tuple[RouteNode, ...]] | None = None
    for members in group.replicas:
        nodes = [by_id[node_id] for node_id in members]
        ready = all(not c.backoff and c.pd_rank is not None and c.pd_rank == _rank(group, c.node_id) for c in nodes)
        if not ready:
            continue
        load = sum(c.active_sessions for c in nodes)
        if best is None or load < best[0]:
            hops = tuple(RouteNode(node_id=c.node_id, endpoint=c.endpoint, shard_start=c.shard_start,
                                   shard_end=c.shard_end, start_layer=c.shard_start, relay_addr=c.relay_addr,
                                   hop_key=c.hop_key)
                         for c in nodes)
            best = (load, hops)
    return None if best is None else best[1]


def _rank(group: PrefillGroup, node_id: str) -> int | None:
    assignment = group.assignment(node_id)
    return None if assignment is None else assignment.engine_rank
