"""Who may call a head's OpenAI endpoints: the mesh (the tracker, or the shared secret) or a client key.

The tracker signs its requests with its route key (:mod:`meshwire.hop_proof`): the proof covers the body,
which is read (boundedly) to check it and handed on. A node without a join token also takes the shared
secret as the mesh's credential, as before; client API keys (``MESHNET_API_KEYS``) are clients. Anyone
else is refused with 401/403 before the body is read, so nobody who merely reaches a node can spend the
mesh's sessions and KV budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from starlette.requests import Request

from meshwire.auth import check_bearer, check_bearer_any
from meshwire.hop_proof import TRACKER_SIGNER_PREFIX, ProofProblem, check_claim, read_claim
from services.node.api.api_error import ApiError
from services.node.api.json_body import read_json_body

if TYPE_CHECKING:
    from services.node.hop.trust import RouteTrust
    from services.node.settings import NodeSettings

PROOF_HEADERS: Final = ("x-meshnet-signer", "x-meshnet-proof")
"""Headers of a signed request: with either, the caller must prove it is the tracker."""


@dataclass(frozen=True)
class Caller:
    """Who asks, as far as the API cares."""

    from_mesh: bool
    """The tracker (or the mesh's shared secret): it may continue a stream and name a choice group."""
    body: bytes | None
    """The body, when checking the caller read it (a signed request's proof covers it)."""


async def check_caller(request: Request, settings: NodeSettings, trust: RouteTrust) -> Caller:
    """Who asks; :class:`ApiError` 401/403 for anyone but the mesh or a client key."""
    if any(name in request.headers for name in PROOF_HEADERS):
        return Caller(from_mesh=True, body=await _tracker_body(request, settings, trust))
    legacy = () if settings.join_token else (settings.secret,)
    failure = check_bearer_any(request.headers.get("authorization"), (*legacy, *settings.api_keys))
    if failure is not None:
        raise ApiError(failure.status, failure.message, failure.code)
    from_mesh = bool(legacy) and check_bearer(request.headers.get("authorization"), settings.secret) is None
    return Caller(from_mesh=from_mesh, body=None)


async def _tracker_body(request: Request, settings: NodeSettings, trust: RouteTrust) -> bytes:
    """The body of a request the tracker signed, once its proof is checked against the tracker's keys."""
    try:
        claim = read_claim(request.headers)
    except ProofProblem as exc:
        raise ApiError(exc.status, str(exc), "unauthorized") from None
    if not claim.signer.startswith(TRACKER_SIGNER_PREFIX):
        raise ApiError(403, f"{claim.signer[:100]} may not call a head's API; only the tracker signs here",
                       "forbidden")
    kid = claim.signer[len(TRACKER_SIGNER_PREFIX):]
    await trust.ensure_kid(kid)
    key = trust.keys.get(kid)
    if key is None:
        raise ApiError(403, f"{kid[:64]!r} is not one of the tracker's keys this node holds", "forbidden")
    body = await read_json_body(request, settings.max_body_bytes)
    try:
        check_claim(claim, key, request.url.path, request.headers, body)
    except ProofProblem as exc:
        raise ApiError(exc.status, str(exc), "forbidden") from None
    return body
