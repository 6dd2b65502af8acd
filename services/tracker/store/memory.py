"""The tracker's registry in its own memory (``MESHNET_STORE=memory``, the default).

One tracker, nothing else to run: every operation is the registry's own, and nothing can be away. Its loss
stops the mesh until it is back and the nodes have registered again (one heartbeat).
"""

from __future__ import annotations

from typing import Final

from meshwire.registry import NodeRegistration

from ..failure_reports import Gate, LocalGate
from ..join_tokens import MAX_TOKENS, JoinTokenRecord
from ..key_limits import KeyLimiter, MemoryKeyLimiter
from ..ratings import Ratings
from ..registry import Registered, Registry, RegistryPolicy, UnknownNode
from ..revocations import Revocations
from .base import StoreHealth

MEMORY: Final = "memory"
"""``MESHNET_STORE`` for a registry in the tracker's own memory."""


class MemoryStore:
    """The registry in this process: every operation is the registry's own, nothing can be away."""

    kind = MEMORY

    def __init__(self, policy: RegistryPolicy) -> None:
        self.registry = Registry(policy)
        self._docs: dict[str, str] = {}
        self._tokens: dict[str, JoinTokenRecord] = {}
        self.revocations = Revocations()
        self.ratings = Ratings()

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

    def failure_gate(self, window_s: float) -> Gate:
        return LocalGate(window_s)

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

    async def revoke_node(self, node_id: str, at: float) -> None:
        self.revocations.add(node_id, at)

    async def lift_revocation(self, node_id: str) -> None:
        self.revocations.discard(node_id)

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
