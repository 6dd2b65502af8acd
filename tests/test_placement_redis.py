"""Placement with two trackers on one real Redis: claims in the store keep them from placing or moving twice.

Two tracker apps in this process share one ``redis-server`` (``MESHNET_STORE``).
Each tracker hands out ranges and tells moves from its own book; the claims they
also write to the store (services/tracker/placement_claims.py) are what keeps
two joining nodes off one gap and two spares from both being sent to one hole.
The tests wait for states (bounded), never for a time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any, Final

import httpx
import pytest
import redis
from fastapi.testclient import TestClient

from meshwire.auth import bearer_headers
from meshwire.headers import LEASE
from services.tracker.app import create_app
from services.tracker.healing import GAP_GRACE_S
from services.tracker.placement import DEFAULT_KV_RESERVE_TOKENS
from services.tracker.placement_claims import DOC_PREFIX
from services.tracker.settings import TrackerSettings
from tests.procs import TEST_SECRET
from tests.test_placement import _ask, _register

WAIT_S: Final = 120.0
"""Bound of every wait for a state (the machine may be loaded)."""
BUDGET: Final = 4 * (10 + DEFAULT_KV_RESERVE_TOKENS) + 5  # four layers with the embedding or the LM head
NODE_TTL_S: Final = 120.0
"""Long enough that no node of these tests expires while they run (their heartbeats are the test's own)."""


def wait_for(condition: Callable[[], Any], what: str) -> Any:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if (value := condition()):
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def trackers(redis_url: str) -> Iterator[tuple[TestClient, TestClient]]:
    redis.Redis.from_url(redis_url).flushall()
    settings = TrackerSettings(secret=TEST_SECRET, store=redis_url, node_ttl_s=NODE_TTL_S)
    with TestClient(create_app(settings)) as one, TestClient(create_app(settings)) as two:
        yield one, two


def listed(client: httpx.Client) -> dict[str, tuple[int, int]]:
    return {n["node_id"]: (n["shard_start"], n["shard_end"]) for n in client.get("/v1/nodes").json()["nodes"]
            if n["routable"]}


def test_two_trackers_give_two_joining_nodes_different_gaps(trackers: tuple[TestClient, TestClient],
                                                            redis_url: str) -> None:
    one, two = trackers
    first = _ask(one, "a", BUDGET).json()
    second = _ask(two, "b", BUDGET).json()  # b has not registered: only a's claim in the store says 0-3 is taken
    assert (first["shard_start"], first["shard_end"], first["reason"]) == (0, 3, "covering")
    assert (second["shard_start"], second["shard_end"], second["reason"]) == (4, 7, "covering")
    doc = redis.Redis.from_url(redis_url, decode_responses=True).get(f"meshnet:doc:{DOC_PREFIX}tiny")
    assert doc is not None and '"node_id":"a"' in doc and '"node_id":"b"' in doc and '"expires_at"' in doc


def test_two_trackers_do_not_both_move_a_spare_onto_one_gap(trackers: tuple[TestClient, TestClient]) -> None:
    """c (placed by one) and d (placed by two) are both spare copies of 0-3; when 4-7 loses its holder, one
    of them is told to take it, and the other is not told anything while that move is under way."""
    one, two = trackers
    leases = {node_id: _register(one, node_id, start, end, "pinned")["lease"]
              for node_id, start, end in (("a", 0, 3), ("b", 4, 7))}
    for client, node_id in ((one, "c"), (two, "d")):
        assert _ask(client, node_id, BUDGET).status_code == 200  # the tracker knows its costs and budget
    leases["c"] = _register(one, "c", 0, 3, "replica")["lease"]
    leases["d"] = _register(two, "d", 0, 3, "replica")["lease"]
    wait_for(lambda: {"a", "b", "c", "d"} <= listed(two).keys() and {"a", "b", "c", "d"} <= listed(one).keys(),
             "both trackers to list every node")
    one.request("DELETE", "/v1/nodes/b", headers={**bearer_headers(TEST_SECRET), LEASE: str(leases["b"])})
    wait_for(lambda: "b" not in listed(two) and "b" not in listed(one), "both trackers to see b gone")
    told: dict[str, list[tuple[int, int]]] = {"c": [], "d": []}

    def beat() -> bool:
        for client, node_id in ((one, "c"), (two, "d")):
            move = _register(client, node_id, 0, 3, "replica", str(leases[node_id]))["move"]
            if move is not None:
                told[node_id].append((move["shard_start"], move["shard_end"]))
        return bool(told["c"] or told["d"])

    wait_for(beat, "a spare to be told to take layers 4-7")
    # Go on past the other tracker's own grace (it saw the gap within a beat of the first): a lower bound, so a
    # slow machine only makes the check stronger. The other spare is still not sent to the same gap.
    until = time.monotonic() + 2 * GAP_GRACE_S
    while time.monotonic() < until:
        beat()
    moved = [node_id for node_id, moves in told.items() if moves]
    assert len(moved) == 1, told
    assert set(told[moved[0]]) == {(4, 7)}
