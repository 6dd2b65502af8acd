"""Placement by speed, on the planner alone: faster nodes take more layers within their budgets.

Costs as in :mod:`tests.test_placement`: a layer weighs 10 units, the embedding and LM head 5
each (so the LM head counts as half a layer of decode work); KV room is 1024 units a layer at the
:data:`~services.tracker.placement.DEFAULT_KV_RESERVE_TOKENS` a tune keeps, so a layer needs ``L0``.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from services.tracker.app import create_app
from services.tracker.placement import Holder, Placement, stage_times
from services.tracker.placement_rebalance import MAX_SPEEDUP, believed_speeds, rebalance
from services.tracker.placement_tune import TUNE_GAIN, slowest_stage_s, tune
from services.tracker.settings import TrackerSettings
from tests.procs import TEST_SECRET
from tests.test_placement import COSTS, L0, Clock, _ask, _register, movable

BIG = 8 * L0 + 10  # holds every layer, the embedding and the LM head
SLOW, FAST = 0.004, 0.001


def test_the_lm_head_counts_on_the_last_stage_as_its_bytes_in_layers() -> None:
    assert COSTS.tail_extra_layers == 0.5
    times = stage_times([Holder("a", 0, 3, 0.001), Holder("b", 4, 7, 0.001)], 8, COSTS.tail_extra_layers)
    assert times == pytest.approx({(0, 3): 0.004, (4, 7): 0.0045})


def test_a_faster_node_takes_more_layers_where_memory_is_not_binding() -> None:
    # a is four times slower than b: a 0-3 and b 4-7 take 16 and 4.5 ms a row; a 0-0 and b 1-7 take 4 and 7.5.
    nodes = [movable(Holder("a", 0, 3, SLOW), BIG), movable(Holder("b", 4, 7, FAST), BIG)]
    plan = tune(nodes, [], 8)
    assert plan.moves == {"a": Placement(0, 0, "covering"), "b": Placement(1, 7, "covering")}


def test_a_fast_node_with_little_memory_keeps_what_its_memory_holds_and_the_slow_one_the_rest() -> None:
    # b is fast but holds 4 layers at most with the LM head: a keeps 0-3, nothing can be gained.
    nodes = [movable(Holder("a", 0, 3, SLOW), BIG), movable(Holder("b", 4, 7, FAST), 4 * L0 + 5)]
    assert tune(nodes, [], 8).moves == {}
    # with room for 5 layers b takes one more: 12 ms instead of 16 is a gain worth a move.
    nodes = [movable(Holder("a", 0, 3, SLOW), BIG), movable(Holder("b", 4, 7, FAST), 5 * L0 + 5)]
    assert tune(nodes, [], 8).moves == {"a": Placement(0, 2, "covering"), "b": Placement(3, 7, "covering")}


def test_nodes_of_equal_speed_are_left_alone_and_ties_move_nobody() -> None:
    nodes = [movable(Holder("a", 0, 3, FAST), BIG), movable(Holder("b", 4, 7, FAST), BIG)]
    assert tune(nodes, [], 8).moves == {}
    nodes = [movable(Holder("a", 0, 4, FAST), BIG), movable(Holder("b", 5, 7, FAST), BIG)]
    assert tune(nodes, [], 8).moves == {}  # 5 against 3.5 layers: an even cut gains less than TUNE_GAIN


def test_a_re_cut_that_gains_less_than_the_damping_factor_moves_nobody() -> None:
    # 5 ms a row against 4.5 at best: the cut is near enough.
    nodes = [movable(Holder("a", 0, 4, 0.001), BIG), movable(Holder("b", 5, 7, 0.0009), BIG)]
    now = slowest_stage_s([m.holder for m in nodes], 8, COSTS.tail_extra_layers)
    assert now < TUNE_GAIN * 0.0045 and tune(nodes, [], 8).moves == {}


def test_a_node_that_lies_about_its_speed_is_believed_only_a_bounded_factor_faster() -> None:
    holders = [Holder("liar", 0, 3, 1e-300), Holder("b", 4, 5, 0.002), Holder("c", 6, 7, 0.002)]
    assert believed_speeds(holders)["liar"] == pytest.approx(0.002 / MAX_SPEEDUP)
    plan = tune([movable(h, BIG) for h in holders], [], 8)
    after = {m: plan.moves.get(m, Placement(h.start, h.end, "covering")) for m, h in
             ((h.node_id, h) for h in holders)}
    # believed 4x faster, it takes most layers but the honest nodes keep theirs: not every layer it could hold
    liar = after["liar"]
    assert liar.end - liar.start + 1 < 8 and all(after[n].end >= after[n].start for n in "bc")
    assert {(p.start, p.end) for p in after.values()} == {(0, 5), (6, 6), (7, 7)}


def test_a_replica_stays_where_it_was_placed_and_pinned_nodes_do_not_move() -> None:
    nodes = [movable(Holder("a", 0, 3, SLOW), BIG), movable(Holder("r", 0, 3, SLOW), BIG),
             movable(Holder("b", 4, 7, FAST), BIG)]
    assert tune(nodes, [], 8).moves == {}  # a and r are each other's replicas: the chain is b alone
    plan = tune([movable(Holder("b", 4, 7, FAST), BIG)], [Holder("pinned", 0, 3, SLOW)], 8)
    assert plan.moves == {}


def test_a_mesh_with_a_gap_is_not_tuned() -> None:
    assert tune([movable(Holder("a", 0, 3, SLOW), BIG)], [], 8).moves == {}


def test_healing_gives_the_gap_to_the_faster_survivor_where_either_could_take_it() -> None:
    # b (2-5) died; a or c can grow over 2-5 with one move each: the fast one does.
    for fast, expected in (("a", Placement(0, 5, "covering")), ("c", Placement(2, 7, "covering"))):
        nodes = [movable(Holder(n, s, e, FAST if n == fast else SLOW), BIG) for n, s, e in (("a", 0, 1), ("c", 6, 7))]
        assert rebalance(nodes, [], 8).moves == {fast: expected}


def test_a_covered_mesh_placed_slow_node_first_is_re_cut_by_speed_growers_first() -> None:
    """a (4x slower) asked first and took 0-5; b took 6-7. b grows to 2-7 at once; a, which drops 2-5, is
    told to shrink to 0-1 only once b has registered them."""
    clock = Clock()
    with TestClient(create_app(TrackerSettings(secret=TEST_SECRET), clock=clock)) as client:
        budget = 6 * L0 + 5
        leases = {}
        for node_id, speed in (("a", SLOW), ("b", FAST)):
            placed = _ask(client, node_id, budget, seconds_per_layer=speed).json()
            leases[node_id] = _register(client, node_id, placed["shard_start"], placed["shard_end"],
                                        placed["reason"])["lease"]
        assert [(placed["shard_start"], placed["shard_end"])] == [(6, 7)]
        assert _register(client, "a", 0, 5, "covering", leases["a"])["move"] is None  # 2-5 held by a alone
        grow = _register(client, "b", 6, 7, "covering", leases["b"])["move"]
        assert (grow["shard_start"], grow["shard_end"]) == (2, 7)
        assert _register(client, "a", 0, 5, "covering", leases["a"])["move"] is None  # b has not loaded them
        assert _register(client, "b", 2, 7, "covering", leases["b"])["move"] is None
        shrink = _register(client, "a", 0, 5, "covering", leases["a"])["move"]
        assert (shrink["shard_start"], shrink["shard_end"]) == (0, 1)
        assert _register(client, "a", 0, 1, "covering", leases["a"])["move"] is None
        clock.now += 1
        assert _register(client, "a", 0, 1, "covering", leases["a"])["move"] is None  # settled
        assert _register(client, "b", 2, 7, "covering", leases["b"])["move"] is None
        moves = client.get("/v1/nodes").json()["models"][0]["moves"]
        assert [(m["node_id"], m["event"], m["why"]) for m in moves] == [
            ("b", "told", "speed"), ("b", "done", "speed"), ("a", "told", "speed"), ("a", "done", "speed")]
