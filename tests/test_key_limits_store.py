"""A key's in-flight slots kept in Redis: renewed while held, freed when their tracker dies, and the limiter
with its store away.

Real trackers share a real ``redis-server`` (test_key_limits.py shows the
counting itself). A slot is held by a chat request whose body the client
never finishes (no timing). Waits are for events, with generous bounds: the
Redis clock passing a lease's first expiry, a tracker admitting the key.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Iterator
from typing import Final

import httpx
import pytest

from meshwire import errors
from meshwire.serving import MAX_BODY_TIMEOUT_S
from services.tracker.key_limits import STREAM_LEASE_S, KeyNames
from tests.procs import TEST_SECRET, Service, running, start_service
from tests.redis_server import RedisServer, redis_server

KEY: Final = "sk-held-key-0123456789"
EVENT_BOUND_S: Final = 4 * STREAM_LEASE_S
"""A generous bound on waiting for an event that the lease's minute brings (a loaded machine is slow)."""


def limited_env(redis: RedisServer) -> dict[str, str]:
    return {"MESHNET_STORE": redis.url, "MESHNET_API_KEYS": KEY, "MESHNET_KEY_MAX_STREAMS": "1",
            "MESHNET_KEY_REQUESTS_PER_MINUTE": "1000",
            # the held request's body never comes: it must outlive the lease, not end in a 408 first
            "MESHNET_BODY_TIMEOUT_S": str(int(MAX_BODY_TIMEOUT_S))}


@contextlib.contextmanager
def in_flight(tracker: Service) -> Iterator[socket.socket]:
    """A chat request with :data:`KEY` whose body is never finished: it holds the key's one slot."""
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {tracker.host}\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{").encode()
    with socket.create_connection((tracker.host, tracker.port), timeout=EVENT_BOUND_S) as sock:
        sock.sendall(head)
        yield sock


def status(tracker: Service) -> int:
    """An empty chat with :data:`KEY`: 429 while the key's slot is held, 400 (the body is invalid) once admitted."""
    return httpx.post(f"{tracker.url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, json={},
                      timeout=30).status_code


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + EVENT_BOUND_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {EVENT_BOUND_S:.0f} s: {what}"
        time.sleep(0.2)


def redis_ms(redis: RedisServer) -> int:
    seconds, micros = redis.client().time()
    return int(seconds) * 1000 + int(micros) // 1000


def lease_expiries(redis: RedisServer) -> list[float]:
    """When each held slot of :data:`KEY` expires, on the Redis clock (ms)."""
    client = redis.client()
    keys = [name for name in client.scan_iter(match=f"*keyflight:{KeyNames([KEY], TEST_SECRET).store_id(KEY)}")]
    return [score for name in keys for _, score in client.zrange(name, 0, -1, withscores=True)]


@pytest.fixture
def store() -> Iterator[RedisServer]:
    with redis_server() as server:
        yield server


def test_a_slot_held_past_its_lease_is_renewed_and_still_counts(store: RedisServer) -> None:
    a, b = start_service("tracker", limited_env(store)), start_service("tracker", limited_env(store))
    with running(a, b):
        with in_flight(a):
            wait_for(lambda: status(b) == 429, "b refusing the key while a holds its slot")
            [first_expiry] = lease_expiries(store)
            wait_for(lambda: redis_ms(store) > first_expiry, "the Redis clock to pass the slot's first expiry")
            [renewed] = lease_expiries(store)
            assert renewed > first_expiry, "tracker a renewed the lease of the slot it still holds"
            assert status(b) == 429, "the renewed slot still counts"
        wait_for(lambda: status(b) == 400, "b admitting the key once a's request ended")


def test_a_dead_tracker_s_slots_free_up_within_their_lease(store: RedisServer) -> None:
    a, b = start_service("tracker", limited_env(store)), start_service("tracker", limited_env(store))
    with running(a, b), in_flight(a):
        wait_for(lambda: status(b) == 429, "b refusing the key while a holds its slot")
        a.kill()  # SIGKILL: a neither releases nor renews the slot
        [expiry] = lease_expiries(store)
        wait_for(lambda: status(b) == 400, "b admitting the key once a dead tracker's lease lapsed")
        assert redis_ms(store) >= expiry, "admitted no earlier than the lapse of the lease"
        assert lease_expiries(store) == []


def test_with_its_store_away_the_limiter_answers_503_and_recovers_with_it(store: RedisServer) -> None:
    tracker = start_service("tracker", limited_env(store))
    with running(tracker):
        assert status(tracker) == 400
        store.kill()
        answer = httpx.post(f"{tracker.url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                            json={}, timeout=30)
        assert answer.status_code == 503, answer.text
        assert answer.headers["retry-after"] == "1"
        error = answer.json()["error"]
        assert error["code"] == errors.STORE_UNAVAILABLE and "limits" in error["message"], error
        assert tracker.alive()
        store.start()
        wait_for(lambda: status(tracker) == 400, "the key admitted again once the store is back")
