"""Connections admitted by a join token stay open only while the token does (issue 34, finding 11).

A token is checked at the handshake (:mod:`services.relay.join_tokens`); a
connection already open when the operator revokes it would run on for as
long as its node keeps it. So each connection admitted by a join token (a
peer's, or a caller's that showed a token rather than a signed handshake or
the secret) has a watch: every :data:`~services.relay.join_tokens.RECHECK_S`
it asks the tracker again, and on the tracker's refusal it closes the
connection (1008, policy violation, naming the reason). A peer's requests in
flight then fail at once with ``peer_disconnected``; a caller's are cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Final

from starlette.websockets import WebSocket, WebSocketDisconnect

from services.relay.join_tokens import RECHECK_S, bearer_token
from services.relay.state import RelayState

log = logging.getLogger(__name__)

CLOSE_POLICY: Final = 1008
"""The WebSocket close code for a connection whose credential no longer admits it."""
SIGNER_HEADER: Final = "x-meshnet-signer"


def watch_token(websocket: WebSocket, state: RelayState, peer_id: str | None) -> asyncio.Task[None] | None:
    """Start the watch of a connection admitted by a join token (``None`` for any other credential).

    ``peer_id`` is the id a peer's token must bind; ``None`` for a caller. The
    caller cancels the task when the connection ends.
    """
    token = bearer_token(websocket.headers.get("authorization"))
    if token is None or state.tokens is None or websocket.headers.get(SIGNER_HEADER) is not None:
        return None
    return asyncio.get_running_loop().create_task(_watch(websocket, state, token, peer_id),
                                                  name=f"token watch {peer_id or 'caller'}")


async def _watch(websocket: WebSocket, state: RelayState, token: str, peer_id: str | None) -> None:
    assert state.tokens is not None
    while True:
        await asyncio.sleep(RECHECK_S)
        failure = await state.tokens.recheck(token, peer_id)
        if failure is None:
            continue
        who = f"peer {peer_id}" if peer_id else "a caller"
        log.warning("closing %s's connection: %s", who, failure.message)
        (state.metrics.peer_connections if peer_id else state.metrics.caller_refusals).labels("token_refused").inc()
        with contextlib.suppress(OSError, RuntimeError, WebSocketDisconnect):
            await websocket.close(CLOSE_POLICY, failure.message[:120])
        return
