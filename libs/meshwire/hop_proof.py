"""Signed requests: proof that a frame comes from the route's previous hop, or a call from the tracker.

A node signs every ``POST /forward`` (and ``/forward/rows``) it sends with its
own hop key (:class:`~meshwire.route_keys.SigningKey`); the route the tracker
signed names that key for that node, so the receiving hop checks the frame
against the key its route vouches for, not against a secret every node
shares. The tracker signs its calls to a head node's ``/v1`` the same way with
its route-signing key, which the node already holds from ``GET /v1/keys``.

Headers:

- ``X-Meshnet-Signer``: the signer, a node id (a hop) or ``tracker:<kid>``;
- ``X-Meshnet-Proof``: ``<unix milliseconds>.<base64url Ed25519 signature>``;
- ``X-Meshnet-Body-Sha256``: the SHA-256 of the body (hex), declared up front;
- ``X-Meshnet-Nonce``: 16 random bytes (base64url), so no two proofs are alike.

The signature covers, each on its own line: :data:`DOMAIN`, the path, the
signer, the timestamp, every other ``X-Meshnet-*`` header of the request
(lower-cased ``name:value`` lines, sorted; the route, session, step, hop
index and nonce among them), and the body's SHA-256 as declared. So a proof is
verified from the headers alone, **before the body is read**
(:func:`check_claim_headers`): an unsigned or forged request costs the
receiver a header parse and one Ed25519 check, never its body. The body read
afterwards must then hash to the declared digest (:func:`check_body`).

A proof older or newer than :data:`MAX_PROOF_AGE_S` is refused, which bounds a
replay; within it, a replayed step is refused by the session's step order
anyway, and a call that must be answered once (a KV handoff, the tracker's call
to a head) keeps a :class:`SeenProofs` replay cache.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from meshwire.route_keys import (
    SIGNATURE_BYTES,
    KeyProblem,
    SigningKey,
    b64decode,
    b64encode,
    verify_signature,
)

SIGNER: Final = "X-Meshnet-Signer"
PROOF: Final = "X-Meshnet-Proof"
DOMAIN: Final = b"meshnet-request/1"
MAX_PROOF_AGE_S: Final = 300.0
"""How far a proof's timestamp may be from the receiver's clock (either way)."""
BODY_DIGEST: Final = "X-Meshnet-Body-Sha256"
NONCE: Final = "X-Meshnet-Nonce"
NONCE_BYTES: Final = 16
TRACKER_SIGNER_PREFIX: Final = "tracker:"
MAX_SIGNER_CHARS: Final = 200
_PROOF: Final = re.compile(r"(?P<ms>[0-9]{1,16})\.(?P<sig>[A-Za-z0-9_\-]{80,90})")
_DIGEST: Final = re.compile(r"[0-9a-f]{64}")
_NONCE: Final = re.compile(r"[A-Za-z0-9_\-]{16,64}")
_SKIPPED: Final = frozenset({SIGNER.lower(), PROOF.lower(), BODY_DIGEST.lower()})
"""Headers outside the signed header lines (the digest is the message's last line instead)."""


class ProofProblem(ValueError):
    """A request's proof is missing (``status`` 401) or does not hold (403); the message says why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Claim:
    """What a request's proof headers claim, parsed but not yet verified."""

    signer: str
    timestamp_ms: int
    signature: bytes
    digest: str
    """The body's SHA-256 (hex) the signer declared, which the signature covers."""
    nonce: str | None = None


def body_digest(body: bytes) -> str:
    """The SHA-256 of ``body`` as :data:`BODY_DIGEST` carries it (hex)."""
    return hashlib.sha256(body).hexdigest()


def _message(path: str, signer: str, timestamp_ms: int, headers: Iterable[tuple[str, str]], digest: str) -> bytes:
    lines = sorted(f"{name.lower()}:{value.strip()}" for name, value in headers
                   if name.lower().startswith("x-meshnet-") and name.lower() not in _SKIPPED)
    return b"\n".join((DOMAIN, path.encode("utf-8"), signer.encode("utf-8"), str(timestamp_ms).encode("ascii"),
                       "\n".join(lines).encode("utf-8"), digest.encode("ascii")))


def sign_request(key: SigningKey, signer: str, path: str, headers: Mapping[str, str], body: bytes,
                 now: float | None = None) -> dict[str, str]:
    """The headers that prove ``signer`` (holding ``key``) sent this request: signer, proof, body digest, nonce."""
    timestamp_ms = int((time.time() if now is None else now) * 1000)
    nonce = b64encode(secrets.token_bytes(NONCE_BYTES))
    digest = body_digest(body)
    signed = {**{k: v for k, v in headers.items() if k.lower() != NONCE.lower()}, NONCE: nonce}
    signature = key.sign(_message(path, signer, timestamp_ms, signed.items(), digest))
    return {SIGNER: signer, PROOF: f"{timestamp_ms}.{b64encode(signature)}", BODY_DIGEST: digest, NONCE: nonce}


def _header(headers: Mapping[str, str], name: str) -> str | None:
    return headers.get(name.lower()) or headers.get(name)


def read_claim(headers: Mapping[str, str]) -> Claim:
    """The proof headers of a request, checked for form; :class:`ProofProblem` (401) otherwise."""
    signer, proof = _header(headers, SIGNER), _header(headers, PROOF)
    if not signer or not proof:
        raise ProofProblem(401, f"missing {SIGNER} / {PROOF}: this request must be signed by its sender")
    digest = (_header(headers, BODY_DIGEST) or "").strip()
    if not _DIGEST.fullmatch(digest):
        raise ProofProblem(401, f"missing or malformed {BODY_DIGEST}: a signed request declares its body's "
                                "SHA-256 (64 hex digits), so its proof is checked before the body is read")
    nonce = _header(headers, NONCE)
    if nonce is not None and not _NONCE.fullmatch(nonce.strip()):
        raise ProofProblem(401, f"{NONCE} must be 16-64 base64url characters")
    if len(signer) > MAX_SIGNER_CHARS:
        raise ProofProblem(401, f"{SIGNER} is too long")
    match = _PROOF.fullmatch(proof.strip())
    if match is None:
        raise ProofProblem(401, f"{PROOF} must be '<unix ms>.<base64url Ed25519 signature>'")
    try:
        signature = b64decode(match.group("sig"))
    except KeyProblem:
        raise ProofProblem(401, f"{PROOF} signature is not base64url") from None
    if len(signature) != SIGNATURE_BYTES:
        raise ProofProblem(401, f"{PROOF} signature is not {SIGNATURE_BYTES} bytes")
    return Claim(signer=signer.strip(), timestamp_ms=int(match.group("ms")), signature=signature, digest=digest,
                 nonce=None if nonce is None else nonce.strip())


def check_claim_headers(claim: Claim, key: Ed25519PublicKey, path: str, headers: Mapping[str, str],
                        now: float | None = None) -> None:
    """Verify ``claim`` with ``key`` over this request's headers and its declared body digest, before the body
    is read; :class:`ProofProblem` (403) when it does not hold. The body must then pass :func:`check_body`."""
    skew = abs((time.time() if now is None else now) - claim.timestamp_ms / 1000)
    if skew > MAX_PROOF_AGE_S:
        raise ProofProblem(403, f"{PROOF} is {skew:.0f} s away from this node's clock (at most "
                                f"{MAX_PROOF_AGE_S:.0f} s): check the clocks, or this is a replay")
    if not verify_signature(key, claim.signature, _message(path, claim.signer, claim.timestamp_ms, headers.items(),
                                                           claim.digest)):
        raise ProofProblem(403, f"{PROOF} does not verify with {claim.signer[:100]}'s key")


def check_body(claim: Claim, body: bytes) -> None:
    """Refuse (403) a body that is not the one ``claim`` declared (and signed) in :data:`BODY_DIGEST`."""
    if body_digest(body) != claim.digest:
        raise ProofProblem(403, f"the body does not hash to its signed {BODY_DIGEST}")


def check_claim(claim: Claim, key: Ed25519PublicKey, path: str, headers: Mapping[str, str], body: bytes,
                now: float | None = None) -> None:
    """:func:`check_claim_headers` and :func:`check_body` at once, for a body already read."""
    check_claim_headers(claim, key, path, headers, now)
    check_body(claim, body)


MAX_SEEN_PROOFS: Final = 4096
"""Most proofs a :class:`SeenProofs` remembers (the oldest are forgotten first)."""


class SeenSignatures:
    """Signatures already accepted within ``window_s``, at most ``max_seen`` of them: one presented again is a
    replay. What outlives the window is refused by its own age check anyway, so it is forgotten then (after
    twice the window, for clock skew); a flood of fresh signatures pushes the oldest out."""

    def __init__(self, window_s: float, max_seen: int, clock: Callable[[], float] = time.time) -> None:
        self._seen: OrderedDict[bytes, float] = OrderedDict()
        self._window_s = window_s
        self._max = max_seen
        self._clock = clock

    def __len__(self) -> int:
        return len(self._seen)

    def first_time(self, signature: bytes) -> bool:
        """``True`` (and remember it) when ``signature`` was not seen before, ``False`` for a replay."""
        now = self._clock()
        while self._seen and (len(self._seen) >= self._max
                              or next(iter(self._seen.values())) < now - 2 * self._window_s):
            self._seen.popitem(last=False)
        if signature in self._seen:
            return False
        self._seen[signature] = now
        return True


class SeenProofs:
    """The proofs already answered within :data:`MAX_PROOF_AGE_S`: a request that must be answered once (a
    KV handoff's prefill) is refused when its proof comes again.

    A proof older than the age bound is refused by :func:`check_claim` anyway, so it is forgotten then; at
    most :data:`MAX_SEEN_PROOFS` are remembered (a flood of fresh proofs pushes the oldest out).
    """

    def __init__(self, max_seen: int = MAX_SEEN_PROOFS, clock: Callable[[], float] = time.time) -> None:
        self._seen = SeenSignatures(MAX_PROOF_AGE_S, max_seen, clock)

    def first_time(self, claim: Claim) -> bool:
        """``True`` (and remember it) when ``claim``'s signature was not seen before, ``False`` for a replay."""
        return self._seen.first_time(claim.signature)

