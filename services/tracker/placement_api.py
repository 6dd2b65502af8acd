"""``POST /v1/placement``: a node without ``--layers`` asks which layers to load.

Authenticated as registration is (the node's join token, or the mesh secret;
see :func:`.mesh_api.require_member`), checked before the body is read; a join
token may ask only for its own node id (403). The body is a
:class:`~meshwire.placement.PlacementRequest`; the answer a
:class:`~meshwire.placement.PlacementAnswer` chosen by :func:`.placement.place`
from the model's routable nodes and the placements handed out but not yet
registered. A budget that cannot hold one layer is a 422
``cannot_hold_layer`` naming the budget and what one layer needs.

Handed-out placements are remembered (:class:`.healing.PlacementBook`) until the node
registers or :data:`.healing.PENDING_S` pass, so nodes that start together are given
different ranges instead of all being told to cover the same gap. With a shared
store each handed-out range is also a claim there (:mod:`.placement_claims`),
decided against the other trackers' claims and written in one atomic swap, so
nodes asking two trackers of one store at the same moment are given different
ranges too (a swap that keeps losing the race is a 503 ``placement_busy``, which
the node asks again after).
"""

from __future__ import annotations

import logging
from typing import Final

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from meshwire import errors, limits
from meshwire.placement import PlacementAnswer, PlacementRequest

from .healing import PENDING_S, PlacedNode, book_of, claims_of
from .mesh_api import require_member
from .placement import (
    DEFAULT_KV_RESERVE_TOKENS,
    CannotHoldLayer,
    Holder,
    LayerCosts,
    Placement,
    clamp_speed,
    place,
)
from .placement_claims import Claim, LostRace
from .placement_view import rated_holders
from .responses import HTTPError, read_body
from .state import tracker_state

logger = logging.getLogger(__name__)

MAX_PLACEMENT_BYTES: Final = 4 * limits.KIB
"""Largest placement request body read."""

router = APIRouter()


@router.post("/v1/placement")
async def placement(request: Request) -> JSONResponse:
    """Answer the range the asking node should load, and remember it until the node registers."""
    state = tracker_state(request)
    member = await require_member(request, state)
    body = await read_body(request, MAX_PLACEMENT_BYTES)
    try:
        ask = PlacementRequest.model_validate_json(body)
    except ValidationError as exc:
        raise HTTPError(400, f"invalid placement request: {exc.errors()[0]['msg']} "
                        f"({'.'.join(str(p) for p in exc.errors()[0]['loc'])})", errors.INVALID_REQUEST,
                        "invalid_body") from None
    if member.startswith("token:") and member != f"token:{ask.node_id}":
        raise HTTPError(403, f"this join token is not node {ask.node_id!r}'s", errors.PERMISSION,
                        "token_node_mismatch")
    now = state.now()
    book, claims = book_of(request), claims_of(request)
    holders = rated_holders(request, ask.model, now, exclude=ask.node_id)  # speeds as measured, not as claimed
    holders += [h for h in book.pending(ask.model, now, {h.node_id for h in holders}) if h.node_id != ask.node_id]
    costs = LayerCosts(num_layers=ask.num_layers, layer_bytes=ask.layer_bytes,
                       kv_bytes_per_token=ask.kv_bytes_per_token, head_bytes=ask.head_bytes,
                       tail_bytes=ask.tail_bytes)

    def decide(standing: list[Claim], mine: list[Claim]) -> tuple[list[Claim], Placement]:
        """The range, given the other trackers' claims too; this tracker's claim on it, in the same swap."""
        known = {h.node_id for h in holders} | {ask.node_id}
        chosen = place(costs, ask.max_memory_bytes, [*holders, *(c.holder() for c in standing
                                                                 if c.node_id not in known)],
                       DEFAULT_KV_RESERVE_TOKENS)
        held = Holder(ask.node_id, chosen.start, chosen.end, ask.seconds_per_layer)
        return [*(c for c in mine if c.node_id != ask.node_id), claims.claim(ask.node_id, "pending", held,
                                                                            PENDING_S)], chosen

    live = state.registry.candidates(ask.model, now)
    try:
        placed = await claims.change(ask.model, live, decide)
    except CannotHoldLayer as exc:
        logger.warning("node %s cannot be placed: %s", ask.node_id, exc)
        raise HTTPError(422, str(exc), errors.INVALID_REQUEST, "cannot_hold_layer", "max_memory_bytes",
                        budget_bytes=exc.budget_bytes, needed_bytes=exc.needed_bytes) from None
    except LostRace as exc:
        raise HTTPError(503, f"placement is busy: {exc}", errors.UNAVAILABLE, "placement_busy",
                        headers={"Retry-After": "1"}) from None
    book.hold(ask.model, Holder(ask.node_id, placed.start, placed.end, ask.seconds_per_layer), now,
              PlacedNode(ask.model, costs, ask.max_memory_bytes, clamp_speed(ask.seconds_per_layer)))
    logger.info("placed node %s on layers %d-%d of %s (%s; budget %d bytes, %d holders)", ask.node_id, placed.start,
                placed.end, ask.model, placed.reason, ask.max_memory_bytes, len(holders))
    answer = PlacementAnswer(shard_start=placed.start, shard_end=placed.end, reason=placed.reason,
                             kv_reserve_tokens=DEFAULT_KV_RESERVE_TOKENS)
    return JSONResponse(answer.model_dump(mode="json"))
