"""What a tracker trusts and vouches for: its route-signing keys and the mesh's join tokens.

Both live in the tracker's store (memory, or Redis shared by several
trackers), so every tracker of one mesh signs with the same key, publishes
the same JWK set and admits the same nodes.

Keys. The ring (:mod:`.keyring`) is read from the store at start and every
:data:`REFRESH_S` after, and cached here, so signing a route costs no store
round trip. The first tracker of an empty store creates the first key (a
compare-and-set, so two trackers starting together agree on one). A key
older than ``route_key_rotate_s`` is rotated by whichever tracker sees it
first; ``POST /v1/admin/keys/rotate`` rotates at once. A new key signs
``route_key_lead_s`` after it is published.

Credentials. A request from a node carries ``Authorization: Bearer`` with
either its join token (``mnj_...``) or, in a mesh that issues none, the
shared secret. :meth:`TrackerTrust.admit` decides a registration: a token
must be valid and bind this node id (and its model and layers when it
says so); the shared secret is refused for an id an unexpired token binds
(revoked or not), so nobody takes over a node that joined by token, and a
revoked node does not come back by the secret.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import Callable
from typing import Final

from meshwire.auth import MAX_AUTHORIZATION_CHARS
from meshwire.registry import NodeRegistration
from meshwire.route_keys import Jwks, SigningKey

from .join_tokens import (
    JoinTokenRecord,
    TokenRefused,
    check_binding,
    check_token,
    looks_like_token,
    token_id_of,
)
from .keyring import KeyRecord, KeyRing
from .store import NodeStore, StoreUnavailable

logger = logging.getLogger(__name__)

ROUTE_KEYS_DOC: Final = "route_keys"
REFRESH_S: Final = 5.0
"""How often a tracker re-reads the key ring from its store (and rotates a key that is due)."""
MAX_SWAP_TRIES: Final = 5
SERVE_REREAD_S: Final = 0.5
"""Shortest time between two store reads prompted by ``GET /v1/keys`` (the endpoint is public: a flood of
calls costs the store at most one read per this many seconds)."""


class NoSigningKey(Exception):
    """The tracker has no route key yet (its store has been away since it started)."""


def bearer_of(authorization: str | None) -> str | None:
    """The credential of an ``Authorization: Bearer`` header, or ``None``."""
    if not authorization or len(authorization) > MAX_AUTHORIZATION_CHARS:
        return None
    scheme, _, credential = authorization.strip().partition(" ")
    credential = credential.strip()
    return credential if scheme.lower() == "bearer" and credential else None


class TrackerTrust:
    """The key ring cache and the credential checks of one tracker."""

    def __init__(self, store: NodeStore, *, secret: str, route_ttl_s: float, rotate_s: float, lead_s: float,
                 clock: Callable[[], float] = time.time) -> None:
        self._store = store
        self._secret = secret
        self._route_ttl_s = route_ttl_s
        self._rotate_s = rotate_s
        self._lead_s = lead_s
        self._clock = clock
        self._ring = KeyRing()
        self._signers: dict[str, SigningKey] = {}
        self._task: asyncio.Task[None] | None = None
        self._served_read_at: float | None = None

    # --- keys -------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Load (or create) the key ring, then keep it fresh in the background."""
        with contextlib.suppress(StoreUnavailable):
            await self.refresh()
        self._task = asyncio.create_task(self._keep_fresh(), name="route-keys")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _keep_fresh(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_S)
            try:
                await self.refresh()
            except StoreUnavailable as exc:
                logger.debug("route keys not refreshed: %s", exc)
            except Exception:  # never let the refresh loop die
                logger.exception("refreshing the route keys failed")

    async def refresh(self) -> KeyRing:
        """Read the ring from the store; create the first key, or rotate one that is due."""
        for _ in range(MAX_SWAP_TRIES):
            stored = await self._store.read_doc(ROUTE_KEYS_DOC)
            ring = KeyRing.parse(stored)
            now = self._clock()
            if not ring.due_for_rotation(now, self._rotate_s):
                self._take(ring)
                return ring
            # The first key signs at once (no route exists yet); a later one after the lead.
            new_ring, record = ring.rotated(now, self._lead_s if ring.keys else 0.0, self._route_ttl_s)
            if await self._store.swap_doc(ROUTE_KEYS_DOC, stored, new_ring.dump()):
                logger.info("route key %s published; it signs from %s", record.kid,
                            "now" if record.signs_from <= now else f"{record.signs_from - now:.0f} s from now")
                self._take(new_ring)
                return new_ring
        raise StoreUnavailable("the route key ring kept changing under this tracker")

    async def rotate(self) -> KeyRecord:
        """Publish a new key that signs after the lead (``POST /v1/admin/keys/rotate``)."""
        for _ in range(MAX_SWAP_TRIES):
            stored = await self._store.read_doc(ROUTE_KEYS_DOC)
            ring = KeyRing.parse(stored)
            now = self._clock()
            new_ring, record = ring.rotated(now, self._lead_s if ring.keys else 0.0, self._route_ttl_s)
            if await self._store.swap_doc(ROUTE_KEYS_DOC, stored, new_ring.dump()):
                logger.info("route key %s published by rotation; it signs in %.0f s", record.kid, self._lead_s)
                self._take(new_ring)
                return record
        raise StoreUnavailable("the route key ring kept changing under this tracker")

    def _take(self, ring: KeyRing) -> None:
        self._ring = ring
        self._signers = {record.kid: self._signers.get(record.kid) or record.signing_key() for record in ring.keys}

    async def ready(self) -> None:
        """Load the ring now if this tracker holds no key yet (an app served without its lifespan, or a
        store that was away at start); a store still away leaves it to :meth:`signing_key` to say so."""
        if self._ring.signer(self._clock()) is None:
            with contextlib.suppress(StoreUnavailable):
                await self.refresh()

    def signing_key(self) -> SigningKey:
        """The key that signs routes now; :class:`NoSigningKey` before the ring was ever read."""
        record = self._ring.signer(self._clock())
        if record is None:
            raise NoSigningKey("the tracker has no route-signing key yet (its store is away)")
        return self._signers[record.kid]

    def jwks(self) -> Jwks:
        """The public keys nodes verify routes with, as this tracker last read them."""
        return self._ring.published(self._clock(), self._route_ttl_s)

    async def current_jwks(self) -> Jwks:
        """The public keys as the store holds them now (``GET /v1/keys``).

        A node asks when it meets a key id it lacks: another tracker of the
        mesh may have made that key a moment ago (a Redis restarted empty), so
        answering from this tracker's cached ring (up to :data:`REFRESH_S`
        old) could hide it. The store is read again unless it was read for
        this endpoint within :data:`SERVE_REREAD_S`; a store that is away
        leaves the cached ring.
        """
        now = self._clock()
        if self._served_read_at is None or now - self._served_read_at >= SERVE_REREAD_S:
            self._served_read_at = now
            with contextlib.suppress(StoreUnavailable):
                await self.refresh()
        return self.jwks()

    # --- credentials ------------------------------------------------------------------------------

    def is_secret(self, credential: str | None) -> bool:
        """Whether ``credential`` is the mesh's shared secret (constant time)."""
        return credential is not None and hmac.compare_digest(credential.encode("utf-8"),
                                                              self._secret.encode("utf-8"))

    async def token(self, credential: str) -> JoinTokenRecord:
        """The valid join token ``credential`` is; :class:`TokenRefused` otherwise."""
        token_id = token_id_of(credential)
        return check_token(credential, await self._store.get_token(token_id), self._clock())

    async def member(self, authorization: str | None) -> str | None:
        """Who a request from the mesh comes from: ``"secret"``, ``"token:<node id>"``, or ``None``.

        ``None`` means no usable credential; a join token that is revoked,
        expired or unknown raises :class:`TokenRefused`.
        """
        credential = bearer_of(authorization)
        if credential is None:
            return None
        if looks_like_token(credential):
            return f"token:{(await self.token(credential)).node_id}"
        return "secret" if self.is_secret(credential) else None

    async def admit(self, authorization: str | None, registration: NodeRegistration) -> JoinTokenRecord | None:
        """Decide a registration or heartbeat; :class:`TokenRefused` (401/403) when it may not join.

        Answers the join token it came with, or ``None`` for the shared secret.
        """
        credential = bearer_of(authorization)
        if credential is None:
            raise TokenRefused(401, "missing_credential",
                               "missing Authorization header (expected 'Bearer <join token or mesh secret>')")
        if looks_like_token(credential):
            record = await self.token(credential)
            check_binding(record, registration)
            return record
        if not self.is_secret(credential):
            raise TokenRefused(403, "invalid_credential", "invalid credential")
        now = self._clock()
        # A revoked token keeps binding its id: a node put out of the mesh does not come back by the secret.
        bound = [record for record in await self._store.all_tokens() if record.node_id == registration.node_id
                 and (record.expires_at is None or now < record.expires_at)]
        if bound:
            raise TokenRefused(403, "token_required", f"node id {registration.node_id!r} is bound to join token "
                                                      f"{bound[0].token_id}: it joins with that token only")
        return None
