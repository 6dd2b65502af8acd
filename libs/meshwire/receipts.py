"""Receipts: a hop's signed statement of what it computed, evidence of who computed what (issue 37).

A hop that ran its layers on a frame signs, with its own hop key (the one the
signed route names for it, :mod:`meshwire.route_keys`), a digest binding:

- the route (the SHA-256 of the route token the tracker signed),
- the session, the step, the hop's index in the route and the node id,
- the positions it ran (first position and count),
- the SHA-256 of its input (the frame body it received) and of its output
  (the frame body it sent on; at a tail, :func:`answer_digest` of the tokens it answered).

It travels back in :data:`RECEIPT` (one compact line). Whoever checks it (the
tracker, keeping a bounded window of recent receipts) verifies the signature
with the key the route names for that hop (:func:`verify_receipt`): a field
changed, a receipt signed by another key, or one made for another route,
session, step or positions is refused (:class:`ReceiptProblem`), and
:class:`SeenReceipts` refuses one presented twice. Because the receipt binds
the input hash, a verifier that recomputes the same step from the same input
can show, with the receipt, that the hop's output was wrong.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable, Sequence
from typing import Annotated, Final

import orjson
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from pydantic import BaseModel, Field, ValidationError

from meshwire import limits
from meshwire.fields import STRICT_MODEL
from meshwire.hop_proof import SeenSignatures
from meshwire.route_keys import (
    SIGNATURE_BYTES,
    KeyProblem,
    SigningKey,
    b64decode,
    b64encode,
    verify_signature,
)

RECEIPT: Final = "X-Meshnet-Receipt"
"""The response header a hop's receipt travels back in."""
DOMAIN: Final = b"meshnet-receipt/1"
"""Signed first, so a receipt's signature can never pass for a request proof or a route (other domains)."""
MAX_RECEIPT_CHARS: Final = 2048
"""Longest encoded receipt read (its fields are bounded; this bounds the parse itself)."""
MAX_SEEN_RECEIPTS: Final = 4096
"""Most receipts a :class:`SeenReceipts` remembers (the oldest forgotten first)."""
SEEN_WINDOW_S: Final = 3600.0
"""How long a receipt is remembered as seen; an older one is refused as stale by :func:`verify_receipt`."""
MAX_RECEIPT_AGE_S: Final = SEEN_WINDOW_S
"""How far from the checker's clock a receipt's time may be (either way)."""
MAX_POSITIONS: Final = 1 << 20
MAX_CHAIN_RECEIPTS: Final = limits.MAX_ROUTE_HOPS + 1
"""Most receipts one answer carries back: one per hop of the longest route, and a shadow's."""

Sha256Hex = Annotated[str, Field(min_length=64, max_length=64, pattern=r"^[0-9a-f]{64}$")]
_ID = r"^[A-Za-z0-9._:\-]+$"
_ENCODED: Final = re.compile(r"[A-Za-z0-9_\-]+\.[A-Za-z0-9_\-]{80,90}")


class ReceiptProblem(ValueError):
    """A receipt is malformed, forged, stale, made for another step, or replayed; the message says which."""


class ReceiptFields(BaseModel):
    """What a receipt binds (signed as canonical JSON after :data:`DOMAIN`)."""

    model_config = STRICT_MODEL

    route: Sha256Hex
    """SHA-256 (hex) of the signed route token (:func:`route_digest`)."""
    session: str = Field(min_length=1, max_length=limits.MAX_SESSION_ID_CHARS)
    node_id: str = Field(min_length=1, max_length=limits.MAX_ID_CHARS, pattern=_ID)
    hop_index: int = Field(ge=0, le=limits.MAX_ID_CHARS)
    step: int = Field(ge=0, le=1 << 40)
    position_offset: int = Field(ge=0, le=1 << 40)
    positions: int = Field(ge=1, le=MAX_POSITIONS)
    input_sha256: Sha256Hex
    output_sha256: Sha256Hex
    issued_ms: int = Field(ge=0, le=1 << 53)

    def message(self) -> bytes:
        """The exact bytes signed: the domain, then the fields as sorted-key JSON."""
        return DOMAIN + b"\n" + orjson.dumps(self.model_dump(), option=orjson.OPT_SORT_KEYS)


class Receipt(BaseModel):
    """A hop's signed receipt: its fields and its hop key's Ed25519 signature over them."""

    model_config = STRICT_MODEL

    fields: ReceiptFields
    signature: bytes = Field(min_length=SIGNATURE_BYTES, max_length=SIGNATURE_BYTES)

    def encode(self) -> str:
        """One header-safe line: ``<base64url fields JSON>.<base64url signature>``."""
        return f"{b64encode(orjson.dumps(self.fields.model_dump()))}.{b64encode(self.signature)}"


