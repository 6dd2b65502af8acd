"""The peer table: which connection holds which peer id, and the requests waiting on each.

One live connection per id. A second connection claiming a held id is
refused while the holder still answers a ping (a peer cannot take over
another's id); a holder that does not answer within the probe time is a dead
link the relay had not noticed yet, and the newcomer replaces it.

A :class:`PeerLink` numbers the requests it sends its peer, bounds what is in
flight, and matches answers to waiters. The bound is an
:class:`~services.relay.budgets.InflightBudget` per kind of caller (count and
bytes), so anonymous health checks never take room from the mesh's own
requests. When the peer goes away every waiter fails at once with
``peer_disconnected``: callers get an error, never a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Mapping
from typing import Final, Literal, Protocol

from pydantic import ValidationError

from meshwire.envelope import EnvelopeError, HttpMethod
from meshwire.relay_client import (
    MuxError,
    MuxMessage,
    MuxRequest,
    MuxResponse,
    MuxSignal,
    RelayErrorCode,
    write_mux,
)
from services.relay.budgets import CallerKind, InflightBudget

log = logging.getLogger(__name__)

CLOSE_REPLACED: Final = 4409
"""Close code sent to a holder that stopped answering and was replaced by a newcomer."""


class TransportClosed(Exception):
    """The connection to a peer is gone; sending on it failed."""


class PeerTransport(Protocol):
    """What a :class:`PeerLink` needs of its connection (the app wraps a WebSocket)."""

    async def send(self, data: bytes) -> None:
        """Send one binary message; raise :class:`TransportClosed` when the connection is gone."""

    async def close(self, code: int, reason: str) -> None:
        """Close the connection (no error when it is already closed)."""


class RelayFailure(Exception):
    """A relayed request failed before the peer answered it; ``code`` says why."""

    def __init__(self, code: RelayErrorCode, message: str) -> None:
        super().__init__(message)
        self.code: RelayErrorCode = code


class ClaimRefused(Exception):
    """A peer connection may not hold the id it asked for; ``status`` is the HTTP answer."""

    def __init__(self, status: Literal[409, 503], code: str, message: str) -> None:
        super().__init__(message)
        self.status: Literal[409, 503] = status
        self.code = code


class PeerLink:
    """One connected peer: sends it requests and matches its answers to the waiters."""

    def __init__(self, peer_id: str, transport: PeerTransport, *, budgets: Mapping[CallerKind, InflightBudget],
                 max_message_bytes: int) -> None:
        self.peer_id = peer_id
        self.budgets = budgets
        """What each kind of caller may have in flight to this peer."""
        self._transport = transport
        self._max_message_bytes = max_message_bytes
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[tuple[MuxResponse, bytes]]] = {}
        self._pings: dict[int, asyncio.Future[None]] = {}
        self._closed: tuple[RelayErrorCode, str] | None = None

    @property
    def inflight(self) -> int:
        """Requests sent to the peer and not yet answered."""
        return len(self._pending)

    @property
    def closed(self) -> bool:
        return self._closed is not None

    async def request(self, method: HttpMethod, path: str, headers: Mapping[str, str], body: bytes,
                      timeout_s: float, kind: CallerKind = "authenticated") -> tuple[MuxResponse, bytes]:
        """Send one request to the peer and wait for its answer, at most ``timeout_s``.

        The request counts against the :attr:`budgets` of ``kind`` (its whole
        message's bytes) until it is answered or given up; over the budget it
        is refused ``busy`` at once, never queued.
        """
        if self._closed is not None:
            raise RelayFailure(*self._closed)
        request_id = next(self._ids)
        try:
            message = write_mux(MuxRequest(id=request_id, method=method, path=path, headers=dict(headers),
                                           timeout_s=timeout_s), body)
        except (EnvelopeError, ValidationError) as exc:
            raise RelayFailure("bad_request", str(exc)) from None
        if len(message) > self._max_message_bytes:
            raise RelayFailure("too_large", f"request of {len(message)} bytes is over the relay's bound "
                                            f"of {self._max_message_bytes}")
        budget = self.budgets[kind]
        if (full := budget.take(len(message))) is not None:
            raise RelayFailure("busy", f"peer {self.peer_id!r} {full} (the relay's limit); retry later")
        try:
            return await self._exchange(request_id, message, timeout_s)
        finally:
            budget.give_back(len(message))

    async def _exchange(self, request_id: int, message: bytes, timeout_s: float) -> tuple[MuxResponse, bytes]:
        """Send ``message`` and wait for the answer to ``request_id``."""
        waiter: asyncio.Future[tuple[MuxResponse, bytes]] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = waiter
        try:
            await self._transport.send(message)
            async with asyncio.timeout(timeout_s):
                return await waiter
        except TransportClosed:
            raise RelayFailure("peer_disconnected", f"peer {self.peer_id!r} disconnected") from None
        except TimeoutError:
            self._cancel_soon(request_id)
            raise RelayFailure("timeout", f"peer {self.peer_id!r} did not answer within {timeout_s:g}s") from None
        except asyncio.CancelledError:
            self._cancel_soon(request_id)
            raise
        finally:
            self._pending.pop(request_id, None)

    def deliver(self, message: MuxMessage, body: bytes) -> None:
        """Hand a message from the peer to whoever waits for it; late or unknown answers are dropped."""
        if isinstance(message, MuxSignal) and message.kind == "pong":
            if (ping := self._pings.get(message.id)) is not None and not ping.done():
                ping.set_result(None)
            return
        if not isinstance(message, MuxResponse | MuxError):
            log.warning("peer %s sent a %r message; ignored", self.peer_id, message.kind)
            return
        waiter = self._pending.get(message.id)
        if waiter is None or waiter.done():
            log.debug("peer %s answered request %d that nobody waits for", self.peer_id, message.id)
            return
        if isinstance(message, MuxResponse):
            waiter.set_result((message, body))
        else:
            waiter.set_exception(RelayFailure(message.code, message.message))

    def fail(self, request_id: int, code: RelayErrorCode, message: str) -> None:
        """Fail one waiting request (the peer's answer to it could not be accepted)."""
        waiter = self._pending.get(request_id)
        if waiter is not None and not waiter.done():
            waiter.set_exception(RelayFailure(code, message))

    def fail_all(self, code: RelayErrorCode, message: str) -> None:
        """The link is over: fail every waiter now, and every later request at once."""
        self._closed = (code, message)
        for waiter in self._pending.values():
            if not waiter.done():
                waiter.set_exception(RelayFailure(code, message))
        for ping in self._pings.values():
            if not ping.done():
                ping.set_exception(TransportClosed(message))

    async def probe(self, timeout_s: float) -> bool:
        """Whether the peer answers a ping within ``timeout_s``."""
        if self._closed is not None:
            return False
        ping_id = next(self._ids)
        pong: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pings[ping_id] = pong
        try:
            await self._transport.send(write_mux(MuxSignal(kind="ping", id=ping_id)))
            async with asyncio.timeout(timeout_s):
                await pong
            return True
        except (TransportClosed, TimeoutError):
            return False
        finally:
            self._pings.pop(ping_id, None)

    async def close(self, code: int, reason: str) -> None:
        """Close the connection to the peer."""
        with contextlib.suppress(TransportClosed):
            await self._transport.close(code, reason)

    def _cancel_soon(self, request_id: int) -> None:
        """Tell the peer nobody waits for ``request_id`` any more (best effort, in the background)."""
        if self._closed is None:
            task = asyncio.create_task(self._transport.send(write_mux(MuxSignal(kind="cancel", id=request_id))))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())


class PeerTable:
    """Which :class:`PeerLink` holds each peer id; at most ``max_peers`` of them."""

    def __init__(self, *, max_peers: int, probe_timeout_s: float) -> None:
        self.max_peers = max_peers
        self.probe_timeout_s = probe_timeout_s
        self._links: dict[str, PeerLink] = {}
        self._claiming: set[str] = set()

    def __len__(self) -> int:
        return len(self._links)

    def get(self, peer_id: str) -> PeerLink | None:
        """The live link holding ``peer_id``, or ``None``."""
        return self._links.get(peer_id)

    async def claim(self, peer_id: str) -> None:
        """Reserve ``peer_id`` for a new connection; :meth:`activate` or :meth:`abandon` it next.

        Raises :class:`ClaimRefused` (409) while a live holder answers its
        ping or another connection is claiming the id, (503) when the table is full.
        """
        if peer_id in self._claiming:
            raise ClaimRefused(409, "peer_id_taken", f"peer id {peer_id!r} is being claimed by another connection")
        holder = self._links.get(peer_id)
        if holder is None and len(self._links) + len(self._claiming) >= self.max_peers:
            raise ClaimRefused(503, "relay_full", f"the relay already serves its limit of {self.max_peers} peers")
        self._claiming.add(peer_id)
        if holder is None:
            return
        try:
            alive = await holder.probe(self.probe_timeout_s)
        except BaseException:
            self._claiming.discard(peer_id)
            raise
        if alive:
            self._claiming.discard(peer_id)
            raise ClaimRefused(409, "peer_id_taken", f"peer id {peer_id!r} is held by a live connection; "
                                                      "a second connection cannot take it over")
        log.warning("peer %s stopped answering; its id goes to the new connection", peer_id)
        self.release(holder, "peer_disconnected", f"peer {peer_id!r} stopped answering and was replaced")
        await holder.close(CLOSE_REPLACED, "replaced by a new connection for this peer id")

    def activate(self, link: PeerLink) -> None:
        """Make ``link`` the holder of the id it claimed."""
        self._claiming.discard(link.peer_id)
        self._links[link.peer_id] = link

    def abandon(self, peer_id: str) -> None:
        """Give up a claim whose connection never opened."""
        self._claiming.discard(peer_id)

    def release(self, link: PeerLink, code: RelayErrorCode, message: str) -> None:
        """``link`` is over: forget it (when it still holds its id) and fail its waiters."""
        if self._links.get(link.peer_id) is link:
            del self._links[link.peer_id]
        link.fail_all(code, message)
