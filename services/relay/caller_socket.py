"""Serving callers: ``ws://relay/rpc/{peer_id}`` (JSON envelope) and ``ws://relay/mux/{peer_id}`` (binary).

Both check the handshake before accepting it: the peer id's form (400), the
credential (``/mux`` always, ``/rpc`` when ``rpc_requires_auth`` or when one is
presented: 401 missing, 403 wrong), the caller bound (503), and that the peer
is connected now (404, so a caller for an unknown peer learns it at once).

After that each message is one request, served concurrently with the others
on the connection (at most ``max_inflight_per_peer`` at once) and looked up
against the peer table when it arrives, so a peer that reconnects is reached
again without the caller reconnecting. Every request gets exactly one answer:
the peer's, or the relay's error (unknown peer, peer disconnected, timeout,
busy, too large, malformed). ``/rpc`` answers in the reference's JSON envelope
(``request_id, status, headers, body_base64``) with an OpenAI error body for
relay errors; ``/mux`` answers with a ``response`` or an ``error`` message.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Final

import orjson
from fastapi import WebSocket

from meshwire import errors
from meshwire.auth import check_bearer
from meshwire.envelope import EnvelopeError, HttpMethod, RelayResponse, decode_request
from meshwire.relay_client import (
    ERROR_STATUS,
    MuxError,
    MuxRequest,
    MuxResponse,
    MuxSignal,
    RelayErrorCode,
    peek_mux_id,
    read_mux,
    write_mux,
)
from services.relay.metrics import Transport
from services.relay.peers import RelayFailure, TransportClosed
from services.relay.state import RelayState
from services.relay.transport import PEER_ID, WebSocketTransport, refuse

log = logging.getLogger(__name__)

CLOSE_TOO_BIG: Final = 1009
CLOSE_PROTOCOL_ERROR: Final = 1002
REQUEST_ID_PEEK_CHARS: Final = 1024
"""How far into an unreadable JSON envelope the relay looks for its ``request_id`` to answer it."""
_REQUEST_ID = re.compile(r'"request_id"\s*:\s*"([^"\\]{1,128})"')
_JSON_HEADERS: Final = {"content-type": "application/json"}


async def forward(state: RelayState, peer_id: str, transport: Transport, method: HttpMethod, path: str,
                  headers: Mapping[str, str], body: bytes,
                  timeout_s: float | None) -> tuple[int, dict[str, str], bytes]:
    """Relay one request to the peer holding ``peer_id`` now; its answer, or :class:`RelayFailure`."""
    started = time.perf_counter()
    outcome: str = "ok"
    try:
        link = state.peers.get(peer_id)
        if link is None:
            raise RelayFailure("unknown_peer", f"peer {peer_id!r} is not connected to this relay")
        limit = state.settings.request_timeout_s
        state.metrics.inflight.inc()
        try:
            response, answer = await link.request(method, path, headers, body,
                                                  min(limit, timeout_s) if timeout_s else limit)
        finally:
            state.metrics.inflight.dec()
        state.metrics.count_bytes("to_peer", len(body))
        return response.status, dict(response.headers), answer
    except RelayFailure as exc:
        outcome = exc.code
        raise
    except asyncio.CancelledError:
        outcome = "cancelled"
        raise
    finally:
        state.metrics.count_request(transport, outcome, time.perf_counter() - started)


async def admit_caller(websocket: WebSocket, peer_id: str, state: RelayState, *, auth_required: bool) -> bool:
    """Check a caller's handshake; accept it (``True``) or refuse it with a status naming the problem."""
    if not PEER_ID.match(peer_id):
        await refuse(websocket, 400, "bad_peer_id", "peer id must be 1-128 characters of [A-Za-z0-9._:-]")
        return False
    authorization = websocket.headers.get("authorization")
    if auth_required or authorization is not None:
        failure = check_bearer(authorization, state.settings.secret)
        if failure is not None:
            await refuse(websocket, failure.status, "unauthorized" if failure.status == 401 else "forbidden",
                         failure.message)
            return False
    if state.callers >= state.settings.max_callers:
        await refuse(websocket, 503, "relay_full",
                     f"the relay already serves its limit of {state.settings.max_callers} caller connections")
        return False
    if state.peers.get(peer_id) is None:
        await refuse(websocket, 404, "unknown_peer", f"peer {peer_id!r} is not connected to this relay")
        return False
    await websocket.accept()
    return True


