"""A node that knows several trackers: the first that answers gets its heartbeats, a dead one is skipped.

The node's :class:`~services.node.hop.registration.Registrar` talks to real
tracker apps in process (memory stores, one each), reached through one
transport that can take a tracker "down" (connection refused) or make it
answer 503 as a tracker whose store is away does. The moves happen within one
:meth:`~services.node.hop.registration.Registrar.beat`: no time passes here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from meshwire.registry import NodeRegistration
from services.node.hop.registration import Registrar
from services.node.settings import NodeSettings
from services.tracker.app import create_app
from services.tracker.settings import TrackerSettings
from tests.procs import TEST_SECRET

A, B = "http://tracker-a.test", "http://tracker-b.test"
AUTH = {"Authorization": f"Bearer {TEST_SECRET}"}


class Trackers(httpx.AsyncBaseTransport):
    """Two tracker apps by host; each may be ``down`` (refuses connections) or ``unavailable`` (503)."""

    def __init__(self) -> None:
        self.apps = {url: httpx.ASGITransport(app=create_app(TrackerSettings(secret=TEST_SECRET)))
                     for url in (A, B)}
        self.down: set[str] = set()
        self.unavailable: set[str] = set()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = f"{request.url.scheme}://{request.url.host}"
        if url in self.down:
            raise httpx.ConnectError("connection refused", request=request)
        if url in self.unavailable:
            return httpx.Response(503, json={"error": {"message": "store away", "type": "unavailable",
                                                       "code": "store_unavailable"}})
        return await self.apps[url].handle_async_request(request)


def body() -> NodeRegistration:
    return NodeRegistration(node_id="roamer", model="tiny", endpoint="http://127.0.0.1:9100", shard_start=0,
                            shard_end=3, num_layers=4)


@pytest.fixture
def trackers() -> Trackers:
    return Trackers()


@pytest.fixture
async def http(trackers: Trackers) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=trackers) as client:
        yield client


async def listed(http: httpx.AsyncClient, tracker: str) -> dict[str, Any]:
    return {n["node_id"]: n for n in (await http.get(f"{tracker}/v1/nodes", headers=AUTH)).json()["nodes"]}


async def test_heartbeats_go_to_the_first_tracker_that_answers(http: httpx.AsyncClient) -> None:
    registrar = Registrar(http, (A, B), TEST_SECRET, body, heartbeat_s=1.0)
    assert await registrar.beat() and await registrar.beat()
    assert registrar.tracker == A
    assert (await listed(http, A))["roamer"]["heartbeats"] == 1
    assert "roamer" not in await listed(http, B)


async def test_when_the_tracker_dies_the_same_heartbeat_lands_on_the_next(
        http: httpx.AsyncClient, trackers: Trackers) -> None:
    registrar = Registrar(http, (A, B), TEST_SECRET, body, heartbeat_s=1.0)
    assert await registrar.beat()
    trackers.down.add(A)
    assert await registrar.beat()  # one beat: A refused, B took it
    assert registrar.tracker == B and "roamer" in await listed(http, B)
    trackers.down.discard(A)
    assert await registrar.beat() and registrar.tracker == B, "a node stays with the tracker that answers"


async def test_a_tracker_whose_store_is_away_is_passed_over(http: httpx.AsyncClient, trackers: Trackers) -> None:
    trackers.unavailable.add(A)
    registrar = Registrar(http, (A, B), TEST_SECRET, body, heartbeat_s=1.0)
    assert await registrar.beat() and registrar.tracker == B


async def test_with_every_tracker_down_a_beat_fails_and_the_next_succeeds_when_one_is_back(
        http: httpx.AsyncClient, trackers: Trackers) -> None:
    registrar = Registrar(http, (A, B), TEST_SECRET, body, heartbeat_s=1.0)
    trackers.down.update({A, B})
    assert not await registrar.beat() and registrar.lease is None
    trackers.down.discard(B)
    assert await registrar.beat() and registrar.tracker == B


async def test_leaving_goes_to_the_tracker_that_answers(http: httpx.AsyncClient, trackers: Trackers) -> None:
    registrar = Registrar(http, (A, B), TEST_SECRET, body, heartbeat_s=1.0)
    trackers.down.add(A)
    assert await registrar.beat()
    await registrar.deregister()
    assert (await listed(http, B))["roamer"]["state"] == "offline"


def test_the_node_takes_its_trackers_comma_separated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHNET_TRACKER", f"{A}/, {B}")
    settings = NodeSettings()
    assert settings.tracker == (A, B)
    assert f"{settings.tracker}/v1/route" == f"{A}/v1/route", "single-tracker callers see the first URL"
    with pytest.raises(ValueError, match="twice"):
        NodeSettings(tracker=f"{A},{A}")
    with pytest.raises(ValueError, match="http"):
        NodeSettings(tracker="ftp://tracker")
    assert NodeSettings(tracker=" ").tracker is None
