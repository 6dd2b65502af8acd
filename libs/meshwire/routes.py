"""Routes: which nodes run which layers for one request, signed by the tracker.

A :class:`Route` lists the hops in layer order; each hop runs layers
``start_layer..shard_end`` (0-based, inclusive). Where a hop's range overlaps
the previous one, it starts just after it (:func:`plan_start_layers`).

The tracker signs a route with its Ed25519 key into a compact JWS carried in
``X-Meshnet-Route``: ``base64url(header) "." base64url(payload) "." base64url(signature)``
with header ``{"alg": "EdDSA", "kid": ...}`` (the key's id in the tracker's
JWK set, ``GET /v1/keys``) and payload ``{"route": ..., "exp": ..., "iat": ..., "v": 2}``;
the signature covers ``header "." payload``. A route may name a *shadow*
(:class:`ShadowHop`, issue 37): another node holding the same layers as one
hop, to which the hop before it sends each frame too; the shadow runs it in a
session of its own and answers only its receipt (:mod:`meshwire.receipts`),
never passing anything on, so the tracker can compare the two receipts of the
same step. A route without one is the same JSON as before. A node forwards activations only
along a route whose signature verifies with a key of the tracker's it holds
(:class:`~meshwire.route_keys.KeySet`) and that has not expired, so a caller
cannot make a node POST to an address of its choosing (the reference node
trusted any route header), and a node, holding only public keys, cannot mint
a route either. Each hop names the node's own public *hop key*, with which the
next hop checks that a frame comes from the route's previous hop
(:mod:`meshwire.hop_proof`).
"""

from __future__ import annotations

import itertools
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
from meshwire.route_keys import KeyProblem, KeySet, PublicKeyText, SigningKey, b64decode, b64encode

TOKEN_VERSION = 2
ALGORITHM = "EdDSA"
MAX_TOKEN_HEADER_BYTES = 256
"""Largest JWS header read (``{"alg": "EdDSA", "kid": ...}``)."""
RouteErrorCode = Literal["malformed", "bad_signature", "unknown_key", "expired"]

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
    hop_key: PublicKeyText | None = None
    """The node's public hop key (Ed25519, base64url): frames it sends the next hop are signed with it."""

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


class ShadowHop(BaseModel):
    """A verifier for one hop of a route: ``node`` runs hop ``hop_index``'s layers on the same frames, in a shadow
    session that never sends anything on (its answer is its receipt, issue 37)."""

    model_config = STRICT_MODEL

    hop_index: Annotated[int, Field(ge=0, lt=limits.MAX_ROUTE_HOPS)]
    """The hop it shadows. The head (0) has no hop before it: it sends its shadow each step's token ids itself."""
    node: RouteNode
    """The shadow node, with the same ``start_layer`` and ``shard_end`` as the hop it shadows."""


class Route(BaseModel):
    """The hops that together run every layer of ``model``, in layer order.

    ``nodes[0]`` is the head, ``nodes[-1]`` the tail. The hops must cover
    layers ``0..num_layers-1`` exactly once: each starts right after the previous.
    """

    model_config = STRICT_MODEL

    model: ModelName
    nodes: RouteNodes
    num_layers: LayerCount
    shadow: ShadowHop | None = None
    """A verifier of one hop (absent on most routes, and then not in the JSON at all)."""

    @model_validator(mode="after")
    def _check_coverage(self) -> Route:
        _check_contiguous(self.nodes, self.num_layers)
        _check_shadow(self.shadow, self.nodes)
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

    def at(self, hop_index: int, node_id: str) -> tuple[RouteNode, bool] | None:
        """The hop ``hop_index`` as ``node_id`` runs it: its route node and whether ``node_id`` is its shadow;
        ``None`` when the route names ``node_id`` at neither."""
        if not 0 <= hop_index < len(self.nodes):
            return None
        if self.nodes[hop_index].node_id == node_id:
            return self.nodes[hop_index], False
        shadow = self.shadow
        if shadow is not None and shadow.hop_index == hop_index and shadow.node.node_id == node_id:
            return shadow.node, True
        return None

    def shadow_of(self, hop_index: int) -> RouteNode | None:
        """The shadow of hop ``hop_index``, if the route names one."""
        shadow = self.shadow
        return shadow.node if shadow is not None and shadow.hop_index == hop_index else None


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
    v: Literal[2]


class _TokenHeader(BaseModel):
    model_config = STRICT_MODEL

    alg: Literal["EdDSA"]
    kid: str = Field(min_length=1, max_length=64)


def _check_shadow(shadow: ShadowHop | None, nodes: Sequence[RouteNode]) -> None:
    if shadow is None:
        return
    if shadow.hop_index >= len(nodes):
        raise ValueError(f"the shadow's hop {shadow.hop_index} is outside the route's {len(nodes)} hops")
    hop = nodes[shadow.hop_index]
    if (shadow.node.start_layer, shadow.node.shard_end) != (hop.start_layer, hop.shard_end):
        raise ValueError(f"the shadow {shadow.node.node_id} must run layers {hop.start_layer}-{hop.shard_end}, "
                         f"as hop {shadow.hop_index} does")
    if any(node.node_id == shadow.node.node_id for node in nodes):
        raise ValueError(f"the shadow {shadow.node.node_id} is a hop of the route already")


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


