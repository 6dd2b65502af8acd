"""The tracker's trust endpoints: its public keys, join-token checks, and the operator's admin API.

Routes:

- ``GET /v1/keys`` (public): the route-signing public keys as a JWK set,
  ``{"keys": [{"kty": "OKP", "crv": "Ed25519", "kid", "x"}]}``. Public keys
  are not secrets: anyone may verify a route, only the trackers can sign one.
- ``POST /v1/tokens/check[?node_id=ID]`` (the join token as bearer): 200 when the
  token is valid (and binds ``ID``, when given); 401/403 otherwise. The relay asks this
  before it admits a peer that presents a join token.
- ``POST /v1/admin/tokens`` (admin key): issue a join token
  ``{"node_id", "model"?, "layers"? "A-B", "ttl_s"?}``; the answer holds the
  token, shown this once (the store keeps only its hash).
- ``GET /v1/admin/tokens`` (admin key): every token, without secrets.
- ``DELETE /v1/admin/tokens/{token_id}`` (admin key): revoke; the node it
  binds leaves every new route at once, every stream this tracker relays
  through it moves to a route without it at its next token, and it is
  refused at its next heartbeat (the bounds: README's trust section).
- ``POST /v1/admin/keys/rotate`` (admin key): publish a new route key now; it
  signs ``MESHNET_ROUTE_KEY_LEAD_S`` later, the old one stays published until
  its routes have expired.

While a shared store is away, each answers 503 ``store_unavailable`` (the app's handler of
:class:`~.store.StoreUnavailable`).

The admin key is ``MESHNET_ADMIN_KEY``; without it the admin API answers 403
(nobody can issue tokens), so a node that holds the shared secret can never
issue itself a token.
"""

from __future__ import annotations

import hmac
import logging
import re
import time
from typing import Final

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, ValidationError

from meshwire import errors, limits
from meshwire.fields import STRICT_MODEL, ModelName, NodeId
from meshwire.openai import validation_error_message, validation_error_param

from .join_tokens import MAX_TOKEN_TTL_S, TokenRefused, mint
from .responses import HTTPError, read_body
from .state import tracker_state
from .store import StoreUnavailable
from .trust import bearer_of

logger = logging.getLogger(__name__)

router = APIRouter()

MAX_ADMIN_BODY_BYTES: Final = 4 * limits.KIB
_LAYERS: Final = re.compile(r"(?P<a>[0-9]{1,5})-(?P<b>[0-9]{1,5})")


class TokenRequest(BaseModel):
    """Body of ``POST /v1/admin/tokens``."""

    model_config = STRICT_MODEL

    node_id: NodeId
    model: ModelName | None = None
    layers: str | None = Field(default=None, max_length=16)
    """``A-B``, inclusive at both ends, as ``meshnet node --layers``."""
    ttl_s: float | None = Field(default=None, gt=0, le=MAX_TOKEN_TTL_S)


def require_admin(request: Request) -> None:
    """Refuse a request without the operator's admin key: 403 when the admin API is off or the key is wrong."""
    admin_key = tracker_state(request).settings.admin_key
    if not admin_key:
        raise HTTPError(403, "the admin API is off: start the tracker with MESHNET_ADMIN_KEY set",
                        errors.PERMISSION, "admin_disabled")
    credential = bearer_of(request.headers.get("authorization"))
    if credential is None:
        raise HTTPError(401, "missing Authorization header (expected 'Bearer <admin key>')",
                        errors.AUTHENTICATION, "missing_credential", headers={"WWW-Authenticate": "Bearer"})
    if not hmac.compare_digest(credential.encode("utf-8"), admin_key.encode("utf-8")):
        raise HTTPError(403, "invalid admin key", errors.PERMISSION, "invalid_credential")


def _refused(exc: TokenRefused) -> HTTPError:
    kind = errors.AUTHENTICATION if exc.status == 401 else errors.PERMISSION
    return HTTPError(exc.status, str(exc), kind, exc.code)


