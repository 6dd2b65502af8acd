"""Slow and greedy clients against real services (``meshnet <service>``, on 127.0.0.1 ephemeral ports).

Each service cuts a connection that never finishes its request head within
``MESHNET_HEAD_TIMEOUT_S`` (``/health`` answering throughout), answers 408 to
a body that does not arrive within ``MESHNET_BODY_TIMEOUT_S``, and serves at
most ``MESHNET_MAX_CONNECTIONS_PER_ADDRESS`` connections from one address
while a client from another address is still served. Deadlines here are a
second or two; every wait is for a condition, bounded far above them.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from meshwire.slow_clients import MAX_HEAD_BYTES
from tests.procs import Service, ServiceKind, running, start_service

SHORT_DEADLINE_S = 1.0
"""The services' head and body deadlines here."""
WAIT_BOUND_S = 30.0
"""How long a test waits for a cut that the setting makes due within ``SHORT_DEADLINE_S``."""
UNDER_BOUND_LOOK_S = 1.0
"""How long a test looks for a cut that must not happen (any length is correct)."""
PER_ADDRESS = 4
HALF_HEAD = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Never-Done: "
OTHER_ADDRESS = "127.0.0.2"
"""Another loopback source address: a second client as the service sees it."""


def _guarded(kind: ServiceKind, head_timeout_s: float, tiny_model_dir: Path | None = None) -> Service:
    env = {"MESHNET_MAX_CONNECTIONS_PER_ADDRESS": str(PER_ADDRESS), "MESHNET_BODY_TIMEOUT_S": str(SHORT_DEADLINE_S)}
    env["MESHNET_READ_TIMEOUT_S" if kind == "bootstrap" else "MESHNET_HEAD_TIMEOUT_S"] = str(head_timeout_s)
    if kind == "node":
        assert tiny_model_dir is not None
        env.update({"MESHNET_MODEL": str(tiny_model_dir), "MESHNET_DTYPE": "float32", "MESHNET_DEVICE": "cpu"})
    if kind == "bootstrap":
        env["MESHNET_ACCESS_LOG"] = "false"
    return start_service(kind, env, launcher="meshnet")


