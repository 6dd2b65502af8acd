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

Every refusal is a :class:`KvRefusal`: 401 with no proof, 403 for a proof or
route that does not hold (nothing is read from the cache before).
"""

from __future__ import annotations

from collections.abc import Mapping

from meshwire import headers as h
from meshwire.hop_proof import Claim, ProofProblem, SeenProofs, check_claim, read_claim
from meshwire.kv_handoff import DECODE_ROUTE, KV_SOURCE, PREFILL_PATH, PULL_PATH, route_digest
from meshwire.route_keys import KeyProblem, public_key_from_text
from meshwire.routes import Route, RouteError, RouteNode, verify_route
from services.node.engine.sessions import Session, log_tag
from services.node.hop.trust import RouteTrust


class KvRefusal(Exception):
    """A handoff call refused: ``status`` and ``code`` go in the OpenAI-shaped error."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


def caller_claim(headers: Mapping[str, str]) -> Claim:
    """The proof headers of a handoff call, checked for form only (401 ``unauthorized`` without them)."""
    try:
        return read_claim(headers)
    except ProofProblem as exc:
        raise KvRefusal(exc.status, "unauthorized" if exc.status == 401 else "bad_proof",
                        f"{exc} (a KV handoff call is signed with the caller's hop key)") from None


def check_pull_target(headers: Mapping[str, str], node_id: str) -> None:
    """Refuse (403 ``wrong_node``) a pull that does not name this node as the one it is meant for."""
    target = headers.get(KV_SOURCE.lower()) or headers.get(KV_SOURCE)
    if target is None or target.strip() != node_id:
        raise KvRefusal(403, "wrong_node", f"this pull is meant for {(target or 'no node')[:100]!r} ({KV_SOURCE}), "
                                           f"not for {node_id}")


class HandoffAuth:
    """Checks handoff calls against the tracker's signed routes (keys from ``trust``) for ``model_id``."""

    def __init__(self, *, trust: RouteTrust, model_id: str, seen: SeenProofs | None = None) -> None:
        self._trust = trust
        self._model_id = model_id
        self._seen = SeenProofs() if seen is None else seen

    async def _route(self, token: str | None, what: str, *, check_expiry: bool) -> Route:
        if not token:
            raise KvRefusal(403, "bad_route", f"missing {what}: a KV handoff is made for a route the tracker signed")
        await self._trust.ensure(token)
        try:
            route = verify_route(token, self._trust.keys, check_expiry=check_expiry)
        except RouteError as exc:
            raise KvRefusal(403, "bad_route", f"{what} refused ({exc.code}): {exc}") from None
        if route.model != self._model_id:
            raise KvRefusal(403, "bad_route", f"{what} is for {route.model}, this node serves {self._model_id}")
        return route

    @staticmethod
    def _check_signer(claim: Claim, node: RouteNode, path: str, headers: Mapping[str, str], body: bytes) -> None:
        if node.hop_key is None:
            raise KvRefusal(403, "bad_proof", f"the decode route names no hop key for {node.node_id}")
        try:
            check_claim(claim, public_key_from_text(node.hop_key), path, headers, body)
        except (ProofProblem, KeyProblem) as exc:
            raise KvRefusal(403, "bad_proof", str(exc)) from None

    async def check_prefill(self, claim: Claim, headers: Mapping[str, str], body: bytes) -> str:
        """Check a prefill request signed by the head of the decode route it carries; that route's digest.

        The prefill route itself is checked by the caller (it must name this node first).
        """
        decode = headers.get(DECODE_ROUTE.lower()) or headers.get(DECODE_ROUTE)
        route = await self._route(decode, DECODE_ROUTE, check_expiry=True)
        head = route.head
        if claim.signer != head.node_id:
            raise KvRefusal(403, "bad_proof", f"a prefill is asked by the decode route's head {head.node_id}, but "
                                              f"this one is signed by {claim.signer[:100]}")
        self._check_signer(claim, head, PREFILL_PATH, headers, body)
        if not self._seen.first_time(claim):
            raise KvRefusal(403, "replayed", "this prefill request was answered before (a replay)")
        assert decode is not None
        return route_digest(decode)

    async def signed_puller(self, claim: Claim, headers: Mapping[str, str]) -> tuple[str, RouteNode]:
        """The digest of the decode route a pull carries and the hop of it that signed the pull.

        Checked before the handoff is looked up: an unsigned or forged pull learns nothing.
        """
        token = headers.get(h.ROUTE.lower()) or headers.get(h.ROUTE)
        route = await self._route(token, f"the decode route ({h.ROUTE})", check_expiry=False)
        index = route.hop_of(claim.signer)
        if index is None:
            raise KvRefusal(403, "bad_proof", f"the decode route does not name {claim.signer[:100]}, who signed "
                                              "this pull")
        node = route.nodes[index]
        self._check_signer(claim, node, PULL_PATH, headers, b"")
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
