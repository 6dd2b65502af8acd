"""The mesh side of the tracker: registration, failure reports, routes and the mesh view.

Routes:

- ``POST /v1/nodes`` (the node's join token, or the mesh secret where the
  id is bound to no token; see :mod:`.trust`): register or heartbeat with a
  :class:`~meshwire.registry.NodeRegistration`; heartbeats carry the lease in
  ``X-Meshnet-Lease``. Answers :class:`~meshwire.registry.RegistrationAnswer`
  (the first time with a fresh lease); 409 ``lease_conflict`` when the id is
  live and the request does not carry its lease; 400 naming the field for an
  endpoint or relay address that is not a plain ``scheme://host:port[/prefix]``,
  and 400 ``forbidden_address`` for one on a link-local or cloud-metadata
  address (or a private one with ``MESHNET_ALLOW_PRIVATE_ENDPOINTS=0``,
  :mod:`.endpoint_policy`).
- ``DELETE /v1/nodes/{node_id}`` (its join token or the mesh secret, and the
  node's lease): leave now; 403 ``lease_required`` without the lease.
- ``POST /v1/nodes/{node_id}/failures`` (a join token or the mesh secret):
  the head of a signed route (``route`` in the body) could not use the node,
  another hop of that route; it backs off (see :mod:`.registry`) on the terms
  of :mod:`.failure_reports` (one reporter alone earns it one short backoff;
  at most 30 reports a minute a reporter, 429 beyond). 400 ``route_required``
  without the route, 403 ``not_route_head`` / ``not_on_route`` when the
  reporter is not its head or the node is not on it. Answers whether the
  report was ``applied``.
- ``GET /v1/nodes``: every listed node (state, load, last heartbeat, the kind of
  its last failure: one word of :data:`.failure_kinds.FAILURE_KINDS`, never
  what its endpoint answered, and its speed as this tracker measured it:
  ``measured_tokens_per_s``, ``measured_streams``, ``measured_ttft_s``, see
  :mod:`.ratings`) and each model's coverage, with its placement (``stages`` as this tracker
  rates them and ``healing``: see :mod:`.placement_view`).
- ``GET /v1/mesh``: the same plus the tracker's clocks, for the live page.
- ``GET /v1/route?model=M&exclude=a,b``: a signed route
  (:class:`~meshwire.routes.SignedRoute`).

The credential is checked before the body is read, so an unauthenticated
registration changes nothing. Registration, departure and failure reports
are applied by the tracker's store (see :mod:`.store`); while a shared store
is away they answer 503 ``store_unavailable`` with ``Retry-After`` (the app's handler of
:class:`~.store.StoreUnavailable`). The three views hand out every endpoint, relay
address and failure reason: with ``MESHNET_API_KEYS`` set they need a client
API key, a valid join token or the mesh secret (401 otherwise); without it the
mesh's layout is public.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any, Final

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, ValidationError

from meshwire import errors, limits
from meshwire.fields import STRICT_MODEL, NodeId
from meshwire.headers import LEASE
from meshwire.openai import validation_error_message, validation_error_param
from meshwire.registry import MAX_QUARANTINE_NOTICE, NodeRegistration, RegistrationAnswer
from meshwire.route_keys import KeySet
from meshwire.routes import RouteError, verify_route

from .endpoint_policy import EndpointPolicy
from .failure_reports import ROUTE_GRACE_S, TooManyReports, run_of
from .healing import heal_move
from .join_tokens import TokenRefused
from .placement_view import model_placement
from .registry import MAX_REASON_CHARS, Registered, RegistryError, UnknownNode
from .responses import HTTPError, read_body, require_api_key
from .state import TrackerState, parse_exclude, tracker_state
from .store import StoreUnavailable
from .verification import verification_view

logger = logging.getLogger(__name__)

MAX_REGISTRATION_BYTES: Final = 64 * limits.KIB
"""Largest registration or failure-report body read."""

router = APIRouter()


class FailureReport(BaseModel):
    """Body of ``POST /v1/nodes/{node_id}/failures``."""

    model_config = STRICT_MODEL

    reason: str = Field(min_length=1, max_length=MAX_REASON_CHARS)
    reporter: NodeId | None = None
    """The reporting node, when a node reports."""
    route: str | None = Field(default=None, min_length=1, max_length=limits.MAX_ROUTE_TOKEN_BYTES)
    """The signed route (its token) the failure happened on; the reporter is its head."""


def _invalid(exc: ValidationError) -> HTTPError:
    return HTTPError(400, validation_error_message(exc), errors.INVALID_REQUEST, "invalid_body",
                     validation_error_param(exc))


def _refused(exc: RegistryError) -> HTTPError:
    error_type = {404: errors.NOT_FOUND, 403: errors.PERMISSION, 503: errors.UNAVAILABLE}.get(
        exc.status, errors.INVALID_REQUEST)
    return HTTPError(exc.status, str(exc), error_type, exc.code)


def _token_refused(exc: TokenRefused) -> HTTPError:
    kind = errors.AUTHENTICATION if exc.status == 401 else errors.PERMISSION
    return HTTPError(exc.status, str(exc), kind, exc.code,
                     headers={"WWW-Authenticate": "Bearer"} if exc.status == 401 else None)


async def require_member(request: Request, state: TrackerState) -> str:
    """Refuse a request without a node's credential (a valid join token or the mesh secret): 401/403.

    Answers ``"secret"`` or ``"token:<node id>"``. Reads no body.
    """
    try:
        member = await state.trust.member(request.headers.get("authorization"))
    except TokenRefused as exc:
        raise _token_refused(exc) from None
    if member is None:
        if request.headers.get("authorization"):
            raise HTTPError(403, "invalid credential", errors.PERMISSION, "invalid_credential")
        raise HTTPError(401, "missing Authorization header (expected 'Bearer <join token or mesh secret>')",
                        errors.AUTHENTICATION, "missing_credential", headers={"WWW-Authenticate": "Bearer"})
    return member


async def require_reader(request: Request, state: TrackerState) -> None:
    """Guard the mesh's layout: with API keys set, an API key, a join token or the mesh secret (401 otherwise)."""
    if not state.settings.api_keys:
        return
    try:
        require_api_key(request, state.settings.api_keys, also=(state.settings.secret,))
    except HTTPError:
        try:
            member = await state.trust.member(request.headers.get("authorization"))
        except (TokenRefused, StoreUnavailable):
            member = None
        if member is None:
            raise


