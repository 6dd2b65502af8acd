"""The tracker registry's wire types: what a node registers, what it gets back.

A node ``POST``s the same :class:`NodeRegistration` body to ``/v1/nodes`` to
register and on every heartbeat. The first registration of an id answers a
:class:`RegistrationAnswer` whose ``lease`` later heartbeats carry in
``X-Meshnet-Lease``, so a peer cannot take over another node's id.

The fields the design card names (id, model, endpoint, shard range,
``relay_addr``) are required; the load figures have neutral defaults so a
minimal client can register too.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator

from meshwire import limits
from meshwire.fields import (
    STRICT_MODEL,
    DType,
    HttpEndpoint,
    LayerCount,
    LayerIndex,
    ModelName,
    NodeId,
    WsAddress,
)

NodeState = Literal["joining", "online", "suspect", "offline"]
"""A registered node's health as the tracker sees it."""

MAX_DEVICE_CHARS = 64
MAX_KV_TOKENS = 1 << 40
MAX_SESSIONS = 1 << 20


class NodeRegistration(BaseModel):
    """Body of ``POST /v1/nodes``: a node's identity, its shard and its load."""

    model_config = STRICT_MODEL

    node_id: NodeId
    model: ModelName
    endpoint: HttpEndpoint
    shard_start: LayerIndex
    """First layer held (0-based, inclusive)."""
    shard_end: LayerIndex
    """Last layer held (inclusive)."""
    num_layers: LayerCount | None = None
    """How many layers the whole model has; ``None`` when the node does not say."""
    relay_addr: WsAddress | None = None
    """Where callers reach this node through the relay when it is behind NAT."""
    dtype: DType | None = None
    device: str | None = Field(default=None, min_length=1, max_length=MAX_DEVICE_CHARS)
    kv_capacity_tokens: int = Field(default=0, ge=0, le=MAX_KV_TOKENS)
    kv_free_tokens: int = Field(default=0, ge=0, le=MAX_KV_TOKENS)
    active_sessions: int = Field(default=0, ge=0, le=MAX_SESSIONS)
    decode_tokens_per_s: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _check_shard(self) -> NodeRegistration:
        if self.shard_start > self.shard_end:
            raise ValueError(f"shard_start {self.shard_start} is after shard_end {self.shard_end}")
        if self.num_layers is not None and self.shard_end >= self.num_layers:
            raise ValueError(f"shard_end {self.shard_end} is beyond the model's {self.num_layers} layers")
        if self.kv_free_tokens > self.kv_capacity_tokens and self.kv_capacity_tokens:
            raise ValueError("kv_free_tokens exceeds kv_capacity_tokens")
        return self


class RegistrationAnswer(BaseModel):
    """What ``POST /v1/nodes`` answers: the lease and how often to heartbeat."""

    model_config = STRICT_MODEL

    lease: str = Field(min_length=1, max_length=limits.MAX_ID_CHARS)
    heartbeat_s: float = Field(gt=0, allow_inf_nan=False)
    ttl_s: float = Field(gt=0, allow_inf_nan=False)
