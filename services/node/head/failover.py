"""Failover: moving one request to a new route when a hop of its route fails, within bounds.

When a hop fails mid-request (it cannot be reached, resets the connection,
answers a 5xx, does not answer in time, or lost the session), the head

1. reports the node to the tracker (``POST /v1/nodes/{id}/failures``), which
   keeps it out of routes for a backoff that grows on repeats and never leaves
   a layer range without a holder;
2. asks the tracker for a route from this head that avoids every node that
   failed during this request (``GET /v1/route?exclude=``, see
   :meth:`~services.node.hop.routing.TrackerRoutes.route_from_here`);
3. replays the session's history through the new route, which the
   generation loop (:mod:`services.node.head.generation`) does.

A node that is merely busy (503 ``kv_budget``) while the request is recovering
is left out of the next route too, but not reported: it did not fail.

When the tracker has no route but says it is healing the gap (placed nodes are
being moved onto the missing layers, issue 36), the failover asks again every
:data:`HEALING_POLL_S` within its budget instead of giving up at once.

Bounds, so a request never hangs on a broken mesh: at most ``max_failovers``
moves per request, and at most ``budget_s`` seconds spent recovering in total,
counted from each failure until the next token arrives (a replay still running
when the budget runs out is cut off). Past either bound, or when the tracker
has no route, the request ends with :class:`FailoverGaveUp`, which the API
answers with 503 (or an error event in a stream that already began).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Final, Literal

from services.node.hop.routing import NoRoute, RoutedHop, TrackerRoutes
from services.node.model.shard import Shard

logger = logging.getLogger(__name__)

MAX_FAILOVERS: Final = 3
"""Routes one request may move to after its first route broke."""
FAILOVER_BUDGET_S: Final = 60.0
"""Seconds one request may spend recovering, all its failovers together (failure to next token)."""
HEALING_POLL_S: Final = 1.0
"""How often a failover asks again for a route while the tracker says it is moving placed nodes onto the gap."""

GiveUpCode = Literal["no_route", "failover_exhausted", "failover_timeout"]


class FailoverGaveUp(Exception):
    """No route could replace the broken one within the bounds; ``code`` says which bound."""

    def __init__(self, code: GiveUpCode, message: str, failed_node: str) -> None:
        super().__init__(message)
        self.code: GiveUpCode = code
        self.failed_node = failed_node


@dataclass(frozen=True)
class FailoverPolicy:
    """How far one request may go to survive failed hops."""

    max_failovers: int = MAX_FAILOVERS
    budget_s: float = FAILOVER_BUDGET_S

    def __post_init__(self) -> None:
        if self.max_failovers < 0:
            raise ValueError(f"max_failovers must be at least 0, got {self.max_failovers}")
        if self.budget_s <= 0:
            raise ValueError(f"budget_s must be positive, got {self.budget_s}")


class Failover:
    """One request's failovers: the nodes it avoids, the moves and the recovery time it has left."""

    def __init__(self, policy: FailoverPolicy, routes: TrackerRoutes | None, *, model: str,
                 shard: Shard | Callable[[], Shard], clock: Callable[[], float] = time.monotonic) -> None:
        self._policy = policy
        self._routes = routes
        self._model = model
        self._shard = shard if callable(shard) else (lambda: shard)
        """The layers this node holds now (a placed node may move to another range while a request recovers)."""
        self._clock = clock
        self.avoided: set[str] = set()
        """Nodes this request's routes must not use any more."""
        self.moves = 0
        """Routes this request moved to so far."""
        self._spent_s = 0.0
        self._since: float | None = None
        self._last_failed = ""

    @property
    def recovering(self) -> bool:
        """True from a failure until the next token arrives."""
        return self._since is not None

    def remaining_s(self) -> float:
        """Recovery seconds left to this request."""
        current = 0.0 if self._since is None else self._clock() - self._since
        return self._policy.budget_s - self._spent_s - current

    async def reroute(self, node_id: str, reason: str, *, failed: bool, route: str | None = None) -> RoutedHop:
        """A route from this head around ``node_id`` and every node avoided before.

        ``failed`` says whether ``node_id`` failed (it is reported to the
        tracker, naming ``route``, the token of the route it failed on) or was only busy. Raises :class:`FailoverGaveUp` past a bound
        or when the tracker has no such route.
        """
        if self._since is None:
            self._since = self._clock()
        self._last_failed = node_id
        self.avoided.add(node_id)
        if self.moves >= self._policy.max_failovers:
            raise FailoverGaveUp("failover_exhausted", f"node {node_id} failed ({reason}), and this request "
                                 f"already moved to {self.moves} other route(s), its limit", node_id)
        routes = self._routes
        if routes is None or not routes.available:
            raise FailoverGaveUp("no_route", f"node {node_id} failed ({reason}), and this node has no tracker "
                                 "to ask for a route around it", node_id)
        self.moves += 1
        gap: NoRoute | None = None
        try:
            async with asyncio.timeout(max(self.remaining_s(), 0.0)):
                if failed:
                    await routes.report_failure(node_id, reason, route)
                while True:
                    try:
                        return await routes.route_from_here(self._model, self._shard(), self.avoided)
                    except NoRoute as exc:
                        if not exc.healing:
                            raise
                        if gap is None:
                            logger.info("no route avoids %s yet; the tracker is healing the gap, asking again "
                                        "every %.0f s", ", ".join(sorted(self.avoided)), HEALING_POLL_S)
                        gap = exc
                    await asyncio.sleep(HEALING_POLL_S)
        except NoRoute as exc:
            raise FailoverGaveUp("no_route", f"node {node_id} failed ({reason}), and no route avoids "
                                 f"{', '.join(sorted(self.avoided))}: {exc}", node_id) from None
        except TimeoutError:
            if gap is not None:  # the mesh was healing, but not in time: say what was missing
                raise FailoverGaveUp("no_route", f"node {node_id} failed ({reason}), and no route avoiding "
                                     f"{', '.join(sorted(self.avoided))} came within this request's "
                                     f"{self._policy.budget_s:.0f} s failover budget while the mesh healed: "
                                     f"{gap}", node_id) from None
            raise self._timed_out(node_id) from None

    @asynccontextmanager
    async def bounded(self) -> AsyncIterator[None]:
        """Run the block (one step of generation) within the recovery budget while recovering."""
        if self._since is None:
            yield
            return
        try:
            async with asyncio.timeout(max(self.remaining_s(), 0.0)):
                yield
        except TimeoutError:
            raise self._timed_out(self._last_failed) from None

    def recovered(self) -> None:
        """A token arrived: the current recovery (if any) is over and its time is spent."""
        if self._since is not None:
            self._spent_s += self._clock() - self._since
            self._since = None

    def _timed_out(self, node_id: str) -> FailoverGaveUp:
        return FailoverGaveUp("failover_timeout", f"node {node_id} failed, and recovering took longer than "
                              f"this request's {self._policy.budget_s:.0f} s failover budget", node_id)
