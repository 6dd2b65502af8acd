"""Where a tracker keeps its registry: in its own memory, or in Redis shared by several trackers.

``MESHNET_STORE`` picks the store (:func:`open_store`):

- ``memory`` (the default): :class:`~.memory.MemoryStore`, the registry lives in this
  process. One tracker, nothing else to run; its loss stops the mesh until it
  is back and the nodes have registered again (one heartbeat).
- ``redis://host:port/db``: :class:`~.redis.RedisStore`. Node records,
  leases (keys with an expiry), failure backoffs and load figures live in
  Redis, so any number of trackers serve one mesh and any of them may die.

Either way the tracker plans routes from a synchronous
:class:`~..registry.Registry` (``store.registry``): the memory store's is the
registry itself, the Redis store's is a view kept current from Redis by
pub/sub. What changes state (register, heartbeat, leave, a failure report) goes
through the store's ``async`` methods, which the store applies where it is
authoritative.

Modules: :mod:`.base` (the :class:`NodeStore` contract, :class:`StoreHealth`, :class:`StoreUnavailable`),
:mod:`.memory`, and :mod:`.redis` with its Lua scripts (:mod:`.redis_scripts`); only a tracker whose
store is Redis imports :mod:`.redis` (and the ``redis`` client).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from ..registry import RegistryPolicy
from .base import NodeStore, StoreHealth, StoreUnavailable
from .memory import MEMORY, MemoryStore

__all__ = ["MEMORY", "REDIS_SCHEMES", "MemoryStore", "NodeStore", "StoreHealth", "StoreUnavailable", "open_store"]

REDIS_SCHEMES: Final = ("redis://", "rediss://", "unix://")


def open_store(url: str, policy: RegistryPolicy, clock: Callable[[], float]) -> NodeStore:
    """The store ``MESHNET_STORE`` names: ``memory``, or a Redis URL."""
    if url == MEMORY:
        return MemoryStore(policy)
    if url.startswith(REDIS_SCHEMES):
        from .redis import RedisStore  # redis is imported only by trackers that use it

        return RedisStore(url, policy, clock)
    raise ValueError(f"store must be 'memory' or a redis:// URL, got {url[:100]!r}")
