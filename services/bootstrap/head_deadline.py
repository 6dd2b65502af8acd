"""uvicorn's h11 protocol with a deadline on the request head.

uvicorn closes a connection that stays idle between requests
(``timeout_keep_alive``), but once a single byte of a request has arrived it
waits for the rest of the head forever: a client that sends its headers one
byte at a time holds a connection (and, with many, the service) for as long
as it likes. This protocol gives a connection :attr:`head_timeout_s` to
deliver each request head, counted from the moment it starts waiting for one
(connection made, or previous response sent); a connection that misses it is
closed. The body that follows has its own deadline, in the app
(:mod:`services.bootstrap.body_guard`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import ClassVar

from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)


class HeadDeadlineProtocol(H11Protocol):
    """An :class:`H11Protocol` that closes a connection slow to send a request head."""

    head_timeout_s: ClassVar[float] = 10.0
    """Seconds a connection has to deliver a request head; set by :func:`with_head_deadline`."""

    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[arg-type]
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and not self.cycle.response_complete:
            self._disarm_head_timer()  # a request head arrived: the app's deadlines take over

    def on_response_complete(self) -> None:
        self._arm_head_timer()  # before super(): it may start a pipelined request at once
        super().on_response_complete()

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_deadline_passed)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_deadline_passed(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return
        logger.warning("closed a connection that sent no complete request head within %g s",
                       self.head_timeout_s)
        self.transport.close()


def with_head_deadline(timeout_s: float) -> type[HeadDeadlineProtocol]:
    """A :class:`HeadDeadlineProtocol` class whose connections get ``timeout_s`` per request head."""
    return type("HeadDeadlineProtocol", (HeadDeadlineProtocol,), {"head_timeout_s": timeout_s})
