"""Placement's wire types: a node without ``--layers`` asks the tracker where to serve.

A node started without ``--layers`` measures what one layer of the model costs it
(bytes of weights in the format it will hold, bytes of KV cache a token, seconds a
decode row takes through the layer) and ``POST``s a :class:`PlacementRequest` to the
tracker's ``/v1/placement`` with the credential it registers with. The tracker answers a
:class:`PlacementAnswer`: the range to load and why (``covering`` a gap, or a
``replica`` of the slowest stage). The node then loads only that range and
registers as a pinned node does, naming the reason in its registration's
``placement`` field so ``GET /v1/nodes`` says why it holds what it holds.
"""

from __future__ import annotations

from typing import Final, Literal

from pydantic import BaseModel, Field, model_validator

from meshwire.fields import STRICT_MODEL, LayerCount, LayerIndex, ModelName, NodeId

PlacementReason = Literal["pinned", "covering", "replica"]
"""Why a node holds its range: its operator pinned it (``--layers``), the tracker gave it layers nobody
held (``covering``), or a copy of the mesh's slowest stage (``replica``)."""

MAX_BYTES: Final = 1 << 50
"""Largest byte figure a placement request may carry (a petabyte)."""
MAX_SECONDS_PER_LAYER: Final = 3600.0
"""Largest speed figure accepted on the wire; the planner clamps claims far tighter."""


class PlacementRequest(BaseModel):
    """Body of ``POST /v1/placement``: what the node can hold, and what one layer costs it."""

    model_config = STRICT_MODEL

    node_id: NodeId
    model: ModelName
    num_layers: LayerCount
    max_memory_bytes: int = Field(ge=1, le=MAX_BYTES)
    """The node's budget for weights and KV cache together (``--max-memory``)."""
    layer_bytes: int = Field(ge=1, le=MAX_BYTES)
    """Bytes one decoder layer's weights take in the format the node holds them."""
    head_bytes: int = Field(default=0, ge=0, le=MAX_BYTES)
    """Extra bytes the first layer's holder needs (the token embedding)."""
    tail_bytes: int = Field(default=0, ge=0, le=MAX_BYTES)
    """Extra bytes the last layer's holder needs (the final norm and LM head)."""
    kv_bytes_per_token: int = Field(ge=1, le=MAX_BYTES)
    """Bytes of KV cache one token takes in one layer."""
    seconds_per_layer: float = Field(gt=0, le=MAX_SECONDS_PER_LAYER, allow_inf_nan=False)
    """Measured seconds of one decode row through one layer on the node's device."""


class PlacementAnswer(BaseModel):
    """What ``POST /v1/placement`` answers: the inclusive range to load, and why."""

    model_config = STRICT_MODEL

    shard_start: LayerIndex
    shard_end: LayerIndex
    reason: PlacementReason
    kv_reserve_tokens: int = Field(ge=0, le=MAX_BYTES)
    """Tokens of KV cache per layer the tracker left room for within the node's budget."""

    @model_validator(mode="after")
    def _check_range(self) -> PlacementAnswer:
        if self.shard_start > self.shard_end:
            raise ValueError(f"shard_start {self.shard_start} is after shard_end {self.shard_end}")
        return self
