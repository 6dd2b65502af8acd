"""Who may ask a prefill node for a handoff, and who may pull one: the tracker's signed routes decide.

No shared secret: a node that joined by token holds none. Both handoff calls are
signed with the caller's hop key (:mod:`meshwire.hop_proof`) and checked
against the key a route the tracker signed names for that node:

- ``POST /kv/prefill`` carries the prefill route (naming this node first) and
  the decode route the handoff is for (:data:`~meshwire.kv_handoff.DECODE_ROUTE`);
  it must be signed by that decode route's head. The handoff is then held
  under the decode route's digest on every prefill hop (the hold header rides
  the prefill route's own signed frames). A proof seen before is a replay.
- ``POST /kv/pull`` carries the decode route (``X-Meshnet-Route``) and must be
  signed by a node that route names, at layers covering those pulled, for a
  handoff held for that very route, and name this node
  (:data:`~meshwire.kv_handoff.KV_SOURCE`, signed with the rest: a pull made
  for another prefill node is refused here); each proof is answered once.

Both are checked at the node's front door (:mod:`services.node.hop.auth`), from
the headers alone: the proof covers the body's declared digest, so a prefill's
body is read only once its signer is known. Every refusal is a
:class:`KvRefusal`: 401 with no proof, 403 for a proof or route that does not
hold (nothing is read from the body or the cache before).
"""

from __future__ import annotations

from collections.abc import Mapping

from meshwire import headers as h
from meshwire.hop_proof import Claim, SeenProofs
from meshwire.kv_handoff import DECODE_ROUTE, KV_SOURCE, PREFILL_PATH, PULL_PATH, route_digest
from meshwire.routes import RouteNode
from services.node.engine.sessions import Session, log_tag
from services.node.hop.auth import Credential, HopAuth, HopRefused, proof_claim

KvRefusal = HopRefused
"""A handoff call refused: ``status`` and ``code`` go in the OpenAI-shaped error."""


def caller_claim(headers: Mapping[str, str]) -> Claim:
    """The proof headers of a handoff call, checked for form only (401 ``unauthorized`` without them)."""
    return proof_claim(headers, "a KV handoff call")


def check_pull_target(headers: Mapping[str, str], node_id: str) -> None:
    """Refuse (403 ``wrong_node``) a pull that does not name this node as the one it is meant for."""
    target = headers.get(KV_SOURCE.lower()) or headers.get(KV_SOURCE)
    if target is None or target.strip() != node_id:
        raise KvRefusal(403, "wrong_node", f"this pull is meant for {(target or 'no node')[:100]!r} ({KV_SOURCE}), "
                                           f"not for {node_id}")


class HandoffAuth:
    """Checks handoff calls against the tracker's signed routes (through ``auth``, the node's front door)."""

    def __init__(self, *, auth: HopAuth, seen: SeenProofs | None = None) -> None:
        self._auth = auth
        self._seen = SeenProofs() if seen is None else seen

    async def check_prefill(self, claim: Claim, headers: Mapping[str, str]) -> tuple[str, Credential]:
        """Check a prefill request signed by the head of the decode route it carries, before its body is read:
        that route's digest, and the credential its body must then pass (:meth:`Credential.check_body`).

        The prefill route itself is checked by the caller (it must name this node first).
        """
        decode = headers.get(DECODE_ROUTE.lower()) or headers.get(DECODE_ROUTE)
        route = await self._auth.route(decode, DECODE_ROUTE, check_expiry=True)
        credential = Credential(claim, PREFILL_PATH, headers)
        self._auth.verify_signer(credential, route.head, "the decode route's head (who asks for a prefill)")
        if not self._seen.first_time(claim):
            raise KvRefusal(403, "replayed", "this prefill request was answered before (a replay)")
        assert decode is not None
        return route_digest(decode), credential

    async def signed_puller(self, claim: Claim, headers: Mapping[str, str]) -> tuple[str, RouteNode]:
        """The digest of the decode route a pull carries and the hop of it that signed the pull.

        Checked before the handoff is looked up: an unsigned or forged pull learns nothing.
        """
        token = headers.get(h.ROUTE.lower()) or headers.get(h.ROUTE)
        route = await self._auth.route(token, f"the decode route ({h.ROUTE})", check_expiry=False)
        index = route.hop_of(claim.signer)
        if index is None:
            raise KvRefusal(403, "bad_proof", f"the decode route does not name {claim.signer[:100]}, who signed "
                                              "this pull")
        node = route.nodes[index]
        credential = Credential(claim, PULL_PATH, headers)
        self._auth.verify_signer(credential, node, "the decode route")
        credential.check_body(b"")
        assert token is not None
        return route_digest(token), node
    @staticmethod
    def check_pull(claim: Claim, digest: str, node: RouteNode, session: Session, first: int, last: int) -> None:
        """Refuse (403) a signed pull of ``session``'s layers ``first..last`` the decode route does not allow."""
        if session.handoff_for is None or session.handoff_for != digest:
            raise KvRefusal(403, "bad_route", f"handoff {log_tag(session.session_id)} is not held for the decode "
                                              "route this pull carries")
        if first < node.start_layer or last > node.shard_end:
            raise KvRefusal(403, "bad_layers", f"the decode route gives {node.node_id} layers {node.start_layer}-"
                                               f"{node.shard_end}, not {first}-{last}")
        if claim.signature in session.pull_proofs:
            raise KvRefusal(403, "replayed", "this pull was answered before (a replay)")
        session.pull_proofs.add(claim.signature)