def _check_model_claim(state: TrackerState, registration: NodeRegistration) -> None:
    """A join token that binds no model cannot take over a model name other nodes serve (409 ``model_conflict``).

    The name's identity is its layer count as its live nodes agree on it (see
    :mod:`.registry`); a registration under such a token must report that
    count while another live node serves the name, so it can neither serve a
    different model under the name nor outvote the count. A token bound to the
    model by the operator (``meshnet token create --model M``) is the
    operator's word and is not held to this.
    """
    now = state.now()
    others = [c for c in state.registry.candidates(registration.model, now) if c.node_id != registration.node_id]
    count = state.registry.models(now).get(registration.model)
    if others and count is not None and registration.num_layers != count:
        raise TokenRefused(409, "model_conflict", f"model {registration.model[:200]!r} is served by other nodes as a "
                                                  f"{count}-layer model; this node says "
                                                  f"{registration.num_layers or 'nothing of its layers'}: a join "
                                                  "token that binds no model cannot take over a model name")


def _lease(request: Request) -> str | None:
    lease = request.headers.get(LEASE)
    if lease is not None and (not lease.strip() or len(lease) > limits.MAX_ID_CHARS):
        raise HTTPError(400, f"{LEASE} must be 1-{limits.MAX_ID_CHARS} characters", errors.INVALID_REQUEST,
                        "bad_lease")
    return lease.strip() if lease is not None else None


async def _check_addresses(request: Request, state: TrackerState, registration: NodeRegistration) -> None:
    """Refuse (400 ``forbidden_address``) a registration whose endpoint or relay address the tracker must not
    call (:class:`.endpoint_policy.EndpointPolicy`)."""
    policy: EndpointPolicy | None = getattr(request.app.state, "endpoint_policy", None)
    if policy is None:
        policy = EndpointPolicy(allow_private=state.settings.allow_private_endpoints)
        request.app.state.endpoint_policy = policy
    for field, address in (("endpoint", registration.endpoint), ("relay_addr", registration.relay_addr)):
        problem = None if address is None else await policy.address_problem(address)
        if problem is not None:  # counted as refused by the caller
            logger.warning("refused registration of %s: %s %s: %s", registration.node_id, field, address, problem)
            hint = "" if policy.allow_private else " (MESHNET_ALLOW_PRIVATE_ENDPOINTS is off)"
            raise HTTPError(400, f"{field} is refused: {problem}{hint}", errors.INVALID_REQUEST, "forbidden_address",
                            field)


