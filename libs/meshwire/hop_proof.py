"""Signed requests: proof that a frame comes from the route's previous hop, or a call from the tracker.

A node signs every ``POST /forward`` (and ``/forward/rows``) it sends with its
own hop key (:class:`~meshwire.route_keys.SigningKey`); the route the tracker
signed names that key for that node, so the receiving hop checks the frame
against the key its route vouches for, not against a secret every node
shares. The tracker signs its calls to a head node's ``/v1`` the same way with
its route-signing key, which the node already holds from ``GET /v1/keys``.

Headers:

- ``X-Meshnet-Signer``: the signer, a node id (a hop) or ``tracker:<kid>``;
- ``X-Meshnet-Proof``: ``<unix milliseconds>.<base64url Ed25519 signature>``.

The signature covers, each on its own line: :data:`DOMAIN`, the path, the
signer, the timestamp, every other ``X-Meshnet-*`` header of the request
(lower-cased ``name:value`` lines, sorted; the route, session, step and hop
index among them), and the SHA-256 of the body. A proof older or newer than
:data:`MAX_PROOF_AGE_S` is refused, which bounds a replay; within it, a
replayed step is refused by the session's step order anyway.
"""

from __future__ import annotations

import hashlib
import re
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
TRACKER_SIGNER_PREFIX: Final = "tracker:"
MAX_SIGNER_CHARS: Final = 200
_PROOF: Final = re.compile(r"(?P<ms>[0-9]{1,16})\.(?P<sig>[A-Za-z0-9_\-]{80,90})")
_SKIPPED: Final = frozenset({SIGNER.lower(), PROOF.lower()})


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


def _message(path: str, signer: str, timestamp_ms: int, headers: Iterable[tuple[str, str]], body: bytes) -> bytes:
    lines = sorted(f"{name.lower()}:{value.strip()}" for name, value in headers
                   if name.lower().startswith("x-meshnet-") and name.lower() not in _SKIPPED)
    return b"\n".join((DOMAIN, path.encode("utf-8"), signer.encode("utf-8"), str(timestamp_ms).encode("ascii"),
                       "\n".join(lines).encode("utf-8"), hashlib.sha256(body).hexdigest().encode("ascii")))


def sign_request(key: SigningKey, signer: str, path: str, headers: Mapping[str, str], body: bytes,
                 now: float | None = None) -> dict[str, str]:
    """The two headers that prove ``signer`` (holding ``key``) sent this request."""
    timestamp_ms = int((time.time() if now is None else now) * 1000)
    signature = key.sign(_message(path, signer, timestamp_ms, headers.items(), body))
    return {SIGNER: signer, PROOF: f"{timestamp_ms}.{b64encode(signature)}"}


def read_claim(headers: Mapping[str, str]) -> Claim:
    """The proof headers of a request, checked for form and age; :class:`ProofProblem` (401) otherwise."""
    signer, proof = headers.get(SIGNER.lower()) or headers.get(SIGNER), headers.get(PROOF.lower()) or headers.get(PROOF)
    if not signer or not proof:
        raise ProofProblem(401, f"missing {SIGNER} / {PROOF}: this request must be signed by its sender")
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
    return Claim(signer=signer.strip(), timestamp_ms=int(match.group("ms")), signature=signature)


def check_claim(claim: Claim, key: Ed25519PublicKey, path: str, headers: Mapping[str, str], body: bytes,
                now: float | None = None) -> None:
    """Verify ``claim`` with ``key`` over this request; :class:`ProofProblem` (403) when it does not hold."""
    skew = abs((time.time() if now is None else now) - claim.timestamp_ms / 1000)
    if skew > MAX_PROOF_AGE_S:
        raise ProofProblem(403, f"{PROOF} is {skew:.0f} s away from this node's clock (at most "
                                f"{MAX_PROOF_AGE_S:.0f} s): check the clocks, or this is a replay")
    if not verify_signature(key, claim.signature, _message(path, claim.signer, claim.timestamp_ms, headers.items(),
                                                           body)):
        raise ProofProblem(403, f"{PROOF} does not verify with {claim.signer}'s key")


MAX_SEEN_PROOFS: Final = 4096
"""Most proofs a :class:`SeenProofs` remembers (the oldest are forgotten first)."""


class SeenProofs:
    """The proofs already answered within :data:`MAX_PROOF_AGE_S`: a request that must be answered once (a
    KV handoff's prefill) is refused when its proof comes again.

    A proof older than the age bound is refused by :func:`check_claim` anyway, so it is forgotten then; at
    most :data:`MAX_SEEN_PROOFS` are remembered (a flood of fresh proofs pushes the oldest out).
    """

    def __init__(self, max_seen: int = MAX_SEEN_PROOFS, clock: Callable[[], float] = time.time) -> None:
        self._seen: OrderedDict[bytes, float] = OrderedDict()
        self._max = max_seen
        self._clock = clock

    def first_time(self, claim: Claim) -> bool:
        """``True`` (and remember it) when ``claim``'s signature was not seen before, ``False`` for a replay."""
        now = self._clock()
        while self._seen and (len(self._seen) >= self._max
                              or next(iter(self._seen.values())) < now - 2 * MAX_PROOF_AGE_S):
            self._seen.popitem(last=False)
        if claim.signature in self._seen:
            return False
        self._seen[claim.signature] = now
        return True
