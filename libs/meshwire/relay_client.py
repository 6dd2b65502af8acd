"""Clients of the meshnet relay: a peer behind NAT, and a caller that reaches it.

A node that cannot be dialled keeps one outbound WebSocket to a relay
(:class:`RelayPeer`) and serves the HTTP-shaped requests that arrive over it.
Other nodes reach it through the relay (:class:`RelayCaller`), many requests at
once on one persistent connection.

Addresses: a relay at ``ws://relay:8001`` serves

- ``/peer/{peer_id}``: a peer's connection (``Authorization: Bearer <secret>``);
- ``/rpc/{peer_id}``: the reference's JSON envelope, one text message each way
  (:mod:`meshwire.envelope`). This URL is the peer's ``relay_addr``. With the
  mesh credential at the handshake it reaches everything the peer serves;
  without one, only the peer's public ``GET /health`` (anything else is
  answered 401 ``unauthorized``);
- ``/mux/{peer_id}``: the binary multiplexed form (bearer auth), derived from the
  ``relay_addr`` by :func:`mux_url`.

The relay closes a caller connection that has had nothing in flight and sent
nothing for its idle timeout, with close code :data:`CLOSE_IDLE`. Nothing sent
on such a connection after the relay decided to close it was served, so
:class:`RelayCaller` sends a request that met that close once more, on a new
connection.

The peer link and the mux speak the same binary messages,
``u32 be header_len | header JSON | body`` (:func:`meshwire.envelope.encode_mux`),
whose headers are the models below, told apart by ``kind``:

=============  ===========================  ===============================================
kind           sent by                      meaning
=============  ===========================  ===============================================
``request``    caller -> relay -> peer      an HTTP request; the body is the message body
``response``   peer -> relay -> caller      its answer (``status``, ``headers``, body)
``error``      relay -> caller              the request failed before the peer answered
                                            (``code``: :data:`RelayErrorCode`)
``cancel``     caller -> relay -> peer      the caller stopped waiting for ``id``
``ping/pong``  relay <-> peer               liveness, asked when another connection claims the id
=============  ===========================  ===============================================

``id`` is chosen by whoever sends the ``request`` on that connection and is
echoed in its answer; the relay renumbers requests on the peer link, since
many callers share it. Bodies are never base64'd on this path.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import re
import ssl
from collections.abc import Awaitable, Callable, Mapping
from typing import Annotated, Any, Final, Literal

import orjson
from pydantic import BaseModel, Field, TypeAdapter, ValidationError
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI

from meshwire import limits
from meshwire.auth import bearer_headers
from meshwire.envelope import (
    MUX_PREFIX,
    EnvelopeError,
    HeaderMap,
    HttpMethod,
    decode_mux,
    encode_mux,
    validation_problem,
)
from meshwire.fields import STRICT_MODEL

log = logging.getLogger(__name__)

RelayErrorCode = Literal[
    "unknown_peer",       # no peer holds that id on the relay
    "peer_disconnected",  # the peer went away with the request in flight
    "timeout",            # no answer in time
    "busy",               # the peer already has as many requests in flight as the relay allows
    "too_large",          # a message over the size bound
    "bad_request",        # a malformed message or address
    "unauthorized",       # the relay refused our credential
    "unreachable",        # the relay could not be reached
    "disconnected",       # our connection to the relay dropped with the request in flight
    "bad_answer",         # the peer's answer could not be relayed (e.g. a header over its bound)
]
ERROR_STATUS: Final[Mapping[RelayErrorCode, int]] = {
    "unknown_peer": 502, "peer_disconnected": 502, "timeout": 504, "busy": 503, "too_large": 413,
    "bad_request": 400, "unauthorized": 401, "unreachable": 502, "disconnected": 502, "bad_answer": 502,
}
"""The HTTP status a relay failure is reported with where an HTTP answer is needed (``/rpc``)."""

Handler = Callable[[str, str, dict[str, str], bytes], Awaitable[tuple[int, Mapping[str, str], bytes]]]
"""What a :class:`RelayPeer` serves: ``(method, path, headers, body) -> (status, headers, body)``."""

DEFAULT_TIMEOUT_S: Final = 120.0
DEFAULT_OPEN_TIMEOUT_S: Final = 10.0
DEFAULT_PEER_CONCURRENCY: Final = 80
"""Requests a peer serves at once; the relay bounds what it sends by its own in-flight limits too
(by default 64 for authenticated callers and 4 public health checks: both fit under this)."""
CLOSE_IDLE: Final = 4408
"""Close code of a caller connection the relay closed for idleness (nothing in flight, nothing sent)."""
BACKOFF_INITIAL_S: Final = 0.25
BACKOFF_MAX_S: Final = 10.0
BACKOFF_JITTER: Final = 0.5
"""A reconnect waits a uniform fraction in ``[1 - BACKOFF_JITTER, 1]`` of the exponential delay,
so peers cut off together by a relay restart do not all come back at the same instant."""
MAX_ERROR_MESSAGE_CHARS: Final = 1024
MAX_MUX_ID: Final = (1 << 53) - 1
"""Request ids stay exact in every JSON implementation."""

_ADDRESS = re.compile(r"^(?P<base>(?P<scheme>wss?)://[^/\s]+(?:/[^\s]*?)?)/rpc/(?P<peer>[A-Za-z0-9._:\-]{1,128})$")
_BASE = re.compile(r"^(?P<scheme>wss?|https?)://[^\s/]+(/[^\s]*)?$")

MuxId = Annotated[int, Field(ge=0, le=MAX_MUX_ID)]


# --- the binary protocol ---------------------------------------------------------------------


class MuxRequest(BaseModel):
    """An HTTP request travelling to a peer; ``timeout_s`` is how long the caller will wait."""

    model_config = STRICT_MODEL

    kind: Literal["request"] = "request"
    id: MuxId
    method: HttpMethod
    path: str = Field(min_length=1, max_length=limits.RELAY_MAX_PATH_CHARS, pattern=r"^/[^\s\x00-\x1f\x7f]*$")
    headers: HeaderMap = Field(default_factory=dict)
    timeout_s: float | None = Field(default=None, gt=0, le=3600)


class MuxResponse(BaseModel):
    """A peer's answer to the request with the same ``id``."""

    model_config = STRICT_MODEL

    kind: Literal["response"] = "response"
    id: MuxId
    status: int = Field(ge=100, le=599)
    headers: HeaderMap = Field(default_factory=dict)


