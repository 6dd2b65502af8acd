"""A node's membership in the mesh: register with the tracker, heartbeat, leave.

``POST {tracker}/v1/nodes`` carries the same :class:`~meshwire.registry.NodeRegistration`
body every time (identity, shard, live load figures: free KV tokens, open
sessions, measured decode tokens/s). The first answer gives a lease, which
every heartbeat carries in ``X-Meshnet-Lease`` so nobody else can take this
node's id; the tracker's ``heartbeat_s`` sets the pace, and a new lease in an
answer (a restarted tracker registered the node afresh) replaces the old.
A node may know several trackers (``--tracker URL1,URL2``): it heartbeats to
the one it last reached and, when that one does not answer (no connection, a
timeout, or a 5xx such as a tracker whose store is away), tries the others in
order within the same heartbeat, so it moves to a live tracker within one
heartbeat interval. Trackers that share a store (Redis) honour the lease it
already holds; a tracker with a store of its own registers it afresh. Either
way the node's sessions are untouched: they live on the node, not in the
tracker. When every tracker is down the node retries with a bounded backoff; one that no longer
honours the lease (404, or 409: the id went to another node meanwhile) gets
a fresh registration, and one that refuses the id because it is still live
under an earlier run's lease is retried until that entry expires. On
shutdown the node leaves with ``DELETE /v1/nodes/{id}``, carrying its lease, at
the tracker it last reached (or the next that answers).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Final

import httpx
from pydantic import ValidationError

from meshwire import headers as h
from meshwire.auth import bearer_headers
from meshwire.registry import NodeRegistration, RegistrationAnswer

logger = logging.getLogger(__name__)

NODES_PATH: Final = "/v1/nodes"
TRACKER_TIMEOUT_S: Final = 10.0
RETRY_MIN_S: Final = 0.5
"""First wait after a failed registration; doubles up to the heartbeat interval."""
MIN_HEARTBEAT_S: Final = 0.2
"""Never heartbeat faster than this, whatever a tracker answers."""
MIN_TRY_TIMEOUT_S: Final = 5.0
"""With several trackers, the shortest wait for one before trying the next (see :meth:`Registrar.beat`)."""


class _TrackerDown(Exception):
    """This tracker did not answer usefully (no connection, a timeout, a 5xx): try the next one."""


class Registrar:
    """Keeps this node registered with the first of its trackers that answers, until :meth:`deregister`."""

    def __init__(self, http: httpx.AsyncClient, tracker: str | Sequence[str], credential: str,
                 registration: Callable[[], NodeRegistration], heartbeat_s: float, *,
                 on_new_lease: Callable[[], Awaitable[object]] | None = None,
                 on_answer: Callable[[RegistrationAnswer], None] | None = None) -> None:
        self._http = http
        self._trackers: tuple[str, ...] = (tracker,) if isinstance(tracker, str) else tuple(tracker)
        if not self._trackers:
            raise ValueError("a registrar needs at least one tracker URL")
        self._current = 0
        self._credential = credential
        self._on_new_lease = on_new_lease
        self._registration = registration
        self._heartbeat_s = heartbeat_s
        self._on_answer = on_answer
        self._lease: str | None = None
        self.registered = asyncio.Event()
        """Set once the tracker has accepted this node."""

    async def run(self) -> None:
        """Register, then heartbeat forever (cancel the task to stop)."""
        delay = RETRY_MIN_S
        while True:
            if await self.beat():
                delay = self._heartbeat_s
            else:
                delay = min(max(delay * 2, RETRY_MIN_S), self._heartbeat_s)
            await asyncio.sleep(delay)

    @property
    def tracker(self) -> str:
        """The tracker this node heartbeats to now (the one it last reached)."""
        return self._trackers[self._current]

    def _try_timeout(self) -> float:
        """One tracker's time to answer: the full timeout when it is the only one, else about a heartbeat."""
        if len(self._trackers) == 1:
            return TRACKER_TIMEOUT_S
        return min(TRACKER_TIMEOUT_S, max(self._heartbeat_s, MIN_TRY_TIMEOUT_S))

    async def beat(self) -> bool:
        """One registration or heartbeat; ``True`` when a tracker accepted it.

        Tries the current tracker, then each other one in order, within this one beat.
        """
        count = len(self._trackers)
        for step in range(count):
            index = (self._current + step) % count
            try:
                accepted = await self._beat_at(self._trackers[index])
            except _TrackerDown as exc:
                logger.warning("tracker %s: %s%s", self._trackers[index], exc,
                               "; trying the next tracker" if step + 1 < count else "")
                continue
            if index != self._current:
                logger.info("heartbeats move from tracker %s to %s", self._trackers[self._current],
                            self._trackers[index])
                self._current = index
            return accepted
        return False

    async def _beat_at(self, tracker: str) -> bool:
        body = self._registration()
        headers = bearer_headers(self._credential)
        if self._lease is not None:
            headers[h.LEASE] = self._lease
        try:
            response = await self._http.post(f"{tracker}{NODES_PATH}", content=body.model_dump_json(),
                                              headers={**headers, "Content-Type": "application/json"},
                                              timeout=self._try_timeout())
        except httpx.HTTPError as exc:
            raise _TrackerDown(f"unreachable ({type(exc).__name__}: {exc})") from None
        if response.status_code >= 500:
            raise _TrackerDown(f"HTTP {response.status_code}: {response.text[:300]}")
        if response.status_code in (404, 409) and self._lease is not None:
            logger.warning("tracker forgot this node (HTTP %d); registering again", response.status_code)
            self._lease = None
            return False
        if response.status_code == 409:
            logger.warning("tracker holds node id %s under another lease (an earlier run of this node, or "
                           "another node): retrying until that entry expires: %s", body.node_id,
                           response.text[:300])
            return False
        if response.status_code in (401, 403):
            logger.error("tracker refused %s's credential (HTTP %d): %s; check MESHNET_JOIN_TOKEN / MESHNET_SECRET",
                         body.node_id, response.status_code, response.text[:300])
            return False
        if response.status_code >= 300:
            logger.warning("tracker refused registration of %s: HTTP %d %s", body.node_id, response.status_code,
                           response.text[:300])
            return False
        before = self._lease
        self._take_answer(response)
        if self._lease != before and self._on_new_lease is not None:
            try:  # e.g. fetch the tracker's route keys: a tracker that registered us afresh may hold new ones
                await self._on_new_lease()
            except Exception:
                logger.exception("after registering with %s", tracker)
        if not self.registered.is_set():
            logger.info("registered %s (layers %d-%d of %s) with %s", body.node_id, body.shard_start,
                        body.shard_end, body.model, tracker)
            self.registered.set()
        return True

    def _take_answer(self, response: httpx.Response) -> None:
        try:
            answer = RegistrationAnswer.model_validate_json(response.content)
        except ValidationError:
            return  # a heartbeat answer need not repeat the lease
        self._lease = answer.lease
        self._heartbeat_s = max(MIN_HEARTBEAT_S, min(self._heartbeat_s, answer.heartbeat_s))
        if self._on_answer is not None:
            self._on_answer(answer)

    @property
    def lease(self) -> str | None:
        """The lease the tracker last answered; ``None`` before the first accepted registration."""
        return self._lease

    async def deregister(self) -> None:
        """``DELETE /v1/nodes/{id}`` with the lease: leave the mesh now rather than when the lease runs out."""
        node_id = self._registration().node_id
        if self._lease is None:
            logger.info("%s never registered with %s: nothing to leave", node_id, self.tracker)
            return
        headers = {**bearer_headers(self._credential), h.LEASE: self._lease}
        count = len(self._trackers)
        for step in range(count):
            tracker = self._trackers[(self._current + step) % count]
            try:
                response = await self._http.delete(f"{tracker}{NODES_PATH}/{node_id}", headers=headers,
                                                    timeout=self._try_timeout())
            except httpx.HTTPError as exc:
                logger.warning("could not deregister %s from %s: %s", node_id, tracker, exc)
                continue
            logger.info("deregistered %s from %s: HTTP %d", node_id, tracker, response.status_code)
            if response.status_code < 500:
                return
