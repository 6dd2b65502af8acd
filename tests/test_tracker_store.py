"""The tracker's stores: the same registry rules in memory and in a real Redis, and what only Redis adds.

Every test of the first part runs on both stores (``store`` is parametrised):
leases, conflicts, departures, failure backoffs, bounds and expiry behave
alike. The second part is Redis's own: two trackers' views of one Redis, the
lease as a key with a real expiry, Redis away, and Redis back empty. Expiry is
real time here (Redis keeps its own clock), so a test polls for the outcome
with a generous deadline and never sleeps and asserts; the rules' exact
timings are unit-tested on the memory registry with a hand-driven clock.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from meshwire.registry import NodeRegistration
from services.tracker.join_tokens import mint
from services.tracker.planner import plan_route
from services.tracker.registry import LeaseConflict, LeaseRequired, RegistryFull, RegistryPolicy, UnknownNode
from services.tracker.settings import TrackerSettings
from services.tracker.store import MemoryStore, NodeStore, StoreUnavailable, open_store
from services.tracker.store.redis import LEASE_GRACE_S, PREFIX, RedisStore
from services.tracker.trust import TrackerTrust
from tests.redis_server import RedisServer, require_redis_server

MODEL = "/models/tiny"
POLICY = RegistryPolicy(ttl_s=30.0, suspect_s=15.0, offline_keep_s=300.0, max_nodes=4, backoff_s=5.0,
                        backoff_max_s=20.0, failure_reset_s=120.0)
SHORT_TTL = RegistryPolicy(ttl_s=1.0, suspect_s=0.5, offline_keep_s=300.0, max_nodes=4)
DEADLINE_S = 30.0


def reg(node_id: str = "a", start: int = 0, end: int = 3, *, port: int = 9001, **load: Any) -> NodeRegistration:
    return NodeRegistration(node_id=node_id, model=MODEL, endpoint=f"http://127.0.0.1:{port}", shard_start=start,
                            shard_end=end, num_layers=4, **load)


def now() -> float:
    return time.monotonic()


async def eventually(condition: Callable[[], Awaitable[bool]], what: str, timeout_s: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for: {what}")


@pytest.fixture(scope="module")
def redis() -> Any:
    server = RedisServer(require_redis_server()).start()
    yield server
    server.stop()


@pytest.fixture
def flushed(redis: RedisServer) -> RedisServer:
    client = redis.client()
    client.flushdb()
    client.close()
    return redis


StoreFactory = Callable[[RegistryPolicy], Awaitable[NodeStore]]


@pytest.fixture(params=["memory", "redis"])
async def make_store(request: pytest.FixtureRequest) -> AsyncIterator[StoreFactory]:
    """Opens stores of the parametrised kind (all Redis ones on one flushed Redis); closes them after."""
    opened: list[NodeStore] = []
    url = "memory" if request.param == "memory" else request.getfixturevalue("flushed").url

    async def make(policy: RegistryPolicy = POLICY) -> NodeStore:
        store = open_store(url, policy, now)
        await store.start()
        opened.append(store)
        return store

    yield make
    for store in opened:
        await store.close()


def routable(store: NodeStore) -> set[str]:
    return {c.node_id for c in store.registry.candidates(MODEL, now())}


# --- the same rules on both stores ------------------------------------------------------------------------


async def test_a_first_registration_gets_a_lease_and_heartbeats_keep_it(make_store: StoreFactory) -> None:
    store = await make_store()
    first = await store.register(reg("a"), None, now())
    again = await store.register(reg("a", active_sessions=3), first.lease, now())
    assert first.new_lease and not again.new_lease and again.lease == first.lease
    [info] = store.registry.snapshot(now())
    assert (info.state, info.heartbeats, info.active_sessions) == ("online", 1, 3)


async def test_a_node_cannot_register_under_a_live_nodes_id(make_store: StoreFactory) -> None:
    store = await make_store()
    await store.register(reg("a", port=9001), None, now())
    with pytest.raises(LeaseConflict, match="held by a live node"):
        await store.register(reg("a", port=9002), None, now())
    with pytest.raises(LeaseConflict):
        await store.register(reg("a", port=9002), "guessed-lease", now())
    assert store.registry.snapshot(now())[0].endpoint == "http://127.0.0.1:9001"


async def test_leaving_needs_the_lease_and_takes_the_node_out_of_routes(make_store: StoreFactory) -> None:
    store = await make_store()
    lease = (await store.register(reg("a"), None, now())).lease
    with pytest.raises(UnknownNode):
        await store.deregister("nobody", lease, now())
    with pytest.raises(LeaseRequired):
        await store.deregister("a", None, now())
    with pytest.raises(LeaseRequired):
        await store.deregister("a", "not-its-lease", now())
    assert routable(store) == {"a"}
    await store.deregister("a", lease, now())
    assert routable(store) == set()
    assert store.registry.state("a", now()) == "offline"


async def test_a_node_back_with_its_lease_after_leaving_keeps_it(make_store: StoreFactory) -> None:
    store = await make_store()
    lease = (await store.register(reg("a"), None, now())).lease
    await store.deregister("a", lease, now())
    back = await store.register(reg("a"), lease, now())
    assert back.lease == lease and not back.new_lease and routable(store) == {"a"}


async def test_an_id_that_left_may_be_taken_by_a_new_node_with_a_new_lease(make_store: StoreFactory) -> None:
    store = await make_store()
    lease = (await store.register(reg("a", port=9001), None, now())).lease
    await store.deregister("a", lease, now())
    other = await store.register(reg("a", port=9002), None, now())
    assert other.new_lease and other.lease != lease
    assert store.registry.snapshot(now())[0].endpoint == "http://127.0.0.1:9002"


async def test_a_reported_node_backs_off_and_repeats_do_not_lengthen_it(make_store: StoreFactory) -> None:
    store = await make_store()
    await store.register(reg("a"), None, now())
    await store.register(reg("b"), None, now())
    first = await store.report_failure("a", "connection refused", now())
    again = await store.report_failure("a", "connection refused", now())
    assert 4.0 < first <= POLICY.backoff_s and again <= first
    info = next(n for n in store.registry.snapshot(now()) if n.node_id == "a")
    assert info.state == "suspect" and info.last_failure_reason == "refused"
    hops = plan_route(store.registry.candidates(MODEL, now()), 4)
    assert [hop.node_id for hop in hops] == ["b"]
    with pytest.raises(UnknownNode):
        await store.report_failure("nobody", "gone", now())


async def test_the_registry_holds_at_most_max_nodes_live_nodes(make_store: StoreFactory) -> None:
    store = await make_store()
    for index in range(POLICY.max_nodes):
        await store.register(reg(f"n{index}", port=9001 + index), None, now())
    with pytest.raises(RegistryFull):
        await store.register(reg("one-too-many", port=9100), None, now())


async def test_a_silent_node_leaves_the_routes_once_its_lease_runs_out(make_store: StoreFactory) -> None:
    store = await make_store(SHORT_TTL)
    await store.register(reg("a"), None, now())
    assert routable(store) == {"a"}

    async def gone() -> bool:
        await store.fresh()
        return routable(store) == set()

    await eventually(gone, "the silent node to leave the routes")
    assert store.registry.state("a", now()) == "offline"


# --- Redis: several trackers, one state --------------------------------------------------------------------


@pytest.fixture
async def trackers(flushed: RedisServer) -> AsyncIterator[tuple[RedisStore, RedisStore]]:
    """Two trackers' stores on one Redis."""
    first, second = RedisStore(flushed.url, POLICY, now), RedisStore(flushed.url, POLICY, now)
    await first.start()
    await second.start()
    yield first, second
    await first.close()
    await second.close()


