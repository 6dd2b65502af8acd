"""Serving callers: ``ws://relay/rpc/{peer_id}`` (JSON envelope) and ``ws://relay/mux/{peer_id}`` (binary).

Both check the handshake before accepting it, in this order: the peer id's
form (400); the credential (:mod:`services.relay.access`: ``/mux`` always,
``/rpc`` whenever one is presented or ``rpc_requires_auth`` is on; 401
missing, 403 wrong; a node calling a peer shows a signed proof bound to that
peer instead of a secret, :mod:`services.relay.hop_callers`); that the peer is connected now (404, so a caller for an
unknown peer learns it at once); and a place in the caller budget of its kind
(:class:`~services.relay.budgets.CallerSlots`: 503 full, 429 when one address
holds its limit of anonymous connections).

An ``/rpc`` caller without a credential is *anonymous*: it reaches only the
peer's ``GET /health``; anything else is answered 401 without reaching the
peer. Its messages are bounded smaller (``max_anonymous_message_bytes``), its
requests count against the peer's anonymous in-flight budget, never the
authenticated one, and it is closed sooner when idle.

After that each message is one request, served concurrently with the others
on the connection and looked up against the peer table when it arrives, so a
peer that reconnects is reached again without the caller reconnecting. Every
request gets exactly one answer: the peer's, or the relay's error (unknown
peer, peer disconnected, timeout, busy, too large, malformed, unauthorized,
an answer that cannot be relayed). ``/rpc`` answers in the reference's JSON
envelope (``request_id, status, headers, body_base64``) with an OpenAI error
body for relay errors; ``/mux`` answers with a ``response`` or an ``error``
message.

A caller with nothing in flight that sends nothing for its idle timeout
(``caller_idle_timeout_s``, ``anonymous_idle_timeout_s``) is closed with
:data:`~meshwire.relay_client.CLOSE_IDLE`; a message that arrives after that
decision is not served, which is what lets a :class:`~meshwire.relay_client.RelayCaller`
send it again on a new link.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final

import orjson
from fastapi import WebSocket
from pydantic import ValidationError
from starlette.websockets import WebSocketDisconnect

from meshwire import errors
from meshwire.auth import AuthFailure
from meshwire.envelope import EnvelopeError, HttpMethod, RelayResponse, decode_request, validation_problem
from meshwire.relay_client import (
    CLOSE_IDLE,
    ERROR_STATUS,
    MAX_ERROR_MESSAGE_CHARS,
    MuxError,
    MuxRequest,
    MuxResponse,
    MuxSignal,
    RelayErrorCode,
    peek_mux_id,
    read_mux,
    write_mux,
)
from services.relay.access import caller_kind, is_public, refusal_message
from services.relay.budgets import CallerKind, CallerSlot, Refusal
from services.relay.join_tokens import bearer_token
from services.relay.metrics import Transport
from services.relay.peer_socket import admit_credential
from services.relay.peers import RelayFailure, TransportClosed
from services.relay.state import RelayState
from services.relay.token_watch import watch_token
from services.relay.transport import PEER_ID, WebSocketTransport, refuse
from services.relay.ws_protocol import AUTHENTICATED_SCOPE_KEY

log = logging.getLogger(__name__)

CLOSE_TOO_BIG: Final = 1009
CLOSE_PROTOCOL_ERROR: Final = 1002
REQUEST_ID_PEEK_CHARS: Final = 1024
"""How far into an unreadable JSON envelope the relay looks for its ``request_id`` to answer it."""
_REQUEST_ID = re.compile(r'"request_id"\s*:\s*"([^"\\]{1,128})"')
_JSON_HEADERS: Final = {"content-type": "application/json"}


async def forward(state: RelayState, peer_id: str, transport: Transport, method: HttpMethod, path: str,
                  headers: Mapping[str, str], body: bytes, timeout_s: float | None,
                  kind: CallerKind = "authenticated") -> tuple[int, dict[str, str], bytes]:
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
                                                  min(limit, timeout_s) if timeout_s else limit, kind)
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


async def admit_caller(websocket: WebSocket, peer_id: str, state: RelayState,
                       transport: Transport) -> CallerSlot | None:
    """Check a caller's handshake; accept it (its budget place) or refuse it with a status naming the problem."""
    settings, metrics = state.settings, state.metrics
    if not PEER_ID.match(peer_id):
        metrics.caller_refusals.labels("bad_peer_id").inc()
        await refuse(websocket, 400, "bad_peer_id", "peer id must be 1-128 characters of [A-Za-z0-9._:-]")
        return None
    authorization = websocket.headers.get("authorization")
    kind: CallerKind | AuthFailure
    if websocket.headers.get("x-meshnet-signer") is not None:  # a node's signed, peer-bound proof (no secret)
        assert state.handshakes is not None
        refused = await state.handshakes.check(websocket.headers, peer_id)
        kind = "authenticated" if refused is None else refused
    elif bearer_token(authorization) is not None:  # a node that joined by its join token
        refused = await admit_credential(authorization, state, None)
        kind = "authenticated" if refused is None else refused
    else:
        kind = caller_kind(authorization, settings.secret, transport, rpc_requires_auth=settings.rpc_requires_auth)
    if isinstance(kind, AuthFailure):
        metrics.caller_refusals.labels(kind.code).inc()
        await refuse(websocket, kind.status, kind.code, kind.message)
        return None
    if state.peers.get(peer_id) is None:
        metrics.caller_refusals.labels("unknown_peer").inc()
        await refuse(websocket, 404, "unknown_peer", f"peer {peer_id!r} is not connected to this relay")
        return None
    slot = state.callers.take(kind, websocket.client.host if websocket.client else None)
    if isinstance(slot, Refusal):
        metrics.caller_refusals.labels(slot.code).inc()
        log.debug("refused a %s %s caller of %s: %s", kind, transport, peer_id, slot.message)
        await refuse(websocket, slot.status, slot.code, slot.message)
        return None
    if kind == "authenticated":  # the secret, a join token or a node's signed handshake: full-size messages
        websocket.scope[AUTHENTICATED_SCOPE_KEY] = True
    try:
        await websocket.accept()
    except BaseException:
        slot.release()
        raise
    return slot


