"""What the registry shows of the mesh: each node (``GET /v1/nodes``'s records) and each model's coverage.

Read-only answers built by :class:`~.registry.Registry` from its entries (``snapshot`` and ``coverage``),
for the mesh views, ``/health`` and the metrics.
"""

from __future__ import annotations

from pydantic import BaseModel

from meshwire.fields import STRICT_MODEL, DType
from meshwire.placement import PlacementReason
from meshwire.registry import Activations, NodeRole, NodeState, WeightsFormat

from .planner import LayerRange


class NodeInfo(BaseModel):
    """One node as ``GET /v1/nodes`` shows it: identity, shard, state, load and health."""

    model_config = STRICT_MODEL

    node_id: str
    model: str
    endpoint: str
    shard_start: int
    shard_end: int
    num_layers: int | None
    relay_addr: str | None
    dtype: DType | None
    device: str | None
    weights: WeightsFormat | None = None
    """How the node holds its weights (``float``, ``int8``, ``int4``), as it registered."""
    activations: Activations | None = None
    """The rows its quantized products take (``float32``, ``int8``), as it registered."""
    rows_exact: str | None = None
    """The batch-invariant path its hop output takes, as it registered (``None``: not shown invariant): a spot
    check compares it before the tail only with a replica naming the same one."""
    weight_bytes: int = 0
    """Bytes its weights take in memory."""
    kv_bytes: int = 0
    """Bytes its KV caches take now."""
    state: NodeState
    routable: bool
    """Whether routes may use it: not offline, and its ``num_layers`` agrees with its model's."""
    num_layers_agreed: bool
    """Whether its ``num_layers`` is its model's (or it reports none that contradicts it)."""
    active_sessions: int
    inflight_requests: int
    """Front-door requests the tracker is proxying through this node right now."""
    kv_free_tokens: int
    kv_capacity_tokens: int
    decode_tokens_per_s: float
    last_heartbeat_age_s: float
    registered_for_s: float
    """Seconds since this lease was first registered."""
    heartbeats: int
    failures: int
    """Failure reports in the current run."""
    backoff_remaining_s: float
    last_failure_reason: str | None
    """What kind of failure the last report was: a word of :data:`.failure_kinds.FAILURE_KINDS` (``refused``,
    ``timeout``, ``http_5xx``...), never what the node's endpoint answered."""
    role: NodeRole = "both"
    """What the node serves: ``prefill``, ``decode`` or ``both`` (``meshnet node --role``)."""
    pd_rank: int | None = None
    """A prefill node: the ``engine_rank`` the bootstrap registry accepted it under."""
    placement: PlacementReason | None = None
    """Why it holds its range: ``pinned`` (``--layers``), ``covering`` (the tracker gave it layers nobody held)
    or ``replica`` (a copy of the slowest stage), as it registered."""


class ModelCoverage(BaseModel):
    """How well the routable nodes of one model cover its layers."""

    model_config = STRICT_MODEL

    model: str
    num_layers: int
    complete: bool
    """Whether a route exists right now."""
    missing: tuple[LayerRange, ...]
    """Inclusive layer ranges no routable node holds."""
    layer_holders: tuple[int, ...]
    """How many routable nodes hold each layer, layer 0 first."""
    nodes_routable: int
    nodes_listed: int