async def test_a_node_registered_through_one_tracker_is_routable_through_the_other_at_once(
        trackers: tuple[RedisStore, RedisStore]) -> None:
    a, b = trackers
    for index in range(3):
        await a.register(reg(f"n{index}", port=9001 + index), None, now())
        await b.fresh()  # what GET /v1/route and every chat on tracker b do first
        assert routable(b) == {f"n{i}" for i in range(index + 1)}
    assert plan_route(b.registry.candidates(MODEL, now()), 4)[0].node_id in {"n0", "n1", "n2"}


async def test_load_departures_and_failures_through_one_tracker_reach_the_other(
        trackers: tuple[RedisStore, RedisStore]) -> None:
    a, b = trackers
    lease_x = (await a.register(reg("x", port=9001), None, now())).lease
    lease_y = (await b.register(reg("y", port=9002), None, now())).lease
    await a.register(reg("y", port=9002, active_sessions=7), lease_y, now())  # y's heartbeat moved to a
    await b.report_failure("x", "reset by peer", now())
    await a.fresh()
    await b.fresh()
    for store in (a, b):
        infos = {n.node_id: n for n in store.registry.snapshot(now())}
        assert infos["x"].state == "suspect" and infos["x"].last_failure_reason == "reset"
    await eventually(lambda: _sessions_of(b, "y", 7), "y's load figures to reach the other tracker")
    await b.deregister("x", lease_x, now())
    await a.fresh()
    assert routable(a) == {"y"}