class _Requests:
    """The requests one caller connection has in flight, bounded and cancellable."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._tasks: dict[int, asyncio.Task[None]] = {}

    def full(self) -> bool:
        return len(self._tasks) >= self.limit

    def __contains__(self, key: int) -> bool:
        return key in self._tasks

    def start(self, key: int, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks[key] = task
        task.add_done_callback(lambda _t: self._tasks.pop(key, None))

    def cancel(self, key: int) -> None:
        if (task := self._tasks.get(key)) is not None:
            task.cancel()

    async def cancel_all(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _caller_loop(websocket: WebSocket, state: RelayState, transport: Transport,
                       on_message: Callable[[bytes | str], Awaitable[bool]]) -> None:
    """Feed each message to ``on_message`` until the caller leaves (or ``on_message`` says stop)."""
    state.callers += 1
    state.metrics.callers.labels(transport).inc()
    try:
        while True:
            event = await websocket.receive()
            if event["type"] == "websocket.disconnect":
                return
            data = event.get("bytes")
            if data is None:
                data = event.get("text") or ""
            if not await on_message(data):
                return
    finally:
        state.callers -= 1
        state.metrics.callers.labels(transport).dec()


async def serve_mux(websocket: WebSocket, peer_id: str, state: RelayState) -> None:
    """Serve one binary multiplexed caller of ``peer_id``."""
    if not await admit_caller(websocket, peer_id, state, auth_required=True):
        return
    out = WebSocketTransport(websocket)
    requests = _Requests(state.settings.max_inflight_per_peer)
    max_bytes = state.settings.max_message_bytes

    async def answer_error(request_id: int, code: RelayErrorCode, message: str) -> None:
        with contextlib.suppress(TransportClosed):
            await out.send(write_mux(MuxError(id=request_id, code=code, message=message[:1024])))

    async def serve(request: MuxRequest, body: bytes) -> None:
        try:
            status, headers, answer = await forward(state, peer_id, "mux", request.method, request.path,
                                                    request.headers, body, request.timeout_s)
        except RelayFailure as exc:
            await answer_error(request.id, exc.code, str(exc))
            return
        reply = write_mux(MuxResponse(id=request.id, status=status, headers=headers), answer)
        with contextlib.suppress(TransportClosed):
            await out.send(reply)

    async def on_message(data: bytes | str) -> bool:
        if isinstance(data, str):
            await websocket.close(CLOSE_PROTOCOL_ERROR, "/mux takes binary messages; use /rpc for JSON")
            return False
        try:
            message, body = read_mux(data, max_bytes)
        except EnvelopeError as exc:
            request_id = peek_mux_id(data)
            if request_id is None:
                await websocket.close(CLOSE_TOO_BIG if exc.code == "too_large" else CLOSE_PROTOCOL_ERROR,
                                      str(exc)[:120])
                return False
            code: RelayErrorCode = "too_large" if exc.code == "too_large" else "bad_request"
            await answer_error(request_id, code, str(exc))
            return True
        if isinstance(message, MuxRequest):
            if message.id in requests:
                await answer_error(message.id, "bad_request", f"request id {message.id} is already in flight")
            elif requests.full():
                await answer_error(message.id, "busy", f"this connection already has {requests.limit} "
                                                       "requests in flight")
            else:
                requests.start(message.id, serve(message, body))
        elif isinstance(message, MuxSignal) and message.kind == "cancel":
            requests.cancel(message.id)
        return True

    try:
        await _caller_loop(websocket, state, "mux", on_message)
    finally:
        await requests.cancel_all()


async def serve_rpc(websocket: WebSocket, peer_id: str, state: RelayState) -> None:
    """Serve one JSON-envelope caller of ``peer_id`` (the reference's form)."""
    if not await admit_caller(websocket, peer_id, state, auth_required=state.settings.rpc_requires_auth):
        return
    out = WebSocketTransport(websocket)
    requests = _Requests(state.settings.max_inflight_per_peer)
    counter = itertools.count()
    max_bytes = state.settings.max_message_bytes

    async def answer(response: RelayResponse) -> None:
        with contextlib.suppress(TransportClosed):
            await out.send_text(response.model_dump_json(exclude_none=True))

    def error(code: RelayErrorCode, message: str, request_id: str | None) -> RelayResponse:
        body = orjson.dumps(errors.error_body(message, errors.SERVER_ERROR if ERROR_STATUS[code] >= 500
                                              else errors.INVALID_REQUEST, code))
        return RelayResponse.of(ERROR_STATUS[code], _JSON_HEADERS, body, request_id)

    async def serve(raw: bytes | str) -> None:
        try:
            request = decode_request(raw, max_bytes)
            body = request.body()
        except EnvelopeError as exc:
            code: RelayErrorCode = "too_large" if exc.code == "too_large" else "bad_request"
            await answer(error(code, str(exc), _peek_request_id(raw)))
            return
        try:
            status, headers, reply = await forward(state, peer_id, "rpc", request.method, request.path,
                                                   request.headers, body, None)
        except RelayFailure as exc:
            await answer(error(exc.code, str(exc), request.request_id))
            return
        await answer(RelayResponse.of(status, headers, reply, request.request_id))

    async def on_message(data: bytes | str) -> bool:
        if requests.full():
            await answer(error("busy", f"this connection already has {requests.limit} requests in flight",
                               _peek_request_id(data)))
        else:
            requests.start(next(counter), serve(data))
        return True

    try:
        await _caller_loop(websocket, state, "rpc", on_message)
    finally:
        await requests.cancel_all()


def _peek_request_id(raw: bytes | str) -> str | None:
    """The ``request_id`` of an envelope that could not be read, when it is near the start."""
    head = raw[:REQUEST_ID_PEEK_CHARS]
    text = head.decode("utf-8", errors="ignore") if isinstance(head, bytes) else head
    match = _REQUEST_ID.search(text)
    return match.group(1) if match else None
