"""Sealing a KV pull's answer to the decode node that asked for it.

A pull is signed by the decode node, but a signed request can be copied: a
man in the middle that captured one could replay it to the prefill node and
read the KV, from which the prompt can be recovered. So every pull carries a
fresh X25519 public key of the puller's (:data:`BOX`, covered by the pull's
signature), and the prefill node encrypts the chunk to it: its own fresh
X25519 key (:data:`BOX` on the answer, covered by the answer's signature),
HKDF-SHA256 of the shared secret (bound to the pull's proof), AES-256-GCM.
A replayed pull, answered or not, yields bytes only the puller can open, and
a passive listener on the wire learns nothing of the KV either.

Each answer uses a key of its own (both halves are fresh), so the nonce is fixed.
"""

from __future__ import annotations

from typing import Final

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from meshwire.route_keys import KEY_BYTES, KeyProblem, b64decode, b64encode

BOX: Final = "X-Meshnet-KV-Box"
"""On a pull: the puller's X25519 public key (base64url); on its answer: the prefill node's."""
INFO: Final = b"meshnet-kv-box/1"
NONCE: Final = bytes(12)
TAG_BYTES: Final = 16


class BoxProblem(ValueError):
    """A box key or sealed answer that cannot be used; the message says why."""


def _public(text: str | None) -> X25519PublicKey:
    if not text:
        raise BoxProblem(f"missing {BOX}: the answer is sealed to the puller's key")
    try:
        raw = b64decode(text.strip())
    except KeyProblem:
        raise BoxProblem(f"{BOX} is not base64url") from None
    if len(raw) != KEY_BYTES:
        raise BoxProblem(f"{BOX} is not an X25519 public key ({KEY_BYTES} bytes)")
    return X25519PublicKey.from_public_bytes(raw)


def _key(private: X25519PrivateKey, public: X25519PublicKey, context: str) -> AESGCM:
    shared = private.exchange(public)
    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=INFO + b"\n" + context.encode()).derive(shared)
    return AESGCM(key)


def _text(public: X25519PublicKey) -> str:
    return b64encode(public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw))


class Opener:
    """The puller's half: a fresh key for one pull (:attr:`public_text` goes in the pull's :data:`BOX`)."""

    def __init__(self) -> None:
        self._private = X25519PrivateKey.generate()
        self.public_text = _text(self._private.public_key())

    def open(self, box: str | None, sealed: bytes | bytearray, context: str) -> bytes:
        """The answer's plain bytes; :class:`BoxProblem` when it was not sealed to this key for ``context``."""
        aead = _key(self._private, _public(box), context)
        try:
            return aead.decrypt(NONCE, sealed, None)
        except InvalidTag:
            raise BoxProblem("the answer is not sealed to this pull's key") from None


def check_box(box: str | None) -> None:
    """Refuse (:class:`BoxProblem`) a pull whose :data:`BOX` is not an X25519 public key, before any work."""
    _public(box)


def seal(box: str | None, plain: bytes, context: str) -> tuple[str, bytes]:
    """``plain`` sealed to the puller's :data:`BOX` key for ``context`` (the pull's proof): the answer's
    :data:`BOX` value and the sealed bytes. :class:`BoxProblem` when ``box`` is not a key."""
    theirs = _public(box)
    mine = X25519PrivateKey.generate()
    return _text(mine.public_key()), _key(mine, theirs, context).encrypt(NONCE, plain, None)
