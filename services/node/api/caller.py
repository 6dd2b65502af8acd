"""Who may call a head's OpenAI endpoints: the mesh (the tracker, or the shared secret) or a client key.

The tracker signs its requests with its route key (:mod:`meshwire.hop_proof`), with a nonce seen once: the
node's front door (:meth:`HopAuth.tracker_call`) checks the proof from the headers before the body is read
(boundedly), which must then hash to the signed digest; the body is handed on. A node without a join token also takes the shared
secret as the mesh's credential, as before; client API keys (``MESHNET_API_KEYS``) are clients. Anyone
else is refused with 401/403 before the body is read, so nobody who merely reaches a node can spend the
mesh's sessions and KV budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from starlette.requests import Request

from meshwire.auth import check_bearer, check_bearer_any
from services.node.api.api_error import ApiError
from services.node.api.json_body import read_json_body
from services.node.hop.auth import HopAuth, HopRefused

if TYPE_CHECKING:
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


async def check_caller(request: Request, settings: NodeSettings, auth: HopAuth) -> Caller:
    """Who asks; :class:`ApiError` 401/403 for anyone but the mesh or a client key."""
    if any(name in request.headers for name in PROOF_HEADERS):
        return Caller(from_mesh=True, body=await _tracker_body(request, settings, auth))
    legacy = () if settings.join_token else (settings.secret,)
    failure = check_bearer_any(request.headers.get("authorization"), (*legacy, *settings.api_keys))
    if failure is not None:
        raise ApiError(failure.status, failure.message, failure.code)
    from_mesh = bool(legacy) and check_bearer(request.headers.get("authorization"), settings.secret) is None
    return Caller(from_mesh=from_mesh, body=None)


async def _tracker_body(request: Request, settings: NodeSettings, auth: HopAuth) -> bytes:
    """The body of a request the tracker signed: its proof checked from the headers first (a made-up one costs
    no body read), then the body read boundedly and checked against the digest the proof signed."""
    try:
        credential = await auth.tracker_call(request.headers, request.url.path)
        body = await read_json_body(request, settings.max_body_bytes)
        credential.check_body(body)
    except HopRefused as exc:
        raise ApiError(exc.status, str(exc), exc.code) from None
    return body