class MuxError(BaseModel):
    """The relay's word that request ``id`` failed before the peer answered."""

    model_config = STRICT_MODEL

    kind: Literal["error"] = "error"
    id: MuxId
    code: RelayErrorCode
    message: str = Field(max_length=MAX_ERROR_MESSAGE_CHARS)


class MuxSignal(BaseModel):
    """A bodiless control message: ``cancel`` a request, or ``ping``/``pong`` for liveness."""

    model_config = STRICT_MODEL

    kind: Literal["cancel", "ping", "pong"]
    id: MuxId


MuxMessage = Annotated[MuxRequest | MuxResponse | MuxError | MuxSignal, Field(discriminator="kind")]
_MUX_MESSAGE: TypeAdapter[MuxMessage] = TypeAdapter(MuxMessage)


def read_mux(data: bytes, max_bytes: int = limits.RELAY_MAX_MESSAGE_BYTES) -> tuple[MuxMessage, bytes]:
    """Decode and validate one binary message; :class:`EnvelopeError` when it is not one of ours."""
    header, body = decode_mux(data, max_bytes)
    try:
        message = _MUX_MESSAGE.validate_python(header)
    except ValidationError as exc:
        raise EnvelopeError("bad_header", validation_problem(exc, "mux header")) from None
    if body and not isinstance(message, MuxRequest | MuxResponse):
        raise EnvelopeError("bad_header", f"a {message.kind!r} message carries no body")
    return message, body


def write_mux(message: BaseModel, body: bytes = b"") -> bytes:
    """Encode one binary message (``None`` fields left out)."""
    return encode_mux(message.model_dump(exclude_none=True), body)


def peek_mux_id(data: bytes) -> int | None:
    """The ``id`` of a binary message whatever its size, or ``None``: to answer an oversize one.

    Reads only the length prefix and the header, so peeking costs nothing for a large body.
    """
    if len(data) < MUX_PREFIX.size:
        return None
    (header_len,) = MUX_PREFIX.unpack_from(data)
    end = MUX_PREFIX.size + header_len
    if header_len > limits.RELAY_MAX_HEADER_JSON_BYTES or end > len(data):
        return None
    try:
        header = orjson.loads(data[MUX_PREFIX.size:end])
    except orjson.JSONDecodeError:
        return None
    value = header.get("id") if isinstance(header, dict) else None
    return value if isinstance(value, int) and 0 <= value <= MAX_MUX_ID else None