def sha256_hex(data: bytes) -> str:
    """The SHA-256 of ``data`` (hex), as a receipt holds input and output hashes."""
    return hashlib.sha256(data).hexdigest()


def route_digest(route_token: str) -> str:
    """The SHA-256 (hex) of a signed route token, as a receipt binds it."""
    return sha256_hex(route_token.encode("utf-8"))


def answer_digest(tokens: Sequence[int]) -> str:
    """A tail's output as a receipt hashes it: the token ids it answered (a speculative run's several; none on
    a prompt chunk that samples nothing)."""
    return sha256_hex(b"tokens:" + ",".join(str(int(token)) for token in tokens).encode("ascii"))


def make_receipt(key: SigningKey, *, route_token: str, session: str, node_id: str, hop_index: int, step: int,
                 position_offset: int, positions: int, input_sha256: str, output_sha256: str,
                 now: float | None = None) -> Receipt:
    """``node_id``'s receipt for one step, signed with its hop ``key``."""
    fields = ReceiptFields(route=route_digest(route_token), session=session, node_id=node_id, hop_index=hop_index,
                           step=step, position_offset=position_offset, positions=positions,
                           input_sha256=input_sha256, output_sha256=output_sha256,
                           issued_ms=int((time.time() if now is None else now) * 1000))
    return Receipt(fields=fields, signature=key.sign(fields.message()))


def parse_receipt(text: str) -> Receipt:
    """A receipt from its :data:`RECEIPT` line, checked for form only (not yet verified)."""
    text = text.strip()
    if len(text) > MAX_RECEIPT_CHARS or not _ENCODED.fullmatch(text):
        raise ReceiptProblem(f"{RECEIPT} must be '<base64url fields>.<base64url signature>', at most "
                             f"{MAX_RECEIPT_CHARS} characters")
    fields_text, _, signature_text = text.partition(".")
    try:
        fields = ReceiptFields.model_validate(orjson.loads(b64decode(fields_text)))
        return Receipt(fields=fields, signature=b64decode(signature_text))
    except (KeyProblem, orjson.JSONDecodeError, ValidationError) as exc:
        raise ReceiptProblem(f"{RECEIPT} is malformed: {str(exc).splitlines()[0][:200]}") from None


def verify_receipt(receipt: Receipt, key: Ed25519PublicKey, *, route_token: str, session: str, node_id: str,
                   hop_index: int, step: int, position_offset: int, positions: int,
                   now: float | None = None) -> None:
    """Refuse (:class:`ReceiptProblem`) a receipt that ``key`` (the hop key the route names for ``node_id``) did
    not sign, or that was made for another route, session, hop, step or positions than the one it is shown
    for (a replay), or whose time is more than :data:`MAX_RECEIPT_AGE_S` from ``now``."""
    fields = receipt.fields
    if not verify_signature(key, receipt.signature, fields.message()):
        raise ReceiptProblem(f"the receipt does not verify with {node_id[:100]}'s hop key: forged or altered")
    expected = {"route": route_digest(route_token), "session": session, "node_id": node_id, "hop_index": hop_index,
                "step": step, "position_offset": position_offset, "positions": positions}
    for name, value in expected.items():
        if getattr(fields, name) != value:
            raise ReceiptProblem(f"the receipt was made for another {name.replace('_', ' ')} "
                                 f"({str(getattr(fields, name))[:100]!r}, not {str(value)[:100]!r}): a replay")
    skew = abs((time.time() if now is None else now) - fields.issued_ms / 1000)
    if skew > MAX_RECEIPT_AGE_S:
        raise ReceiptProblem(f"the receipt is {skew:.0f} s from this clock (at most {MAX_RECEIPT_AGE_S:.0f} s)")


class SeenReceipts:
    """The receipts already accepted within :data:`SEEN_WINDOW_S`, bounded: one presented again is a replay."""

    def __init__(self, max_seen: int = MAX_SEEN_RECEIPTS, clock: Callable[[], float] = time.time) -> None:
        self._seen = SeenSignatures(SEEN_WINDOW_S, max_seen, clock)

    def __len__(self) -> int:
        return len(self._seen)

    def first_time(self, receipt: Receipt) -> bool:
        """``True`` (and remember it) the first time ``receipt`` is seen, ``False`` for a replay."""
        return self._seen.first_time(receipt.signature)
