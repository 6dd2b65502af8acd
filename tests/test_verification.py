"""Spot checks (issue 37), without processes: a route's shadow, the tracker's comparisons and verdicts.

A route may name a shadow of one hop (another holder of its layers), which a node accepts as its own place; a
route without one is the JSON it always was. The tracker's :class:`Verifier` keeps only receipts that verify
with the hop key the route names, refuses a forged or replayed one, compares a hop's receipt with its shadow's,
and quarantines a node only when two nodes that agree with each other both disagree with it; with two
replicas it reports the dispute and guesses nothing.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from meshwire.receipts import answer_digest, make_receipt, sha256_hex
from meshwire.route_keys import SigningKey
from meshwire.routes import Route, RouteNode, ShadowHop, sign_route
from services.tracker.planner import Candidate
from services.tracker.quarantine import Quarantine
from services.tracker.registry import RegistryPolicy
from services.tracker.store import open_store
from services.tracker.verification import NumberFormat, ReportRefused, Verifier
from tests.procs import TEST_ROUTE_KEY, node_hop_key

NAMES = ("head", "a", "b", "c")


def _node(name: str, start: int, end: int, start_layer: int | None = None) -> RouteNode:
    return RouteNode(node_id=name, endpoint=f"http://127.0.0.1:1/{name}", shard_start=start, shard_end=end,
                     start_layer=start if start_layer is None else start_layer,
                     hop_key=node_hop_key(name).public_text)


def _route(tail: str, shadow: str | None) -> tuple[Route, str]:
    route = Route(model="m", nodes=(_node("head", 0, 1), _node(tail, 2, 3)), num_layers=4,
                  shadow=None if shadow is None else ShadowHop(hop_index=1, node=_node(shadow, 2, 3)))
    return route, sign_route(route, TEST_ROUTE_KEY)


def _receipt(token: str, node: str, step: int, output: str, *, session: str = "s1",
             key: SigningKey | None = None) -> str:
    return make_receipt(key or node_hop_key(node), route_token=token, session=session, node_id=node, hop_index=1,
                        step=step, position_offset=10 + step, positions=1, input_sha256=sha256_hex(b"in%d" % step),
                        output_sha256=output).encode()


def _verifier(rate: float = 1.0) -> Verifier:
    store = open_store("memory", RegistryPolicy(), lambda: 0.0)
    return Verifier(Quarantine(store), CollectorRegistry(), rate=rate, rng=random.Random(0))


def _run(verifier: Verifier, tail: str, shadow: str, outputs: tuple[str, str], step: int,
         session: str = "s1") -> list[tuple[str, str, tuple[str, ...]]]:
    route, token = _route(tail, shadow)
    kept = verifier.verify(route, token, [_receipt(token, tail, step, outputs[0], session=session),
                                          _receipt(token, shadow, step, outputs[1], session=session)])
    verifier.keep(kept)
    due = verifier.verdicts_due()
    for node_id, reason, evidence in due:
        asyncio.run(verifier.quarantine.add(node_id, reason, evidence))
    return due


RIGHT, WRONG = answer_digest([5]), answer_digest([9])


# --- the route's shadow ------------------------------------------------------------------------------------


def test_a_route_without_a_shadow_is_the_json_it_always_was() -> None:
    route, _ = _route("a", None)
    assert "shadow" not in route.model_dump(mode="json", exclude_none=True)


def test_a_shadow_must_run_the_layers_of_the_hop_it_shadows_and_not_be_on_the_route() -> None:
    with pytest.raises(ValidationError, match="must run layers"):
        Route(model="m", nodes=(_node("head", 0, 1), _node("a", 2, 3)), num_layers=4,
              shadow=ShadowHop(hop_index=1, node=_node("b", 1, 3, start_layer=1)))
    with pytest.raises(ValidationError, match="already"):
        Route(model="m", nodes=(_node("head", 0, 1), _node("a", 2, 3)), num_layers=4,
              shadow=ShadowHop(hop_index=1, node=_node("a", 2, 3)))
    with pytest.raises(ValidationError, match="must run layers"):  # a head's shadow runs the head's layers
        Route(model="m", nodes=(_node("head", 0, 1), _node("a", 2, 3)), num_layers=4,
              shadow=ShadowHop(hop_index=0, node=_node("b", 0, 2)))


def test_a_node_finds_itself_as_the_shadow_of_a_hop() -> None:
    route, _ = _route("a", "b")
    assert route.at(1, "a") == (route.nodes[1], False)
    placed = route.at(1, "b")
    assert placed is not None and placed[1] and placed[0].node_id == "b"
    assert route.at(1, "c") is None and route.at(0, "b") is None
    assert route.shadow_of(1) is not None and route.shadow_of(0) is None


def test_the_tracker_names_a_spare_replica_of_the_same_format_as_shadow() -> None:
    verifier = _verifier(rate=1.0)
    hops = (_node("head", 0, 1), _node("a", 2, 3))
    candidates = [Candidate(node_id=n, endpoint=f"http://127.0.0.1:1/{n}", shard_start=2, shard_end=3,
                            hop_key=node_hop_key(n).public_text, active_sessions=load)
                  for n, load in (("a", 0), ("b", 3), ("c", 1))]
    shadow = verifier.shadow_for(hops, candidates)
    assert shadow is not None and (shadow.hop_index, shadow.node.node_id) == (1, "c")  # the least loaded other
    formats = {"a": NumberFormat("float32", "float", "float32"), "b": NumberFormat("float32", "float", "float32"),
               "c": NumberFormat("bfloat16", "float", "float32")}
    shadow = verifier.shadow_for(hops, candidates, lambda: formats)
    assert shadow is not None and shadow.node.node_id == "b"  # c computes in another format: never compared
    assert _verifier(rate=0.0).shadow_for(hops, candidates) is None
    assert verifier.shadow_for(hops, candidates[:1]) is None  # nobody else holds the layers


def _replicas(*loads: tuple[str, int]) -> list[Candidate]:
    return [Candidate(node_id=n, endpoint=f"http://127.0.0.1:1/{n}", shard_start=2, shard_end=3,
                      hop_key=node_hop_key(n).public_text, active_sessions=load) for n, load in loads]


def test_only_the_tail_is_shadowed_for_its_tokens_never_a_hop_whose_output_is_hidden_states() -> None:
    """Three hops with replicas of the middle one only: no shadow; with a replica of the tail too: the tail's."""
    verifier = _verifier(rate=1.0)
    hops = (_node("head", 0, 1), _node("a", 2, 2), _node("t", 3, 3))
    middle = [Candidate(node_id=n, endpoint=f"http://127.0.0.1:1/{n}", shard_start=2, shard_end=2,
                        hop_key=node_hop_key(n).public_text) for n in ("b", "c")]
    assert verifier.shadow_for(hops, middle) is None
    tails = [Candidate(node_id="t2", endpoint="http://127.0.0.1:1/t2", shard_start=3, shard_end=3,
                       hop_key=node_hop_key("t2").public_text)]
    for _ in range(10):
        shadow = verifier.shadow_for(hops, [*middle, *tails])
        assert shadow is not None and (shadow.hop_index, shadow.node.node_id) == (2, "t2")