async def _sessions_of(store: RedisStore, node_id: str, sessions: int) -> bool:
    return any(n.node_id == node_id and n.active_sessions == sessions for n in store.registry.snapshot(now()))


async def test_a_lease_is_a_redis_key_with_an_expiry(trackers: tuple[RedisStore, RedisStore],
                                                     flushed: RedisServer) -> None:
    a, _ = trackers
    lease = (await a.register(reg("a"), None, now())).lease
    client = flushed.client()
    try:
        assert client.get(f"{PREFIX}lease:a") == lease
        ttl_ms = client.pttl(f"{PREFIX}lease:a")
        assert POLICY.ttl_s * 1000 < ttl_ms <= (POLICY.ttl_s + LEASE_GRACE_S) * 1000
    finally:
        client.close()


async def test_no_view_names_a_node_whose_lease_key_has_expired(flushed: RedisServer) -> None:
    a, b = RedisStore(flushed.url, SHORT_TTL, now), RedisStore(flushed.url, SHORT_TTL, now)
    await a.start()
    await b.start()
    client = flushed.client()
    try:
        await a.register(reg("a"), None, now())
        await b.fresh()
        assert routable(b) == {"a"}
        deadline = time.monotonic() + DEADLINE_S
        while client.exists(f"{PREFIX}lease:a"):
            assert time.monotonic() < deadline, "the lease key never expired"
            await asyncio.sleep(0.02)
        # The key is gone: neither view may still route through the node.
        assert routable(a) == set() and routable(b) == set()
    finally:
        client.close()
        await a.close()
        await b.close()


async def test_an_expired_lease_reaches_every_view_as_a_redis_event(flushed: RedisServer) -> None:
    """A view whose own clock stands still still learns of the expiry: Redis's expired-key event tells it."""
    a = RedisStore(flushed.url, SHORT_TTL, now)
    frozen = RedisStore(flushed.url, SHORT_TTL, lambda: 0.0)
    await a.start()
    await frozen.start()
    try:
        await a.register(reg("a"), None, now())
        await frozen.fresh()
        assert {c.node_id for c in frozen.registry.candidates(MODEL, 0.0)} == {"a"}

        async def expired() -> bool:
            return not frozen.registry.candidates(MODEL, 0.0)

        await eventually(expired, "the expired-key event to reach the frozen view")
        assert frozen.registry.state("a", 0.0) == "offline"
    finally:
        await a.close()
        await frozen.close()


