"""While the tracker's store is away, every route that needs it answers 503 ``store_unavailable`` with
``Retry-After``, in the OpenAI shape: one handler on the app, not a translation in each route.

The tracker is the real app, in process; its memory store is made to raise
:class:`~services.tracker.store.StoreUnavailable` from every operation, as a Redis store does while
Redis is away (a real Redis going away is ``test_redis_trackers.py``'s).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Final

import httpx
import pytest

from services.tracker.app import create_app
from services.tracker.join_tokens import mint
from services.tracker.settings import TrackerSettings
from services.tracker.state import TrackerState
from services.tracker.store import StoreUnavailable
from tests.procs import TEST_SECRET

TRACKER: Final = "http://tracker.test"
ADMIN_KEY: Final = "admin-key"
HEARTBEAT_S: Final = 3.0
MESH: Final = {"Authorization": f"Bearer {TEST_SECRET}"}
ADMIN: Final = {"Authorization": f"Bearer {ADMIN_KEY}"}
REASON: Final = "store redis://redis.test:6379/0 unreachable: connection refused"
STORE_OPERATIONS: Final = ("register", "deregister", "report_failure", "read_doc", "swap_doc", "put_token",
                           "get_token", "all_tokens", "evict")
REGISTRATION: Final = {"node_id": "n1", "model": "tiny", "endpoint": "http://n1.test:8100", "shard_start": 0,
                       "shard_end": 3, "num_layers": 4}


@pytest.fixture
async def away() -> AsyncIterator[tuple[httpx.AsyncClient, TrackerState]]:
    """A tracker (its key ring loaded) whose store has since gone away."""
    app = create_app(TrackerSettings(secret=TEST_SECRET, admin_key=ADMIN_KEY, heartbeat_s=HEARTBEAT_S))
    state: TrackerState = app.state.tracker
    async with app.router.lifespan_context(app):
        async def unreachable(*args: Any, **kwargs: Any) -> Any:
            raise StoreUnavailable(REASON)

        for operation in STORE_OPERATIONS:
            setattr(state.store, operation, unreachable)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=TRACKER) as client:
            yield client, state


def a_join_token() -> str:
    token, _ = mint("n1", 0.0)
    return token


CALLS: Final[dict[str, tuple[str, str, dict[str, str], dict[str, Any] | None]]] = {
    "register": ("POST", "/v1/nodes", MESH, REGISTRATION),
    "deregister": ("DELETE", "/v1/nodes/n1", {**MESH, "X-Meshnet-Lease": "lease"}, None),
    "member-by-token": ("DELETE", "/v1/nodes/n1", {"Authorization": f"Bearer {a_join_token()}"}, None),
    "check-token": ("POST", "/v1/tokens/check", {"Authorization": f"Bearer {a_join_token()}"}, None),
    "issue-token": ("POST", "/v1/admin/tokens", ADMIN, {"node_id": "n1"}),
    "list-tokens": ("GET", "/v1/admin/tokens", ADMIN, None),
    "revoke-token": ("DELETE", "/v1/admin/tokens/abc", ADMIN, None),
    "rotate-keys": ("POST", "/v1/admin/keys/rotate", ADMIN, None),
}


@pytest.mark.parametrize("call", CALLS.values(), ids=CALLS.keys())
async def test_a_route_that_needs_the_store_answers_503_store_unavailable(
        away: tuple[httpx.AsyncClient, TrackerState],
        call: tuple[str, str, dict[str, str], dict[str, Any] | None]) -> None:
    client, _ = away
    method, path, headers, body = call
    answer = await client.request(method, path, headers=headers, json=body)
    assert answer.status_code == 503, answer.text
    assert answer.headers["retry-after"] == str(int(HEARTBEAT_S))
    error = answer.json()["error"]
    assert error["code"] == "store_unavailable" and error["type"] == "service_unavailable"
    assert REASON in error["message"]


async def test_a_registration_refused_because_the_store_is_away_is_counted_as_refused(
        away: tuple[httpx.AsyncClient, TrackerState]) -> None:
    client, _ = away
    assert (await client.post("/v1/nodes", json=REGISTRATION, headers=MESH)).status_code == 503
    metrics = (await client.get("/metrics")).text
    assert 'meshnet_tracker_registrations_total{outcome="refused"} 1.0' in metrics


async def test_the_route_keys_not_yet_read_are_a_503_store_unavailable(
        away: tuple[httpx.AsyncClient, TrackerState], monkeypatch: pytest.MonkeyPatch) -> None:
    client, state = away

    async def empty() -> Any:
        return type(state.trust.jwks())(keys=())

    monkeypatch.setattr(state.trust, "current_jwks", empty)
    answer = await client.get("/v1/keys")
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "store_unavailable"
    assert "has not read its route keys yet" in answer.json()["error"]["message"]
