"""A hop's signed word that the next hop of a route failed it: the evidence a head blames a node on.

A route's head reports a failed hop to the tracker, which backs the node off.
A hop further down answers its caller a 502 ``hop_failed`` naming the node it
could not reach (``failed_node``), and the head used to take that name on the
hop's word, so a dishonest hop could name any honest node after it (issue 34).
Now:

- a hop that itself fails to reach its next hop (or is told by that hop that it
  failed) signs the statement with its own hop key (:func:`sign_failure`):
  it binds the route (the SHA-256 of the signed route token), the session,
  the signer and the node it could not reach, and rides in the 502's error as
  :data:`FIELD`, passed back unchanged by every hop before it;
- the head believes a downstream claim only when that statement verifies
  (:func:`failure_believed`) with the hop key the route names for the node
  just before the failed one; otherwise it blames the hop that answered it
  the 502, its own next hop (the one it can vouch for having met).

So a hop can blame only its own next hop, and only under its own name.
"""

from __future__ import annotations

import hashlib
from typing import Final

from meshwire.route_keys import (
    KeyProblem,
    SigningKey,
    b64decode,
    b64encode,
    public_key_from_text,
    verify_signature,
)
from meshwire.routes import Route

FIELD: Final = "failure_proof"
"""The key of the signed statement inside a 502's ``error`` object."""
VERSION: Final = b"meshnet-failure-v1"
MAX_FIELD_CHARS: Final = 256
"""Longest signer id or signature text read from a statement."""


def failure_message(route_token: str, session: str, signer: str, failed_node: str) -> bytes:
    """The bytes a statement signs: its version, the route's digest, the session, the signer, the failed node."""
    digest = hashlib.sha256(route_token.encode()).hexdigest()
    return b"\n".join((VERSION, digest.encode(), session.encode(), signer.encode(), failed_node.encode()))


def sign_failure(key: SigningKey, signer: str, route_token: str, session: str, failed_node: str) -> dict[str, str]:
    """``signer``'s statement, by its hop ``key``, that ``failed_node`` failed it on ``session`` along the route ``route_token``."""
    signature = key.sign(failure_message(route_token, session, signer, failed_node))
    return {"signer": signer, "failed_node": failed_node, "signature": b64encode(signature)}


def failure_believed(statement: object, route: Route, route_token: str, session: str, failed_node: str) -> bool:
    """Whether ``statement`` proves that the hop just before ``failed_node`` on ``route`` says it failed it."""
    if not isinstance(statement, dict):
        return False
    signer, named, signature = statement.get("signer"), statement.get("failed_node"), statement.get("signature")
    if not all(isinstance(v, str) and 0 < len(v) <= MAX_FIELD_CHARS for v in (signer, named, signature)):
        return False
    index = route.hop_of(failed_node)
    if named != failed_node or index is None or index == 0:
        return False
    before = route.nodes[index - 1]
    if before.node_id != signer or before.hop_key is None:
        return False
    try:
        key = public_key_from_text(before.hop_key)
        raw = b64decode(str(signature))
    except (KeyProblem, ValueError):
        return False
    return verify_signature(key, raw, failure_message(route_token, session, str(signer), failed_node))
