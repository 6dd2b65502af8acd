"""The prefill group: how a mesh's prefill nodes form the pipeline the bootstrap registry describes.

The tracker plans it (from the live nodes registered with ``role`` prefill)
and tells each member its place in the answer to its heartbeat; the member
registers that place in the bootstrap registry; decode nodes look it up there.

* **Stages** are the prefill nodes' distinct layer ranges, which must tile the
  model's layers exactly (``0-1`` and ``2-3``, or one ``0-3``); otherwise
  there is no group (and no prefill/decode split) until they do.
* **Replicas** (DP groups): ``dp_size`` is the fewest nodes any stage has;
  replica ``r`` is the ``r``-th node (by id) of every stage. Nodes beyond
  ``dp_size`` at a stage wait outside the group.
* ``world_size = dp_size * pp_size``; a member's ``engine_rank`` is dense and
  stage-major within its replica, ``dp_group * pp_size + stage`` (tensor
  parallel size 1), so the registry files it under DP group ``dp_group`` and
  rank ``stage`` (``engine_rank // (world_size // dp_size)``).

The bootstrap registry keeps the first registration's sizes (first-wins), so a
group should be started whole (``meshnet up --prefill-nodes N`` does); a
group that later changes shape is refused there and its nodes stay out of
prefill/decode routes until the registry restarts.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated

from pydantic import BaseModel, Field

from meshwire.fields import STRICT_MODEL, AsTuple
from meshwire.limits import MAX_LAYERS, MAX_ROUTE_HOPS

LayerRange = tuple[int, int]
MAX_REPLICAS = 256
"""Most DP groups a prefill group has."""


class PrefillAssignment(BaseModel):
    """One member's place in the prefill group: what it registers in the bootstrap registry."""

    model_config = STRICT_MODEL

    engine_rank: Annotated[int, Field(ge=0)]
    world_size: Annotated[int, Field(ge=1)]
    dp_size: Annotated[int, Field(ge=1, le=MAX_REPLICAS)]
    pp_size: Annotated[int, Field(ge=1, le=MAX_ROUTE_HOPS)]
    dp_group: Annotated[int, Field(ge=0)]
    stage: Annotated[int, Field(ge=0)]
    stages: Annotated[tuple[Annotated[tuple[int, int], AsTuple], ...], AsTuple,
                      Field(min_length=1, max_length=MAX_ROUTE_HOPS)]
    """Each stage's layers ``(first, last)`` inclusive, stage 0 first."""


@dataclass(frozen=True)
class PrefillMember:
    """A prefill node as the planner sees it."""

    node_id: str
    shard_start: int
    shard_end: int


@dataclass(frozen=True)
class PrefillGroup:
    """The planned group: its stages, and the members of each replica in stage order."""

    stages: tuple[LayerRange, ...]
    replicas: tuple[tuple[str, ...], ...]

    @property
    def pp_size(self) -> int:
        return len(self.stages)

    @property
    def dp_size(self) -> int:
        return len(self.replicas)

    def assignment(self, node_id: str) -> PrefillAssignment | None:
        """``node_id``'s place in the group, or ``None`` when it is not a member."""
        for dp_group, members in enumerate(self.replicas):
            if node_id in members:
                stage = members.index(node_id)
                return PrefillAssignment(engine_rank=dp_group * self.pp_size + stage,
                                         world_size=self.dp_size * self.pp_size, dp_size=self.dp_size,
                                         pp_size=self.pp_size, dp_group=dp_group, stage=stage, stages=self.stages)
        return None


def plan_prefill_group(members: Iterable[PrefillMember], num_layers: int) -> PrefillGroup | None:
    """The group ``members`` form for a model of ``num_layers`` layers, or ``None`` when they form none."""
    if not 1 <= num_layers <= MAX_LAYERS:
        return None
    by_range: dict[LayerRange, list[str]] = {}
    for member in members:
        if 0 <= member.shard_start <= member.shard_end < num_layers:
            by_range.setdefault((member.shard_start, member.shard_end), []).append(member.node_id)
    stages = tuple(sorted(by_range))
    if not stages or len(stages) > MAX_ROUTE_HOPS:
        return None
    expected = 0
    for first, last in stages:
        if first != expected:
            return None  # a gap or an overlap: the ranges do not tile the layers
        expected = last + 1
    if expected != num_layers:
        return None
    dp_size = min(min(len(ids) for ids in by_range.values()), MAX_REPLICAS)
    ordered = {stage: sorted(by_range[stage]) for stage in stages}
    replicas = tuple(tuple(ordered[stage][replica] for stage in stages) for replica in range(dp_size))
    return PrefillGroup(stages=stages, replicas=replicas)