def test_a_middle_hop_is_shadowed_only_where_it_and_its_replica_name_the_same_batch_invariant_path() -> None:
    """A hop before the tail outputs hidden states: compared by exact hash only between nodes that register the
    same ``rows_exact`` path (quantized products on the native kernel); a float (BLAS) replica, one on another
    path, or one that says nothing (an older node) is never its shadow. The tail stays compared as before."""
    verifier = _verifier(rate=1.0)
    hops = (_node("head", 0, 1), _node("a", 2, 2), _node("t", 3, 3))
    middle = [Candidate(node_id=n, endpoint=f"http://127.0.0.1:1/{n}", shard_start=2, shard_end=2,
                        hop_key=node_hop_key(n).public_text) for n in ("b", "c", "d")]
    exact = "float32-avx512/native/kv-float32"
    formats = {"a": NumberFormat("float32", "int8", "float32", exact),
               "b": NumberFormat("float32", "int8", "float32", exact),
               "c": NumberFormat("float32", "int8", "float32", "float32-avx2/torch/kv-float32"),
               "d": NumberFormat("float32", "int8", "float32", None), "t": NumberFormat("float32", "int8", "float32")}
    for _ in range(10):
        shadow = verifier.shadow_for(hops, middle, lambda: formats)
        assert shadow is not None and (shadow.hop_index, shadow.node.node_id) == (1, "b")
    blas = {**formats, "a": NumberFormat("float32", "int8", "float32", None)}
    assert verifier.shadow_for(hops, middle, lambda: blas) is None  # the hop itself is not shown invariant
    tails = [Candidate(node_id="t2", endpoint="http://127.0.0.1:1/t2", shard_start=3, shard_end=3,
                       hop_key=node_hop_key("t2").public_text)]
    with_tail = {**blas, "t2": NumberFormat("float32", "int8", "float32")}
    shadow = verifier.shadow_for(hops, [*middle, *tails], lambda: with_tail)
    assert shadow is not None and (shadow.hop_index, shadow.node.node_id) == (2, "t2")


