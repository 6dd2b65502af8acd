"""Serving one peer's connection: ``ws://relay/peer/{peer_id}``.

The handshake is checked before it is accepted, in this order: the peer id's
form (400), the bearer credential (401 missing, 403 wrong), the claim on the
id (409 held by a live connection, 503 relay full). Then every binary message
from the peer is an answer (or a ``pong``) handed to the request waiting for
it. An answer that cannot be read (a header over its bound, bad JSON) fails
only the request it answers, with ``bad_answer`` (502); the link serves on.
When the connection ends, for whatever reason, every request still in
flight to this peer fails at once with ``peer_disconnected``.
"""

from __future__ import annotations

import logging
from typing import Final

from fastapi import WebSocket

from meshwire.auth import AuthFailure, check_bearer
from meshwire.envelope import EnvelopeError
from meshwire.relay_client import peek_mux_id, read_mux
from services.relay.budgets import CallerKind, InflightBudget
from services.relay.join_tokens import bearer_token
from services.relay.peers import ClaimRefused, PeerLink
from services.relay.state import RelayState
from services.relay.token_watch import watch_token
from services.relay.transport import PEER_ID, WebSocketTransport, refuse
from services.relay.ws_protocol import AUTHENTICATED_SCOPE_KEY

log = logging.getLogger(__name__)

CLOSE_UNSUPPORTED_DATA: Final = 1003
"""The WebSocket close code for a message of a kind the endpoint does not take (peers send binary)."""


async def admit_credential(authorization: str | None, state: RelayState, peer_id: str | None) -> AuthFailure | None:
    """Check a handshake's credential: a join token (asked of the tracker; for a peer, it must bind
    ``peer_id``) or the shared secret. ``None`` when it admits."""
    token = bearer_token(authorization)
    if token is None:
        return check_bearer(authorization, state.settings.secret)
    if state.tokens is None:
        return AuthFailure(403, "this relay checks no join tokens: start it with MESHNET_TRACKER set")
    return await state.tokens.check(token, peer_id)


async def serve_peer(websocket: WebSocket, peer_id: str, state: RelayState) -> None:
    """Admit a peer under ``peer_id`` and relay its answers until it goes away."""
    settings, metrics = state.settings, state.metrics
    if not PEER_ID.match(peer_id):
        metrics.peer_connections.labels("bad_id").inc()
        await refuse(websocket, 400, "bad_peer_id", "peer id must be 1-128 characters of [A-Za-z0-9._:-]")
        return
    failure = await admit_credential(websocket.headers.get("authorization"), state, peer_id)
    if failure is not None:
        metrics.peer_connections.labels("unauthorized").inc()
        await refuse(websocket, failure.status, failure.code, failure.message)
        return
    try:
        await state.peers.claim(peer_id)
    except ClaimRefused as exc:
        metrics.peer_connections.labels(exc.code).inc()
        log.warning("refused a connection for peer %s: %s", peer_id, exc)
        await refuse(websocket, exc.status, exc.code, str(exc))
        return
    websocket.scope[AUTHENTICATED_SCOPE_KEY] = True  # its credential was checked: full-size messages
    try:
        await websocket.accept()
    except BaseException:
        state.peers.abandon(peer_id)
        raise
    budgets: dict[CallerKind, InflightBudget] = {
        "authenticated": InflightBudget("authenticated", max_requests=settings.max_inflight_per_peer,
                                        max_bytes=settings.max_inflight_bytes_per_peer),
        "anonymous": InflightBudget("anonymous", max_requests=settings.max_anonymous_inflight_per_peer,
                                    max_bytes=settings.max_anonymous_inflight_per_peer
                                    * settings.max_anonymous_message_bytes),
    }
    link = PeerLink(peer_id, WebSocketTransport(websocket), budgets=budgets,
                    max_message_bytes=settings.max_message_bytes)
    state.peers.activate(link)
    metrics.peer_connections.labels("accepted").inc()
    metrics.peers.set(len(state.peers))
    log.info("peer %s connected (%d peers)", peer_id, len(state.peers))
    watch = watch_token(websocket, state, peer_id)  # a token revoked later closes the connection
    try:
        await _relay_answers(websocket, link, state)
    finally:
        if watch is not None:
            watch.cancel()
        state.peers.release(link, "peer_disconnected", f"peer {peer_id!r} disconnected from the relay")
        metrics.peers.set(len(state.peers))
        log.info("peer %s disconnected (%d peers)", peer_id, len(state.peers))


async def _relay_answers(websocket: WebSocket, link: PeerLink, state: RelayState) -> None:
    max_bytes = state.settings.max_message_bytes
    while True:
        event = await websocket.receive()
        if event["type"] == "websocket.disconnect":
            return
        data = event.get("bytes")
        if data is None:
            await websocket.close(CLOSE_UNSUPPORTED_DATA, "peer messages are binary mux messages")
            return
        if len(data) > max_bytes:
            request_id = peek_mux_id(data)
            log.warning("peer %s sent a %d-byte message, over %d", link.peer_id, len(data), max_bytes)
            if request_id is not None:
                link.fail(request_id, "too_large",
                          f"the peer's answer of {len(data)} bytes is over the relay's bound of {max_bytes}")
            continue
        try:
            message, body = read_mux(data, max_bytes)
        except EnvelopeError as exc:
            log.warning("peer %s sent a malformed message: %s", link.peer_id, exc)
            if (request_id := peek_mux_id(data)) is not None:
                link.fail(request_id, "bad_answer", f"the peer's answer cannot be relayed: {exc}")
            continue
        state.metrics.count_bytes("from_peer", len(body))
        link.deliver(message, body)
