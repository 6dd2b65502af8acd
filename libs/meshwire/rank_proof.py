"""Signed bootstrap registrations: a prefill rank proves the slot it registers is its own.

The bootstrap registry's wire (``PUT /route``, ``reference/bootstrap-spec.md``)
has no credential, and the same slot registered again replaces the address
that is there. Anyone who reached the registry could point a slot at a
listener of their own. So a meshnet prefill node signs its registration with
its hop key: :data:`SIGNER_KEY` carries the public key, and the
:mod:`meshwire.hop_proof` headers sign the request (path ``/route``, the key
header among the covered ones, the body). The registry pins the slot to the
first key that signs it: later registrations of that slot must carry the same
key's signature (or the mesh secret, ``Authorization: Bearer``), and an
unsigned one is refused. Unsigned registrations of unsigned slots keep the
reference's behaviour, so the reference wire and its conformance suite work
unchanged.

This is defence in depth: decode nodes pull KV only from the endpoints the
tracker's signed prefill route names, and check every answer's signature
(:mod:`meshwire.kv_handoff`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from meshwire.hop_proof import ProofProblem, check_claim, read_claim, sign_request
from meshwire.route_keys import KeyProblem, SigningKey, public_key_from_text

SIGNER_KEY: Final = "X-Meshnet-Signer-Key"
"""The public key (43 base64url characters) a signed registration is signed with."""
REGISTER_PATH: Final = "/route"


def sign_registration(key: SigningKey, signer: str, body: bytes) -> dict[str, str]:
    """The headers that sign a ``PUT /route`` of ``body`` by ``signer`` (holding ``key``)."""
    headers = {SIGNER_KEY: key.public_text}
    return {**headers, **sign_request(key, signer, REGISTER_PATH, headers, body)}


def registration_key(headers: Mapping[str, str], body: bytes) -> str | None:
    """The public key that signed this registration, ``None`` when it is unsigned.

    Raises :class:`ProofProblem` (403) when a signature is present and does not hold.
    """
    key_text = headers.get(SIGNER_KEY.lower()) or headers.get(SIGNER_KEY)
    try:
        claim = read_claim(headers)
    except ProofProblem:
        if key_text is None:
            return None
        raise ProofProblem(403, f"{SIGNER_KEY} without a valid X-Meshnet-Signer / X-Meshnet-Proof") from None
    if key_text is None:
        raise ProofProblem(403, f"a signed registration names its key in {SIGNER_KEY}")
    try:
        key = public_key_from_text(key_text.strip())
    except KeyProblem as exc:
        raise ProofProblem(403, f"{SIGNER_KEY}: {exc}") from None
    check_claim(claim, key, REGISTER_PATH, headers, body)
    return key_text.strip()
