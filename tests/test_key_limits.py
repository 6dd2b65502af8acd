"""Limits per API key on the tracker: requests per minute, requests in flight, per-key counters.

The counting rules are checked on the in-memory limiter with a clock the test
moves; the behaviour a client sees (429 with ``Retry-After`` in OpenAI's shape,
the others served, ``/metrics`` by key id) against a real tiny mesh with the
official OpenAI client; and the sharing of a key's budget by two trackers on
one Redis against real trackers. A request held in flight is one whose body
the client has not finished sending: it stays in flight for as long as the
test needs, with no timing involved. A streamed answer is held open by a proxy
in front of its head node (:mod:`tests.tcp_proxy`), which stops the stream after
its first event until the test lets it go on.
"""

from __future__ import annotations

import contextlib
import hashlib
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from services.tracker.key_limits import KeyNames, MemoryKeyLimiter, Refused
from tests.procs import Service, free_port, running, start_service
from tests.redis_server import redis_server
from tests.tcp_proxy import Proxy
from tests.tiny_mesh import HEARTBEAT_S, tiny_mesh, wait_until_servable

KEY, OTHER_KEY, THIRD_KEY = "sk-first-key-0123456789", "sk-second-key-9876543210", "key1"
STREAM_KEY = "sk-streaming-key-5555555555"
PER_MINUTE = 3
WAIT_S = 60.0
MESSAGES = [{"role": "user", "content": "hi"}]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# --- the counting rules ------------------------------------------------------------------------


async def test_a_key_gets_its_requests_per_minute_then_waits_for_the_oldest_to_leave_the_window() -> None:
    clock = Clock()
    limiter = MemoryKeyLimiter(requests_per_minute=2, max_streams=0, clock=clock)
    first = await limiter.admit(KEY)
    clock.now += 20
    second = await limiter.admit(KEY)
    assert isinstance(first, str) and isinstance(second, str)
    await limiter.release(KEY, first)  # finishing does not give back a request of the minute
    refused = await limiter.admit(KEY)
    assert isinstance(refused, Refused) and refused.retry_after_s == 40
    assert isinstance(await limiter.admit(OTHER_KEY), str)  # another key has its own budget
    clock.now += 40
    assert isinstance(await limiter.admit(KEY), str)


async def test_a_key_gets_its_streams_at_once_and_another_when_one_ends() -> None:
    limiter = MemoryKeyLimiter(requests_per_minute=0, max_streams=2)
    tickets = [await limiter.admit(KEY), await limiter.admit(KEY)]
    refused = await limiter.admit(KEY)
    assert isinstance(refused, Refused) and refused.retry_after_s == 1
    await limiter.release(KEY, str(tickets[0]))
    assert isinstance(await limiter.admit(KEY), str)


def test_a_key_is_named_by_its_place_in_the_list_and_counted_in_the_store_under_a_keyed_hash() -> None:
    names = KeyNames([KEY, OTHER_KEY], secret="mesh-secret")
    assert (names.label(KEY), names.label(OTHER_KEY)) == ("key-1", "key-2")
    assert names.store_id(KEY) != names.store_id(OTHER_KEY)
    assert names.store_id(KEY) != KeyNames([KEY], secret="another-secret").store_id(KEY)
    for name in (names.label(KEY), names.store_id(KEY)):
        assert KEY not in name and hashlib.sha256(KEY.encode()).hexdigest()[:12] not in name


async def test_several_choices_take_one_in_flight_slot_each_and_give_them_all_back() -> None:
    limiter = MemoryKeyLimiter(requests_per_minute=0, max_streams=4)
    first = await limiter.admit(KEY)
    assert isinstance(first, str)
    refused = await limiter.admit(KEY, requests=0, streams=4)
    assert isinstance(refused, Refused) and "needs 4 more" in refused.message
    more = await limiter.admit(KEY, requests=0, streams=3)
    assert isinstance(more, str)
    assert isinstance(await limiter.admit(KEY), Refused)
    await limiter.release(KEY, more)
    await limiter.release(KEY, first)
    assert isinstance(await limiter.admit(KEY, requests=0, streams=4), str)


# --- what a client sees ------------------------------------------------------------------------


def _client(tracker: Service, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tracker.url}/v1", api_key=key, max_retries=0, timeout=120)


