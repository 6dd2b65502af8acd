"""A node's membership in the mesh: register with the tracker, heartbeat, leave.

``POST {tracker}/v1/nodes`` carries the same :class:`~meshwire.registry.NodeRegistration`
body every time (identity, shard, live load figures: free KV tokens, open
sessions, measured decode tokens/s). The first answer gives a lease, which
every heartbeat carries in ``X-Meshnet-Lease`` so nobody else can take this
node's id; the tracker's ``heartbeat_s`` sets the pace, and a new lease in an
answer (a restarted tracker registered the node afresh) replaces the old.
A tracker that is down is retried with a bounded backoff; one that no longer
honours the lease (404, or 409: the id went to another node meanwhile) gets
a fresh registration, and one that refuses the id because it is still live
under an earlier run's lease is retried until that entry expires. On
shutdown the node leaves with ``DELETE /v1/nodes/{id}``, carrying its lease.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
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


class Registrar:
    """Keeps this node registered with one tracker until :meth:`deregister`."""

    def __init__(self, http: httpx.AsyncClient, tracker: str, secret: str,
                 registration: Callable[[], NodeRegistration], heartbeat_s: float) -> None:
        self._http = http
        self._tracker = tracker
        self._secret = secret
        self._registration = registration
        self._heartbeat_s = heartbeat_s
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

    async def beat(self) -> bool:
        """One registration or heartbeat; ``True`` when the tracker accepted it."""
        body = self._registration()
        headers = bearer_headers(self._secret)
        if self._lease is not None:
            headers[h.LEASE] = self._lease
        try:
            response = await self._http.post(f"{self._tracker}{NODES_PATH}", content=body.model_dump_json(),
                                              headers={**headers, "Content-Type": "application/json"},
                                              timeout=TRACKER_TIMEOUT_S)
        except httpx.HTTPError as exc:
            logger.warning("tracker %s unreachable: %s", self._tracker, exc)
            return False
        if response.status_code in (404, 409) and self._lease is not None:
            logger.warning("tracker forgot this node (HTTP %d); registering again", response.status_code)
            self._lease = None
            return False
        if response.status_code == 409:
            logger.warning("tracker holds node id %s under another lease (an earlier run of this node, or "
                           "another node): retrying until that entry expires: %s", body.node_id,
                           response.text[:300])
            return False
        if response.status_code >= 300:
            logger.warning("tracker refused registration of %s: HTTP %d %s", body.node_id, response.status_code,
                           response.text[:300])
            return False
        self._take_answer(response)
        if not self.registered.is_set():
            logger.info("registered %s (layers %d-%d of %s) with %s", body.node_id, body.shard_start,
                        body.shard_end, body.model, self._tracker)
            self.registered.set()
        return True

    def _take_answer(self, response: httpx.Response) -> None:
        try:
            answer = RegistrationAnswer.model_validate_json(response.content)
        except ValidationError:
            return  # a heartbeat answer need not repeat the lease
        self._lease = answer.lease
        self._heartbeat_s = max(MIN_HEARTBEAT_S, min(self._heartbeat_s, answer.heartbeat_s))

    @property
    def lease(self) -> str | None:
        """The lease the tracker last answered; ``None`` before the first accepted registration."""
        return self._lease

    async def deregister(self) -> None:
        """``DELETE /v1/nodes/{id}`` with the lease: leave the mesh now rather than when the lease runs out."""
        node_id = self._registration().node_id
        if self._lease is None:
            logger.info("%s never registered with %s: nothing to leave", node_id, self._tracker)
            return
        headers = {**bearer_headers(self._secret), h.LEASE: self._lease}
        try:
            response = await self._http.delete(f"{self._tracker}{NODES_PATH}/{node_id}", headers=headers,
                                                timeout=TRACKER_TIMEOUT_S)
            logger.info("deregistered %s from %s: HTTP %d", node_id, self._tracker, response.status_code)
        except httpx.HTTPError as exc:
            logger.warning("could not deregister %s from %s: %s", node_id, self._tracker, exc)