class RelayError(Exception):
    """A request through the relay failed; ``code`` says why, ``str()`` says it in words."""

    def __init__(self, code: RelayErrorCode, message: str) -> None:
        super().__init__(message)
        self.code: RelayErrorCode = code


# --- addresses -------------------------------------------------------------------------------


def ws_base(relay_url: str) -> str:
    """A relay's base WebSocket URL: ``http(s)://`` becomes ``ws(s)://``, no trailing slash."""
    url = relay_url.strip().rstrip("/")
    match = _BASE.match(url)
    if match is None or len(url) > limits.MAX_URL_CHARS:
        raise ValueError(f"relay URL must be ws(s):// or http(s)://host[:port], got {relay_url[:200]!r}")
    scheme = match.group("scheme")
    if scheme.startswith("http"):
        url = "ws" + url[len("http"):]
    return url


def rpc_address(relay_url: str, peer_id: str) -> str:
    """The ``relay_addr`` of ``peer_id`` on the relay at ``relay_url``: ``ws(s)://relay/rpc/{peer_id}``."""
    return f"{ws_base(relay_url)}/rpc/{peer_id}"


def relay_parts(relay_addr: str) -> tuple[str, str]:
    """``ws(s)://relay/rpc/{peer_id}`` -> ``(ws(s)://relay, peer_id)``; :class:`RelayError` for anything else."""
    match = _ADDRESS.match(relay_addr.strip())
    if match is None or len(relay_addr) > limits.MAX_URL_CHARS:
        raise RelayError("bad_request", f"relay_addr must be ws(s)://relay/rpc/{{peer_id}}, got {relay_addr[:200]!r}")
    return match.group("base"), match.group("peer")


def mux_url(relay_addr: str) -> str:
    """``ws(s)://relay/rpc/{peer_id}`` -> ``ws(s)://relay/mux/{peer_id}``."""
    match = _ADDRESS.match(relay_addr.strip())
    if match is None or len(relay_addr) > limits.MAX_URL_CHARS:
        raise RelayError("bad_request", f"relay_addr must be ws(s)://relay/rpc/{{peer_id}}, got {relay_addr[:200]!r}")
    return f"{match.group('base')}/mux/{match.group('peer')}"


def backoff_delay(attempt: int, initial_s: float = BACKOFF_INITIAL_S, max_s: float = BACKOFF_MAX_S) -> float:
    """Exponential backoff with jitter: attempt 0 waits about ``initial_s``, doubling up to ``max_s``."""
    ceiling = min(max_s, initial_s * (2 ** min(attempt, 32)))
    return ceiling * random.uniform(1.0 - BACKOFF_JITTER, 1.0)


def _refusal(exc: InvalidStatus) -> tuple[int, str]:
    """The status and the message of a refused handshake (the relay answers an OpenAI error body)."""
    status = exc.response.status_code
    message = f"HTTP {status}"
    with contextlib.suppress(orjson.JSONDecodeError, AttributeError, TypeError):
        message = str(orjson.loads(exc.response.body or b"")["error"]["message"])[:MAX_ERROR_MESSAGE_CHARS]
    return status, message


# --- the peer behind NAT ---------------------------------------------------------------------


def _tls_option(url: str, context: ssl.SSLContext | None) -> dict[str, Any]:
    """``connect``'s ``ssl`` argument: ``context`` for a ``wss://`` URL (websockets refuses it for ``ws://``)."""
    return {"ssl": context} if context is not None and url.startswith("wss://") else {}