@contextlib.contextmanager
def _in_flight(tracker: Service, key: str) -> Iterator[socket.socket]:
    """A chat request with ``key`` whose body is never finished: it holds one of the key's slots."""
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {tracker.host}\r\nAuthorization: Bearer {key}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{").encode()
    with socket.create_connection((tracker.host, tracker.port), timeout=WAIT_S) as sock:
        sock.sendall(head)
        yield sock


def _wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {WAIT_S} s: {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def limited_mesh(tiny_model_dir: Path) -> Iterator[tuple[Service, str]]:
    env = {"MESHNET_API_KEYS": f"{KEY},{OTHER_KEY},{THIRD_KEY}", "MESHNET_KEY_REQUESTS_PER_MINUTE": str(PER_MINUTE),
           "MESHNET_KEY_MAX_STREAMS": "1"}
    with tiny_mesh(tiny_model_dir, env=env) as running_mesh:
        yield running_mesh


def test_the_request_over_the_minute_s_limit_gets_429_with_retry_after_and_the_others_succeed(
        limited_mesh: tuple[Service, str]) -> None:
    tracker, model = limited_mesh
    client = _client(tracker, KEY)
    answers = [client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=3, temperature=0)
               for _ in range(PER_MINUTE)]
    assert all(answer.choices[0].message.content for answer in answers)
    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=3, temperature=0)
    response = refused.value.response
    assert response.status_code == 429
    assert 1 <= int(response.headers["retry-after"]) <= 60
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
    assert "requests per minute" in error["message"]
    other = _client(tracker, OTHER_KEY).chat.completions.create(model=model, messages=MESSAGES, max_tokens=3,
                                                                  temperature=0)
    assert other.choices[0].message.content

    metrics = httpx.get(f"{tracker.url}/metrics").text
    assert f'meshnet_tracker_key_requests_total{{key="key-1",status="200"}} {PER_MINUTE}.0' in metrics
    assert 'meshnet_tracker_key_requests_total{key="key-1",status="429"} 1.0' in metrics
    completion = sum(answer.usage.completion_tokens for answer in answers if answer.usage)
    prompt = sum(answer.usage.prompt_tokens for answer in answers if answer.usage)
    assert f'meshnet_tracker_key_tokens_total{{key="key-1",kind="completion"}} {completion}.0' in metrics
    assert f'meshnet_tracker_key_tokens_total{{key="key-1",kind="prompt"}} {prompt}.0' in metrics
    assert KEY not in metrics and OTHER_KEY not in metrics


def test_a_second_request_in_flight_is_refused_until_the_first_ends(limited_mesh: tuple[Service, str]) -> None:
    tracker, _ = limited_mesh
    url = f"{tracker.url}/v1/chat/completions"
    headers = {"Authorization": f"Bearer {OTHER_KEY}"}
    with _in_flight(tracker, OTHER_KEY):
        _wait_for(lambda: httpx.post(url, headers=headers, json={}).status_code == 429,
                  "a second request of the key refused while the first is in flight")
        second = httpx.post(url, headers=headers, json={})
        assert second.headers["retry-after"] == "1"
        assert "in flight" in second.json()["error"]["message"]
    _wait_for(lambda: httpx.post(url, headers=headers, json={}).status_code == 400,
              "the key's slot back once the first request ended")  # admitted: the empty body is then invalid


def test_a_request_without_a_valid_key_is_401_and_not_counted(limited_mesh: tuple[Service, str]) -> None:
    tracker, _ = limited_mesh
    for headers in ({}, {"Authorization": "Bearer sk-not-a-key"}):
        assert httpx.post(f"{tracker.url}/v1/chat/completions", headers=headers, json={}).status_code == 401
    assert 'key="key-unknown"' not in httpx.get(f"{tracker.url}/metrics").text


def test_public_metrics_name_no_key_by_anything_a_guess_can_be_checked_against(
        limited_mesh: tuple[Service, str]) -> None:
    """Issue 34, finding 5: ``/metrics`` named a key by 12 hex digits of its unsalted SHA-256, so a weak key
    (``key1``) was found offline by hashing guesses. Now the label is the key's place in the list."""
    tracker, model = limited_mesh
    _client(tracker, THIRD_KEY).chat.completions.create(model=model, messages=MESSAGES, max_tokens=2,
                                                         temperature=0)
    metrics = httpx.get(f"{tracker.url}/metrics").text
    assert 'key="key-3"' in metrics
    guesses = [f"key{n}" for n in range(100)] + [KEY, OTHER_KEY]
    for guess in guesses:
        assert hashlib.sha256(guess.encode()).hexdigest()[:12] not in metrics
        assert guess not in metrics.replace('key="key-', "")


def test_several_choices_in_one_request_count_as_that_many_streams(limited_mesh: tuple[Service, str]) -> None:
    """Issue 34, finding 7: ``n=16`` counted as one stream against the key's in-flight limit (1 here)."""
    tracker, model = limited_mesh
    answer = httpx.post(f"{tracker.url}/v1/chat/completions", headers={"Authorization": f"Bearer {THIRD_KEY}"},
                        json={"model": model, "messages": MESSAGES, "max_tokens": 2, "n": 16}, timeout=WAIT_S)
    assert answer.status_code == 429, answer.text
    assert answer.json()["error"]["code"] == "rate_limit_exceeded"
    assert "16" in answer.json()["error"]["message"] and answer.headers["retry-after"] == "1"
    alone = _client(tracker, THIRD_KEY).chat.completions.create(model=model, messages=MESSAGES, max_tokens=2,
                                                                 temperature=0)
    assert alone.choices[0].message.content is not None  # its slots were all given back


