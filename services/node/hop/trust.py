"""The tracker keys a node verifies routes with, pinned at registration and refreshed on rotation.

A node trusts two sets of route-signing public keys: those pinned by hand
(``MESHNET_ROUTE_KEYS``, a JWK set) and those its tracker publishes at
``GET /v1/keys``, fetched over the node's own connection to the tracker it
was configured with when it registers. A key it meets in a route but does not
hold (the trackers rotated, or a restarted tracker made a new one) makes it
fetch the set again, at most once per :data:`MIN_REFRESH_S`, so a flood of
forged routes cannot turn into a flood of requests to the tracker. The set
fetched replaces the previous one: a key the trackers no longer publish (its
routes have all expired) is dropped.

A node holds no private route key, so it can verify a route and never mint one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Final

from meshwire.route_keys import KeySet
from meshwire.routes import route_key_id

logger = logging.getLogger(__name__)

MIN_REFRESH_S: Final = 2.0
"""Shortest time between two fetches of the tracker's keys prompted by an unknown key id."""

KeyFetch = Callable[[], Awaitable[KeySet]]


class KeyFetchFailed(Exception):
    """The tracker's keys could not be had (no tracker answered, or its answer is not a JWK set)."""


class RouteTrust:
    """The route keys this node holds; :meth:`ensure` fetches the tracker's again for a key it lacks."""

    def __init__(self, pinned: KeySet, fetch: KeyFetch | None, clock: Callable[[], float] = time.monotonic) -> None:
        self._pinned = pinned
        self._fetched = KeySet()
        self._fetch = fetch
        self._clock = clock
        self._last_try: float | None = None
        self._lock = asyncio.Lock()
        self.keys: KeySet = pinned
        """Every key a route may be signed with (pinned and fetched)."""

    async def refresh(self) -> bool:
        """Fetch the tracker's keys now; ``True`` when they were fetched."""
        if self._fetch is None:
            return False
        async with self._lock:
            return await self._refresh_locked()

    async def _refresh_locked(self) -> bool:
        assert self._fetch is not None
        self._last_try = self._clock()
        try:
            fetched = await self._fetch()
        except KeyFetchFailed as exc:  # the tracker is away or answered nonsense: keep the keys held
            logger.warning("could not fetch the tracker's route keys: %s", exc)
            return False
        if fetched.kids != self._fetched.kids:
            logger.info("route keys from the tracker: %s", ", ".join(sorted(fetched.kids)) or "none")
        self._fetched = fetched
        self.keys = self._pinned.merged(fetched)
        return True

    async def ensure(self, token: str | None) -> None:
        """Make sure the key ``token`` names is held, fetching the tracker's keys if it may be new."""
        if not token or self.keys.remembered(token) is not None:  # verified before: its key is held
            return
        kid = route_key_id(token)
        if kid is not None:
            await self.ensure_kid(kid)

    async def ensure_kid(self, kid: str) -> None:
        """:meth:`ensure` for a key id."""
        if kid in self.keys or self._fetch is None:
            return
        async with self._lock:
            if kid in self.keys:  # fetched while this call waited
                return
            if self._last_try is not None and (wait := MIN_REFRESH_S - (self._clock() - self._last_try)) > 0:
                # fetched moments ago (a key may have been made since: a store restarted empty): wait out the
                # window rather than refuse a route the tracker signed a moment later
                await asyncio.sleep(wait)
                if kid in self.keys:
                    return
            await self._refresh_locked()