def test_the_head_is_shadowed_by_another_head_on_its_path_never_one_behind_a_relay() -> None:
    """The head's hidden states are compared like a middle hop's: only between heads naming the same
    batch-invariant path, and its shadow must be one the head can dial (not behind a relay)."""
    verifier = _verifier(rate=1.0)
    hops = (_node("head", 0, 1), _node("a", 2, 3))
    exact = NumberFormat("float32", "int8", "float32", "int8/native/kv-float32")
    heads = [Candidate(node_id=n, endpoint=f"http://127.0.0.1:1/{n}", shard_start=0, shard_end=1,
                       hop_key=node_hop_key(n).public_text, relay_addr=relay) for n, relay in (("h2", None),)]
    shadow = verifier.shadow_for(hops, heads, lambda: {"head": exact, "h2": exact, "a": exact})
    assert shadow is not None and (shadow.hop_index, shadow.node.node_id, shadow.node.start_layer) == (0, "h2", 0)
    floats = NumberFormat("float32", "float", "float32")
    assert verifier.shadow_for(hops, heads, lambda: {"head": floats, "h2": floats, "a": floats}) is None
    assert verifier.shadow_for(hops, heads) is None  # formats unknown: tails only
    relayed = [Candidate(node_id="h3", endpoint="http://127.0.0.1:1/h3", shard_start=0, shard_end=1,
                         hop_key=node_hop_key("h3").public_text, relay_addr="relay:1")]
    assert verifier.shadow_for(hops, relayed, lambda: {"head": exact, "h3": exact, "a": exact}) is None


def test_a_registration_that_does_not_say_reads_as_not_batch_invariant() -> None:
    """An older node's registration (no ``rows_exact``) still parses, as not exact; a path name is checked."""
    from meshwire.registry import NodeRegistration

    base = {"node_id": "n", "model": "m", "endpoint": "http://127.0.0.1:9", "shard_start": 0, "shard_end": 1}
    assert NodeRegistration.model_validate(base).rows_exact is None
    path = "float32-avx512/native/kv-float32"
    assert NodeRegistration.model_validate({**base, "rows_exact": path}).rows_exact == path
    for bad in ("", "Float32 avx", "x" * 65):
        with pytest.raises(ValidationError):
            NodeRegistration.model_validate({**base, "rows_exact": bad})