@pytest.fixture(scope="module")
def held_streams(tiny_model_dir: Path) -> Iterator[tuple[Service, str, Proxy]]:
    """A tracker whose key may hold one stream at a time, and one node holding every layer that the tracker
    reaches through a :class:`~tests.tcp_proxy.Proxy` (the node advertises the proxy's address)."""
    port = free_port()
    with Proxy(port) as proxy:
        tracker = start_service("tracker", {"MESHNET_API_KEYS": STREAM_KEY, "MESHNET_KEY_MAX_STREAMS": "1",
                                            "MESHNET_HEARTBEAT_S": HEARTBEAT_S, "MESHNET_STORE": "memory"})
        with running(tracker):
            node = start_service("node", {
                "MESHNET_MODEL": str(tiny_model_dir), "MESHNET_LAYERS": "0-3", "MESHNET_TRACKER": tracker.url,
                "MESHNET_NODE_ID": "proxied-node", "MESHNET_DTYPE": "float32", "MESHNET_DEVICE": "cpu",
                "MESHNET_HEARTBEAT_S": HEARTBEAT_S, "MESHNET_ADVERTISE": proxy.url}, port=port)
            with running(node):
                model = wait_until_servable(tracker, tiny_model_dir.name, {"Authorization": f"Bearer {STREAM_KEY}"})
                yield tracker, model, proxy


def test_a_streamed_answer_holds_its_slot_until_it_ends(held_streams: tuple[Service, str, Proxy]) -> None:
    """With one stream allowed, a second request is refused while the first streams (its first chunk is read,
    the rest held by the proxy), and admitted once the stream has ended."""
    tracker, model, proxy = held_streams
    client = _client(tracker, STREAM_KEY)
    url, headers = f"{tracker.url}/v1/chat/completions", {"Authorization": f"Bearer {STREAM_KEY}"}
    assert httpx.post(url, headers=headers, json={}).status_code == 400  # admitted (then invalid): the slot is free
    proxy.hold_after_first_event()
    stream = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6, temperature=0,
                                            stream=True)
    chunks = iter(stream)
    try:
        first = next(chunks)
        assert first.choices[0].delta.role == "assistant"
        assert proxy.holding.wait(WAIT_S), "the proxy holds the stream after its first event"
        with pytest.raises(openai.RateLimitError) as refused:
            client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, temperature=0)
        assert "in flight" in refused.value.response.json()["error"]["message"]
        assert refused.value.response.headers["retry-after"] == "1"
    finally:
        proxy.release()
    rest = list(chunks)
    assert rest and rest[-1].choices[0].finish_reason in ("stop", "length"), rest[-1:]
    _wait_for(lambda: httpx.post(url, headers=headers, json={}).status_code == 400,
              "the key's slot back once the stream ended")
    answer = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, temperature=0)
    assert answer.choices[0].message.content is not None


# --- several trackers, one budget ----------------------------------------------------------------


@pytest.fixture(scope="module")
def two_trackers() -> Iterator[tuple[Service, Service]]:
    with redis_server() as redis:
        env = {"MESHNET_STORE": redis.url, "MESHNET_API_KEYS": f"{KEY},{OTHER_KEY}",
               "MESHNET_KEY_REQUESTS_PER_MINUTE": str(PER_MINUTE), "MESHNET_KEY_MAX_STREAMS": "1"}
        first, second = start_service("tracker", env), start_service("tracker", env)
        with running(first, second):
            yield first, second


def test_trackers_sharing_a_store_share_a_key_s_requests_in_flight(two_trackers: tuple[Service, Service]) -> None:
    a, b = two_trackers
    headers = {"Authorization": f"Bearer {KEY}"}
    with _in_flight(a, KEY):
        _wait_for(lambda: httpx.post(f"{b.url}/v1/chat/completions", headers=headers, json={}).status_code == 429,
                  "tracker b refusing the key's second request while a holds its first")
    _wait_for(lambda: httpx.post(f"{b.url}/v1/chat/completions", headers=headers, json={}).status_code != 429,
              "tracker b admitting the key once a's request ended")


def test_trackers_sharing_a_store_share_a_key_s_requests_per_minute(two_trackers: tuple[Service, Service]) -> None:
    a, b = two_trackers
    headers = {"Authorization": f"Bearer {OTHER_KEY}"}
    statuses = [httpx.post(f"{tracker.url}/v1/chat/completions", headers=headers, json={}).status_code
                for tracker in (a, b, a, b, a, b, a, b)]
    assert 429 in statuses
    assert statuses.count(429) == len(statuses) - PER_MINUTE  # the budget is the key's, whichever tracker is asked
    assert all(status == 429 for status in statuses[PER_MINUTE:])
