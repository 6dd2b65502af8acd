"""Where a tracker keeps its registry: in its own memory, or in Redis shared by several trackers.

``MESHNET_STORE`` picks the store (:func:`open_store`):

- ``memory`` (the default): :class:`MemoryStore`, the registry lives in this
  process. One tracker, nothing else to run; its loss stops the mesh until it
  is back and the nodes have registered again (one heartbeat).
- ``redis://host:port/db``: :class:`~.store_redis.RedisStore`. Node records,
  leases (keys with an expiry), failure backoffs and load figures live in
  Redis, so any number of trackers serve one mesh and any of them may die.

Either way the tracker plans routes from a synchronous
:class:`~.registry.Registry` (``store.registry``): the memory store's is the
registry itself, the Redis store's is a view kept current from Redis by
pub/sub. What changes state (register, heartbeat, leave, a failure report) goes
through the store's ``async`` methods, which the store applies where it is
authoritative.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Protocol

from meshwire.registry import NodeRegistration

from .join_tokens import MAX_TOKENS, JoinTokenRecord
from .key_limits import KeyLimiter, MemoryKeyLimiter
from .registry import Registered, Registry, RegistryPolicy, UnknownNode

MEMORY: Final = "memory"
"""``MESHNET_STORE`` for a registry in the tracker's own memory."""
REDIS_SCHEMES: Final = ("redis://", "rediss://", "unix://")


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

    def key_limiter(self, requests_per_minute: int, max_streams: int) -> KeyLimiter:
        """Where the API keys' limits are counted: this process (memory), or shared by every tracker (Redis)."""

    async def evict(self, node_id: str, now: float) -> bool:
        """Take ``node_id`` out of every new route now, lease or not (its join token was revoked)."""

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


class MemoryStore:
    """The registry in this process: every operation is the registry's own, nothing can be away."""

    kind = MEMORY

    def __init__(self, policy: RegistryPolicy) -> None:
        self.registry = Registry(policy)
        self._docs: dict[str, str] = {}
        self._tokens: dict[str, JoinTokenRecord] = {}

    @property
    def available(self) -> bool:
        return True

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def register(self, registration: NodeRegistration, lease: str | None, now: float) -> Registered:
        return self.registry.register(registration, lease, now)

    async def deregister(self, node_id: str, lease: str | None, now: float) -> None:
        self.registry.deregister(node_id, lease, now)

    async def report_failure(self, node_id: str, reason: str, now: float) -> float:
        return self.registry.report_failure(node_id, reason, now)

    async def fresh(self) -> None:
        return None

    async def health(self) -> StoreHealth:
        return StoreHealth(ok=True)

    def key_limiter(self, requests_per_minute: int, max_streams: int) -> KeyLimiter:
        return MemoryKeyLimiter(requests_per_minute, max_streams)

    async def evict(self, node_id: str, now: float) -> bool:
        lease = self.registry.lease_of(node_id)
        if lease is None:
            return False
        try:
            self.registry.deregister(node_id, lease, now)
        except UnknownNode:
            return False
        return True

    async def read_doc(self, name: str) -> str | None:
        return self._docs.get(name)

    async def swap_doc(self, name: str, expected: str | None, new: str) -> bool:
        if self._docs.get(name) != expected:
            return False
        self._docs[name] = new
        return True

    async def put_token(self, record: JoinTokenRecord) -> None:
        if record.token_id not in self._tokens and len(self._tokens) >= MAX_TOKENS:
            raise ValueError(f"the mesh already keeps {MAX_TOKENS} join tokens; revoke and prune some")
        self._tokens[record.token_id] = record

    async def get_token(self, token_id: str) -> JoinTokenRecord | None:
        return self._tokens.get(token_id)

    async def all_tokens(self) -> list[JoinTokenRecord]:
        return list(self._tokens.values())


def open_store(url: str, policy: RegistryPolicy, clock: Callable[[], float]) -> NodeStore:
    """The store ``MESHNET_STORE`` names: ``memory``, or a Redis URL."""
    if url == MEMORY:
        return MemoryStore(policy)
    if url.startswith(REDIS_SCHEMES):
        from .store_redis import RedisStore  # redis is imported only by trackers that use it

        return RedisStore(url, policy, clock)
    raise ValueError(f"store must be 'memory' or a redis:// URL, got {url[:100]!r}")
