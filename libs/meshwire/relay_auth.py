"""A node calling a peer through a relay proves who it is without handing the relay anything reusable.

A peer chooses its own ``relay_addr`` when it registers, so the relay a node
dials to reach a peer is an address the peer chose. A node therefore never
sends a bearer secret (its join token, the mesh secret) to such a relay; it
shows, at the WebSocket handshake of ``/mux/{peer_id}``:

- ``X-Meshnet-Route``: a route the tracker signed that names the caller and,
  after it, the peer called;
- the hop proof headers of :mod:`meshwire.hop_proof`, by the caller's hop key
  (the one the route names for it), over the path ``/relay/mux/{peer_id}``
  (:data:`RELAY_AUDIENCE` and the peer: the proof's audience) and that route.

A relay holding the tracker's route keys verifies it (:func:`check_relay_handshake`).
A listener posing as the relay learns a proof that reaches only the peer that
named it, along that route, for :data:`~meshwire.hop_proof.MAX_PROOF_AGE_S`: nothing
it could not reach already.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from meshwire import headers as h
from meshwire.hop_proof import ProofProblem, check_claim_headers, read_claim, sign_request
from meshwire.route_keys import KeyProblem, KeySet, SigningKey, public_key_from_text
from meshwire.routes import RouteError, route_key_id, verify_route

RELAY_AUDIENCE: Final = "/relay/mux/"
"""The path a relay handshake proof signs, followed by the peer called."""


def relay_handshake(key: SigningKey, signer: str, route_token: str, peer_id: str,
                    now: float | None = None) -> dict[str, str]:
    """The handshake headers that let ``signer`` (holding ``key``) call ``peer_id`` through a relay."""
    headers = {h.ROUTE: route_token}
    return {**headers, **sign_request(key, signer, f"{RELAY_AUDIENCE}{peer_id}", headers, b"", now)}


def handshake_kid(headers: Mapping[str, str]) -> str | None:
    """The tracker key id a handshake's route names (to fetch the tracker's keys when it is new), or ``None``."""
    token = headers.get(h.ROUTE.lower()) or headers.get(h.ROUTE)
    return route_key_id(token) if token else None


def check_relay_handshake(headers: Mapping[str, str], peer_id: str, keys: KeySet) -> str:
    """The node that may call ``peer_id``, as a handshake proves it; :class:`ProofProblem` (401/403) otherwise.

    The route must verify with ``keys`` (its expiry is not checked: a session's
    route outlives it, and the proof's age bounds a replay), name the signer,
    and name ``peer_id`` after it; the proof must verify with the hop key the
    route names for the signer, over this peer's audience.
    """
    claim = read_claim(headers)
    token = headers.get(h.ROUTE.lower()) or headers.get(h.ROUTE)
    if not token:
        raise ProofProblem(401, f"a signed relay handshake carries the route ({h.ROUTE}) naming caller and peer")
    try:
        route = verify_route(token, keys, check_expiry=False)
    except RouteError as exc:
        raise ProofProblem(403, f"the handshake's route is refused ({exc.code}): {exc}") from None
    caller, called = route.hop_of(claim.signer), route.hop_of(peer_id)
    shadow = route.shadow
    if called is None and shadow is not None and shadow.node.node_id == peer_id:  # a verifier (issue 37)
        called = shadow.hop_index
    if caller is None or called is None or called <= caller:
        raise ProofProblem(403, f"the handshake's route does not name {claim.signer[:100]} before {peer_id}")
    hop_key = route.nodes[caller].hop_key
    if hop_key is None:
        raise ProofProblem(403, f"the handshake's route names no hop key for {claim.signer[:100]}")
    try:
        check_claim_headers(claim, public_key_from_text(hop_key), f"{RELAY_AUDIENCE}{peer_id}", headers)
    except KeyProblem as exc:
        raise ProofProblem(403, str(exc)) from None
    return claim.signer
