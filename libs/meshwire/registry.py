"""The tracker registry's wire types: what a node registers, what it gets back.

A node ``POST``s the same :class:`NodeRegistration` body to ``/v1/nodes`` to
register and on every heartbeat. The first registration of an id answers a
:class:`RegistrationAnswer` whose ``lease`` every later heartbeat, and the
node's ``DELETE``, carry in ``X-Meshnet-Lease``, so a peer cannot take over
or remove another node's id while it is live.

The fields the design card names (id, model, endpoint, shard range,
``relay_addr``) are required; the load figures have neutral defaults so a
minimal client can register too.

Addresses are plain. The tracker appends a path to a node's ``endpoint`` and
POSTs there with the mesh's bearer secret, so an endpoint that carried a
query (``?``), a fragment (``#``) or user information (``@``) could move that
path out of the way and aim the request anywhere on the host. An
``endpoint`` is therefore exactly ``http(s)://host[:port][/prefix]`` and a
``relay_addr`` ``ws(s)://host[:port][/prefix]``, both at most
:data:`MAX_ADDRESS_CHARS` long; anything else is refused at registration with
an error naming the field (:func:`plain_address_problem`).
"""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Annotated, Final, Literal

from pydantic import AfterValidator, BaseModel, Field, model_validator

from meshwire import limits
from meshwire.fields import (
    STRICT_MODEL,
    DType,
    LayerCount,
    LayerIndex,
    ModelName,
    NodeId,
)
from meshwire.pd_group import PrefillAssignment
from meshwire.placement import PlacementAnswer, PlacementReason
from meshwire.route_keys import PublicKeyText

NodeState = Literal["joining", "online", "suspect", "offline"]
"""A registered node's health as the tracker sees it."""

MAX_DEVICE_CHARS: Final = 64
MAX_KV_TOKENS: Final = 1 << 40
MAX_SESSIONS: Final = 1 << 20
MAX_ADDRESS_CHARS: Final = 512
"""Longest ``endpoint`` or ``relay_addr`` a node may register (a DNS name is at most 253 characters)."""
MAX_PORT: Final = 65535
MAX_MEMORY_BYTES: Final = 1 << 50
"""Largest memory figure (weights, KV cache) a node may report."""
WeightsFormat = Literal["float", "int8", "int4"]
"""How a node holds its weights (``meshnet node --weights``)."""
Activations = Literal["float32", "int8"]
MAX_ROWS_EXACT_CHARS: Final = 64
RowsExactPath = Annotated[str, Field(min_length=1, max_length=MAX_ROWS_EXACT_CHARS, pattern=r"^[a-z0-9][a-z0-9/._-]*$")]
"""A batch-invariant arithmetic path's name (``NodeRegistration.rows_exact``)."""
"""The rows a node's quantized products take (``meshnet node --activations``, resolved at start)."""
NodeRole = Literal["prefill", "decode", "both"]
"""What a node serves (``meshnet node --role``): prompts handed off to decode nodes (``prefill``),
decode steps of handed-off prompts (``decode``), or whole requests as before (``both``)."""
ENDPOINT_SCHEMES: Final = ("http", "https")
RELAY_SCHEMES: Final = ("ws", "wss")

_PLAIN_ADDRESS: Final = re.compile(
    r"(?P<scheme>[a-z]+)://"
    r"(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?)"
    r"(?::(?P<port>[0-9]{1,5}))?"
    r"(?P<prefix>(?:/[A-Za-z0-9._~-]*)*)"
)
"""``scheme://host[:port][/prefix]``: a DNS name or IP literal, and a prefix of plain path segments."""


def plain_address_problem(address: str, schemes: Collection[str]) -> str | None:
    """What keeps ``address`` from being a plain ``scheme://host[:port][/prefix]``; ``None`` if nothing.

    The most telling problem is named first (a query, a fragment, user
    information), so a refusal says what to remove.
    """
    if len(address) > MAX_ADDRESS_CHARS:
        return f"must be at most {MAX_ADDRESS_CHARS} characters"
    if "?" in address:
        return "must not carry a query ('?'); give scheme://host:port[/prefix]"
    if "#" in address:
        return "must not carry a fragment ('#'); give scheme://host:port[/prefix]"
    if "@" in address:
        return "must not carry user information ('@'); give scheme://host:port[/prefix]"
    match = _PLAIN_ADDRESS.fullmatch(address)
    if match is None or match.group("scheme") not in schemes:
        allowed = " or ".join(schemes)
        return (f"must be a plain scheme://host:port[/prefix] with scheme {allowed} (a host name or IP, "
                "and path segments of letters, digits and '._~-')")
    port = match.group("port")
    if port is not None and not 1 <= int(port) <= MAX_PORT:
        return f"port must be 1-{MAX_PORT}"
    if any(segment in (".", "..") for segment in match.group("prefix").split("/")):
        return "the path prefix must not contain '.' or '..' segments"
    return None


def _plain_endpoint(address: str) -> str:
    if (problem := plain_address_problem(address, ENDPOINT_SCHEMES)) is not None:
        raise ValueError(problem)
    return address


def _plain_relay_address(address: str) -> str:
    if (problem := plain_address_problem(address, RELAY_SCHEMES)) is not None:
        raise ValueError(problem)
    return address


NodeEndpoint = Annotated[str, AfterValidator(_plain_endpoint)]
"""A node's base URL, exactly ``http(s)://host[:port][/prefix]`` (e.g. ``http://10.0.0.5:8001``)."""
RelayAddress = Annotated[str, AfterValidator(_plain_relay_address)]
"""Where a node behind NAT is reached through a relay, ``ws(s)://host[:port][/prefix]``
(e.g. ``ws://relay:8003/rpc/node-a``)."""


