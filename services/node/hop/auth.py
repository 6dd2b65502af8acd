"""The node's one front door for authorisation: who a caller is and what it may do, from headers alone.

Every endpoint that the mesh (not a client) calls asks here first, before it
reads a byte of the body:

- ``POST /forward`` (:meth:`HopAuth.credential`, then :meth:`HopAuth.frame`):
  the previous hop of a route the tracker signed, proven by its hop key;
- ``POST /forward/rows`` (:meth:`HopAuth.batch`, then :meth:`HopAuth.frame` per row):
  the same, for a batch whose rows' routes are inside the body, so the request
  names one of them in its own headers to vouch for the signer's key;
- ``POST /kv/prefill``, ``POST /kv/pull`` (:meth:`HopAuth.route` and
  :meth:`HopAuth.verify_signer`, used by :mod:`services.node.pd.kv_auth`);
- the head's ``/v1`` called by the tracker (:meth:`HopAuth.tracker_call`):
  signed with the tracker's route key, with a nonce seen once.

A credential is one of two things:

- a proof (:mod:`meshwire.hop_proof`): it covers the headers and the body's
  declared SHA-256, so it is verified against the key a signed route names
  **before the body is read**; the body read afterwards (within the bound its
  headers give) must hash to that digest (:meth:`Credential.check_body`);
- on a node holding no join token, ``Authorization: Bearer <MESHNET_SECRET>``,
  compared in constant time, as before.

An anonymous or forged request thus costs a header parse, at most one route
signature and one proof signature check, and, when the route names a tracker
key this node does not hold, a wait on the one shared, rate-limited key
fetch (:mod:`services.node.hop.trust`); never its body. Every refusal is a
:class:`HopRefused`: 401 ``unauthorized`` without a credential, 403
``forbidden``/``bad_route``/``bad_proof``/``replayed`` when it does not hold.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from meshwire import errors
from meshwire import headers as h
from meshwire.auth import check_bearer
from meshwire.frames import FrameError, get_header, parse_int_header
from meshwire.hop_proof import (
    PROOF,
    SIGNER,
    TRACKER_SIGNER_PREFIX,
    Claim,
    ProofProblem,
    SeenProofs,
    check_body,
    check_claim_headers,
    read_claim,
)
from meshwire.limits import MAX_ROUTE_HOPS
from meshwire.route_keys import KeyProblem, public_key_from_text
from meshwire.routes import Route, RouteError, RouteNode, verify_route
from services.node.hop.routing import RoutedHop, RouteRefused, refuse_revoked, verify_hop
from services.node.hop.trust import RouteTrust
from services.node.model.shard import Shard

MAX_TRACKER_CALLS_SEEN: Final = 65536
"""Tracker calls a head remembers to refuse their replay (within a proof's age: ~218 calls a second)."""
_TYPES: Final = {401: errors.AUTHENTICATION, 403: errors.PERMISSION}


class HopRefused(Exception):
    """A call refused before its body was read: ``status`` (401/403, or 400) and ``code`` go in the JSON error."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code

    def error_body(self, node_id: str | None = None) -> dict[str, Any]:
        """The OpenAI-shaped JSON error naming the problem (and this node)."""
        kind = _TYPES.get(self.status, errors.INVALID_REQUEST)
        return errors.error_body(str(self), kind, self.code, **({} if node_id is None else {"node_id": node_id}))


class Credential:
    """Who the headers say is calling: a proof (``claim``), or the mesh secret already checked (``claim`` None).

    The proof is verified against each key a route names for its signer once
    (:meth:`verify_with`), from the headers alone; :meth:`check_body` then ties
    the body read afterwards to the digest the proof signed.
    """

    def __init__(self, claim: Claim | None, path: str, headers: Mapping[str, str]) -> None:
        self.claim = claim
        self.path = path
        self._headers = headers
        self._verified: set[str] = set()
        self._body_checked = False

    @property
    def signer(self) -> str | None:
        """The node that signed, or ``None`` for the mesh secret."""
        return None if self.claim is None else self.claim.signer

    def verify_with(self, node: RouteNode, what: str = "the route") -> None:
        """Refuse (403 ``bad_proof``) unless the proof verifies with the hop key ``what`` names for ``node``."""
        if self.claim is None:
            return
        if node.hop_key is None:
            raise HopRefused(403, "bad_proof", f"{what} names no hop key for {node.node_id}")
        if node.hop_key in self._verified:
            return
        try:
            check_claim_headers(self.claim, public_key_from_text(node.hop_key), self.path, self._headers)
        except (ProofProblem, KeyProblem) as exc:
            raise HopRefused(403, "bad_proof", str(exc)) from None
        self._verified.add(node.hop_key)

    def check_body(self, body: bytes) -> None:
        """Refuse (403 ``bad_proof``) a body that is not the one the proof signed (once per request)."""
        if self.claim is None or self._body_checked:
            return
        try:
            check_body(self.claim, body)
        except ProofProblem as exc:
            raise HopRefused(403, "bad_proof", str(exc)) from None
        self._body_checked = True


def proof_claim(headers: Mapping[str, str], what: str = "this call") -> Claim:
    """The proof headers' claim, checked for form only; 401 ``unauthorized`` without one, naming the problem."""
    try:
        return read_claim(headers)
    except ProofProblem as exc:
        raise HopRefused(exc.status, "unauthorized" if exc.status == 401 else "bad_proof",
                         f"{exc} ({what} is signed with the caller's hop key)") from None


class HopAuth:
    """Answers, from a request's headers, who calls this node and along which route, or refuses it."""

    def __init__(self, *, node_id: str, model_id: str, trust: RouteTrust, legacy_secret: str | None,
                 tracker_calls: SeenProofs | None = None) -> None:
        self.node_id = node_id
        self.model_id = model_id
        self.trust = trust
        self._legacy_secret = legacy_secret
        self._tracker_calls = SeenProofs(MAX_TRACKER_CALLS_SEEN) if tracker_calls is None else tracker_calls

    # --- credentials ------------------------------------------------------------------

    def credential(self, headers: Mapping[str, str], path: str) -> Credential:
        """A frame's credential: the mesh secret (checked now) or a proof (checked against the route later)."""
        has_proof = any(name.lower() in headers or name in headers for name in (SIGNER, PROOF))
        authorization = headers.get("authorization")
        if not has_proof and self._legacy_secret is not None and authorization:
            failure = check_bearer(authorization, self._legacy_secret)
            if failure is not None:
                raise HopRefused(failure.status, failure.code, failure.message)
            return Credential(None, path, headers)
        return Credential(proof_claim(headers, "a frame"), path, headers)

    # --- routes -------------------------------------------------------------------------

    async def route(self, token: str | None, what: str, *, check_expiry: bool) -> Route:
        """The signed route ``token`` for this node's model; 403 ``bad_route`` naming ``what`` otherwise."""
        if not token:
            raise HopRefused(403, "bad_route", f"missing {what}: this call is made along a route the tracker signed")
        await self.trust.ensure(token)
        try:
            route = verify_route(token, self.trust.keys, check_expiry=check_expiry)
        except RouteError as exc:
            raise HopRefused(403, "bad_route", f"{what} refused ({exc.code}): {exc}") from None
        try:
            refuse_revoked(route, self.trust.revoked)
        except RouteRefused as exc:
            raise HopRefused(403, "bad_route", f"{what}: {exc}") from None
        if route.model != self.model_id:
            raise HopRefused(403, "bad_route", f"{what} is for {route.model}, this node serves {self.model_id}")
        return route

    @staticmethod
    def verify_signer(credential: Credential, node: RouteNode, what: str) -> None:
        """The proof must be ``node``'s, by the key ``what`` (a route) names for it; 403 ``bad_proof`` otherwise."""
        if credential.signer is not None and credential.signer != node.node_id:
            raise HopRefused(403, "bad_proof", f"{what} expects a call signed by {node.node_id}, not "
                                               f"{credential.signer[:100]}")
        credential.verify_with(node, what)

    # --- frames -------------------------------------------------------------------------

    async def frame(self, credential: Credential, token: str | None, hop_index: int, *, shard: Shard,
                    opens_session: bool, closing: bool = False) -> RoutedHop:
        """The verified route naming this node at ``hop_index``, whose previous hop signed ``credential``.

        403 ``bad_route`` for a route that does not verify or give this node its
        layers; 403 ``bad_proof`` for a signer the route does not name before
        this hop (a close may also come from the route's head, which owns the
        session). A route's expiry bounds when a session may open; an open
        session's later frames ride on the route that opened it.
        """
        await self.trust.ensure(token)
        try:
            hop = verify_hop(token, hop_index, keys=self.trust.keys, node_id=self.node_id, model_id=self.model_id,
                             shard=shard, check_expiry=opens_session, revoked=self.trust.revoked)
        except RouteRefused as exc:
            raise HopRefused(403, "bad_route", str(exc)) from None
        if credential.claim is not None:
            credential.verify_with(self._sender(hop, credential.claim.signer, closing))
        return hop

    @staticmethod
    def _sender(hop: RoutedHop, signer: str, closing: bool) -> RouteNode:
        if hop.hop_index == 0:
            if not hop.shadow:
                raise HopRefused(403, "bad_proof", "hop 0 has no previous hop to send it frames")
            previous = hop.route.head  # a head's shadow is sent the step's token ids by the head itself
        else:
            previous = hop.route.nodes[hop.hop_index - 1]
        if closing and previous.node_id != signer and hop.route.head.node_id == signer:
            previous = hop.route.head
        if previous.node_id != signer:
            raise HopRefused(403, "bad_proof", f"the route's previous hop is {previous.node_id}, but the frame "
                                               f"is signed by {signer[:100]}")
        return previous

    async def batch(self, headers: Mapping[str, str], path: str) -> Credential:
        """A ``/forward/rows`` batch's credential, verified from its headers before the batch is read.

        The batch's own ``X-Meshnet-Route`` and ``X-Meshnet-Hop-Index`` (those of
        one of its rows) must be a route the tracker signed that names this node
        at that index and the signer just before it; the proof must verify with
        the key it names. Each row is then checked as a ``/forward`` frame.
        """
        credential = self.credential(headers, path)
        if credential.claim is None:
            return credential
        try:
            index = parse_int_header(h.HOP_INDEX, get_header(headers, h.HOP_INDEX), minimum=0,
                                     maximum=MAX_ROUTE_HOPS - 1)
        except FrameError as exc:
            raise HopRefused(403, "bad_route", f"a batch names the route of one of its rows in {h.ROUTE} and "
                                               f"{h.HOP_INDEX}: {exc}") from None
        route = await self.route(get_header(headers, h.ROUTE), f"the batch's route ({h.ROUTE})", check_expiry=False)
        placed = route.at(index, self.node_id)
        if placed is None:
            raise HopRefused(403, "bad_route", f"the batch's route does not name {self.node_id} at hop {index}")
        hop = RoutedHop(route=route, token=get_header(headers, h.ROUTE) or "", hop_index=index, shadow=placed[1])
        credential.verify_with(self._sender(hop, credential.claim.signer, False), "the batch's route")
        return credential

    # --- the tracker's calls to a head --------------------------------------------------------

    async def tracker_call(self, headers: Mapping[str, str], path: str) -> Credential:
        """A call signed with the tracker's route key, verified before its body is read and refused when replayed.

        401 without a well-formed proof and nonce; 403 ``forbidden`` for a signer
        that is not the tracker or a key this node does not hold, or a proof
        that does not verify; 403 ``replayed`` for a proof answered before.
        """
        claim = proof_claim(headers, "a tracker's call")
        if not claim.signer.startswith(TRACKER_SIGNER_PREFIX):
            raise HopRefused(403, "forbidden", f"{claim.signer[:100]} may not call a head's API; only the tracker "
                                               "signs here")
        if claim.nonce is None:
            raise HopRefused(401, "unauthorized", "a tracker's call carries a nonce (X-Meshnet-Nonce), so a replay "
                                                  "can be told from a new call")
        kid = claim.signer[len(TRACKER_SIGNER_PREFIX):]
        await self.trust.ensure_kid(kid)
        key = self.trust.keys.get(kid)
        if key is None:
            raise HopRefused(403, "forbidden", f"{kid[:64]!r} is not one of the tracker's keys this node holds")
        try:
            check_claim_headers(claim, key, path, headers)
        except ProofProblem as exc:
            raise HopRefused(403, "forbidden", str(exc)) from None
        if not self._tracker_calls.first_time(claim):
            raise HopRefused(403, "replayed", "this signed call was answered before (a replay)")
        return Credential(claim, path, headers)