@router.post("/v1/nodes")
async def register(request: Request) -> JSONResponse:
    """Register a node or take its heartbeat."""
    state = tracker_state(request)
    await require_member(request, state)
    body = await read_body(request, MAX_REGISTRATION_BYTES)
    try:
        registration, registered = await _registered(request, state, body)
    except (HTTPError, StoreUnavailable):  # refused, whatever the reason (the store's 503 is answered by the app)
        state.metrics.registrations.labels("refused").inc()
        raise
    state.metrics.registrations.labels("new" if registered.new_lease else "heartbeat").inc()
    quarantine = state.verifier.quarantine
    if quarantine.stale:  # another tracker of the store may have quarantined a node since (read at most every 5 s)
        await quarantine.refresh()
    answer = RegistrationAnswer(lease=registered.lease, heartbeat_s=state.settings.heartbeat_s,
                                ttl_s=state.settings.node_ttl_s, prefill_group=state.prefill_assignment(registration),
                                move=await heal_move(request, registration), revoked_nodes=state.revoked.notice(),
                                quarantined_nodes=tuple(sorted(quarantine.ids()))[:MAX_QUARANTINE_NOTICE])
    return JSONResponse(answer.model_dump(mode="json"))


async def _registered(request: Request, state: TrackerState, body: bytes) -> tuple[NodeRegistration, Registered]:
    """The registration ``body`` holds, admitted by its credential and registered (or heartbeated) in the store."""
    try:
        registration = NodeRegistration.model_validate_json(body)
    except ValidationError as exc:
        raise _invalid(exc) from None
    await _check_addresses(request, state, registration)
    try:
        record = await state.trust.admit(request.headers.get("authorization"), registration)
        if record is not None and record.model is None:
            _check_model_claim(state, registration)
        if record is not None and registration.node_id in state.revoked:
            await state.store.lift_revocation(registration.node_id)  # it holds a valid token again
    except TokenRefused as exc:
        logger.warning("refused registration of %s from %s: %s", registration.node_id, registration.endpoint, exc)
        raise _token_refused(exc) from None
    try:
        registered = await state.store.register(registration, _lease(request), state.now())
    except RegistryError as exc:
        logger.warning("refused registration of %s from %s: %s", registration.node_id, registration.endpoint, exc)
        raise _refused(exc) from None
    return registration, registered


@router.delete("/v1/nodes/{node_id}")
async def deregister(node_id: str, request: Request) -> JSONResponse:
    """A node leaves (with its lease): it is listed ``offline`` at once and leaves every new route."""
    state = tracker_state(request)
    member = await require_member(request, state)
    if member.startswith("token:") and member != f"token:{node_id}":
        raise HTTPError(403, f"this join token is not node {node_id[:limits.MAX_ID_CHARS]!r}'s", errors.PERMISSION,
                        "token_node_mismatch")
    try:
        await state.store.deregister(node_id, _lease(request), state.now())
    except RegistryError as exc:
        logger.warning("refused the departure of %s: %s", node_id[:limits.MAX_ID_CHARS], exc)
        raise _refused(exc) from None
    return JSONResponse({"node_id": node_id, "state": "offline"})


def _route_reporter(state: TrackerState, member: str, node_id: str, token: str | None) -> str:
    """The head of the signed route ``token`` names, when ``member`` may report ``node_id`` on it (else 4xx)."""
    if token is None:
        raise HTTPError(400, "a failure report names the signed route the failure happened on ('route'), and "
                             "comes from that route's head", errors.INVALID_REQUEST, "route_required", "route")
    try:  # a stream outlives its route: a route expired for at most ROUTE_GRACE_S may still be named
        route = verify_route(token, KeySet.from_jwks(state.trust.jwks()), now=time.time() - ROUTE_GRACE_S)
    except RouteError as exc:
        raise HTTPError(403, f"the route of this report is not one this tracker signed: {exc}", errors.PERMISSION,
                        "bad_route", "route") from None
    head = route.nodes[0].node_id
    if member.startswith("token:") and member != f"token:{head}":
        raise HTTPError(403, f"only the route's head ({head!r}) reports failures on it", errors.PERMISSION,
                        "not_route_head", "route")
    if node_id == head or node_id not in {hop.node_id for hop in route.nodes}:
        raise HTTPError(403, f"node {node_id[:limits.MAX_ID_CHARS]!r} is not a hop after the head of this route",
                        errors.PERMISSION, "not_on_route", "route")
    return head


