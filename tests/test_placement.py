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
    heal,
    place,
    stage_times,
    uncovered_runs,
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

def test_a_replica_moves_wholly_to_layers_that_lost_their_last_holder() -> None:
    replica = Holder("c", 4, 7, 0.002)
    assert heal(COSTS, needs(4, head=True), replica, [Holder("b", 4, 7, 0.002)], KV) == Placement(0, 3, "covering")


def test_a_node_that_holds_layers_alone_grows_toward_the_gap_next_to_it_as_far_as_it_fits() -> None:
    own = Holder("b", 4, 7, 0.002)
    assert heal(COSTS, needs(6, tail=True), own, [], KV) == Placement(2, 7, "covering")
    assert heal(COSTS, needs(8, head=True, tail=True), own, [], KV) == Placement(0, 7, "covering")


def test_a_node_without_room_stays_where_it_is() -> None:
    assert heal(COSTS, needs(4, tail=True), Holder("b", 4, 7, 0.002), [], KV) is None


def test_nothing_moves_while_every_layer_is_held() -> None:
    holders = [Holder("a", 0, 3, 0.002), Holder("b", 4, 7, 0.002)]
    assert heal(COSTS, needs(8, head=True, tail=True), Holder("c", 4, 7, 0.001), holders, KV) is None


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
