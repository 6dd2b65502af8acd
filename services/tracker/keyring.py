"""The tracker's route-signing keys and how they rotate (pure: the clock is passed in).

A key ring is a short list of :class:`KeyRecord` kept in the tracker's store,
so every tracker of one mesh signs with the same key and publishes the same
set. A rotation adds a key that is *published* at once (``GET /v1/keys``) and
*signs* only from ``signs_from``, a lead later, so nodes learn it before they
meet a route signed with it. The key it replaces stays published until the
last route it signed has expired (``signs_from`` of its successor plus the
route lifetime), so rotating never breaks a route in flight. Keys past that
are dropped from the ring.

Unix seconds throughout: every tracker of a mesh reads the same times.
"""

from __future__ import annotations

import time
from typing import Annotated, Final

from pydantic import BaseModel, Field, ValidationError

from meshwire.fields import STRICT_MODEL, AsTuple
from meshwire.route_keys import MAX_KEYS, Jwks, SigningKey, jwks_of

MAX_RING_BYTES: Final = 32 * 1024
"""Largest stored key ring read."""


class KeyRecord(BaseModel):
    """One route-signing key as the store holds it (the private seed never leaves the trackers)."""

    model_config = STRICT_MODEL

    kid: str = Field(min_length=1, max_length=64)
    seed: str = Field(min_length=43, max_length=43)
    created_at: float
    signs_from: float

    def signing_key(self) -> SigningKey:
        return SigningKey.from_seed(self.seed)


class KeyRing(BaseModel):
    """Every route key a mesh's trackers hold, oldest first."""

    model_config = STRICT_MODEL

    keys: Annotated[tuple[KeyRecord, ...], AsTuple, Field(max_length=MAX_KEYS)] = ()

    @classmethod
    def parse(cls, text: str | None) -> KeyRing:
        """The ring stored as ``text``; an empty ring when there is none (or it cannot be read)."""
        if not text or len(text) > MAX_RING_BYTES:
            return cls()
        try:
            return cls.model_validate_json(text)
        except ValidationError:
            return cls()

    def dump(self) -> str:
        return self.model_dump_json()

    def signer(self, now: float) -> KeyRecord | None:
        """The key that signs now: the newest whose ``signs_from`` has come."""
        ready = [(key.signs_from, key.created_at, index) for index, key in enumerate(self.keys)
                 if key.signs_from <= now]
        return self.keys[max(ready)[2]] if ready else None

    def newest(self) -> KeyRecord | None:
        """The key added last (it signs last; the ring keeps keys in the order they were added)."""
        return self.keys[-1] if self.keys else None

    def live(self, now: float, route_ttl_s: float) -> KeyRing:
        """The ring without keys whose every route has expired.

        A key stops signing when a newer one starts (``retired``); the routes it
        signed run at most ``route_ttl_s`` more.
        """
        kept: list[KeyRecord] = []
        for index, key in enumerate(self.keys):
            successors = [later.signs_from for later in self.keys[index + 1:] if later.signs_from <= now]
            retired = min(successors) if successors else None
            if retired is None or retired + route_ttl_s > now:
                kept.append(key)
        return KeyRing(keys=tuple(kept[-MAX_KEYS:]))

    def published(self, now: float, route_ttl_s: float) -> Jwks:
        """The public JWK set nodes verify with: every live key, including one not signing yet."""
        return jwks_of(record.signing_key() for record in self.live(now, route_ttl_s).keys)

    def rotated(self, now: float, lead_s: float, route_ttl_s: float) -> tuple[KeyRing, KeyRecord]:
        """The ring with a new key that signs from ``now + lead_s``, and that key."""
        key = SigningKey.generate()
        record = KeyRecord(kid=key.kid, seed=key.seed_text, created_at=now, signs_from=now + lead_s)
        live = self.live(now, route_ttl_s).keys
        return KeyRing(keys=(*live[-(MAX_KEYS - 1):], record)), record

    def due_for_rotation(self, now: float, rotate_s: float) -> bool:
        """Whether the newest key is older than ``rotate_s`` (0: never rotate by age)."""
        newest = self.newest()
        return newest is None or (rotate_s > 0 and now - newest.signs_from >= rotate_s)


def now_s() -> float:
    """Unix seconds (the ring's clock)."""
    return time.time()