class RelayPeer:
    """Keeps one outbound connection to a relay and serves the requests that arrive over it.

    ``await peer.run()`` runs until cancelled (or :meth:`close`): it connects,
    serves requests concurrently (at most ``max_concurrency`` at once), and
    when the relay goes away reconnects with exponential backoff and jitter.
    ``connected`` is set while the link is up.
    """

    def __init__(self, relay_url: str, peer_id: str, secret: str, handler: Handler, *,
                 max_concurrency: int = DEFAULT_PEER_CONCURRENCY,
                 max_message_bytes: int = limits.RELAY_MAX_MESSAGE_BYTES,
                 open_timeout_s: float = DEFAULT_OPEN_TIMEOUT_S,
                 backoff_initial_s: float = BACKOFF_INITIAL_S, backoff_max_s: float = BACKOFF_MAX_S,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        if not re.fullmatch(r"[A-Za-z0-9._:\-]{1,128}", peer_id):
            raise ValueError(f"peer id must be 1-128 characters of [A-Za-z0-9._:-], got {peer_id[:200]!r}")
        base = ws_base(relay_url)
        self.peer_id = peer_id
        self.relay_addr = f"{base}/rpc/{peer_id}"
        """What callers use to reach this peer (register it with the tracker as ``relay_addr``)."""
        self.connected = asyncio.Event()
        self._peer_url = f"{base}/peer/{peer_id}"
        self._secret = secret
        self._handler = handler
        self._max_concurrency = max_concurrency
        self._max_message_bytes = max_message_bytes
        self._open_timeout_s = open_timeout_s
        self._backoff = (backoff_initial_s, backoff_max_s)
        self._ssl = ssl_context
        self._closing = False
        self._ws: ClientConnection | None = None

    async def run(self) -> None:
        """Stay connected to the relay and serve, until cancelled or closed."""
        attempt = 0
        while not self._closing:
            try:
                async with connect(self._peer_url, additional_headers=bearer_headers(self._secret),
                                   max_size=self._max_message_bytes, open_timeout=self._open_timeout_s,
                                   compression=None, **_tls_option(self._peer_url, self._ssl)) as ws:
                    self._ws = ws
                    attempt = 0
                    self.connected.set()
                    log.info("relay peer %s connected to %s", self.peer_id, self._peer_url)
                    await self._serve(ws)
                    if not self._closing:
                        log.warning("relay peer %s: the relay closed the link (%s %s)", self.peer_id,
                                    ws.close_code, ws.close_reason)
            except InvalidStatus as exc:
                status, message = _refusal(exc)
                level = logging.ERROR if status in (401, 403) else logging.WARNING
                log.log(level, "relay peer %s refused by %s: %s %s", self.peer_id, self._peer_url, status, message)
            except InvalidURI:
                raise
            except (OSError, TimeoutError, ConnectionClosed, InvalidHandshake) as exc:
                log.warning("relay peer %s: link to %s failed: %s", self.peer_id, self._peer_url,
                            exc or type(exc).__name__)
            except Exception:  # never give up the only way in: log the surprise and reconnect
                log.exception("relay peer %s: unexpected failure on the link to %s", self.peer_id, self._peer_url)
            finally:
                self._ws = None
                self.connected.clear()
            if self._closing:
                break
            delay = backoff_delay(attempt, *self._backoff)
            attempt += 1
            log.info("relay peer %s reconnects in %.2fs", self.peer_id, delay)
            await asyncio.sleep(delay)

    async def close(self) -> None:
        """Stop reconnecting and close the link; :meth:`run` returns."""
        self._closing = True
        if self._ws is not None:
            await self._ws.close()

    async def _serve(self, ws: ClientConnection) -> None:
        tasks: dict[int, asyncio.Task[None]] = {}
        try:
            async for data in ws:
                if isinstance(data, str):
                    log.warning("relay peer %s: ignoring a text message from the relay", self.peer_id)
                    continue
                try:
                    message, body = read_mux(data, self._max_message_bytes)
                except EnvelopeError as exc:
                    log.warning("relay peer %s: ignoring a malformed message: %s", self.peer_id, exc)
                    continue
                if isinstance(message, MuxRequest):
                    if message.id in tasks or len(tasks) >= self._max_concurrency:
                        await ws.send(write_mux(MuxResponse(id=message.id, status=503, headers=_JSON),
                                                _error_json("busy", "peer is serving its limit of requests")))
                        continue
                    task = asyncio.create_task(self._answer(ws, message, body))
                    tasks[message.id] = task
                    task.add_done_callback(lambda _t, rid=message.id: tasks.pop(rid, None))
                elif isinstance(message, MuxSignal) and message.kind == "ping":
                    await ws.send(write_mux(MuxSignal(kind="pong", id=message.id)))
                elif isinstance(message, MuxSignal) and message.kind == "cancel" and message.id in tasks:
                    tasks[message.id].cancel()
        finally:
            for task in list(tasks.values()):
                task.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)

    async def _answer(self, ws: ClientConnection, request: MuxRequest, body: bytes) -> None:
        try:
            status, headers, answer = await self._handler(request.method, request.path, dict(request.headers), body)
            try:
                reply = write_mux(MuxResponse(id=request.id, status=status, headers=dict(headers)), answer)
            except (ValidationError, EnvelopeError) as exc:
                problem = validation_problem(exc, "answer") if isinstance(exc, ValidationError) else str(exc)
                log.warning("relay peer %s: cannot relay the answer to %s %s: %s", self.peer_id, request.method,
                            request.path, problem)
                reply = write_mux(MuxResponse(id=request.id, status=502, headers=_JSON),
                                  _error_json("bad_answer", problem[:MAX_ERROR_MESSAGE_CHARS]))
            if len(reply) > self._max_message_bytes:
                reply = write_mux(MuxResponse(id=request.id, status=500, headers=_JSON),
                                  _error_json("too_large", f"answer of {len(answer)} bytes is over the relay bound"))
        except asyncio.CancelledError:
            raise
        except Exception:  # the handler's bug must not take the link down: answer 500, log it
            log.exception("relay peer %s: handler failed on %s %s", self.peer_id, request.method, request.path)
            reply = write_mux(MuxResponse(id=request.id, status=500, headers=_JSON),
                              _error_json("handler_failed", "the peer failed to serve the request"))
        with contextlib.suppress(ConnectionClosed):
            await ws.send(reply)


