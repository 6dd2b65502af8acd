"""What every store of the tracker is: the operations a tracker needs, its health, and its one failure.

:class:`NodeStore` is the contract :mod:`.memory` and :mod:`.redis` both keep (see the package's doc);
:class:`StoreUnavailable` is what any of its operations raises while a shared store is away, which the
tracker answers with 503 ``store_unavailable`` and ``Retry-After`` (one exception handler on the app).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from meshwire.registry import NodeRegistration

from ..failure_reports import Gate
from ..join_tokens import JoinTokenRecord
from ..key_limits import KeyLimiter
from ..ratings import Ratings
from ..registry import Registered, Registry
from ..revocations import Revocations


@dataclass(frozen=True)
class StoreHealth:
    """Whether the store can serve right now, and if not, why (shown by ``/health``)."""

    ok: bool
    reason: str | None = None


class StoreUnavailable(Exception):
    """The store cannot be reached: the tracker answers 503 with ``Retry-After`` rather than guess."""


class NodeStore(Protocol):
    """The operations a tracker needs from its store (see the module doc)."""

    registry: Registry
    """The view routes are planned from (synchronous, ``now`` passed in)."""
    kind: str
    """``memory`` or ``redis``, for logs and ``/health``."""
    revocations: Revocations
    """The revoked node ids as this tracker knows them (a shared store's kept current from it): see
    :mod:`..revocations`."""
    ratings: Ratings
    """Each node's measured speed (this tracker's, or shared by every tracker of the store): :mod:`..ratings`."""

    @property
    def available(self) -> bool:
        """Whether the store was reachable when last tried (for the ``meshnet_tracker_store_up`` gauge)."""

    async def start(self) -> None:
        """Connect and load the current state (the app's lifespan calls it)."""

    async def close(self) -> None:
        """Release connections."""

    async def register(self, registration: NodeRegistration, lease: str | None, now: float) -> Registered:
        """:meth:`Registry.register`, applied where the store is authoritative."""

    async def deregister(self, node_id: str, lease: str | None, now: float) -> None:
        """:meth:`Registry.deregister`, applied where the store is authoritative."""

    async def report_failure(self, node_id: str, reason: str, now: float) -> float:
        """:meth:`Registry.report_failure`; answers the backoff's remaining seconds."""

    async def fresh(self) -> None:
        """Make ``registry`` reflect every change the store has acknowledged; raises :class:`StoreUnavailable`.

        Called before a route is planned, so a node registered through any
        tracker is routable through this one as soon as its registration
        was answered.
        """

    async def health(self) -> StoreHealth:
        """Whether the store answers now."""

    def failure_gate(self, window_s: float) -> Gate:
        """Where failure reports are judged (:mod:`..failure_reports`): this process, or shared (Redis)."""

    def key_limiter(self, requests_per_minute: int, max_streams: int) -> KeyLimiter:
        """Where the API keys' limits are counted: this process (memory), or shared by every tracker (Redis)."""

    async def evict(self, node_id: str, now: float) -> bool:
        """Take ``node_id`` out of every new route now, lease or not (its join token was revoked)."""

    async def revoke_node(self, node_id: str, at: float) -> None:
        """Record that ``node_id``'s join token was revoked at wall time ``at``, for every tracker of the store."""

    async def lift_revocation(self, node_id: str) -> None:
        """``node_id`` joined again with a valid token: it is no longer revoked anywhere."""

    # --- trust: the route-signing key ring and join tokens (see .trust) ---------------------

    async def read_doc(self, name: str) -> str | None:
        """A small document the trackers share (the key ring), or ``None``."""

    async def swap_doc(self, name: str, expected: str | None, new: str) -> bool:
        """Replace document ``name`` with ``new`` if it is still ``expected``; whether it was replaced."""

    async def put_token(self, record: JoinTokenRecord) -> None:
        """Store (or update) a join token's record."""

    async def get_token(self, token_id: str) -> JoinTokenRecord | None:
        """A join token's record, or ``None``."""

    async def all_tokens(self) -> list[JoinTokenRecord]:
        """Every join token's record (at most :data:`~.join_tokens.MAX_TOKENS`)."""
