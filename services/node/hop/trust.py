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

Pins are the operator's word and a fetch over plain ``http://`` is anyone's on
the path (issue 34, finding 12): a node with pinned keys and any ``http://``
tracker across a network fetches nothing (:func:`may_fetch`), so the keys it
trusts are its pins and nothing a network attacker answers. Over ``https://``
(the tracker's certificate checked), or to a tracker on this machine's
loopback (no network to attack), the fetched keys join the pins, as they
always did.

A node holds no private route key, so it can verify a route and never mint one.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Final
from urllib.parse import urlsplit

from meshwire.route_keys import KeySet
from meshwire.routes import route_key_id

logger = logging.getLogger(__name__)

MIN_REFRESH_S: Final = 2.0
"""Shortest time between two fetches of the tracker's keys prompted by an unknown key id."""

KeyFetch = Callable[[], Awaitable[KeySet]]


def may_fetch(pinned: KeySet, trackers: Sequence[str] | None) -> bool:
    """Whether a node may add its trackers' keys to its pins: not over plain HTTP across a network when it
    pinned any."""
    if not trackers:
        return False
    return not pinned.kids or all(_authenticated_path(url) for url in trackers)


def _authenticated_path(url: str) -> bool:
    """Whether nobody on a network can answer for ``url``: ``https://`` (certificate checked) or loopback."""
    parts = urlsplit(url)
    if parts.scheme.lower() == "https":
        return True
    host = (parts.hostname or "").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class KeyFetchFailed(Exception):
    """The tracker's keys could not be had (no tracker answered, or its answer is not a JWK set)."""


class RouteTrust:
    """The route keys this node holds; :meth:`ensure` fetches the tracker's again for a key it lacks.

    A key id nobody holds may be a new key of the tracker's or a made-up one: the
    two look alike until the tracker's set is fetched. So every caller with an
    unknown id waits on one shared, scheduled fetch (:meth:`_upcoming`), never on
    a lock: a fetch starts at most once per ``min_refresh_s``, however many ids
    arrive, and each one that starts answers every caller waiting then. A flood
    of made-up ids costs the tracker one fetch per window and delays a real new
    key by at most one window and one fetch.
    """

    def __init__(self, pinned: KeySet, fetch: KeyFetch | None, clock: Callable[[], float] = time.monotonic,
                 min_refresh_s: float | None = None) -> None:
        self._pinned = pinned
        self._fetched = KeySet()
        self._fetch = fetch
        self._clock = clock
        self._min_refresh_s = MIN_REFRESH_S if min_refresh_s is None else min_refresh_s
        self._last_try: float | None = None
        self._fetching = asyncio.Lock()
        self._upcoming_fetch: asyncio.Task[bool] | None = None
        self._upcoming_started = False
        self.fetches = 0
        """Fetches of the tracker's keys made so far (the rate limit's witness in tests and metrics)."""
        self.keys: KeySet = pinned
        """Every key a route may be signed with (pinned and fetched)."""
        self.revoked: frozenset[str] = frozenset()
        """Node ids whose join token was revoked, as the tracker's last heartbeat answer named them: a route
        naming one is refused (:func:`services.node.hop.routing.refuse_revoked`)."""
        self.quarantined: frozenset[str] = frozenset()
        """Node ids the tracker quarantined for computing wrong, as its last heartbeat answer named them: a head
        moves a stream off a route naming one at its next step (issue 37)."""

    async def refresh(self) -> bool:
        """Fetch the tracker's keys now; ``True`` when they were fetched."""
        if self._fetch is None:
            return False
        async with self._fetching:  # held only while one fetch runs, never while anyone waits out the window
            return await self._fetch_now()

    async def _fetch_now(self) -> bool:
        assert self._fetch is not None
        self._last_try = self._clock()
        self.fetches += 1
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
        """:meth:`ensure` for a key id: wait for the next shared fetch when ``kid`` is not held.

        Returns once that fetch is done, whatever it found; the caller then
        verifies with :attr:`keys` and refuses a key still unknown.
        """
        if kid in self.keys or self._fetch is None:
            return
        await asyncio.shield(self._upcoming())

    def _upcoming(self) -> asyncio.Task[bool]:
        """The fetch every caller arriving now shares: one not yet started, or a new one scheduled after it.

        A fetch already under way may have started before the key it is awaited
        for was made, so a caller arriving then waits for the next one.
        """
        task = self._upcoming_fetch
        if task is None or task.done() or self._upcoming_started:
            previous = None if task is None or task.done() else task
            task = asyncio.get_running_loop().create_task(self._scheduled(previous), name="route key refresh")
            self._upcoming_fetch = task
            self._upcoming_started = False
        return task

    async def _scheduled(self, previous: asyncio.Task[bool] | None) -> bool:
        if previous is not None:
            await asyncio.gather(previous, return_exceptions=True)
        if self._last_try is not None and (wait := self._min_refresh_s - (self._clock() - self._last_try)) > 0:
            await asyncio.sleep(wait)  # fetched moments ago: the next fetch waits out the window (no lock held)
        self._upcoming_started = True
        try:
            return await self.refresh()
        except Exception:  # every waiter goes on (and refuses the key it lacks); the next call fetches again
            logger.exception("fetching the tracker's route keys failed")
            return False