@router.post("/v1/nodes/{node_id}/failures")
async def report_failure(node_id: str, request: Request) -> JSONResponse:
    """The head of a signed route could not use ``node_id``, a hop of it: back it off (on the gate's terms)."""
    state = tracker_state(request)
    member = await require_member(request, state)
    try:
        report = FailureReport.model_validate_json(await read_body(request, MAX_REGISTRATION_BYTES))
    except ValidationError as exc:
        raise _invalid(exc) from None
    reporter = _route_reporter(state, member, node_id, report.route)
    now = state.now()
    try:
        await state.failure_gate.count(reporter, now)
    except TooManyReports as exc:
        raise HTTPError(429, str(exc), errors.RATE_LIMIT, "too_many_reports",
                        headers={"Retry-After": str(max(math.ceil(exc.retry_after_s), 1))}) from None
    if state.registry.state(node_id, now) is None:
        raise _refused(UnknownNode(f"no node {node_id!r} is registered"))
    applied = await state.failure_gate.judge(run_of(state.registry, node_id), reporter, now) == "apply"
    backoff_s = 0.0
    if applied:
        try:  # a store that is away: the app's handler answers 503
            backoff_s = await state.store.report_failure(node_id, report.reason, now)
        except RegistryError as exc:
            raise _refused(exc) from None
        state.metrics.failure_reports.inc()
    logger.info("node %s reports node %s failing%s: %s", reporter, node_id,
                "" if applied else " (noted: a lone reporter's repeat)", report.reason)
    return JSONResponse({"node_id": node_id, "applied": applied, "backoff_s": round(backoff_s, 3),
                         "state": state.registry.state(node_id, now)})


async def _mesh_view(request: Request) -> dict[str, Any]:
    state = tracker_state(request)
    await require_reader(request, state)
    now = state.now()
    await state.verifier.quarantine.refresh()
    return {
        "nodes": [{**node.model_dump(mode="json"),
                   **dataclasses.asdict(state.ratings.rating(node.node_id, node.shard_end - node.shard_start + 1)),
                   **verification_view(state.verifier, node.node_id)}
                  for node in state.registry.snapshot(now)],
        "models": [{**model.model_dump(mode="json"), **model_placement(request, model.model, model.num_layers)}
                   for model in state.registry.coverage(now)],
    }


@router.get("/v1/nodes")
async def list_nodes(request: Request) -> JSONResponse:
    """Who holds what, in which state, under which load; and each model's coverage."""
    return JSONResponse(await _mesh_view(request))


@router.get("/v1/mesh")
async def mesh(request: Request) -> JSONResponse:
    """The mesh at a glance, for the live page: nodes, coverage, and the tracker's clocks."""
    settings = tracker_state(request).settings
    return JSONResponse({**(await _mesh_view(request)), "node_ttl_s": settings.node_ttl_s,
                         "heartbeat_s": settings.heartbeat_s, "offline_keep_s": settings.offline_keep_s})


@router.get("/v1/route")
async def route(request: Request) -> JSONResponse:
    """A signed route for ``model`` that avoids the ``exclude``d nodes."""
    state = tracker_state(request)
    await require_reader(request, state)
    model = request.query_params.get("model")
    if not model:
        raise HTTPError(400, "missing query parameter 'model'", errors.INVALID_REQUEST, "missing_model", "model")
    if len(model) > limits.MAX_URL_CHARS:
        raise HTTPError(400, "model name is too long", errors.INVALID_REQUEST, "bad_model", "model")
    exclude = parse_exclude(request.query_params.getlist("exclude"))
    await state.trust.ready()
    resolved = state.resolve_model(model)
    signed = state.route_for(resolved, exclude)  # a no_route says healing where placed nodes may close the gap
    return JSONResponse(signed.model_dump(mode="json"))
