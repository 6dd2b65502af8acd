"""The tracker's verification endpoints (issue 37): heads report receipts; operators see and lift quarantines.

Routes:

- ``POST /v1/receipts`` (a node's credential; the route's head when it joined by
  token): ``{"route": <signed route token>, "receipts": [<receipt>, ...]}``, at
  most :data:`~.verification.MAX_REPORT_RECEIPTS`. The route must be one this
  tracker signed (expired for at most :data:`ROUTE_GRACE_S`), and every receipt
  must verify with the hop key that route names for its node at its hop, be made
  on that route, and be new: a forged, altered, misplaced or replayed receipt
  refuses the whole report (403 ``bad_receipt``, nothing kept). Kept receipts
  join the window, are compared with the other receipt of their step, and a node
  shown wrong is quarantined at once. The answer counts what was kept and names
  the nodes quarantined now.
- ``GET /v1/verify`` (reader): the rate, the window's size, the unresolved disputes, the quarantine.
- ``POST /v1/admin/nodes/{node_id}/readmit`` (the admin key, or the mesh secret where no admin
  key is set): lift a quarantine; issuing the node a new join token does too.
- ``POST /v1/admin/verify`` (the same credential): ``{"rate": r}`` changes this tracker's
  ``MESHNET_VERIFY_RATE`` until it restarts (an operator raising it on a suspicion; the benchmark).
"""

from __future__ import annotations

import hmac
import logging
import time
from typing import Annotated, Final

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, ValidationError

from meshwire import errors, limits
from meshwire.fields import STRICT_MODEL
from meshwire.receipts import MAX_RECEIPT_CHARS
from meshwire.route_keys import KeySet
from meshwire.routes import RouteError, verify_route

from .admin_api import require_admin
from .failure_reports import ROUTE_GRACE_S
from .mesh_api import require_member, require_reader
from .responses import HTTPError, read_body
from .state import TrackerState, tracker_state
from .trust import bearer_of
from .verification import MAX_REPORT_RECEIPTS, ReportRefused

logger = logging.getLogger(__name__)

router = APIRouter()

MAX_REPORT_BYTES: Final = limits.MAX_ROUTE_TOKEN_BYTES + MAX_REPORT_RECEIPTS * (MAX_RECEIPT_CHARS + 8) + 1024
"""Largest receipt report read."""
MAX_DISPUTES_SHOWN: Final = 100


class RateChange(BaseModel):
    """Body of ``POST /v1/admin/verify``."""

    model_config = STRICT_MODEL

    rate: float = Field(ge=0.0, le=1.0)


class ReceiptReport(BaseModel):
    """Body of ``POST /v1/receipts``."""

    model_config = STRICT_MODEL

    route: str = Field(min_length=1, max_length=limits.MAX_ROUTE_TOKEN_BYTES)
    receipts: list[Annotated[str, Field(min_length=1, max_length=MAX_RECEIPT_CHARS)]] = Field(
        min_length=1, max_length=MAX_REPORT_RECEIPTS)


@router.post("/v1/receipts")
async def report_receipts(request: Request) -> JSONResponse:
    """A head's receipts of its steps: verified, kept, compared; a node shown wrong is quarantined."""
    state = tracker_state(request)
    member = await require_member(request, state)
    try:
        report = ReceiptReport.model_validate_json(await read_body(request, MAX_REPORT_BYTES))
    except ValidationError as exc:
        raise HTTPError(400, f"invalid receipt report: {exc.errors()[0]['msg']}", errors.INVALID_REQUEST,
                        "invalid_body") from None
    try:
        route = verify_route(report.route, KeySet.from_jwks(state.trust.jwks()), now=time.time() - ROUTE_GRACE_S)
    except RouteError as exc:
        raise HTTPError(403, f"the route of this report is not one this tracker signed: {exc}", errors.PERMISSION,
                        "bad_route", "route") from None
    head = route.nodes[0].node_id
    if member.startswith("token:") and member != f"token:{head}":
        raise HTTPError(403, f"only the route's head ({head!r}) reports its receipts", errors.PERMISSION,
                        "not_route_head", "route")
    verifier = state.verifier
    try:
        kept = verifier.verify(route, report.route, report.receipts)
    except ReportRefused as exc:
        logger.warning("refused a receipt report from %s: %s", head, exc)
        raise HTTPError(403, f"receipt report refused: {exc}", errors.PERMISSION, "bad_receipt",
                        "receipts") from None
    if verifier.quarantine.stale:
        await verifier.quarantine.refresh()
    verifier.keep(kept)
    quarantined = []
    for node_id, reason, evidence in verifier.verdicts_due():
        await verifier.quarantine.add(node_id, reason, evidence)
        verifier.verdicts.inc()
        quarantined.append(node_id)
    return JSONResponse({"kept": len(kept), "quarantined": quarantined})


@router.get("/v1/verify")
async def verify_view(request: Request) -> JSONResponse:
    """What spot checks have found: the rate, the receipts kept, unresolved disputes, the quarantine."""
    state = tracker_state(request)
    await require_reader(request, state)
    verifier = state.verifier
    await verifier.quarantine.refresh()
    disputes = list(verifier.disputes.values())[-MAX_DISPUTES_SHOWN:]
    return JSONResponse({
        "verify_rate": verifier.rate,
        "receipts_kept": len(verifier.window),
        "disputes": [{"nodes": [d.node_id, d.peer], "receipts": list(d.evidence)} for d in disputes],
        "quarantined": {record.node_id: record.view() for record in verifier.quarantine.records()},
    })


def _require_operator(request: Request, state: TrackerState) -> None:
    """The admin key; where none is set, the mesh secret (an operator's mesh of one shared secret)."""
    if state.settings.admin_key:
        require_admin(request)
        return
    credential = bearer_of(request.headers.get("authorization"))
    secret = state.settings.secret
    if credential is None:
        raise HTTPError(401, "missing Authorization header (expected 'Bearer <admin key or mesh secret>')",
                        errors.AUTHENTICATION, "missing_credential", headers={"WWW-Authenticate": "Bearer"})
    if not secret or not hmac.compare_digest(credential.encode("utf-8"), secret.encode("utf-8")):
        raise HTTPError(403, "invalid credential", errors.PERMISSION, "invalid_credential")


@router.post("/v1/admin/nodes/{node_id}/readmit")
async def readmit(node_id: str, request: Request) -> JSONResponse:
    """Lift ``node_id``'s quarantine: it may be routed again (its disputes are forgotten)."""
    state = tracker_state(request)
    _require_operator(request, state)
    if len(node_id) > limits.MAX_ID_CHARS:
        raise HTTPError(400, "node id is too long", errors.INVALID_REQUEST, "bad_node_id")
    lifted = await state.verifier.quarantine.remove(node_id)
    state.verifier.forget(node_id)
    if not lifted:
        raise HTTPError(404, f"node {node_id!r} is not quarantined", errors.NOT_FOUND, "not_quarantined")
    return JSONResponse({"node_id": node_id, "readmitted": True})


@router.post("/v1/admin/verify")
async def set_rate(request: Request) -> JSONResponse:
    """Change the fraction of routes planned with a shadow, on this tracker, until it restarts."""
    state = tracker_state(request)
    _require_operator(request, state)
    try:
        change = RateChange.model_validate_json(await read_body(request, 256))
    except ValidationError as exc:
        raise HTTPError(400, f"invalid body: {exc.errors()[0]['msg']}", errors.INVALID_REQUEST,
                        "invalid_body", "rate") from None
    state.verifier.rate = change.rate
    logger.info("verify rate set to %g", change.rate)
    return JSONResponse({"verify_rate": change.rate})