def _layers(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    match = _LAYERS.fullmatch(text.strip())
    if match is None or int(match["a"]) > int(match["b"]) or int(match["b"]) >= limits.MAX_LAYERS:
        raise HTTPError(400, f"layers must be A-B with A <= B < {limits.MAX_LAYERS}, got {text[:20]!r}",
                        errors.INVALID_REQUEST, "bad_layers", "layers")
    return int(match["a"]), int(match["b"])


@router.get("/v1/keys")
async def keys(request: Request) -> JSONResponse:
    """The route-signing public keys (JWK set)."""
    state = tracker_state(request)
    jwks = await state.trust.current_jwks()
    if not jwks.keys:  # never loaded (its store has been away since it started): an empty set would unpin nodes
        raise StoreUnavailable("the tracker has not read its route keys yet")
    return JSONResponse(jwks.model_dump(mode="json"), headers={"Cache-Control": "no-cache"})


@router.post("/v1/tokens/check")
async def check_token(request: Request) -> JSONResponse:
    """Whether the bearer join token is valid and binds ``node_id`` (asked by the relay)."""
    state = tracker_state(request)
    credential = bearer_of(request.headers.get("authorization"))
    if credential is None:
        raise HTTPError(401, "missing Authorization header (expected 'Bearer <join token>')",
                        errors.AUTHENTICATION, "missing_credential", headers={"WWW-Authenticate": "Bearer"})
    node_id = request.query_params.get("node_id")
    if node_id is not None and not 0 < len(node_id) <= limits.MAX_ID_CHARS:
        raise HTTPError(400, f"node_id must be 1-{limits.MAX_ID_CHARS} characters", errors.INVALID_REQUEST,
                        "bad_node_id", "node_id")
    try:
        record = await state.trust.token(credential)
    except TokenRefused as exc:
        raise _refused(exc) from None
    if node_id is not None and record.node_id != node_id:
        raise HTTPError(403, f"this join token is for node {record.node_id!r}, not {node_id[:100]!r}",
                        errors.PERMISSION, "token_node_mismatch")
    return JSONResponse({"node_id": record.node_id, "token_id": record.token_id, "expires_at": record.expires_at})


@router.post("/v1/admin/tokens")
async def create_token(request: Request) -> JSONResponse:
    """Issue a join token (shown once)."""
    require_admin(request)
    state = tracker_state(request)
    try:
        wanted = TokenRequest.model_validate_json(await read_body(request, MAX_ADMIN_BODY_BYTES))
    except ValidationError as exc:
        raise HTTPError(400, validation_error_message(exc), errors.INVALID_REQUEST, "invalid_body",
                        validation_error_param(exc)) from None
    token, record = mint(wanted.node_id, time.time(), model=wanted.model, layers=_layers(wanted.layers),
                         ttl_s=wanted.ttl_s)
    try:
        await state.store.put_token(record)
    except ValueError as exc:
        raise HTTPError(409, str(exc), errors.INVALID_REQUEST, "too_many_tokens") from None
    logger.info("join token %s issued for node %s", record.token_id, record.node_id)
    if await state.verifier.quarantine.remove(record.node_id):  # a token re-issued: the operator re-admits it
        state.verifier.forget(record.node_id)
    return JSONResponse({"token": token, **record.public(time.time())}, status_code=201)


@router.get("/v1/admin/tokens")
async def list_tokens(request: Request) -> JSONResponse:
    """Every join token, without secrets, oldest first."""
    require_admin(request)
    state = tracker_state(request)
    records = await state.store.all_tokens()
    now = time.time()
    return JSONResponse({"tokens": [r.public(now) for r in sorted(records, key=lambda r: r.created_at)]})


@router.delete("/v1/admin/tokens/{token_id}")
async def revoke_token(token_id: str, request: Request) -> JSONResponse:
    """Revoke a join token; its node leaves every new route now."""
    require_admin(request)
    state = tracker_state(request)
    record = await state.store.get_token(token_id[:64])
    if record is None:
        raise HTTPError(404, f"no join token {token_id[:64]!r}", errors.NOT_FOUND, "unknown_token")
    if record.revoked_at is None:
        record = record.model_copy(update={"revoked_at": time.time()})
        await state.store.put_token(record)
    await state.store.revoke_node(record.node_id, record.revoked_at or time.time())
    evicted = await state.store.evict(record.node_id, state.now())
    logger.warning("join token %s of node %s revoked%s", record.token_id, record.node_id,
                   "; the node left every route" if evicted else "")
    return JSONResponse({**record.public(time.time()), "evicted": evicted})


@router.post("/v1/admin/keys/rotate")
async def rotate_keys(request: Request) -> JSONResponse:
    """Publish a new route-signing key; it signs after the lead."""
    require_admin(request)
    state = tracker_state(request)
    record = await state.trust.rotate()
    return JSONResponse({"kid": record.kid, "signs_from": record.signs_from,
                         "keys": state.trust.jwks().model_dump(mode="json")["keys"]})
