"""Ed25519 keys: the tracker's route-signing keys, their public JWK set, and a node's own hop key.

The tracker signs every route with a private Ed25519 key (:class:`SigningKey`)
and publishes the public halves at ``GET /v1/keys`` as a JWK set in the
standard form (RFC 8037)::

    {"keys": [{"kty": "OKP", "crv": "Ed25519", "kid": "...", "x": "<base64url public key>"}]}

A node pins that set (:class:`KeySet`) and verifies routes with it, so it can
check a route but never mint one: it holds no private route key. Each node
also holds a :class:`SigningKey` of its own, its *hop key*, whose public half
it registers; the tracker names it inside every signed route, and the node
signs what it sends to the next hop with it (:mod:`meshwire.hop_proof`).

Keys travel as base64url without padding: a public key (``x``) is 32 bytes,
a private key is its 32-byte seed.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated, Final, Literal

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import BaseModel, Field, ValidationError

from meshwire.fields import STRICT_MODEL, AsTuple

KEY_BYTES: Final = 32
"""Length of an Ed25519 public key and of a private key's seed."""
SIGNATURE_BYTES: Final = 64
MAX_KEYS: Final = 16
"""Most keys one JWK set may hold (a rotation publishes two or three at once)."""
MAX_JWKS_BYTES: Final = 16 * 1024
"""Largest JWK set document read (from a tracker or the environment)."""
MAX_REMEMBERED_TOKENS: Final = 1024
"""Most verified route tokens one :class:`KeySet` remembers (a session's every frame carries the same token)."""
KID_CHARS: Final = 16
"""Length of a generated key id (the start of the key's SHA-256, base64url)."""
_B64URL: Final = re.compile(r"[A-Za-z0-9_\-]*")

KeyId = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_\-]+$")]
PublicKeyText = Annotated[str, Field(min_length=43, max_length=43, pattern=r"^[A-Za-z0-9_\-]+$")]
"""A 32-byte key as unpadded base64url (43 characters)."""


class KeyProblem(ValueError):
    """A key, key set or signature that cannot be used; the message says why."""


def b64encode(data: bytes) -> str:
    """Unpadded base64url, as JWK and JWS write it."""
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def b64decode(text: str) -> bytes:
    """The inverse of :func:`b64encode`; :class:`KeyProblem` when ``text`` is not base64url."""
    if not _B64URL.fullmatch(text):
        raise KeyProblem("not base64url")
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raise KeyProblem("not base64url") from None


def public_key_from_text(text: str) -> Ed25519PublicKey:
    """The Ed25519 public key written as 43 base64url characters."""
    raw = b64decode(text)
    if len(raw) != KEY_BYTES:
        raise KeyProblem(f"an Ed25519 public key is {KEY_BYTES} bytes, got {len(raw)}")
    return Ed25519PublicKey.from_public_bytes(raw)


def public_key_text(key: Ed25519PublicKey) -> str:
    """``key`` as 43 base64url characters (a JWK's ``x``)."""
    return b64encode(key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw))


def key_id(public_text: str) -> str:
    """A key's id: the first :data:`KID_CHARS` base64url characters of the SHA-256 of its public key."""
    return b64encode(hashlib.sha256(public_text.encode("ascii")).digest())[:KID_CHARS]


@dataclass(frozen=True)
class SigningKey:
    """A private Ed25519 key with its id; signs routes (the tracker) or frames (a node's hop key)."""

    kid: str
    private: Ed25519PrivateKey

    @classmethod
    def generate(cls) -> SigningKey:
        return cls.from_private(Ed25519PrivateKey.generate())

    @classmethod
    def from_private(cls, private: Ed25519PrivateKey) -> SigningKey:
        return cls(kid=key_id(public_key_text(private.public_key())), private=private)

    @classmethod
    def from_seed(cls, seed_text: str) -> SigningKey:
        """The key whose 32-byte seed is ``seed_text`` (base64url); :class:`KeyProblem` otherwise."""
        seed = b64decode(seed_text.strip())
        if len(seed) != KEY_BYTES:
            raise KeyProblem(f"an Ed25519 private key is a {KEY_BYTES}-byte seed, got {len(seed)} bytes")
        return cls.from_private(Ed25519PrivateKey.from_private_bytes(seed))

    @property
    def seed_text(self) -> str:
        """The private seed as base64url (what a store keeps; never published)."""
        return b64encode(self.private.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                                    serialization.NoEncryption()))

    @property
    def public_text(self) -> str:
        return public_key_text(self.private.public_key())

    def jwk(self) -> Jwk:
        """The public half as a JWK."""
        return Jwk(kty="OKP", crv="Ed25519", kid=self.kid, x=self.public_text)

    def sign(self, message: bytes) -> bytes:
        return self.private.sign(message)

    def __repr__(self) -> str:  # never print the private key
        return f"SigningKey(kid={self.kid!r})"


