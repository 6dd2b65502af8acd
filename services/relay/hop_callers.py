"""Nodes that call a peer through this relay with a signed, peer-bound proof instead of a bearer secret.

A node reaches a peer behind NAT at the ``relay_addr`` the peer registered:
an address the peer chose, so the node sends it no secret. It shows a route
the tracker signed and a proof by its own hop key, bound to the peer it calls
(:mod:`meshwire.relay_auth`). This relay verifies the route with the tracker's
route keys: pinned (``MESHNET_ROUTE_KEYS``) and those its trackers publish at
``GET /v1/keys`` (``MESHNET_TRACKER``), fetched when a handshake names a key it
does not hold, at most once per :data:`MIN_REFRESH_S` and shared by every
handshake waiting then. A relay with neither refuses such callers (403).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Final

import httpx

from meshwire.auth import AuthFailure
from meshwire.hop_proof import ProofProblem
from meshwire.relay_auth import check_relay_handshake, handshake_kid
from meshwire.route_keys import MAX_JWKS_BYTES, KeyProblem, KeySet

log = logging.getLogger(__name__)

KEYS_PATH: Final = "/v1/keys"
MIN_REFRESH_S: Final = 2.0
"""Shortest time between two fetches of the trackers' keys prompted by an unknown key id."""
TRACKER_TIMEOUT_S: Final = 5.0


class HandshakeKeys:
    """The route keys a relay verifies signed caller handshakes with."""

    def __init__(self, pinned: KeySet, trackers: Sequence[str], clock: Callable[[], float] = time.monotonic) -> None:
        self._pinned = pinned
        self._trackers = tuple(url.rstrip("/") for url in trackers)
        self._clock = clock
        self._last_try: float | None = None
        self._fetching: asyncio.Task[None] | None = None
        self._http = httpx.AsyncClient(timeout=TRACKER_TIMEOUT_S, trust_env=False) if self._trackers else None
        self.keys = pinned

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()

    async def check(self, headers: Mapping[str, str], peer_id: str) -> AuthFailure | None:
        """``None`` when the handshake proves a node may call ``peer_id``; the refusal (401/403) otherwise."""
        kid = handshake_kid(headers)
        if kid is not None and kid not in self.keys:
            await self._refresh()
        try:
            check_relay_handshake(headers, peer_id, self.keys)
        except ProofProblem as exc:
            return AuthFailure(401 if exc.status == 401 else 403, str(exc))
        return None

    async def _refresh(self) -> None:
        """Fetch the trackers' keys: one fetch at a time, shared; at most one a window (then the key is refused)."""
        if self._http is None:
            return
        if self._fetching is None or self._fetching.done():
            if self._last_try is not None and self._clock() - self._last_try < MIN_REFRESH_S:
                return
            self._last_try = self._clock()
            self._fetching = asyncio.get_running_loop().create_task(self._fetch())
        await asyncio.shield(self._fetching)

    async def _fetch(self) -> None:
        assert self._http is not None
        for tracker in self._trackers:
            try:
                response = await self._http.get(f"{tracker}{KEYS_PATH}")
                if response.status_code != 200 or len(response.content) > MAX_JWKS_BYTES:
                    continue
                self.keys = self._pinned.merged(KeySet.parse(response.content))
                return
            except (httpx.HTTPError, KeyProblem) as exc:
                log.warning("could not fetch route keys from %s: %s", tracker, exc)
