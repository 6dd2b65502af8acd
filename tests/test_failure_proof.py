"""A hop's signed word that its next hop failed (meshwire.failure_proof), and how a hop judges a claim with it."""

from __future__ import annotations

import asyncio

import httpx

from meshwire import headers as h
from meshwire.failure_proof import FIELD, failure_believed, sign_failure
from meshwire.route_keys import KeySet, SigningKey
from meshwire.routes import Route, RouteNode, plan_start_layers, sign_route
from services.node.hop.hop_client import ChainFailure, HopClient, hop_failed

ROUTE_KEY = SigningKey.generate()
KEYS = {name: SigningKey.generate() for name in ("a", "b", "c")}


def _route() -> tuple[Route, str]:
    hops = [RouteNode(node_id=name, endpoint=f"http://127.0.0.1:{9000 + i}", shard_start=i, shard_end=i,
                      hop_key=KEYS[name].public_text) for i, name in enumerate(KEYS)]
    planned = Route(model="m", nodes=plan_start_layers(hops), num_layers=3)
    return planned, sign_route(planned, ROUTE_KEY)


ROUTE = _route()


def route() -> tuple[Route, str]:
    """One route a -> b -> c (each hop's key named), signed once for the module."""
    return ROUTE


def test_only_the_predecessors_signature_over_this_route_and_session_is_believed() -> None:
    planned, token = route()
    good = sign_failure(KEYS["b"], "b", token, "s1", "c")
    assert failure_believed(good, planned, token, "s1", "c")
    assert not failure_believed(good, planned, token, "s2", "c"), "another session"
    assert not failure_believed(good, planned, token + "x", "s1", "c"), "another route"
    assert not failure_believed(sign_failure(KEYS["a"], "a", token, "s1", "c"), planned, token, "s1", "c")
    assert not failure_believed(sign_failure(KEYS["a"], "b", token, "s1", "c"), planned, token, "s1", "c")
    assert not failure_believed({**good, "signature": good["signature"][::-1]}, planned, token, "s1", "c")
    assert not failure_believed(None, planned, token, "s1", "c")


def judged(claim: ChainFailure) -> ChainFailure:
    """What hop a makes of ``claim`` answered by its next hop b on session s1."""
    planned, token = route()

    async def run() -> ChainFailure:
        async with httpx.AsyncClient() as http:
            client = HopClient(http, "", 1.0, node_id="a", hop_key=KEYS["a"])
            client.route_keys = lambda: KeySet.of([ROUTE_KEY])
            return client.attested(claim, planned.nodes[1], {h.ROUTE: token, h.SESSION: "s1"})

    return asyncio.run(run())


def test_a_claim_about_a_later_node_without_evidence_blames_the_hop_that_answered() -> None:
    out = judged(hop_failed("c", "connection refused"))
    assert out.failed_node == "b" and out.body["error"]["failed_node"] == "b"
    planned, token = route()
    assert failure_believed(out.body["error"][FIELD], planned, token, "s1", "b"), "a signs that b failed it"


def test_a_claim_with_the_predecessors_signed_word_is_passed_on() -> None:
    _, token = route()
    claim = hop_failed("c", "connection refused")
    claim.body["error"][FIELD] = sign_failure(KEYS["b"], "b", token, "s1", "c")
    assert judged(claim).failed_node == "c"