_JSON: Final = {"content-type": "application/json"}


def _error_json(code: str, message: str) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": "server_error", "code": code, "param": None}})


# --- the caller ------------------------------------------------------------------------------


class _MuxLink:
    """One open ``/mux/{peer_id}`` connection: request ids, waiters, and the reader that answers them."""

    def __init__(self, ws: ClientConnection, url: str, max_message_bytes: int) -> None:
        self.url = url
        self._ws = ws
        self._max_message_bytes = max_message_bytes
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[tuple[MuxResponse, bytes]]] = {}
        self._reader = asyncio.create_task(self._read(), name=f"relay-mux-reader {url}")

    @property
    def closed(self) -> bool:
        return self._reader.done()

    @property
    def closed_idle(self) -> bool:
        """Whether the relay closed this link for idleness: nothing sent on it since was served."""
        received = self._ws.protocol.close_rcvd  # set as the close frame arrives, before the state is CLOSED
        return received is not None and received.code == CLOSE_IDLE

    async def request(self, method: HttpMethod, path: str, headers: Mapping[str, str], body: bytes,
                      timeout_s: float) -> tuple[int, dict[str, str], bytes]:
        request_id = next(self._ids)
        try:
            message = write_mux(MuxRequest(id=request_id, method=method, path=path, headers=dict(headers),
                                           timeout_s=timeout_s), body)
        except (ValidationError, EnvelopeError) as exc:
            raise RelayError("bad_request", f"cannot relay {method} {path[:200]}: {exc}") from None
        if len(message) > self._max_message_bytes:
            raise RelayError("too_large", f"request of {len(message)} bytes is over the relay bound "
                                          f"of {self._max_message_bytes}")
        if self.closed:
            raise RelayError("disconnected", f"connection to {self.url} is closed")
        waiter: asyncio.Future[tuple[MuxResponse, bytes]] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = waiter
        try:
            await self._ws.send(message)
            async with asyncio.timeout(timeout_s):
                response, answer = await waiter
        except TimeoutError:
            self._cancel_soon(request_id)
            raise RelayError("timeout", f"no answer from {self.url} within {timeout_s:g}s") from None
        except ConnectionClosed as exc:
            raise RelayError("disconnected", f"connection to {self.url} closed: {exc}") from None
        except asyncio.CancelledError:
            self._cancel_soon(request_id)
            raise
        finally:
            self._pending.pop(request_id, None)
        return response.status, {k.lower(): v for k, v in response.headers.items()}, answer

    def _cancel_soon(self, request_id: int) -> None:
        """Tell the relay (and so the peer) that nobody waits for ``request_id`` any more."""
        if not self.closed:
            task = asyncio.create_task(self._ws.send(write_mux(MuxSignal(kind="cancel", id=request_id))))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _read(self) -> None:
        reason = "closed by the relay"
        try:
            async for data in self._ws:
                if isinstance(data, str):
                    continue
                try:
                    message, body = read_mux(data, self._max_message_bytes)
                except EnvelopeError as exc:
                    log.warning("relay caller: ignoring a malformed message from %s: %s", self.url, exc)
                    continue
                waiter = self._pending.get(message.id)
                if waiter is None or waiter.done():
                    continue  # the caller gave up (timeout, cancel): a late answer has no reader
                if isinstance(message, MuxResponse):
                    waiter.set_result((message, body))
                elif isinstance(message, MuxError):
                    waiter.set_exception(RelayError(message.code, message.message))
        except ConnectionClosed as exc:
            reason = f"closed ({exc.rcvd.code if exc.rcvd else 'no close frame'})"
        finally:
            failure = RelayError("disconnected", f"connection to {self.url} {reason} with the request in flight")
            for waiter in self._pending.values():
                if not waiter.done():
                    waiter.set_exception(failure)
                    waiter.exception()  # mark retrieved: a waiter that timed out meanwhile logs nothing

    async def close(self) -> None:
        await self._ws.close()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader


