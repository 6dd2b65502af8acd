"""A head's failover against a real tracker: whom it reports, which routes it takes, and when it gives up.

The tracker is the real app, served in process through httpx's ASGI
transport; nodes are plain registrations (route planning never dials them).
The head's shard is the tiny model's layers 0-1, loaded for real, because a
route is verified against the layers the head actually holds. The failover
clock is the test's, so a spent budget needs no waiting.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Collection
from pathlib import Path
from typing import Any, Final

import httpx
import pytest
import torch

from services.node.head import failover as failover_module
from services.node.head.failover import Failover, FailoverGaveUp, FailoverPolicy
from services.node.hop.routing import NoRoute, RoutedHop, TrackerRoutes
from services.node.model.shard import Shard
from services.node.model.shard_load import load_shard
from services.tracker.app import create_app
from services.tracker.settings import TrackerSettings
from tests.procs import TEST_SECRET

TRACKER: Final = "http://tracker.test"
MODEL: Final = "tiny"
AUTH: Final = {"Authorization": f"Bearer {TEST_SECRET}"}
HEAD_LAYERS: Final = (0, 1)
BUDGET_S: Final = 10.0


@pytest.fixture(scope="module")
def shard(tiny_model_dir: Path) -> Shard:
    return load_shard(tiny_model_dir, *HEAD_LAYERS, torch.float32, torch.device("cpu"))


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(TrackerSettings(secret=TEST_SECRET))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as client:
        yield client


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def register(http: httpx.AsyncClient, node_id: str, start: int, end: int, **load: Any) -> None:
    body = {"node_id": node_id, "model": MODEL, "endpoint": f"http://{node_id}.test:8100", "shard_start": start,
            "shard_end": end, "num_layers": 4, **load}
    response = await http.post(f"{TRACKER}/v1/nodes", json=body, headers=AUTH)
    assert response.status_code == 200, response.text


async def mesh(http: httpx.AsyncClient, *tails: str) -> None:
    await register(http, "head", *HEAD_LAYERS)
    for tail in tails:
        await register(http, tail, 2, 3)


async def failures(http: httpx.AsyncClient, node_id: str) -> int:
    nodes = (await http.get(f"{TRACKER}/v1/nodes")).json()["nodes"]
    return int(next(node for node in nodes if node["node_id"] == node_id)["failures"])


def failover(http: httpx.AsyncClient | None, shard: Shard, clock: Clock | None = None,
             **policy: Any) -> Failover:
    routes = None if http is None else TrackerRoutes(http, TRACKER, TEST_SECRET, "head")
    return Failover(FailoverPolicy(**{"budget_s": BUDGET_S, **policy}), routes, model=MODEL, shard=shard,
                    clock=clock or Clock())


async def test_a_failed_node_is_reported_and_the_new_route_avoids_it(http: httpx.AsyncClient, shard: Shard) -> None:
    await mesh(http, "tail-a", "tail-b")
    broken = (await http.get(f"{TRACKER}/v1/route", params={"model": MODEL, "exclude": "tail-b"})).json()["token"]

    hop = await failover(http, shard).reroute("tail-a", "connection reset", failed=True, route=broken)

    assert hop.node_ids == ("head", "tail-b") and hop.hop_index == 0
    assert await failures(http, "tail-a") == 1  # reported with the route it failed on, by its head


async def test_a_busy_node_is_avoided_but_not_reported(http: httpx.AsyncClient, shard: Shard) -> None:
    await mesh(http, "tail-a", "tail-b")

    hop = await failover(http, shard).reroute("tail-a", "kv_budget", failed=False)

    assert hop.node_ids == ("head", "tail-b")
    assert await failures(http, "tail-a") == 0


async def test_every_node_that_failed_during_the_request_stays_avoided(http: httpx.AsyncClient, shard: Shard) -> None:
    await mesh(http, "tail-a", "tail-b", "tail-c")
    moves = failover(http, shard)

    await moves.reroute("tail-a", "reset", failed=True)
    hop = await moves.reroute("tail-b", "reset", failed=True)

    assert hop.node_ids == ("head", "tail-c")


async def test_a_route_the_tracker_starts_at_another_head_is_not_taken(http: httpx.AsyncClient, shard: Shard) -> None:
    await mesh(http, "tail-a", "tail-b")
    await register(http, "another-head", *HEAD_LAYERS, decode_tokens_per_s=1000.0)
    preferred = (await http.get(f"{TRACKER}/v1/route", params={"model": MODEL, "exclude": "tail-a"})).json()
    assert preferred["nodes"][0]["node_id"] == "another-head", "the tracker would rather start elsewhere"

    hop = await failover(http, shard).reroute("tail-a", "reset", failed=True)

    assert hop.node_ids == ("head", "tail-b")


async def test_when_nobody_else_holds_the_range_it_gives_up_naming_the_missing_layers(
        http: httpx.AsyncClient, shard: Shard) -> None:
    await mesh(http, "tail-a")

    with pytest.raises(FailoverGaveUp) as gave_up:
        await failover(http, shard).reroute("tail-a", "connection refused", failed=True)

    assert gave_up.value.code == "no_route" and gave_up.value.failed_node == "tail-a"
    assert "2-3" in str(gave_up.value) and "tail-a" in str(gave_up.value)


async def test_it_gives_up_after_its_limit_of_moves(http: httpx.AsyncClient, shard: Shard) -> None:
    await mesh(http, "tail-a", "tail-b", "tail-c")
    moves = failover(http, shard, max_failovers=1)
    await moves.reroute("tail-a", "reset", failed=True)

    with pytest.raises(FailoverGaveUp) as gave_up:
        await moves.reroute("tail-b", "reset", failed=True)

    assert gave_up.value.code == "failover_exhausted" and gave_up.value.failed_node == "tail-b"


async def test_without_a_tracker_it_gives_up_at_once(shard: Shard) -> None:
    with pytest.raises(FailoverGaveUp) as gave_up:
        await failover(None, shard).reroute("tail-a", "reset", failed=True)

    assert gave_up.value.code == "no_route"


async def test_a_replay_still_running_when_the_budget_is_spent_is_cut_off(
        http: httpx.AsyncClient, shard: Shard) -> None:
    await mesh(http, "tail-a", "tail-b")
    clock = Clock()
    moves = failover(http, shard, clock)
    await moves.reroute("tail-a", "reset", failed=True)
    clock.now += BUDGET_S

    with pytest.raises(FailoverGaveUp) as gave_up:
        async with moves.bounded():
            await asyncio.sleep(60)

    assert gave_up.value.code == "failover_timeout" and gave_up.value.failed_node == "tail-a"


async def test_the_budget_counts_every_recovery_of_the_request_together(
        http: httpx.AsyncClient, shard: Shard) -> None:
    await mesh(http, "tail-a", "tail-b", "tail-c")
    clock = Clock()
    moves = failover(http, shard, clock)
    await moves.reroute("tail-a", "reset", failed=True)
    clock.now += BUDGET_S * 0.6
    moves.recovered()
    clock.now += 1000.0  # generating normally spends nothing
    assert not moves.recovering and moves.remaining_s() == pytest.approx(BUDGET_S * 0.4)

    await moves.reroute("tail-b", "reset", failed=True)
    clock.now += BUDGET_S * 0.4

    with pytest.raises(FailoverGaveUp, match="budget"):
        async with moves.bounded():
            await asyncio.sleep(60)


async def test_outside_a_recovery_a_step_is_not_bounded(http: httpx.AsyncClient, shard: Shard) -> None:
    clock = Clock()
    moves = failover(http, shard, clock)
    clock.now += BUDGET_S * 2

    async with moves.bounded():
        await asyncio.sleep(0)

    assert not moves.recovering and moves.moves == 0


class HealingRoutes(TrackerRoutes):
    """A tracker that has no route while it heals the gap (``healing``), then has one."""

    def __init__(self, http: httpx.AsyncClient, gaps: int, *, healing: bool = True) -> None:
        super().__init__(http, TRACKER, TEST_SECRET, "head")
        self.gaps, self.asked, self._healing = gaps, 0, healing

    async def route_from_here(self, model: str, shard: Shard, exclude: Collection[str] = ()) -> RoutedHop:
        self.asked += 1
        if self.asked <= self.gaps:
            raise NoRoute("no live node holds layers 2-3", healing=self._healing)
        return await super().route_from_here(model, shard, exclude)


async def test_while_the_tracker_heals_the_gap_it_asks_again_until_a_route_comes(
        http: httpx.AsyncClient, shard: Shard, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(failover_module, "HEALING_POLL_S", 0.0)
    await mesh(http, "tail-a", "tail-b")
    routes = HealingRoutes(http, gaps=3)
    moves = Failover(FailoverPolicy(budget_s=BUDGET_S), routes, model=MODEL, shard=shard, clock=Clock())

    hop = await moves.reroute("tail-a", "reset", failed=True)

    assert hop.node_ids == ("head", "tail-b") and routes.asked == 4 and moves.moves == 1


async def test_a_gap_nobody_heals_gives_up_at_once(http: httpx.AsyncClient, shard: Shard) -> None:
    await mesh(http, "tail-a", "tail-b")
    routes = HealingRoutes(http, gaps=1, healing=False)
    moves = Failover(FailoverPolicy(budget_s=BUDGET_S), routes, model=MODEL, shard=shard, clock=Clock())

    with pytest.raises(FailoverGaveUp) as gave_up:
        await moves.reroute("tail-a", "reset", failed=True)

    assert gave_up.value.code == "no_route" and routes.asked == 1


async def test_a_gap_not_healed_within_the_budget_gives_up_naming_it(
        http: httpx.AsyncClient, shard: Shard, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(failover_module, "HEALING_POLL_S", 0.01)
    await mesh(http, "tail-a")
    moves = Failover(FailoverPolicy(budget_s=0.2), HealingRoutes(http, gaps=10**6), model=MODEL, shard=shard)

    with pytest.raises(FailoverGaveUp) as gave_up:
        await moves.reroute("tail-a", "reset", failed=True)

    assert gave_up.value.code == "no_route" and "while the mesh healed" in str(gave_up.value)
