"""Routes: which nodes run which layers for one request, signed by the tracker.

A :class:`Route` lists the hops in layer order; each hop runs layers
``start_layer..shard_end`` (0-based, inclusive). Where a hop's range overlaps
the previous one, it starts just after it (:func:`plan_start_layers`).

The tracker signs a route into a token carried in ``X-Meshnet-Route``:
``base64url(orjson(payload)) + "." + base64url(hmac_sha256(secret, first_part))``
with payload ``{"route": ..., "exp": ..., "iat": ..., "v": 1}``. A node
forwards activations only along a route whose signature verifies and has not
expired, so a caller cannot make a node POST to an address of its choosing
(the reference node trusted any route header).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import itertools
import re
import time
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, Field, ValidationError, model_validator

from meshwire import limits
from meshwire.fields import (
    STRICT_MODEL,
    AsTuple,
    HttpEndpoint,
    LayerCount,
    LayerIndex,
    ModelName,
    NodeId,
    WsAddress,
)

TOKEN_VERSION = 1
RouteErrorCode = Literal["malformed", "bad_signature", "expired"]
_B64URL = re.compile(r"[A-Za-z0-9_\-]+")

RouteNodes = Annotated[tuple["RouteNode", ...], AsTuple, Field(min_length=1, max_length=limits.MAX_ROUTE_HOPS)]
"""1..MAX_ROUTE_HOPS hops, in layer order."""


class RouteError(ValueError):
    """A route or route token was refused; ``code`` says why, ``str()`` says it in words."""

    def __init__(self, code: RouteErrorCode, message: str) -> None:
        super().__init__(message)
        self.code: RouteErrorCode = code


class RouteNode(BaseModel):
    """One hop: a node and the layers it runs for this route.

    ``start_layer`` defaults to ``shard_start`` when omitted (the design card's
    route JSON may leave it out).
    """

    model_config = STRICT_MODEL

    node_id: NodeId
    endpoint: HttpEndpoint
    shard_start: LayerIndex
    shard_end: LayerIndex
    start_layer: LayerIndex
    relay_addr: WsAddress | None = None

    @model_validator(mode="before")
    @classmethod
    def _default_start_layer(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("start_layer") is None and "shard_start" in data:
            return {**data, "start_layer": data["shard_start"]}
        return data

    @model_validator(mode="after")
    def _check_layers(self) -> RouteNode:
        if not self.shard_start <= self.start_layer <= self.shard_end:
            raise ValueError(
                f"node {self.node_id}: start_layer {self.start_layer} is outside its shard "
                f"{self.shard_start}-{self.shard_end}"
            )
        return self


class Route(BaseModel):
    """The hops that together run every layer of ``model``, in layer order.

    ``nodes[0]`` is the head, ``nodes[-1]`` the tail. The hops must cover
    layers ``0..num_layers-1`` exactly once: each starts right after the previous.
    """

    model_config = STRICT_MODEL

    model: ModelName
    nodes: RouteNodes
    num_layers: LayerCount

    @model_validator(mode="after")
    def _check_coverage(self) -> Route:
        _check_contiguous(self.nodes, self.num_layers)
        return self

    @property
    def head(self) -> RouteNode:
        return self.nodes[0]

    @property
    def tail(self) -> RouteNode:
        return self.nodes[-1]

    def hop_of(self, node_id: str) -> int | None:
        """Index of ``node_id`` in :attr:`nodes`, or ``None``."""
        return next((i for i, node in enumerate(self.nodes) if node.node_id == node_id), None)


class SignedRoute(BaseModel):
    """What ``GET /v1/route`` answers: the route, its token and when it expires."""

    model_config = STRICT_MODEL

    model: ModelName
    nodes: RouteNodes
    num_layers: LayerCount
    token: str = Field(min_length=1, max_length=limits.MAX_ROUTE_TOKEN_BYTES)
    """The ``X-Meshnet-Route`` header value."""
    expires_at: float
    """Unix seconds."""

    @model_validator(mode="after")
    def _check_coverage(self) -> SignedRoute:
        _check_contiguous(self.nodes, self.num_layers)
        return self

    @property
    def route(self) -> Route:
        return Route(model=self.model, nodes=self.nodes, num_layers=self.num_layers)


class _TokenPayload(BaseModel):
    model_config = STRICT_MODEL

    route: Route
    exp: float
    iat: float
    v: Literal[1]


def _check_contiguous(nodes: Sequence[RouteNode], num_layers: int) -> None:
    if nodes[0].start_layer != 0:
        raise ValueError(f"the head {nodes[0].node_id} must start at layer 0, not {nodes[0].start_layer}")
    for previous, node in itertools.pairwise(nodes):
        if node.start_layer != previous.shard_end + 1:
            raise ValueError(
                f"node {node.node_id} starts at layer {node.start_layer} but the previous hop "
                f"{previous.node_id} ends at {previous.shard_end}"
            )
    if nodes[-1].shard_end != num_layers - 1:
        raise ValueError(f"the tail {nodes[-1].node_id} ends at layer {nodes[-1].shard_end}, "
                         f"the model's last layer is {num_layers - 1}")


def plan_start_layers(nodes: Sequence[RouteNode]) -> tuple[RouteNode, ...]:
    """Set each hop's ``start_layer``: its ``shard_start``, or just after the previous hop.

    Refuses (``RouteError("malformed")``) a gap between hops or a hop whose
    whole range the previous hops already cover.
    """
    planned: list[RouteNode] = []
    next_layer: int | None = None
    for node in nodes:
        start = node.shard_start if next_layer is None else next_layer
        if start < node.shard_start:
            raise RouteError("malformed", f"layers {start}-{node.shard_start - 1} are not covered "
                                          f"before node {node.node_id}")
        if start > node.shard_end:
            raise RouteError("malformed", f"node {node.node_id} ({node.shard_start}-{node.shard_end}) adds no "
                                          f"layer after layer {start - 1}")
        planned.append(node.model_copy(update={"start_layer": start}))
        next_layer = node.shard_end + 1
    return tuple(planned)


def _b64encode(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _b64decode(text: str) -> bytes:
    if not _B64URL.fullmatch(text):
        raise RouteError("malformed", "route token is not base64url")
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raise RouteError("malformed", "route token is not base64url") from None


def _mac(secret: str, first_part: str) -> bytes:
    return hmac.new(secret.encode("utf-8"), first_part.encode("ascii"), hashlib.sha256).digest()


def sign_route(route: Route, secret: str, ttl_s: float = limits.ROUTE_TTL_S, now: float | None = None) -> str:
    """Sign ``route`` with ``secret`` into an ``X-Meshnet-Route`` token valid for ``ttl_s`` seconds."""
    if not secret:
        raise ValueError("cannot sign a route with an empty secret")
    if ttl_s <= 0:
        raise ValueError(f"ttl_s must be positive, got {ttl_s}")
    issued = time.time() if now is None else now
    payload = {"route": route.model_dump(mode="json"), "exp": issued + ttl_s, "iat": issued, "v": TOKEN_VERSION}
    first = _b64encode(orjson.dumps(payload))
    token = f"{first}.{_b64encode(_mac(secret, first))}"
    if len(token) > limits.MAX_ROUTE_TOKEN_BYTES:
        raise RouteError("malformed", f"route token would be {len(token)} bytes, over "
                                      f"{limits.MAX_ROUTE_TOKEN_BYTES}")
    return token


def issue_signed_route(route: Route, secret: str, ttl_s: float = limits.ROUTE_TTL_S,
                       now: float | None = None) -> SignedRoute:
    """Sign ``route`` and wrap it as the ``GET /v1/route`` answer."""
    issued = time.time() if now is None else now
    token = sign_route(route, secret, ttl_s=ttl_s, now=issued)
    return SignedRoute(model=route.model, nodes=route.nodes, num_layers=route.num_layers,
                       token=token, expires_at=issued + ttl_s)


def verify_route(token: str, secret: str, now: float | None = None, check_expiry: bool = True) -> Route:
    """Check a route token's signature (constant time) and expiry; return its route.

    The payload is parsed only after its signature verifies. Raises
    :class:`RouteError` with code ``malformed``, ``bad_signature`` or ``expired``.
    """
    if not isinstance(token, str) or not token:
        raise RouteError("malformed", "missing route token")
    if len(token) > limits.MAX_ROUTE_TOKEN_BYTES:
        raise RouteError("malformed", f"route token is longer than {limits.MAX_ROUTE_TOKEN_BYTES} bytes")
    first, dot, signature_text = token.strip().partition(".")
    if not dot or not first or not signature_text:
        raise RouteError("malformed", "route token must be '<payload>.<signature>'")
    signature = _b64decode(signature_text)
    _b64decode(first)  # alphabet check before MAC: first is hashed as ASCII
    if not hmac.compare_digest(signature, _mac(secret, first)):
        raise RouteError("bad_signature", "route signature does not verify")
    try:
        payload = _TokenPayload.model_validate_json(_b64decode(first))
    except ValidationError as exc:
        raise RouteError("malformed", f"route token payload is invalid: {exc.errors()[0]['msg']}") from None
    if check_expiry and payload.exp <= (time.time() if now is None else now):
        raise RouteError("expired", "route token has expired; ask the tracker for a new route")
    return payload.route