class RelayCaller:
    """Sends requests to peers through relays, over one multiplexed connection per relay and peer.

    Many requests may be in flight at once on a connection. A connection that
    drops fails every waiter at once with :class:`RelayError` (``disconnected``);
    the next request opens a new one. A request already sent is never sent
    twice: whether to retry is the caller's decision.
    """

    def __init__(self, secret: str, *, open_timeout_s: float = DEFAULT_OPEN_TIMEOUT_S,
                 max_message_bytes: int = limits.RELAY_MAX_MESSAGE_BYTES,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        """``ssl_context`` verifies ``wss://`` relays (default: the system's roots)."""
        self._secret = secret
        self._ssl = ssl_context
        self._open_timeout_s = open_timeout_s
        self._max_message_bytes = max_message_bytes
        self._links: dict[str, _MuxLink] = {}
        self._opening: dict[str, asyncio.Lock] = {}

    async def request(self, relay_addr: str, method: HttpMethod, path: str, headers: Mapping[str, str],
                      body: bytes = b"", timeout: float = DEFAULT_TIMEOUT_S, *,
                      handshake: Mapping[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        """Send one request to the peer at ``relay_addr``; its ``(status, headers, body)``.

        ``handshake``: the headers that authenticate a new connection instead of
        the bearer secret (a signed, peer-bound proof, :mod:`meshwire.relay_auth`,
        for a relay a peer chose). Response header names are lower-cased. Raises
        :class:`RelayError` when the relay cannot deliver it (unknown peer,
        timeout, disconnect, size).
        """
        url = mux_url(relay_addr)
        deadline = asyncio.get_running_loop().time() + timeout
        link = await self._link(url, timeout, handshake)
        try:
            return await link.request(method, path, headers, body, timeout)
        except RelayError as exc:
            if exc.code != "disconnected" or not link.closed_idle:
                raise
        # The relay closed the link for idleness as this request went out: it was never served.
        log.debug("relay caller: %s was closed idle; sending %s %s on a new connection", url, method, path[:200])
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            raise RelayError("timeout", f"no answer from {url} within {timeout:g}s")
        link = await self._link(url, left, handshake)
        return await link.request(method, path, headers, body, left)

    async def close(self) -> None:
        """Close every connection; waiters fail with ``disconnected``."""
        links, self._links = list(self._links.values()), {}
        await asyncio.gather(*(link.close() for link in links), return_exceptions=True)

    async def _link(self, url: str, timeout: float, handshake: Mapping[str, str] | None = None) -> _MuxLink:
        link = self._links.get(url)
        if link is not None and not link.closed:
            return link
        lock = self._opening.setdefault(url, asyncio.Lock())
        async with lock:
            link = self._links.get(url)
            if link is not None and not link.closed:
                return link
            self._links[url] = link = await self._open(url, min(timeout, self._open_timeout_s), handshake)
            return link

    async def _open(self, url: str, timeout_s: float, handshake: Mapping[str, str] | None) -> _MuxLink:
        credential = dict(handshake) if handshake is not None else bearer_headers(self._secret)
        try:
            ws = await connect(url, additional_headers=credential, open_timeout=timeout_s,
                               max_size=self._max_message_bytes, compression=None, **_tls_option(url, self._ssl))
        except InvalidStatus as exc:
            status, message = _refusal(exc)
            code: RelayErrorCode = {404: "unknown_peer", 401: "unauthorized", 403: "unauthorized",
                                    503: "busy"}.get(status, "unreachable")
            raise RelayError(code, f"relay refused {url}: {message}") from None
        except (OSError, TimeoutError, InvalidHandshake) as exc:
            raise RelayError("unreachable", f"cannot reach the relay at {url}: {exc or type(exc).__name__}") from None
        return _MuxLink(ws, url, self._max_message_bytes)


__all__: list[str] = [
    "CLOSE_IDLE", "ERROR_STATUS", "Handler", "MuxError", "MuxMessage", "MuxRequest", "MuxResponse", "MuxSignal",
    "RelayCaller", "RelayError", "RelayErrorCode", "RelayPeer", "backoff_delay", "mux_url",
    "peek_mux_id", "read_mux", "relay_parts", "rpc_address", "write_mux", "ws_base",
]