class Jwk(BaseModel):
    """One public key of a JWK set: ``{"kty": "OKP", "crv": "Ed25519", "kid", "x"}``."""

    model_config = STRICT_MODEL

    kty: Literal["OKP"]
    crv: Literal["Ed25519"]
    kid: KeyId
    x: PublicKeyText


class Jwks(BaseModel):
    """A JWK set, the body of ``GET /v1/keys``."""

    model_config = STRICT_MODEL

    keys: Annotated[tuple[Jwk, ...], AsTuple, Field(max_length=MAX_KEYS)]


class KeySet:
    """Public keys by id: what a node verifies route signatures with.

    Built from a JWK set (:meth:`from_jwks`, :meth:`parse`); every key is
    decoded once, so a verification is one dictionary lookup and one
    Ed25519 check.
    """

    def __init__(self, keys: Mapping[str, Ed25519PublicKey] | None = None) -> None:
        self._keys: dict[str, Ed25519PublicKey] = dict(keys or {})
        self._verified: OrderedDict[str, object] = OrderedDict()

    def remembered(self, token: str) -> object | None:
        """What :meth:`remember` stored for ``token`` (a token this set verified), or ``None``.

        Every frame of a session carries the same route token: verifying its
        signature once per set, not once per frame, keeps a decode step cheap.
        A new set (the tracker's keys changed) starts with nothing remembered.
        """
        found = self._verified.get(token)
        if found is not None:
            self._verified.move_to_end(token)
        return found

    def remember(self, token: str, verified: object) -> None:
        self._verified[token] = verified
        while len(self._verified) > MAX_REMEMBERED_TOKENS:
            self._verified.popitem(last=False)

    @classmethod
    def from_jwks(cls, jwks: Jwks) -> KeySet:
        keys: dict[str, Ed25519PublicKey] = {}
        for jwk in jwks.keys:
            keys[jwk.kid] = public_key_from_text(jwk.x)
        return cls(keys)

    @classmethod
    def parse(cls, document: str | bytes) -> KeySet:
        """A key set from a JWK set's JSON; :class:`KeyProblem` naming the problem."""
        if len(document) > MAX_JWKS_BYTES:
            raise KeyProblem(f"a JWK set is at most {MAX_JWKS_BYTES} bytes")
        try:
            return cls.from_jwks(Jwks.model_validate_json(document))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first.get("loc", ()))
            raise KeyProblem(f"not a JWK set of Ed25519 keys: {where}: {first['msg']}") from None

    @classmethod
    def of(cls, keys: Iterable[SigningKey]) -> KeySet:
        """The public halves of ``keys``."""
        return cls({key.kid: key.private.public_key() for key in keys})

    def merged(self, other: KeySet) -> KeySet:
        """Both sets' keys (``other`` wins on a shared id)."""
        return KeySet({**self._keys, **other._keys})

    @property
    def kids(self) -> frozenset[str]:
        return frozenset(self._keys)

    def __contains__(self, kid: object) -> bool:
        return kid in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def get(self, kid: str) -> Ed25519PublicKey | None:
        """The key ``kid``, or ``None``."""
        return self._keys.get(kid)

    def verify(self, kid: str, signature: bytes, message: bytes) -> bool:
        """Whether ``signature`` over ``message`` verifies with the key ``kid`` (``False`` for an unknown id)."""
        key = self._keys.get(kid)
        if key is None or len(signature) != SIGNATURE_BYTES:
            return False
        return verify_signature(key, signature, message)


def verify_signature(key: Ed25519PublicKey, signature: bytes, message: bytes) -> bool:
    """Whether ``signature`` is ``key``'s over ``message``."""
    try:
        key.verify(signature, message)
    except InvalidSignature:
        return False
    return True


def jwks_of(keys: Iterable[SigningKey]) -> Jwks:
    """The public JWK set of ``keys``."""
    return Jwks(keys=tuple(key.jwk() for key in keys))