async def test_redis_away_makes_the_store_say_so_and_back_empty_it_fills_again_from_heartbeats() -> None:
    server = RedisServer(require_redis_server()).start()
    store = RedisStore(server.url, POLICY, now)
    await store.start()
    try:
        lease = (await store.register(reg("a"), None, now())).lease
        server.kill()

        async def away() -> bool:
            return not (await store.health()).ok

        await eventually(away, "the store to notice Redis is away")
        with pytest.raises(StoreUnavailable):
            await store.fresh()
        with pytest.raises(StoreUnavailable):
            await store.register(reg("a"), lease, now())
        server.start()  # empty: no persistence

        async def back() -> bool:
            return (await store.health()).ok

        await eventually(back, "the store to reconnect")
        await store.fresh()
        assert routable(store) == set(), "the view kept a node Redis no longer holds"
        again = await store.register(reg("a"), lease, now())  # the node's next heartbeat
        assert again.new_lease and routable(store) == {"a"}
    finally:
        await store.close()
        server.stop()


async def test_the_memory_store_is_always_healthy_and_fresh() -> None:
    store = MemoryStore(POLICY)
    await store.start()
    assert (await store.health()).ok
    await store.fresh()
    await store.close()


def test_an_unknown_store_is_refused() -> None:
    with pytest.raises(ValueError, match="memory"):
        open_store("postgres://db", POLICY, now)
    with pytest.raises(ValueError, match="store must be 'memory' or a redis://"):
        TrackerSettings(store="postgres://db")
    assert TrackerSettings().store == "memory"
    assert TrackerSettings(store=" redis://127.0.0.1:6379/0 ").store == "redis://127.0.0.1:6379/0"


# --- trust: the route key ring and join tokens live in the store ----------------------------------------------


async def test_a_document_is_replaced_only_while_it_is_what_the_writer_read(make_store: StoreFactory) -> None:
    store = await make_store()
    assert await store.read_doc("ring") is None
    assert await store.swap_doc("ring", None, "one")
    assert not await store.swap_doc("ring", None, "two"), "another writer got there first"
    assert await store.swap_doc("ring", "one", "two")
    assert await store.read_doc("ring") == "two"


async def test_join_tokens_are_kept_and_a_revoked_tokens_node_is_evicted(make_store: StoreFactory) -> None:
    store = await make_store()
    _, record = mint("a", time.time())
    await store.put_token(record)
    assert await store.get_token(record.token_id) == record and await store.all_tokens() == [record]
    assert await store.get_token("0123456789abcdef") is None
    await store.register(reg("a"), None, now())
    assert routable(store) == {"a"}
    assert await store.evict("a", now())
    assert routable(store) == set()
    assert not await store.evict("nobody", now())


async def test_trackers_on_one_redis_sign_with_one_key_and_admit_by_one_token_list(
        trackers: tuple[RedisStore, RedisStore]) -> None:
    a, b = (TrackerTrust(store, secret="s", route_ttl_s=600, rotate_s=0, lead_s=0) for store in trackers)
    await a.refresh()
    await b.refresh()
    assert a.signing_key().kid == b.signing_key().kid and a.jwks() == b.jwks()
    rotated = await b.rotate()
    await a.refresh()
    assert a.signing_key().kid == rotated.kid
    token, record = mint("a", time.time())
    await trackers[0].put_token(record)
    assert await b.admit(f"Bearer {token}", reg("a")) == record


async def test_closing_ends_the_listener_even_when_redis_turns_its_cancellation_into_a_timeout(
        flushed: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """redis-py's ``get_message(timeout=...)`` can answer a cancellation with a ``TimeoutError`` (a RedisError),
    which reads as a lost connection: a tracker's shutdown (and a test under load) then waited for ever."""
    import redis.asyncio.client
    from redis.exceptions import TimeoutError as RedisTimeout

    real = redis.asyncio.client.PubSub.get_message

    async def swallowing(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return await real(self, *args, **kwargs)
        except asyncio.CancelledError:
            raise RedisTimeout("Timeout reading from socket") from None

    monkeypatch.setattr(redis.asyncio.client.PubSub, "get_message", swallowing)
    store = RedisStore(flushed.url, POLICY, now)
    await store.start()
    await asyncio.sleep(0.2)  # the listener is inside get_message
    await asyncio.wait_for(store.close(), DEADLINE_S)