class _Requests:
    """The requests one caller connection has in flight, bounded and cancellable."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.last_finished = asyncio.get_running_loop().time()
        """When the latest request finished (the loop's clock): idleness counts from it too."""
        self._tasks: dict[int, asyncio.Task[None]] = {}

    @property
    def active(self) -> bool:
        return bool(self._tasks)

    def full(self) -> bool:
        return len(self._tasks) >= self.limit

    def __contains__(self, key: int) -> bool:
        return key in self._tasks

    def start(self, key: int, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks[key] = task
        task.add_done_callback(lambda _t: self._finished(key))

    def _finished(self, key: int) -> None:
        self._tasks.pop(key, None)
        self.last_finished = asyncio.get_running_loop().time()

    def cancel(self, key: int) -> None:
        if (task := self._tasks.get(key)) is not None:
            task.cancel()

    async def cancel_all(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _caller_loop(websocket: WebSocket, state: RelayState, transport: Transport, slot: CallerSlot,
                       requests: _Requests, on_message: Callable[[bytes | str], Awaitable[bool]]) -> None:
    """Feed each message to ``on_message`` until the caller leaves, idles out, or ``on_message`` says stop.

    The receive runs as a task that is waited on, never cancelled mid-message,
    while the loop watches the idle clock: nothing in flight and nothing
    received for the caller's idle timeout closes the connection.
    """
    settings = state.settings
    idle_s = settings.caller_idle_timeout_s if slot.kind == "authenticated" else settings.anonymous_idle_timeout_s
    loop = asyncio.get_running_loop()
    state.metrics.callers.labels(transport).inc()
    receiving: asyncio.Future[Any] | None = None
    watch = watch_token(websocket, state, None)  # a join token revoked later closes the connection
    try:
        last_heard = loop.time()
        while True:
            receiving = asyncio.ensure_future(websocket.receive())
            wait_s = idle_s
            while not (await asyncio.wait({receiving}, timeout=wait_s))[0]:
                if requests.active:
                    wait_s = idle_s
                    continue
                wait_s = max(last_heard, requests.last_finished) + idle_s - loop.time()
                if wait_s <= 0:
                    state.metrics.caller_refusals.labels("idle").inc()
                    log.debug("closing an idle %s %s caller from %s", slot.kind, transport, slot.address)
                    with contextlib.suppress(OSError, RuntimeError, WebSocketDisconnect):
                        await websocket.close(CLOSE_IDLE, f"idle: nothing in flight or sent for {idle_s:g}s")
                    return
            event = receiving.result()
            receiving = None
            last_heard = loop.time()
            if event["type"] == "websocket.disconnect":
                return
            data = event.get("bytes")
            if data is None:
                data = event.get("text") or ""
            if not await on_message(data):
                return
    finally:
        if watch is not None:
            watch.cancel()
        if receiving is not None and not receiving.done():
            receiving.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await receiving
        slot.release()
        state.metrics.callers.labels(transport).dec()


async def serve_mux(websocket: WebSocket, peer_id: str, state: RelayState) -> None:
    """Serve one binary multiplexed caller of ``peer_id`` (always authenticated)."""
    slot = await admit_caller(websocket, peer_id, state, "mux")
    if slot is None:
        return
    out = WebSocketTransport(websocket)
    requests = _Requests(state.settings.max_inflight_per_peer)
    max_bytes = state.settings.max_message_bytes

    async def answer_error(request_id: int, code: RelayErrorCode, message: str) -> None:
        with contextlib.suppress(TransportClosed):
            await out.send(write_mux(MuxError(id=request_id, code=code, message=message[:MAX_ERROR_MESSAGE_CHARS])))

    async def serve(request: MuxRequest, body: bytes) -> None:
        try:
            status, headers, answer = await forward(state, peer_id, "mux", request.method, request.path,
                                                    request.headers, body, request.timeout_s)
        except RelayFailure as exc:
            await answer_error(request.id, exc.code, str(exc))
            return
        try:
            reply = write_mux(MuxResponse(id=request.id, status=status, headers=headers), answer)
        except (EnvelopeError, ValidationError) as exc:
            problem = validation_problem(exc, "answer") if isinstance(exc, ValidationError) else str(exc)
            log.warning("peer %s answered %s %s with what cannot be relayed: %s", peer_id, request.method,
                        request.path[:200], problem)
            await answer_error(request.id, "bad_answer", f"the peer's answer cannot be relayed: {problem}")
            return
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
        await _caller_loop(websocket, state, "mux", slot, requests, on_message)
    finally:
        await requests.cancel_all()


async def serve_rpc(websocket: WebSocket, peer_id: str, state: RelayState) -> None:
    """Serve one JSON-envelope caller of ``peer_id`` (the reference's form); anonymous ones reach health only."""
    slot = await admit_caller(websocket, peer_id, state, "rpc")
    if slot is None:
        return
    settings = state.settings
    anonymous = slot.kind == "anonymous"
    out = WebSocketTransport(websocket)
    requests = _Requests(settings.max_anonymous_inflight_per_peer if anonymous else settings.max_inflight_per_peer)
    counter = itertools.count()
    max_bytes = (min(settings.max_anonymous_message_bytes, settings.max_message_bytes) if anonymous
                 else settings.max_message_bytes)

    async def answer(response: RelayResponse) -> None:
        with contextlib.suppress(TransportClosed):
            await out.send_text(response.model_dump_json(exclude_none=True))

    def error(code: RelayErrorCode, message: str, request_id: str | None) -> RelayResponse:
        body = orjson.dumps(errors.error_body(message[:MAX_ERROR_MESSAGE_CHARS], _error_type(code), code))
        return RelayResponse.of(ERROR_STATUS[code], _JSON_HEADERS, body, request_id)

    async def serve(raw: bytes | str) -> None:
        try:
            request = decode_request(raw, max_bytes)
            body = request.body()
        except EnvelopeError as exc:
            code: RelayErrorCode = "too_large" if exc.code == "too_large" else "bad_request"
            await answer(error(code, str(exc), _peek_request_id(raw)))
            return
        method, path, headers = request.method, request.path, request.headers
        if anonymous:
            if not is_public(method, path):
                state.metrics.count_request("rpc", "unauthorized", 0.0)
                await answer(error("unauthorized", refusal_message(method, path), request.request_id))
                return
            headers, body = {}, b""  # the public check, and nothing the caller added to it
        try:
            status, reply_headers, reply = await forward(state, peer_id, "rpc", method, path, headers, body, None,
                                                         slot.kind)
        except RelayFailure as exc:
            await answer(error(exc.code, str(exc), request.request_id))
            return
        try:
            response = RelayResponse.of(status, reply_headers, reply, request.request_id)
        except EnvelopeError as exc:
            log.warning("peer %s answered %s %s with what cannot be relayed: %s", peer_id, method, path[:200], exc)
            response = error("bad_answer", f"the peer's answer cannot be relayed: {exc}", request.request_id)
        await answer(response)

    async def on_message(data: bytes | str) -> bool:
        if requests.full():
            await answer(error("busy", f"this connection already has {requests.limit} requests in flight",
                               _peek_request_id(data)))
        else:
            requests.start(next(counter), serve(data))
        return True

    try:
        await _caller_loop(websocket, state, "rpc", slot, requests, on_message)
    finally:
        await requests.cancel_all()


def _error_type(code: RelayErrorCode) -> str:
    """The OpenAI error ``type`` of a relay error answered on ``/rpc``."""
    if code == "unauthorized":
        return errors.AUTHENTICATION
    return errors.SERVER_ERROR if ERROR_STATUS[code] >= 500 else errors.INVALID_REQUEST


def _peek_request_id(raw: bytes | str) -> str | None:
    """The ``request_id`` of an envelope that could not be read, when it is near the start."""
    head = raw[:REQUEST_ID_PEEK_CHARS]
    text = head.decode("utf-8", errors="ignore") if isinstance(head, bytes) else head
    match = _REQUEST_ID.search(text)
    return match.group(1) if match else None
