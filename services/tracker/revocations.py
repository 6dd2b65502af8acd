"""Which nodes had their join token revoked: what every tracker cuts streams on and every node is told.

``meshnet token revoke`` takes a node out of every new route at once (the
store evicts it). What was already running through it is cut from the
revocations kept here (issue 34, finding 11):

- every tracker of the store moves the streams it relays through a revoked node
  to a route without it at their next token (:mod:`.forwarding`): the Redis
  store publishes a revocation on its own channel, so a stream relayed by
  another tracker than the one that revoked moves as soon as the message
  arrives (and a tracker that reconnects reads them all);
- every node learns the revoked ids in its next heartbeat answer
  (``RegistrationAnswer.revoked_nodes``) and from then on refuses a route, a
  frame or a relayed call whose route names one of them.

A revocation is kept :data:`KEEP_S` (a day: far past any stream's end), at
most :data:`MAX_REVOKED` (the oldest dropped first), and is lifted when the
node joins again with a valid token. :class:`Revocations` is the pure, bounded
book both stores keep (the Redis store as its view of the shared hash).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from meshwire.registry import MAX_REVOKED_NOTICE

KEEP_S: Final = 86400.0
"""How long a revocation is remembered (wall-clock seconds): longer than any stream runs."""
MAX_REVOKED: Final = 4096
"""Most revoked node ids kept (as many as the mesh keeps join tokens); the oldest forgotten first."""


class Revocations:
    """Revoked node ids and when (wall clock); bounded by :data:`MAX_REVOKED` and :data:`KEEP_S`."""

    def __init__(self) -> None:
        self._at: dict[str, float] = {}

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._at

    def __len__(self) -> int:
        return len(self._at)

    def among(self, node_ids: Iterable[str]) -> set[str]:
        """Those of ``node_ids`` that are revoked."""
        return {node_id for node_id in node_ids if node_id in self._at}

    def add(self, node_id: str, at: float) -> None:
        self._at.pop(node_id, None)
        self._at[node_id] = at
        self.prune(at)

    def discard(self, node_id: str) -> None:
        self._at.pop(node_id, None)

    def replace(self, entries: dict[str, float], now: float) -> None:
        """Make the book what a full read of the store found."""
        self._at = dict(sorted(entries.items(), key=lambda item: item[1]))
        self.prune(now)

    def prune(self, now: float) -> list[str]:
        """Forget revocations older than :data:`KEEP_S` and past :data:`MAX_REVOKED`; answers the ids dropped."""
        dropped = [node_id for node_id, at in self._at.items() if now - at > KEEP_S]
        for node_id in dropped:
            del self._at[node_id]
        while len(self._at) > MAX_REVOKED:
            oldest = min(self._at, key=self._at.__getitem__)
            del self._at[oldest]
            dropped.append(oldest)
        return dropped

    def notice(self) -> tuple[str, ...]:
        """The ids a heartbeat answer tells a node: the newest :data:`~meshwire.registry.MAX_REVOKED_NOTICE`."""
        newest = sorted(self._at, key=self._at.__getitem__, reverse=True)[:MAX_REVOKED_NOTICE]
        return tuple(sorted(newest))
