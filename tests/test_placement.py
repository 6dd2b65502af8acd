"""The placement planner alone: a node without ``--layers`` covers the model first, then the slowest stage.

Costs are round numbers: a layer weighs 10 units and each layer keeps 1 unit of KV
room (``kv_reserve_tokens=1`` at 1 byte a token), so a layer needs 11; the
embedding and LM head weigh 5 each.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from fastapi.testclient import TestClient

from meshwire.auth import bearer_headers
from meshwire.headers import LEASE
from services.tracker.app import create_app
from services.tracker.healing import GAP_GRACE_S
from services.tracker.placement import (
    DEFAULT_KV_RESERVE_TOKENS,
    MIN_SECONDS_PER_LAYER,
    CannotHoldLayer,
    Holder,
    LayerCosts,
    Placement,
    clamp_speed,
    format_bytes,
    place,
    stage_times,
    uncovered_runs,
)
from services.tracker.placement_rebalance import (
    KV_RESERVE_LEVELS,
    MIN_KV_RESERVE_TOKENS,
    CannotCover,
    Movable,
    rebalance,
)
from services.tracker.settings import TrackerSettings
from tests.procs import TEST_SECRET

COSTS = LayerCosts(num_layers=8, layer_bytes=10, kv_bytes_per_token=1, head_bytes=5, tail_bytes=5)
KV = 1


def needs(layers: int, *, head: bool = False, tail: bool = False) -> int:
    return layers * 11 + (5 if head else 0) + (5 if tail else 0)


def test_the_first_node_takes_as_many_layers_from_layer_0_as_its_memory_holds() -> None:
    assert place(COSTS, needs(4, head=True), [], KV) == Placement(0, 3, "covering")
    assert place(COSTS, needs(4, head=True) - 1, [], KV) == Placement(0, 2, "covering")


def test_a_node_that_holds_everything_takes_every_layer() -> None:
    assert place(COSTS, needs(8, head=True, tail=True), [], KV) == Placement(0, 7, "covering")


def test_the_second_node_covers_the_gap_left_by_the_first() -> None:
    assert place(COSTS, needs(4, tail=True), [Holder("a", 0, 3, 0.01)], KV) == Placement(4, 7, "covering")


def test_a_node_too_small_for_the_gap_fills_as_much_of_it_as_it_can() -> None:
    assert place(COSTS, needs(2), [Holder("a", 0, 3, 0.01)], KV) == Placement(4, 5, "covering")


def test_a_gap_that_starts_at_the_embedding_is_filled_from_its_end_when_that_holds_more() -> None:
    # From layer 0 only one layer fits beside the embedding; from the gap's end, two layers without it.
    assert place(COSTS, needs(2), [Holder("a", 3, 7, 0.01)], KV) == Placement(1, 2, "covering")


def test_the_largest_uncovered_run_wins_and_ties_go_to_the_lower_layers() -> None:
    holders = [Holder("a", 2, 2, 0.01), Holder("b", 5, 5, 0.01)]  # runs 0-1, 3-4, 6-7
    assert place(COSTS, needs(2, head=True, tail=True), holders, KV) == Placement(0, 1, "covering")
    holders = [Holder("a", 0, 0, 0.01), Holder("b", 3, 3, 0.01)]  # runs 1-2, 4-7
    assert place(COSTS, needs(4, tail=True), holders, KV) == Placement(4, 7, "covering")


def test_once_covered_a_node_takes_a_replica_of_the_slowest_stage() -> None:
    holders = [Holder("fast", 0, 3, 0.001), Holder("slow", 4, 7, 0.004)]
    assert place(COSTS, needs(8, head=True, tail=True), holders, KV) == Placement(4, 7, "replica")


def test_a_stage_with_more_layers_is_slower_at_the_same_speed() -> None:
    holders = [Holder("a", 0, 1, 0.002), Holder("b", 2, 7, 0.002)]
    assert place(COSTS, needs(8, head=True, tail=True), holders, KV) == Placement(2, 7, "replica")


def test_replicas_count_the_stage_held_twice_is_no_longer_the_slowest() -> None:
    holders = [Holder("a", 0, 3, 0.002), Holder("b", 4, 7, 0.002), Holder("c", 4, 7, 0.002)]
    assert stage_times(holders, 8) == pytest.approx({(0, 3): 0.008, (4, 7): 0.004})
    assert place(COSTS, needs(8, head=True, tail=True), holders, KV) == Placement(0, 3, "replica")


def test_equal_stages_tie_to_the_lower_range_every_time() -> None:
    holders = [Holder("b", 4, 7, 0.002), Holder("a", 0, 3, 0.002)]
    for order in (holders, holders[::-1]):
        assert place(COSTS, needs(8, head=True, tail=True), order, KV) == Placement(0, 3, "replica")


def test_a_replica_that_does_not_fit_whole_takes_as_much_of_the_slowest_stage_as_fits() -> None:
    holders = [Holder("fast", 0, 3, 0.001), Holder("slow", 4, 7, 0.004)]
    assert place(COSTS, needs(2), holders, KV) == Placement(4, 5, "replica")


def test_a_node_that_lies_about_its_speed_gets_no_more_than_its_memory_holds() -> None:
    # Speed is not even an input of the asker's range: only memory is. A holder that claims an absurd speed
    # is clamped, so its stage does not look infinitely fast next to honest ones.
    assert clamp_speed(1e-300) == MIN_SECONDS_PER_LAYER
    liar = [Holder("liar", 0, 3, 1e-300), Holder("honest", 4, 7, 0.002)]
    assert place(COSTS, needs(2, head=True), liar, KV) == Placement(4, 5, "replica")
    times = stage_times(liar, 8)
    assert times[(0, 3)] == pytest.approx(4 * MIN_SECONDS_PER_LAYER)


def test_heterogeneous_memories_place_a_mesh_that_covers_every_layer() -> None:
    budgets = [needs(5, head=True), needs(1), needs(3, tail=True)]
    holders: list[Holder] = []
    for index, budget in enumerate(budgets):
        placed = place(COSTS, budget, holders, KV)
        assert placed.reason == "covering"
        assert COSTS.needed_bytes(placed.start, placed.end, KV) <= budget
        holders.append(Holder(f"n{index}", placed.start, placed.end, 0.001))
    assert uncovered_runs(holders, 8) == []
    assert [(h.start, h.end) for h in holders] == [(0, 4), (5, 5), (6, 7)]


def test_holders_of_unknown_speed_count_at_the_others_median() -> None:
    holders = [Holder("a", 0, 3, 0.0), Holder("b", 4, 7, 0.002)]
    assert stage_times(holders, 8) == pytest.approx({(0, 3): 0.008, (4, 7): 0.008})


def test_a_node_that_cannot_hold_one_layer_is_refused_naming_its_budget_and_the_need() -> None:
    with pytest.raises(CannotHoldLayer) as refused:
        place(COSTS, needs(1) - 1, [], KV)
    assert refused.value.needed_bytes == needs(1)
    assert "10 B" in str(refused.value) and "11 B" in str(refused.value)


def test_a_node_that_holds_only_a_middle_layer_covers_a_middle_gap_and_never_the_embedding() -> None:
    assert place(COSTS, needs(1), [], KV) == Placement(1, 1, "covering")


def test_kv_room_is_part_of_what_a_layer_needs() -> None:
    assert COSTS.needed_bytes(1, 2, kv_reserve_tokens=100) == 2 * (10 + 100)
    assert format_bytes(80 * 1024 * 1024) == "80.0 MiB"


# --- the endpoint, against the tracker app in process ----------------------------------------------------------

def _ask(client: httpx.Client, node_id: str, budget: int, **extra: object) -> httpx.Response:
    body = {"node_id": node_id, "model": "tiny", "num_layers": 8, "max_memory_bytes": budget, "layer_bytes": 10,
            "kv_bytes_per_token": 1, "head_bytes": 5, "tail_bytes": 5, "seconds_per_layer": 0.001, **extra}
    return client.post("/v1/placement", json=body, headers=bearer_headers(TEST_SECRET))


@pytest.fixture
def tracker_client() -> Iterator[httpx.Client]:
    app = create_app(TrackerSettings(secret=TEST_SECRET))
    with TestClient(app) as client:
        yield client


def test_nodes_asking_together_are_given_different_ranges_before_either_registers(
        tracker_client: httpx.Client) -> None:
    budget = 4 * (10 + DEFAULT_KV_RESERVE_TOKENS) + 5  # four layers with the embedding or the LM head
    first, second = _ask(tracker_client, "a", budget).json(), _ask(tracker_client, "b", budget).json()
    assert (first["shard_start"], first["shard_end"], first["reason"]) == (0, 3, "covering")
    assert (second["shard_start"], second["shard_end"], second["reason"]) == (4, 7, "covering")
    assert first["kv_reserve_tokens"] == DEFAULT_KV_RESERVE_TOKENS
    again = _ask(tracker_client, "a", budget).json()  # asking again replaces its own reservation
    assert (again["shard_start"], again["shard_end"]) == (0, 3)
    third = _ask(tracker_client, "c", budget).json()
    assert third["reason"] == "replica"


def test_a_budget_below_one_layer_is_a_422_naming_the_budget_and_the_need(tracker_client: httpx.Client) -> None:
    refused = _ask(tracker_client, "tiny-node", 100)
    assert refused.status_code == 422
    error = refused.json()["error"]
    assert error["code"] == "cannot_hold_layer" and "100 B" in error["message"]
    assert error["needed_bytes"] == 10 + DEFAULT_KV_RESERVE_TOKENS


def test_a_placement_request_without_a_credential_is_refused_before_it_is_read(tracker_client: httpx.Client) -> None:
    assert tracker_client.post("/v1/placement", content=b"not json").status_code == 401
    bad = tracker_client.post("/v1/placement", content=b"not json", headers=bearer_headers(TEST_SECRET))
    assert bad.status_code == 400


# --- healing -------------------------------------------------------------------------------------------------

def movable(holder: Holder, budget: int, costs: LayerCosts = COSTS) -> Movable:
    return Movable(holder, costs, budget)


# KV room in these units: a plan is sought with KV_RESERVE_LEVELS tokens a layer at 1 byte each, so a layer
# needs 10 + 1024 at first, then 10 + 512, then 10 + 256.
L0, L1, L2 = (10 + tokens for tokens in KV_RESERVE_LEVELS)


def test_a_replica_moves_wholly_to_layers_that_lost_their_last_holder() -> None:
    replica = movable(Holder("c", 4, 7), 4 * L0 + 5)
    plan = rebalance([replica], [Holder("b", 4, 7)], 8)
    assert plan.moves == {"c": Placement(0, 3, "covering")} and plan.kv_reserve_tokens == KV_RESERVE_LEVELS[0]


def test_a_node_that_holds_layers_alone_grows_toward_the_gap_next_to_it_as_far_as_it_fits() -> None:
    assert rebalance([movable(Holder("b", 4, 7), 8 * L0 + 10)], [], 8).moves == {"b": Placement(0, 7, "covering")}


def test_nothing_moves_while_every_layer_is_held() -> None:
    plan = rebalance([movable(Holder("c", 4, 7), 10**6)], [Holder("a", 0, 3), Holder("b", 4, 7)], 8)
    assert plan.moves == {}


def test_survivors_that_cannot_take_the_gap_as_they_are_are_re_cut_evenly_by_their_budgets() -> None:
    # a held 0-1, b 2-3 and c 4-7 died; a and b together hold the model only by both moving: a grows to 0-3,
    # b shifts to 4-7 (it drops 2-3, which a then holds).
    budget = 4 * L0 + 5
    plan = rebalance([movable(Holder("a", 0, 1), budget), movable(Holder("b", 2, 3), budget)], [], 8)
    assert plan.moves == {"a": Placement(0, 3, "covering"), "b": Placement(4, 7, "covering")}


def test_the_fewest_nodes_move_and_pinned_nodes_stay_where_they_are() -> None:
    budget = 4 * L0 + 5
    nodes = [movable(Holder("a", 0, 1), budget), movable(Holder("b", 2, 3), budget)]
    plan = rebalance(nodes, [Holder("pinned", 6, 7)], 8)  # b grows to 2-5; a need not move
    assert plan.moves == {"b": Placement(2, 5, "covering")}


def test_kv_room_gives_way_to_coverage_down_to_its_floor() -> None:
    # Two nodes that hold half the model each with 512 tokens of KV room a layer, not with 1024.
    budget = 4 * L1 + 5
    plan = rebalance([movable(Holder("a", 0, 1), budget), movable(Holder("b", 6, 7), budget)], [], 8)
    assert plan.kv_reserve_tokens == KV_RESERVE_LEVELS[1]
    assert plan.moves == {"a": Placement(0, 3, "covering"), "b": Placement(4, 7, "covering")}


def test_when_the_budgets_cannot_hold_the_model_the_plan_says_so_and_why() -> None:
    budget = 4 * L2  # not even four layers with the embedding at the floor's KV room
    with pytest.raises(CannotCover) as refused:
        rebalance([movable(Holder("a", 0, 1), budget), movable(Holder("b", 6, 7), budget)], [], 8)
    message = str(refused.value)
    assert "layers 2-5 cannot be restored" in message and f"{MIN_KV_RESERVE_TOKENS} tokens of KV room" in message
    assert format_bytes(2 * budget) in message


def test_the_default_model_at_80_mb_a_node_is_covered_again_by_any_two_of_three() -> None:
    """SmolLM2-135M-Instruct's int4 layers as a node measures them: 3 nodes at 80 MB cover its 30 layers; any
    two left hold them again (with 512 tokens of KV room a layer, not 1024), by both moving."""
    smol = LayerCosts(num_layers=30, layer_bytes=2_216_448, kv_bytes_per_token=1536, head_bytes=31_850_752,
                      tail_bytes=31_853_056)
    budget = 80_000_000
    holders: list[Holder] = []
    for node_id in "abc":
        placed = place(smol, budget, holders)
        holders.append(Holder(node_id, placed.start, placed.end))
    assert not uncovered_runs(holders, 30)
    for dead in "abc":
        survivors = [movable(h, budget, smol) for h in holders if h.node_id != dead]
        plan = rebalance(survivors, [], 30)
        after = [plan.moves.get(m.holder.node_id, Placement(m.holder.start, m.holder.end, "covering"))
                 for m in survivors]
        assert not uncovered_runs([Holder(str(i), p.start, p.end) for i, p in enumerate(after)], 30), (dead, plan)
        assert all(smol.needed_bytes(h.start, h.end, plan.kv_reserve_tokens) <= budget for h in after)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _register(client: TestClient, node_id: str, start: int, end: int, placement: str,
              lease: str | None = None) -> dict[str, object]:
    body = {"node_id": node_id, "model": "tiny", "endpoint": f"http://127.0.0.1:{9000 + ord(node_id[0])}",
            "shard_start": start, "shard_end": end, "num_layers": 8, "placement": placement}
    headers = {**bearer_headers(TEST_SECRET), **({LEASE: lease} if lease else {})}
    answer = client.post("/v1/nodes", json=body, headers=headers)
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def test_when_a_node_leaves_layers_another_still_holds_nobody_is_moved() -> None:
    clock = Clock()
    with TestClient(create_app(TrackerSettings(secret=TEST_SECRET), clock=clock)) as client:
        budget = 4 * (10 + DEFAULT_KV_RESERVE_TOKENS) + 5
        leases = {}
        for node_id in ("a", "b", "c"):
            placed = _ask(client, node_id, budget).json()
            leases[node_id] = _register(client, node_id, placed["shard_start"], placed["shard_end"],
                                        placed["reason"])["lease"]
        assert client.request("DELETE", "/v1/nodes/a", headers={**bearer_headers(TEST_SECRET),
                                                                LEASE: str(leases["a"])}).status_code == 200
        clock.now += GAP_GRACE_S + 1
        assert _register(client, "b", 4, 7, "covering", leases["b"])["move"] is None
        assert _register(client, "c", 0, 3, "replica", leases["c"])["move"] is None  # c still holds 0-3


def test_a_replica_of_surviving_layers_moves_to_the_lost_ones_and_is_then_left_alone() -> None:
    clock = Clock()
    with TestClient(create_app(TrackerSettings(secret=TEST_SECRET), clock=clock)) as client:
        budget = 4 * (10 + DEFAULT_KV_RESERVE_TOKENS) + 5
        leases = {node_id: _register(client, node_id, start, end, reason)["lease"]
                  for node_id, start, end, reason in (("a", 0, 3, "covering"), ("b", 4, 7, "covering"))}
        placed = _ask(client, "c", budget).json()
        assert (placed["shard_start"], placed["shard_end"], placed["reason"]) == (0, 3, "replica")
        leases["c"] = _register(client, "c", 0, 3, "replica")["lease"]
        client.request("DELETE", "/v1/nodes/b", headers={**bearer_headers(TEST_SECRET), LEASE: str(leases["b"])})
        _register(client, "c", 0, 3, "replica", leases["c"])  # the gap is seen
        clock.now += GAP_GRACE_S + 1
        move = _register(client, "c", 0, 3, "replica", leases["c"])["move"]
        assert (move["shard_start"], move["shard_end"], move["reason"]) == (4, 7, "covering")
        assert _register(client, "a", 0, 3, "covering", leases["a"])["move"] is None  # one node per gap
        again = _register(client, "c", 0, 3, "replica", leases["c"])["move"]  # told again until it moves
        assert again == move
        assert _register(client, "c", 4, 7, "covering", leases["c"])["move"] is None  # moved: left alone
        clock.now += 1
        assert _register(client, "c", 4, 7, "covering", leases["c"])["move"] is None


def test_a_node_that_must_drop_layers_is_told_only_once_another_node_holds_them() -> None:
    """a (0-1) dies; b (2-5) and c (6-7) hold the model again only as b 0-3 and c 4-7: c grows at once, b,
    which drops 4-5, is told once c has registered them, so no held layer goes uncovered meanwhile."""
    clock = Clock()
    with TestClient(create_app(TrackerSettings(secret=TEST_SECRET), clock=clock)) as client:
        budget = 4 * L1 + 5
        leases = {}
        for node_id, start, end in (("a", 0, 1), ("b", 2, 5), ("c", 6, 7)):
            assert _ask(client, node_id, budget).status_code == 200  # the tracker now knows its costs and budget
            leases[node_id] = _register(client, node_id, start, end, "covering")["lease"]
        client.request("DELETE", "/v1/nodes/a", headers={**bearer_headers(TEST_SECRET), LEASE: str(leases["a"])})
        _register(client, "b", 2, 5, "covering", leases["b"])  # the gap is seen
        clock.now += GAP_GRACE_S + 1
        assert _register(client, "b", 2, 5, "covering", leases["b"])["move"] is None  # 4-5 would go uncovered
        grow = _register(client, "c", 6, 7, "covering", leases["c"])["move"]
        assert (grow["shard_start"], grow["shard_end"], grow["kv_reserve_tokens"]) == (4, 7, KV_RESERVE_LEVELS[1])
        assert _register(client, "b", 2, 5, "covering", leases["b"])["move"] is None  # c has not loaded them yet
        assert _register(client, "c", 4, 7, "covering", leases["c"])["move"] is None  # c moved
        shift = _register(client, "b", 2, 5, "covering", leases["b"])["move"]
        assert (shift["shard_start"], shift["shard_end"]) == (0, 3)
        _register(client, "b", 0, 3, "covering", leases["b"])
        nodes = client.get("/v1/nodes").json()
        assert nodes["models"][0]["complete"] and nodes["models"][0]["healing"] is None
        moves = [(m["node_id"], m["event"], tuple(m["to_layers"])) for m in nodes["models"][0]["moves"]]
        assert moves == [("c", "told", (4, 7)), ("c", "done", (4, 7)), ("b", "told", (0, 3)), ("b", "done", (0, 3))]


def test_when_the_survivors_cannot_hold_the_model_the_nodes_list_says_why() -> None:
    clock = Clock()
    with TestClient(create_app(TrackerSettings(secret=TEST_SECRET), clock=clock)) as client:
        budget = L0 + 16  # two such budgets fall short of 8 layers at the floor's KV room (2 x 1050 < 8 x 266 + 10)
        leases = {}
        for node_id, start, end in (("a", 0, 1), ("b", 2, 3)):
            assert _ask(client, node_id, budget).status_code == 200
            leases[node_id] = _register(client, node_id, start, end, "covering")["lease"]
        _register(client, "b", 2, 3, "covering", leases["b"])  # layers 4-7 were never held: the gap is seen
        clock.now += GAP_GRACE_S + 1
        assert _register(client, "b", 2, 3, "covering", leases["b"])["move"] is None
        healing = client.get("/v1/nodes").json()["models"][0]["healing"]
        assert "layers 4-7 cannot be restored" in healing and "2 movable placed node(s)" in healing
        assert "healing" not in _route_error(client)  # no plan covers the gap: a head need not wait for it


def _route_error(client: TestClient) -> dict[str, object]:
    answer = client.get("/v1/route", params={"model": "tiny"}, headers=bearer_headers(TEST_SECRET))
    assert answer.status_code == 503, answer.text
    return dict(answer.json()["error"])


def test_a_gap_placed_nodes_may_heal_is_a_no_route_that_says_healing_and_a_pinned_one_is_not() -> None:
    """A head's failover waits for a gap the tracker is healing, and gives up at once on one nobody heals."""
    clock = Clock()
    with TestClient(create_app(TrackerSettings(secret=TEST_SECRET), clock=clock)) as client:
        budget = 4 * (10 + DEFAULT_KV_RESERVE_TOKENS) + 5
        leases = {}
        for node_id in ("a", "b"):
            placed = _ask(client, node_id, budget).json()
            leases[node_id] = _register(client, node_id, placed["shard_start"], placed["shard_end"],
                                        placed["reason"])["lease"]
        client.request("DELETE", "/v1/nodes/b", headers={**bearer_headers(TEST_SECRET), LEASE: str(leases["b"])})
        error = _route_error(client)
        assert error["code"] == "no_route" and error["healing"] is True
    with TestClient(create_app(TrackerSettings(secret=TEST_SECRET), clock=clock)) as client:
        _register(client, "a", 0, 3, "pinned")
        error = _route_error(client)
        assert error["code"] == "no_route" and "healing" not in error
