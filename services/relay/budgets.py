"""The relay's budgets: caller connections by kind and address, and requests in flight per peer.

Why separate budgets: a shared one is a door anyone can lock. With one pool of
caller connections, 4,096 idle anonymous ``/rpc`` sockets left no room for the
mesh's own ``/mux`` links; with one pool of in-flight requests per peer, 64
anonymous requests starved the peer's real ``/forward`` calls. So:

- :class:`CallerSlots` counts caller connections apart by :data:`CallerKind`,
  and anonymous ones by remote IP address too. Authenticated callers have no
  per-address cap: they hold the mesh's secret, and many nodes behind one NAT
  share one address.
- :class:`InflightBudget` bounds one peer's outstanding requests by count and
  by bytes (whole messages, not each one alone); a peer has one per kind.

Everything here is synchronous: a check and the reservation it grants happen
with no ``await`` between them, so concurrent handshakes cannot overshoot a bound.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Final, Literal

CallerKind = Literal["authenticated", "anonymous"]
UNKNOWN_ADDRESS: Final = "unknown"
"""The address counted for a caller whose remote address the server does not report."""


@dataclass(frozen=True)
class Refusal:
    """Why a caller connection was not admitted: the HTTP status, an error code, and words."""

    status: Literal[429, 503]
    code: str
    message: str


class CallerSlot:
    """One admitted caller connection's place in :class:`CallerSlots`; :meth:`release` gives it back once."""

    def __init__(self, slots: CallerSlots, kind: CallerKind, address: str) -> None:
        self.kind: CallerKind = kind
        self.address = address
        self._slots: CallerSlots | None = slots

    def release(self) -> None:
        """Give the place back (again: nothing happens)."""
        if self._slots is not None:
            self._slots.give_back(self.kind, self.address)
            self._slots = None


class CallerSlots:
    """Caller connections open now: authenticated and anonymous apart, anonymous ones by address."""

    def __init__(self, *, max_authenticated: int, max_anonymous: int, max_anonymous_per_address: int) -> None:
        self.max_authenticated = max_authenticated
        self.max_anonymous = max_anonymous
        self.max_anonymous_per_address = max_anonymous_per_address
        self.authenticated = 0
        self.anonymous = 0
        self._by_address: collections.Counter[str] = collections.Counter()

    @property
    def total(self) -> int:
        """Caller connections of both kinds open now."""
        return self.authenticated + self.anonymous

    def from_address(self, address: str) -> int:
        """Anonymous caller connections open now from ``address``."""
        return self._by_address[address]

    def take(self, kind: CallerKind, address: str | None) -> CallerSlot | Refusal:
        """Reserve a place for a new caller of ``kind`` from ``address``, or say why there is none."""
        address = address or UNKNOWN_ADDRESS
        if kind == "authenticated":
            if self.authenticated >= self.max_authenticated:
                return Refusal(503, "relay_full", f"the relay already serves its limit of {self.max_authenticated} "
                                                  "authenticated caller connections")
            self.authenticated += 1
            return CallerSlot(self, kind, address)
        if self._by_address[address] >= self.max_anonymous_per_address:
            return Refusal(429, "too_many_connections",
                           f"{address} already holds its limit of {self.max_anonymous_per_address} caller "
                           "connections without a credential")
        if self.anonymous >= self.max_anonymous:
            return Refusal(503, "relay_full", f"the relay already serves its limit of {self.max_anonymous} "
                                              "caller connections without a credential")
        self.anonymous += 1
        self._by_address[address] += 1
        return CallerSlot(self, kind, address)

    def give_back(self, kind: CallerKind, address: str) -> None:
        """Free a place taken by :meth:`take` (through :meth:`CallerSlot.release`)."""
        if kind == "authenticated":
            self.authenticated -= 1
            return
        self.anonymous -= 1
        self._by_address[address] -= 1
        if self._by_address[address] <= 0:
            del self._by_address[address]


class InflightBudget:
    """Requests outstanding to one peer from one kind of caller, bounded in number and in bytes."""

    def __init__(self, kind: CallerKind, *, max_requests: int, max_bytes: int) -> None:
        self.kind: CallerKind = kind
        self.max_requests = max_requests
        self.max_bytes = max_bytes
        self.requests = 0
        self.bytes = 0

    def take(self, size: int) -> str | None:
        """Reserve room for one request of ``size`` bytes; ``None``, or why there is none now."""
        if self.requests >= self.max_requests:
            return f"already has {self.max_requests} requests from {self.kind} callers in flight"
        if self.bytes + size > self.max_bytes:
            return (f"already has {self.bytes} bytes from {self.kind} callers in flight; {size} more would pass "
                    f"the bound of {self.max_bytes}")
        self.requests += 1
        self.bytes += size
        return None

    def give_back(self, size: int) -> None:
        """Free the room :meth:`take` reserved for a request of ``size`` bytes."""
        self.requests -= 1
        self.bytes -= size
