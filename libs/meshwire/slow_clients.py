"""uvicorn's HTTP protocol with a deadline on each request head and a bound on connections per address.

uvicorn closes a connection that stays idle between requests
(``timeout_keep_alive``), but once one byte of a request has arrived it waits
for the rest of the head for ever: a client that sends its headers a byte at
a time, or never finishes them, holds a connection (and, with many, the
service) for as long as it likes. The protocol :func:`guarded_http` builds
closes such a connection:

* **head deadline**: a connection has ``head_timeout_s`` to deliver each
  request head, counted from the moment it starts waiting for one (connection
  made, or previous response sent). The body that follows has its own
  deadline, in the app (:mod:`meshwire.body_guard`).
* **head size**: at most :data:`MAX_HEAD_BYTES` arrive while a head is
  awaited; past that the connection is answered ``431`` and closed.
* **connections per address**: at most ``max_per_address`` connections from
  one remote IP address are served at once; one more is answered ``503`` with
  ``Retry-After`` and closed before it is read, so one client cannot take
  every connection the service has while another is served.

It works over uvicorn's httptools or h11 parser (whichever uvicorn's
``auto`` picks), so the speed of the parser does not change. A connection
upgraded to a WebSocket leaves both guards: the WebSocket service has its
own bounds (the relay's per-address caller limits). A TLS handshake happens
before the protocol sees the connection; asyncio bounds it
(``ssl_handshake_timeout``, 60 s).

uvicorn's command line takes no protocol options, so a service gets the
guards when it runs through ``meshnet <service>`` (its ``serve``), not under
a bare ``uvicorn services.<service>.app:app`` (which still has the body
deadline and the service's own caps).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any, ClassVar, Final

import orjson

from meshwire import errors

logger = logging.getLogger(__name__)

HEAD_TIMEOUT_S: Final = 10.0
"""Default seconds a connection has to deliver a request head."""
BODY_TIMEOUT_S: Final = 60.0
"""Default seconds a request has to deliver its body once the app starts reading it."""
MAX_CONNECTIONS_PER_ADDRESS: Final = 512
"""Default connections served at once from one remote address (the tracker alone may hold 256 to a node)."""
CROWDED_RETRY_AFTER_S: Final = 1
MAX_HEAD_BYTES: Final = 64 << 10
"""Most bytes a connection may send while a request head is awaited (httptools sets no bound of its own)."""


def _crowded_answer(host: str, limit: int) -> bytes:
    """A complete HTTP/1.1 503 (OpenAI error shape) for a connection over its address's bound."""
    body = orjson.dumps(errors.error_body(
        f"too many connections from {host} (at most {limit} at once); close some and retry",
        errors.UNAVAILABLE, "too_many_connections"))
    head = (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nretry-after: {CROWDED_RETRY_AFTER_S}\r\nconnection: close\r\n\r\n")
    return head.encode("ascii") + body


_HEAD_TOO_LARGE: Final = (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\n"
                          b"connection: close\r\n\r\n")


class _Guards:
    """The mixin :func:`guarded_http` puts in front of one of uvicorn's HTTP protocols."""

    head_timeout_s: ClassVar[float] = HEAD_TIMEOUT_S
    max_per_address: ClassVar[int] = MAX_CONNECTIONS_PER_ADDRESS
    open_per_address: ClassVar[Counter[str]]
    """Connections served now, by remote address: one counter per server (per built class)."""

    # uvicorn's protocol attributes this mixin reads (set by the protocol's connection_made).
    transport: Any
    client: tuple[str, int] | None
    cycle: Any
    loop: asyncio.AbstractEventLoop

    _head_timer: asyncio.TimerHandle | None = None
    _counted: str | None = None
    """The address this connection is counted under, while it is."""
    _refused = False
    _head_bytes = 0
    """Bytes received since the connection began waiting for a request head."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        host = self.client[0] if self.client else None
        if host is not None:
            if self.open_per_address[host] >= self.max_per_address:
                logger.warning("refused a connection from %s: %d already open (limit %d)",
                               host, self.open_per_address[host], self.max_per_address)
                self._refused = True
                self.transport.write(_crowded_answer(host, self.max_per_address))
                self.transport.close()
                return
            self.open_per_address[host] += 1
            self._counted = host
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._leave_guards()
        super().connection_lost(exc)  # type: ignore[misc]

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # answered 503 already: nothing it sends is read
        super().data_received(data)  # type: ignore[misc]
        if self.cycle is not None and not self.cycle.response_complete:
            self._disarm_head_timer()  # a request head arrived: the app's deadlines take over
            self._head_bytes = 0
            return
        if self.cycle is not None and self.cycle.more_body:
            return  # the rest of the body of a request already answered, not a head
        self._head_bytes += len(data)
        if self._head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
            logger.warning("closed a connection from %s that sent %d bytes without completing a request head",
                           self.client[0] if self.client else "?", self._head_bytes)
            self.transport.write(_HEAD_TOO_LARGE)
            self.transport.close()

    def handle_websocket_upgrade(self, *args: Any) -> None:
        super().handle_websocket_upgrade(*args)  # type: ignore[misc]
        self._leave_guards()  # the WebSocket protocol owns the connection now

    def on_response_complete(self) -> None:
        self._head_bytes = 0
        if self._counted is not None:
            self._arm_head_timer()  # before super(): it may start a pipelined request at once
        super().on_response_complete()  # type: ignore[misc]

    def _leave_guards(self) -> None:
        self._disarm_head_timer()
        if self._counted is not None:
            self.open_per_address[self._counted] -= 1
            if self.open_per_address[self._counted] <= 0:
                del self.open_per_address[self._counted]
            self._counted = None

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_deadline_passed)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_deadline_passed(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
            return
        logger.warning("closed a connection from %s that sent no complete request head within %g s",
                       self.client[0] if self.client else "?", self.head_timeout_s)
        self.transport.close()


def _base_protocol() -> type[asyncio.Protocol]:
    """uvicorn's ``auto`` choice: httptools where it is installed, else h11."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    return AutoHTTPProtocol


def guarded_http(head_timeout_s: float = HEAD_TIMEOUT_S,
                 max_per_address: int = MAX_CONNECTIONS_PER_ADDRESS,
                 base: type[asyncio.Protocol] | None = None) -> type[asyncio.Protocol]:
    """An HTTP protocol class for ``uvicorn.Config(http=...)`` with both guards (see the module doc).

    Each call builds a class with its own per-address counter: build one per server.
    """
    if head_timeout_s <= 0 or max_per_address < 1:
        raise ValueError("head_timeout_s must be positive and max_per_address at least 1")
    parent = base if base is not None else _base_protocol()
    return type(f"Guarded{parent.__name__}", (_Guards, parent), {
        "head_timeout_s": head_timeout_s,
        "max_per_address": max_per_address,
        "open_per_address": Counter(),
    })