@pytest.fixture(params=["tracker", "node", "relay", "bootstrap"])
def quick_cut(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Iterator[Service]:
    """Each service with short deadlines."""
    service = _guarded(request.param, SHORT_DEADLINE_S, tiny_model_dir)
    try:
        yield service
    finally:
        service.stop()


@pytest.fixture(scope="module")
def patient_tracker() -> Iterator[Service]:
    """A tracker whose head deadline is far away: half-open connections stay open for the test."""
    service = _guarded("tracker", 600.0)
    try:
        yield service
    finally:
        service.stop()


def _half_open(service: Service, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.create_connection((service.host, service.port), timeout=WAIT_BOUND_S,
                                    source_address=(source, 0))
    sock.sendall(HALF_HEAD)
    return sock


def _closed_by_server(sock: socket.socket, wait_s: float) -> tuple[bool, bytes]:
    """Whether the server closed ``sock`` within ``wait_s``, and what it sent before."""
    sock.settimeout(wait_s)
    received = bytearray()
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except TimeoutError:
        return False, bytes(received)
    except ConnectionResetError:
        pass
    return True, bytes(received)


def _health_from(service: Service, source: str) -> int:
    transport = httpx.HTTPTransport(local_address=source)
    with httpx.Client(transport=transport, timeout=WAIT_BOUND_S) as client:
        return client.get(f"{service.url}/health").status_code


def test_a_client_that_never_finishes_its_head_is_cut_while_health_answers(quick_cut: Service) -> None:
    sock = _half_open(quick_cut)
    started = time.monotonic()
    with contextlib.closing(sock):
        sock.settimeout(0.2)
        closed = False
        while not closed and time.monotonic() - started < WAIT_BOUND_S:
            assert _health_from(quick_cut, OTHER_ADDRESS) == 200
            try:
                closed = sock.recv(65536) == b""
            except TimeoutError:
                continue
            except ConnectionResetError:
                closed = True
    assert closed, f"{quick_cut.kind} kept a half-sent head open for {WAIT_BOUND_S} s"
    assert quick_cut.alive()
    assert _health_from(quick_cut, "127.0.0.1") == 200


def test_a_head_that_grows_past_64_kib_without_ending_is_answered_431_and_cut(patient_tracker: Service) -> None:
    """The head deadline is far away here: only the size bound can cut this connection, and it must, before the
    service holds more than :data:`MAX_HEAD_BYTES` of an unfinished head (httptools sets no bound of its own)."""
    sock = _half_open(patient_tracker)
    with contextlib.closing(sock):
        sent = len(HALF_HEAD)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            while sent <= MAX_HEAD_BYTES + 4096:  # one header value that never ends: no CRLF CRLF, ever
                sock.sendall(b"a" * 4096)
                sent += 4096
        closed, received = _closed_by_server(sock, WAIT_BOUND_S)
    assert closed, "the service kept reading an unfinished head past its size bound"
    assert received.startswith(b"HTTP/1.1 431 "), received[:80]
    assert patient_tracker.alive()
    assert _health_from(patient_tracker, "127.0.0.1") == 200


def test_a_head_under_the_bound_is_not_cut_by_its_size(patient_tracker: Service) -> None:
    sock = _half_open(patient_tracker)
    with contextlib.closing(sock):
        sock.sendall(b"a" * (MAX_HEAD_BYTES - len(HALF_HEAD) - 1024))
        closed, received = _closed_by_server(sock, UNDER_BOUND_LOOK_S)  # any length is correct: nothing may come
    assert not closed and received == b"", received[:80]


def test_a_body_that_does_not_arrive_in_time_is_answered_408(quick_cut: Service) -> None:
    if quick_cut.kind == "relay":
        pytest.skip("the relay has no route that reads a request body (its traffic is WebSocket messages)")
    path = {"tracker": "/v1/chat/completions", "node": "/v1/chat/completions", "bootstrap": "/route"}[quick_cut.kind]
    method = "PUT" if quick_cut.kind == "bootstrap" else "POST"
    head = (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {quick_cut.env['MESHNET_SECRET']}\r\nContent-Length: 1000\r\n\r\n").encode()
    with socket.create_connection((quick_cut.host, quick_cut.port), timeout=WAIT_BOUND_S) as sock:
        sock.sendall(head + b'{"model": ')
        closed, answer = _closed_by_server(sock, WAIT_BOUND_S)
    assert closed
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    if quick_cut.kind != "bootstrap":  # the bootstrap answers text/plain, as its reference does
        body = orjson.loads(answer.partition(b"\r\n\r\n")[2])
        assert body["error"]["code"] == "body_timeout"
    assert _health_from(quick_cut, "127.0.0.1") == 200


def test_connections_over_the_bound_from_one_address_are_refused_while_another_is_served(
        patient_tracker: Service) -> None:
    held = [_half_open(patient_tracker) for _ in range(PER_ADDRESS)]
    try:
        extra = socket.create_connection((patient_tracker.host, patient_tracker.port), timeout=WAIT_BOUND_S)
        with contextlib.closing(extra):
            closed, answer = _closed_by_server(extra, WAIT_BOUND_S)
        assert closed
        assert answer.startswith(b"HTTP/1.1 503 "), answer[:200]
        body = orjson.loads(answer.partition(b"\r\n\r\n")[2])
        assert body["error"]["code"] == "too_many_connections"
        assert b"retry-after: " in answer.lower()
        assert _health_from(patient_tracker, OTHER_ADDRESS) == 200
        assert all(not _closed_by_server(sock, 0.1)[0] for sock in held)  # the bound refuses; it does not evict
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + WAIT_BOUND_S
    while time.monotonic() < deadline:  # the address's slots come back as its connections close
        with contextlib.suppress(httpx.HTTPError):
            if _health_from(patient_tracker, "127.0.0.1") == 200:
                return
        time.sleep(0.1)
    raise AssertionError("connections from 127.0.0.1 were still refused after the held ones closed")


def test_websocket_links_to_the_relay_leave_the_http_guards_once_upgraded() -> None:
    """Peers' links outlive the head deadline, and more of them than the per-address bound connect."""
    from websockets.sync.client import connect

    relay = _guarded("relay", SHORT_DEADLINE_S)
    with running(relay):
        headers = {"Authorization": f"Bearer {relay.env['MESHNET_SECRET']}"}
        links = [connect(f"ws://{relay.host}:{relay.port}/peer/peer-{i}", additional_headers=headers,
                         open_timeout=WAIT_BOUND_S) for i in range(PER_ADDRESS + 2)]
        try:
            deadline = time.monotonic() + WAIT_BOUND_S
            while httpx.get(f"{relay.url}/health").json()["peers"] != len(links):
                assert time.monotonic() < deadline, "the relay never listed every peer"
                time.sleep(0.05)
            time.sleep(3 * SHORT_DEADLINE_S)  # well past the head deadline a plain HTTP connection gets
            for link in links:
                assert link.ping().wait(timeout=WAIT_BOUND_S), "a peer's link was cut"
        finally:
            for link in links:
                link.close()