def _decode(text: str, what: str) -> bytes:
    try:
        return b64decode(text)
    except KeyProblem:
        raise RouteError("malformed", f"route token {what} is not base64url") from None


def _header(kid: str) -> str:
    return b64encode(orjson.dumps({"alg": ALGORITHM, "kid": kid}))


def sign_route(route: Route, key: SigningKey, ttl_s: float = limits.ROUTE_TTL_S, now: float | None = None) -> str:
    """Sign ``route`` with the tracker's ``key`` into an ``X-Meshnet-Route`` token valid for ``ttl_s`` seconds."""
    if not isinstance(key, SigningKey):
        raise TypeError("routes are signed with the tracker's Ed25519 SigningKey")
    if ttl_s <= 0:
        raise ValueError(f"ttl_s must be positive, got {ttl_s}")
    issued = time.time() if now is None else now
    payload = {"route": route.model_dump(mode="json", exclude_none=True), "exp": issued + ttl_s, "iat": issued,
               "v": TOKEN_VERSION}
    signed = f"{_header(key.kid)}.{b64encode(orjson.dumps(payload))}"
    token = f"{signed}.{b64encode(key.sign(signed.encode('ascii')))}"
    if len(token) > limits.MAX_ROUTE_TOKEN_BYTES:
        raise RouteError("malformed", f"route token would be {len(token)} bytes, over "
                                      f"{limits.MAX_ROUTE_TOKEN_BYTES}")
    return token


def issue_signed_route(route: Route, key: SigningKey, ttl_s: float = limits.ROUTE_TTL_S,
                       now: float | None = None) -> SignedRoute:
    """Sign ``route`` and wrap it as the ``GET /v1/route`` answer."""
    issued = time.time() if now is None else now
    token = sign_route(route, key, ttl_s=ttl_s, now=issued)
    return SignedRoute(model=route.model, nodes=route.nodes, num_layers=route.num_layers,
                       token=token, expires_at=issued + ttl_s)


def _split(token: str) -> tuple[str, str, str, _TokenHeader]:
    if not isinstance(token, str) or not token:
        raise RouteError("malformed", "missing route token")
    if len(token) > limits.MAX_ROUTE_TOKEN_BYTES:
        raise RouteError("malformed", f"route token is longer than {limits.MAX_ROUTE_TOKEN_BYTES} bytes")
    parts = token.strip().split(".")
    if len(parts) != 3 or not all(parts):
        raise RouteError("malformed", "route token must be '<header>.<payload>.<signature>' signed with the "
                                      "tracker's Ed25519 key")
    header_text, payload_text, signature_text = parts
    if len(header_text) > MAX_TOKEN_HEADER_BYTES:
        raise RouteError("malformed", "route token header is too long")
    try:
        header = _TokenHeader.model_validate_json(_decode(header_text, "header"))
    except ValidationError:
        raise RouteError("malformed", "route token header must be {\"alg\": \"EdDSA\", \"kid\": ...}") from None
    _decode(payload_text, "payload")  # alphabet check before the signature: it is signed as ASCII
    return header_text, payload_text, signature_text, header


def route_key_id(token: str) -> str | None:
    """The id of the key ``token`` claims to be signed with, or ``None`` when it is not a route token.

    Read before verification only to know whether the key is one the node holds.
    """
    try:
        return _split(token)[3].kid
    except RouteError:
        return None


def _verified_payload(token: str, keys: KeySet) -> _TokenPayload:
    header_text, payload_text, signature_text, header = _split(token)
    signature = _decode(signature_text, "signature")
    if header.kid not in keys:
        raise RouteError("unknown_key", f"route is signed with key {header.kid!r}, which is not one of the "
                                        "tracker's keys this node holds")
    if not keys.verify(header.kid, signature, f"{header_text}.{payload_text}".encode("ascii")):
        raise RouteError("bad_signature", "route signature does not verify")
    try:
        return _TokenPayload.model_validate_json(_decode(payload_text, "payload"))
    except ValidationError as exc:
        raise RouteError("malformed", f"route token payload is invalid: {exc.errors()[0]['msg']}") from None


def verify_route(token: str, keys: KeySet, now: float | None = None, check_expiry: bool = True) -> Route:
    """Check a route token's Ed25519 signature against ``keys`` and its expiry; return its route.

    The payload is parsed only after its signature verifies; a token ``keys`` already
    verified is not verified again (its expiry is checked every time). Raises
    :class:`RouteError` with code ``malformed``, ``unknown_key`` (signed with
    a key not in ``keys``), ``bad_signature`` or ``expired``.
    """
    payload = keys.remembered(token) if isinstance(token, str) else None
    if not isinstance(payload, _TokenPayload):
        payload = _verified_payload(token, keys)
        keys.remember(token, payload)
    if check_expiry and payload.exp <= (time.time() if now is None else now):
        raise RouteError("expired", "route token has expired; ask the tracker for a new route")
    return payload.route
