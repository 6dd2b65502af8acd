"""The route planner: full coverage in layer order, the right replica, honest gaps."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshwire.routes import Route
from services.tracker.planner import (
    Candidate,
    IncompleteCoverage,
    RouteTooLong,
    layer_holders,
    missing_layers,
    plan_route,
)


def node(node_id: str, start: int, end: int, **load: object) -> Candidate:
    return Candidate(node_id=node_id, endpoint=f"http://127.0.0.1:9/{node_id}", shard_start=start,
                     shard_end=end, **load)  # type: ignore[arg-type]


def ids(hops) -> list[str]:
    return [hop.node_id for hop in hops]


# --- properties ---------------------------------------------------------------------------------


@st.composite
def meshes(draw: st.DrawFn) -> tuple[int, list[Candidate], set[str]]:
    num_layers = draw(st.integers(1, 12))
    count = draw(st.integers(0, 8))
    candidates = []
    for i in range(count):
        start = draw(st.integers(0, num_layers - 1))
        end = draw(st.integers(start, num_layers - 1))
        candidates.append(node(
            f"n{i}", start, end,
            active_sessions=draw(st.integers(0, 5)),
            kv_capacity_tokens=draw(st.sampled_from([0, 1000])),
            kv_free_tokens=draw(st.integers(0, 1000)),
            decode_tokens_per_s=draw(st.sampled_from([0.0, 5.0, 50.0])),
            backoff=draw(st.booleans()),
            failure_age_s=draw(st.none() | st.floats(0, 100)),
        ))
    exclude = draw(st.sets(st.sampled_from([f"n{i}" for i in range(max(count, 1))])))
    return num_layers, candidates, exclude


@settings(max_examples=300, deadline=None)
@given(meshes())
def test_a_planned_route_covers_every_layer_once_in_order_or_the_gaps_are_named(mesh) -> None:
    num_layers, candidates, exclude = mesh
    eligible = [c for c in candidates if c.node_id not in exclude]
    uncovered = set(range(num_layers)) - {
        layer for c in eligible for layer in range(c.shard_start, c.shard_end + 1)
    }
    try:
        hops = plan_route(candidates, num_layers, exclude=exclude)
    except IncompleteCoverage as gap:
        named = {layer for a, b in gap.missing for layer in range(a, b + 1)}
        assert uncovered and named == uncovered
        return
    assert not uncovered
    assert hops[0].start_layer == 0
    for previous, hop in itertools.pairwise(hops):
        assert hop.start_layer == previous.shard_end + 1
    for hop in hops:
        assert hop.shard_start <= hop.start_layer <= hop.shard_end
    assert hops[-1].shard_end == num_layers - 1
    assert not set(ids(hops)) & exclude
    Route(model="m", nodes=hops, num_layers=num_layers)  # the shared contract accepts it


@settings(max_examples=200, deadline=None)
@given(meshes())
def test_a_node_in_backoff_is_used_only_where_no_healthy_node_holds_its_layers(mesh) -> None:
    num_layers, candidates, exclude = mesh
    healthy = [c for c in candidates if not c.backoff]
    try:
        plan_route(healthy, num_layers, exclude=exclude)
    except IncompleteCoverage:
        return
    hops = plan_route(candidates, num_layers, exclude=exclude)
    backed_off = {c.node_id for c in candidates if c.backoff}
    assert not set(ids(hops)) & backed_off


# --- choosing among replicas ------------------------------------------------------------------------


def test_a_node_holding_every_layer_serves_alone() -> None:
    hops = plan_route([node("a", 0, 3)], 4)
    assert ids(hops) == ["a"] and hops[0].start_layer == 0


def test_the_least_loaded_replica_is_preferred() -> None:
    busy = node("a", 0, 3, active_sessions=4, decode_tokens_per_s=20.0)
    idle = node("b", 0, 3, active_sessions=0, decode_tokens_per_s=20.0)
    assert ids(plan_route([busy, idle], 4)) == ["b"]


def test_the_faster_replica_is_preferred_when_load_is_equal() -> None:
    slow = node("a", 0, 3, decode_tokens_per_s=5.0)
    fast = node("b", 0, 3, decode_tokens_per_s=50.0)
    assert ids(plan_route([slow, fast], 4)) == ["b"]


def test_the_replica_with_more_free_kv_is_preferred() -> None:
    fuller = node("a", 0, 3, kv_capacity_tokens=1000, kv_free_tokens=100, decode_tokens_per_s=20.0)
    emptier = node("b", 0, 3, kv_capacity_tokens=1000, kv_free_tokens=900, decode_tokens_per_s=20.0)
    assert ids(plan_route([fuller, emptier], 4)) == ["b"]


def test_a_replica_with_no_free_kv_is_avoided_even_when_it_is_faster() -> None:
    full = node("a", 0, 3, kv_capacity_tokens=1000, kv_free_tokens=0, decode_tokens_per_s=500.0)
    roomy = node("b", 0, 3, kv_capacity_tokens=1000, kv_free_tokens=1000, decode_tokens_per_s=5.0)
    assert ids(plan_route([full, roomy], 4)) == ["b"]


def test_one_hop_is_preferred_over_two_equally_fast_ones() -> None:
    whole = node("whole", 0, 3, decode_tokens_per_s=25.0)
    front = node("front", 0, 1, decode_tokens_per_s=50.0)
    back = node("back", 2, 3, decode_tokens_per_s=50.0)
    assert ids(plan_route([front, back, whole], 4)) == ["whole"]


def test_a_head_behind_a_relay_is_avoided_while_a_reachable_one_exists() -> None:
    relayed = node("relayed", 0, 3, relay_addr="ws://relay:8003/rpc/relayed", decode_tokens_per_s=500.0)
    direct = node("direct", 0, 3, decode_tokens_per_s=5.0)
    assert ids(plan_route([relayed, direct], 4)) == ["direct"]
    behind = node("behind", 2, 3, relay_addr="ws://relay:8003/rpc/behind")
    assert ids(plan_route([node("front", 0, 1), behind], 4)) == ["front", "behind"]


def test_equal_replicas_are_chosen_deterministically() -> None:
    replicas = [node("b", 0, 3), node("a", 0, 3)]
    assert ids(plan_route(replicas, 4)) == ids(plan_route(list(reversed(replicas)), 4)) == ["a"]


# --- layer ranges -------------------------------------------------------------------------------------


def test_split_ranges_chain_in_layer_order() -> None:
    hops = plan_route([node("tail", 2, 3), node("head", 0, 1)], 4)
    assert ids(hops) == ["head", "tail"]
    assert [h.start_layer for h in hops] == [0, 2]


def test_an_overlapping_hop_starts_after_the_previous_hop() -> None:
    hops = plan_route([node("a", 0, 2), node("b", 1, 3)], 4)
    assert ids(hops) == ["a", "b"]
    assert hops[1].start_layer == 3 and hops[1].shard_start == 1


def test_a_node_whose_range_does_not_fit_the_model_is_not_used() -> None:
    with pytest.raises(IncompleteCoverage):
        plan_route([node("too-long", 0, 7)], 4)


def test_missing_layers_are_named_as_ranges() -> None:
    with pytest.raises(IncompleteCoverage) as gap:
        plan_route([node("a", 0, 1), node("b", 4, 5)], 8)
    assert gap.value.missing == ((2, 3), (6, 7))
    assert "2-3, 6-7" in str(gap.value)


def test_no_node_at_all_misses_every_layer() -> None:
    with pytest.raises(IncompleteCoverage) as gap:
        plan_route([], 4)
    assert gap.value.missing == ((0, 3),)


# --- exclude and backoff ------------------------------------------------------------------------------


def test_an_excluded_node_is_replaced_by_a_replica() -> None:
    assert ids(plan_route([node("a", 0, 3), node("b", 0, 3)], 4, exclude={"a"})) == ["b"]


def test_excluding_the_only_holder_of_a_range_leaves_a_gap() -> None:
    with pytest.raises(IncompleteCoverage) as gap:
        plan_route([node("a", 0, 1), node("b", 2, 3)], 4, exclude={"b"})
    assert gap.value.missing == ((2, 3),)


def test_a_node_in_backoff_is_avoided_while_a_replica_exists() -> None:
    failing = node("a", 0, 3, backoff=True, failure_age_s=1.0, decode_tokens_per_s=500.0)
    assert ids(plan_route([failing, node("b", 0, 3)], 4)) == ["b"]


def test_the_only_holder_of_a_range_stays_eligible_in_backoff() -> None:
    hops = plan_route([node("a", 0, 1), node("b", 2, 3, backoff=True, failure_age_s=1.0)], 4)
    assert ids(hops) == ["a", "b"]


def test_when_every_holder_is_in_backoff_the_least_recently_failed_serves() -> None:
    recent = node("a", 0, 3, backoff=True, failure_age_s=1.0)
    older = node("b", 0, 3, backoff=True, failure_age_s=30.0)
    assert ids(plan_route([recent, older], 4)) == ["b"]


def test_a_route_longer_than_the_hop_limit_is_refused() -> None:
    chain = [node(f"n{i}", i, i) for i in range(5)]
    with pytest.raises(RouteTooLong):
        plan_route(chain, 5, max_hops=4)


# --- coverage helpers --------------------------------------------------------------------------------


def test_missing_layers_merges_overlapping_ranges() -> None:
    assert missing_layers([(0, 2), (1, 3), (6, 9)], 10) == ((4, 5),)
    assert missing_layers([], 3) == ((0, 2),)
    assert missing_layers([(0, 9)], 10) == ()


def test_layer_holders_counts_replicas_per_layer() -> None:
    assert layer_holders([(0, 1), (1, 3), (0, 3)], 4) == (2, 3, 2, 2)