def test_a_decode_row_batched_with_other_company_is_not_the_same_bits(tiny_model_dir: Path) -> None:
    """Why a float (BLAS) hop before the tail is not compared: an honest hop and its shadow batch a session's
    decode row with different other rows, and a float32 row's hidden states then differ in their last bits (so
    their exact hashes differ), while the token the tail picks from them does not. Quantized hops on the native
    kernel are batch-invariant (``tests/test_rows_exact.py``) and are compared; if the float path became so
    too, this fails and float hops could register ``rows_exact``."""
    import torch

    from meshwire.frames import wire_bytes
    from services.node.model.shard_load import load_shard

    shard = load_shard(tiny_model_dir, 0, 3, torch.float32, torch.device("cpu"))
    prompts = [[(11 * s + 5 * i + 1) % shard.vocab_size for i in range(n)] for s, n in enumerate((3, 9, 1, 17, 5))]
    differ = 0
    for company in range(1, len(prompts)):
        caches = []
        for ids in prompts[:company + 1]:
            cache = shard.new_cache()
            shard.run_layers(shard.embed(torch.tensor([ids])), cache, 0)
            caches.append(cache)
        alone_cache = shard.new_cache()
        shard.run_layers(shard.embed(torch.tensor([prompts[0]])), alone_cache, 0)
        tokens = [ids[-1] for ids in prompts[:company + 1]]
        rows = shard.run_rows(shard.embed(torch.tensor([tokens])).transpose(0, 1), caches,
                              [c.seq_len for c in caches], from_layer=0)
        alone = shard.run_layers(shard.embed(torch.tensor([[tokens[0]]])), alone_cache, alone_cache.seq_len)
        differ += sha256_hex(wire_bytes(rows[:1])) != sha256_hex(wire_bytes(alone))
        assert int(shard.logits_rows(rows[:1]).argmax(-1)) == int(shard.logits_rows(alone).argmax(-1))
    assert differ > 0, differ


def test_a_route_through_a_disputed_node_is_shadowed_by_the_replica_that_can_settle_it() -> None:
    """The loaded run that missed the quarantine (issue 37): ``bad`` was the primary of every route and the
    least loaded other replica (``a``) its shadow every time, so ``bad`` was only ever compared with ``a``: one
    dispute, never the second one a majority needs. The replica whose disagreement makes the verdict comes first,
    however loaded it is."""
    verifier = _verifier(rate=1.0)
    _run(verifier, "bad", "a", (WRONG, RIGHT), 1)
    _run(verifier, "a", "b", (RIGHT, RIGHT), 2, session="s2")
    hops = (_node("head", 0, 1), _node("bad", 2, 3))
    candidates = _replicas(("bad", 0), ("a", 0), ("b", 5))
    for _ in range(20):
        shadow = verifier.shadow_for(hops, candidates)
        assert shadow is not None and shadow.node.node_id == "b"
    shadow = verifier.shadow_for((_node("head", 0, 1), _node("b", 2, 3)), candidates)
    assert shadow is not None and shadow.node.node_id == "bad"  # the same comparison, the other way round


def test_a_disputed_node_is_compared_with_a_replica_it_was_never_compared_with_on_its_next_route() -> None:
    """At a low rate a dispute would wait about 1/rate sessions for each comparison a verdict still needs;
    instead the next route through either disputed node, or through a replica that has not yet been compared
    with them, is shadowed at once (the cost is bounded: once per pair of nodes), and rate 0 still checks
    nothing."""
    verifier = _verifier(rate=1e-9)
    hops_a = (_node("head", 0, 1), _node("a", 2, 3))
    candidates = _replicas(("a", 0), ("b", 0), ("c", 9))
    assert verifier.shadow_for(hops_a, candidates) is None  # no dispute: the rate decides
    _run(verifier, "a", "b", (WRONG, RIGHT), 1)
    shadow = verifier.shadow_for(hops_a, candidates)
    assert shadow is not None and shadow.node.node_id == "c"  # never compared with a, though the most loaded
    shadow = verifier.shadow_for((_node("head", 0, 1), _node("c", 2, 3)), candidates)
    assert shadow is not None and shadow.node.node_id in {"a", "b"}
    _run(verifier, "a", "c", (WRONG, RIGHT), 2, session="s2")
    _run(verifier, "b", "c", (RIGHT, RIGHT), 3, session="s3")
    assert verifier.quarantine.ids() == frozenset({"a"})
    assert verifier.shadow_for((_node("head", 0, 1), _node("b", 2, 3)), candidates) is None  # settled
    off = _verifier(rate=0.0)
    _run(off, "a", "b", (WRONG, RIGHT), 1)
    assert off.shadow_for(hops_a, candidates) is None