class NodeRegistration(BaseModel):
    """Body of ``POST /v1/nodes``: a node's identity, its shard and its load."""

    model_config = STRICT_MODEL

    node_id: NodeId
    model: ModelName
    endpoint: NodeEndpoint
    shard_start: LayerIndex
    """First layer held (0-based, inclusive)."""
    shard_end: LayerIndex
    """Last layer held (inclusive)."""
    num_layers: LayerCount | None = None
    """How many layers the whole model has; ``None`` when the node does not say."""
    relay_addr: RelayAddress | None = None
    """Where callers reach this node through the relay when it is behind NAT."""
    dtype: DType | None = None
    device: str | None = Field(default=None, min_length=1, max_length=MAX_DEVICE_CHARS)
    kv_capacity_tokens: int = Field(default=0, ge=0, le=MAX_KV_TOKENS)
    kv_free_tokens: int = Field(default=0, ge=0, le=MAX_KV_TOKENS)
    active_sessions: int = Field(default=0, ge=0, le=MAX_SESSIONS)
    decode_tokens_per_s: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)
    weights: WeightsFormat | None = None
    """Format the node holds its layers' weights in (``--weights``): ``float`` (its ``dtype``), ``int8``, ``int4``."""
    activations: Activations | None = None
    """The rows its quantized products take: ``int8`` rows compute other bits than ``float32`` rows, so a spot
    check compares only nodes alike in this too; ``None`` when it does not say."""
    rows_exact: RowsExactPath | None = None
    """The arithmetic path on which the node's hop output for a row is the same bits alone or batched with any
    other sessions' rows (its quantized products on meshnet's native CPU kernel, e.g. ``int8/native/kv-float32``);
    ``None``: not shown batch-invariant (torch's BLAS float products, a GPU), or an older node that does not say.
    A spot check compares a hop's hidden states with a replica's by exact hash only where both name the same
    path; a tail is compared on its tokens whatever it says (issue 37)."""
    weight_bytes: int = Field(default=0, ge=0, le=MAX_MEMORY_BYTES)
    """Bytes the node's weights take in memory (packed where quantized; a tied matrix counted once)."""
    kv_bytes: int = Field(default=0, ge=0, le=MAX_MEMORY_BYTES)
    """Bytes its open sessions' KV caches take now."""
    hop_key: PublicKeyText | None = None
    """The node's public hop key (Ed25519, base64url): the tracker names it in every route through the node,
    and the next hop accepts only frames signed with it (every meshnet node registers one)."""
    role: NodeRole = "both"
    """What the node serves (``--role``)."""
    pd_rank: int | None = Field(default=None, ge=0, le=1 << 20)
    """A prefill node: the ``engine_rank`` the bootstrap registry accepted it under (``None``: not registered)."""
    placement: PlacementReason | None = None
    """Why the node holds its range: ``pinned`` (``--layers``), ``covering`` or ``replica`` (placed by the
    tracker, :mod:`meshwire.placement`); ``None`` when it does not say."""

    @model_validator(mode="after")
    def _check_shard(self) -> NodeRegistration:
        if self.shard_start > self.shard_end:
            raise ValueError(f"shard_start {self.shard_start} is after shard_end {self.shard_end}")
        if self.num_layers is not None and self.shard_end >= self.num_layers:
            raise ValueError(f"shard_end {self.shard_end} is beyond the model's {self.num_layers} layers")
        if self.kv_free_tokens > self.kv_capacity_tokens and self.kv_capacity_tokens:
            raise ValueError("kv_free_tokens exceeds kv_capacity_tokens")
        return self


MAX_REVOKED_NOTICE: Final = 1024
MAX_QUARANTINE_NOTICE: Final = 1024
"""Most quarantined node ids a heartbeat answer names (the tracker quarantines at most as many)."""
"""Most revoked node ids one registration answer names (the newest)."""


class RegistrationAnswer(BaseModel):
    """What ``POST /v1/nodes`` answers: the lease and how often to heartbeat.

    ``lease`` is the same on every heartbeat of one registration; a new one
    means the tracker registered the node afresh (it had forgotten it).
    """

    model_config = STRICT_MODEL

    lease: str = Field(min_length=1, max_length=limits.MAX_ID_CHARS)
    heartbeat_s: float = Field(gt=0, allow_inf_nan=False)
    ttl_s: float = Field(gt=0, allow_inf_nan=False)
    prefill_group: PrefillAssignment | None = None
    """A prefill node's place in the mesh's prefill group (``meshwire.pd_group``), once there is one."""
    move: PlacementAnswer | None = None
    """A placed node told to hold another range (layers lost their last holder): it loads the new range while
    serving its old one, then registers it (:mod:`meshwire.placement`)."""
    revoked_nodes: tuple[NodeId, ...] = Field(default=(), max_length=MAX_REVOKED_NOTICE)
    """Nodes whose join token was revoked (the newest :data:`MAX_REVOKED_NOTICE`): the node refuses from then on
    every route, frame and relayed call whose route names one of them (issue 34, finding 11)."""
    quarantined_nodes: tuple[NodeId, ...] = Field(default=(), max_length=MAX_QUARANTINE_NOTICE)
    """Nodes the tracker quarantined for computing wrong (issue 37): a head moves a stream it runs (one started
    on it directly, not through the tracker) off a route naming one of them at its next step."""
