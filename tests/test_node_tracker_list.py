"""A head with several trackers asks the one that answers for routes (and for failure reports)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from services.node.hop.routing import NoRoute, TrackerRoutes
from tests.procs import free_port, start_service


def test_route_requests_pass_over_a_dead_tracker_to_one_that_answers_and_stay_there() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    tracker = start_service("tracker", {})
    try:
        async def scenario() -> tuple[str, str, int]:
            async with httpx.AsyncClient() as http:
                routes = TrackerRoutes(http, (dead, tracker.url), "s" * 32, "head-a")
                with pytest.raises(NoRoute) as first:
                    await routes.fetch("no-such-model")
                with pytest.raises(NoRoute) as second:
                    await routes.fetch("no-such-model")
                return str(first.value), str(second.value), first.value.status

        first, second, status = asyncio.run(scenario())
        # The live tracker's own answer (no such model), not "unreachable": the dead one was passed over.
        assert "unreachable" not in first and "no route" in first, first
        assert status == 404 and second == first
    finally:
        tracker.stop()


def test_with_every_tracker_away_the_error_names_each() -> None:
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]

    async def scenario() -> str:
        async with httpx.AsyncClient() as http:
            with pytest.raises(NoRoute) as caught:
                await TrackerRoutes(http, dead, "s" * 32, "head-a").fetch("m")
            return str(caught.value)

    message = asyncio.run(scenario())
    assert all(url in message for url in dead), message


def test_without_trackers_there_is_no_route_to_ask_for() -> None:
    async def scenario() -> bool:
        async with httpx.AsyncClient() as http:
            routes = TrackerRoutes(http, None, "s" * 32, "head-a")
            with pytest.raises(NoRoute):
                await routes.fetch("m")
            await routes.report_failure("x", "gone")  # nothing to tell: no error
            return routes.available

    assert asyncio.run(scenario()) is False