# --- reports -------------------------------------------------------------------------------------------------


def test_a_forged_receipt_refuses_the_report() -> None:
    verifier = _verifier()
    route, token = _route("a", "b")
    forged = _receipt(token, "a", 1, RIGHT, key=SigningKey.generate())
    with pytest.raises(ReportRefused, match="forged"):
        verifier.verify(route, token, [_receipt(token, "b", 1, RIGHT), forged])
    with pytest.raises(ReportRefused, match="does not name"):  # a node the route does not name at that hop
        verifier.verify(route, token, [_receipt(token, "c", 1, RIGHT)])


def test_a_receipt_reported_twice_or_on_another_route_is_refused_as_a_replay() -> None:
    verifier = _verifier()
    route, token = _route("a", "b")
    receipt = _receipt(token, "a", 1, RIGHT)
    verifier.verify(route, token, [receipt])
    with pytest.raises(ReportRefused, match="replay"):
        verifier.verify(route, token, [receipt])
    other_route, other_token = _route("a", "c")
    with pytest.raises(ReportRefused, match="another route"):
        verifier.verify(other_route, other_token, [_receipt(token, "a", 2, RIGHT)])


# --- verdicts --------------------------------------------------------------------------------------------------


def test_two_replicas_that_disagree_are_reported_and_nobody_is_guessed_at() -> None:
    verifier = _verifier()
    assert _run(verifier, "a", "b", (WRONG, RIGHT), 1) == []
    assert verifier.disputes_of("a") == ["b"] and verifier.disputes_of("b") == ["a"]
    assert verifier.quarantine.ids() == frozenset()


def test_the_node_two_agreeing_replicas_disagree_with_is_quarantined_with_the_receipts() -> None:
    verifier = _verifier()
    _run(verifier, "a", "b", (WRONG, RIGHT), 1)
    assert _run(verifier, "b", "c", (RIGHT, RIGHT), 2) == []  # b and c agree
    due = _run(verifier, "c", "a", (RIGHT, WRONG), 3)
    assert [node for node, _, _ in due] == ["a"]
    record = verifier.quarantine.get("a")
    assert record is not None and "b and c agree" in record.reason and len(record.evidence) == 3
    assert verifier.quarantine.ids() == frozenset({"a"})


def test_agreeing_nodes_are_never_quarantined() -> None:
    verifier = _verifier()
    for step, (tail, shadow) in enumerate([("a", "b"), ("b", "c"), ("c", "a")] * 5):
        assert _run(verifier, tail, shadow, (RIGHT, RIGHT), step, session=f"s{step}") == []
    assert verifier.disputes == {} and verifier.quarantine.ids() == frozenset()


@pytest.fixture(params=["memory", "redis"])
def store_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A store two trackers share: the memory store (one object) or a real, empty Redis."""
    if request.param == "memory":
        yield "memory"
        return
    from tests.redis_server import redis_server, require_redis_server

    require_redis_server()
    with redis_server() as server:
        yield server.url


async def test_the_quarantine_is_kept_in_the_store_for_every_tracker(store_url: str) -> None:
    policy = RegistryPolicy()
    stores = [open_store(store_url, policy, lambda: 0.0)]
    if store_url != "memory":
        stores.append(open_store(store_url, policy, lambda: 0.0))
    for store in stores:
        await store.start()
    try:
        first, second = Quarantine(stores[0]), Quarantine(stores[-1])
        await first.add("a", "it computed wrong", ("r1",))
        await second.refresh()
        assert second.ids() == frozenset({"a"}) and second.get("a").evidence == ("r1",)  # type: ignore[union-attr]
        assert await second.remove("a")
        await first.refresh()
        assert first.ids() == frozenset()
        assert not await first.remove("a")
    finally:
        for store in stores:
            await store.close()


# --- the operator's calls (the tracker app in process) --------------------------------------------------------


async def test_an_operator_readmits_a_quarantined_node_by_admin_call_or_a_new_join_token() -> None:
    import httpx

    from services.tracker.app import create_app
    from services.tracker.settings import TrackerSettings
    from tests.procs import TEST_SECRET

    app = create_app(TrackerSettings(secret=TEST_SECRET, admin_key="admin-key-for-tests"))
    verifier = app.state.tracker.verifier
    admin = {"Authorization": "Bearer admin-key-for-tests"}
    async with (app.router.lifespan_context(app),
                httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://tracker") as client):
        await verifier.quarantine.add("a", "it computed wrong", ("r",))
        secret_only = await client.post("/v1/admin/nodes/a/readmit", headers=bearer(TEST_SECRET))
        assert secret_only.status_code == 403  # with an admin key set, only the admin key re-admits
        assert (await client.post("/v1/admin/nodes/a/readmit", headers=admin)).status_code == 200
        assert verifier.quarantine.ids() == frozenset()
        assert (await client.post("/v1/admin/nodes/a/readmit", headers=admin)).status_code == 404
        await verifier.quarantine.add("a", "it computed wrong again", ("r",))
        issued = await client.post("/v1/admin/tokens", json={"node_id": "a"}, headers=admin)
        assert issued.status_code == 201 and verifier.quarantine.ids() == frozenset()
        assert (await client.post("/v1/admin/verify", json={"rate": 0.5}, headers=admin)).status_code == 200
        assert verifier.rate == 0.5
        bad_rate = await client.post("/v1/admin/verify", json={"rate": 2}, headers=admin)
        assert bad_rate.status_code == 400


def bearer(credential: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {credential}"}


def test_a_shadow_behind_a_relay_may_be_called_by_the_hop_before_it_only() -> None:
    from meshwire.hop_proof import ProofProblem
    from meshwire.relay_auth import check_relay_handshake, relay_handshake
    from meshwire.route_keys import KeySet, jwks_of

    _, token = _route("a", "b")
    keys = KeySet.from_jwks(jwks_of([TEST_ROUTE_KEY]))
    assert check_relay_handshake(relay_handshake(node_hop_key("head"), "head", token, "b"), "b", keys) == "head"
    with pytest.raises(ProofProblem):  # the hop it shadows is not before it
        check_relay_handshake(relay_handshake(node_hop_key("a"), "a", token, "b"), "b", keys)
    with pytest.raises(ProofProblem):  # a node the route does not name at all
        check_relay_handshake(relay_handshake(node_hop_key("head"), "head", token, "c"), "c", keys)


def test_replicas_whose_quantized_products_take_other_rows_are_never_each_others_shadow() -> None:
    verifier = _verifier(rate=1.0)
    hops = (_node("head", 0, 1), _node("a", 2, 3))
    candidates = [Candidate(node_id=n, endpoint=f"http://127.0.0.1:1/{n}", shard_start=2, shard_end=3,
                            hop_key=node_hop_key(n).public_text) for n in ("a", "b")]
    int8, float32 = NumberFormat("float32", "int4", "int8"), NumberFormat("float32", "int4", "float32")
    assert verifier.shadow_for(hops, candidates, lambda: {"a": int8, "b": float32}) is None
    shadow = verifier.shadow_for(hops, candidates, lambda: {"a": int8, "b": int8})
    assert shadow is not None and shadow.node.node_id == "b"
