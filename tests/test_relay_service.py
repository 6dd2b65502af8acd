"""The relay alone: a real relay process, real `RelayPeer`s serving a small real handler, real callers.

The relay runs with small bounds (64 KiB messages, 8 requests in flight per
peer) so the limits can be reached cheaply. Each test uses its own peer ids.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import inspect
import json
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping

import httpx
import pytest
import websockets.sync.client as sync_ws
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from meshwire.relay_client import RelayCaller, RelayError, RelayPeer
from tests.procs import TEST_SECRET, Service, free_port, start_service

MAX_MESSAGE_BYTES = 64 * 1024
MAX_INFLIGHT = 8
PROBE_S = 5.0
"""How long the relay waits for a holder's pong before handing its id to a new connection. Long enough that a
live holder on a loaded machine always answers in time (a live peer wrongly replaced would fail the takeover
tests); the dead-holder test waits this long once."""
WAIT_S = 20.0
"""Deadline for things that should happen at once; reaching it fails the test, it is not a timing claim."""
RELAY_ENV = {
    "MESHNET_MAX_MESSAGE_BYTES": str(MAX_MESSAGE_BYTES),
    "MESHNET_MAX_INFLIGHT_PER_PEER": str(MAX_INFLIGHT),
    "MESHNET_TAKEOVER_PROBE_S": str(PROBE_S),
}


class EchoService:
    """The small real service behind the relay.

    ``/echo`` answers the body reversed and says what it saw in headers;
    ``/hold`` waits until :attr:`release` is set; ``/fail`` raises;
    ``/large`` answers ``x-size`` bytes.
    """

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.holding = 0
        self.cancelled = 0

    async def __call__(self, method: str, path: str, headers: dict[str, str],
                       body: bytes) -> tuple[int, Mapping[str, str], bytes]:
        if path == "/echo":
            seen = {"x-echo-method": method, "x-echo-path": path, "x-echo-session": headers.get("X-Meshnet-Session", ""),
                    "content-type": "application/octet-stream"}
            return 200, seen, body[::-1]
        if path == "/hold":
            self.holding += 1
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
            finally:
                self.holding -= 1
            return 200, {}, b"released"
        if path == "/fail":
            raise RuntimeError("a bug in the handler")
        if path == "/large":
            return 200, {}, b"z" * int(headers["x-size"])
        return 404, {}, b""


async def eventually(predicate: Callable[[], bool | Awaitable[bool]], what: str) -> None:
    """Wait until ``predicate()`` holds; fail naming ``what`` if it never does."""
    deadline = time.monotonic() + WAIT_S
    while True:
        held = predicate()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"never happened: {what}")
        await asyncio.sleep(0.02)


async def fetch(relay: Service, path: str) -> httpx.Response:
    async with httpx.AsyncClient() as client:
        return await client.get(f"{relay.url}{path}")


async def health(relay: Service) -> dict[str, int]:
    return (await fetch(relay, "/health")).json()


async def _is(figures: Awaitable[dict[str, int]], key: str, value: int) -> bool:
    return (await figures)[key] == value


def ws_url(relay: Service) -> str:
    return f"ws://{relay.host}:{relay.port}"


@contextlib.asynccontextmanager
async def serving(relay: Service, handler: Callable[..., Awaitable[tuple[int, Mapping[str, str], bytes]]],
                  peer_id: str | None = None, **options: float) -> AsyncIterator[RelayPeer]:
    """A `RelayPeer` connected to ``relay`` and serving ``handler``; closed on exit."""
    peer = RelayPeer(ws_url(relay), peer_id or f"peer-{uuid.uuid4().hex[:8]}", TEST_SECRET, handler, **options)
    task = asyncio.create_task(peer.run())
    try:
        await asyncio.wait_for(peer.connected.wait(), WAIT_S)
        yield peer
    finally:
        await peer.close()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@contextlib.asynccontextmanager
async def caller() -> AsyncIterator[RelayCaller]:
    relay_caller = RelayCaller(TEST_SECRET)
    try:
        yield relay_caller
    finally:
        await relay_caller.close()


MESH_CREDENTIAL = {"Authorization": f"Bearer {TEST_SECRET}"}
"""What an ``/rpc`` caller presents at the handshake to reach more than a peer's ``GET /health``."""


def reference_relay_hop(relay_addr: str, path: str, body: bytes, headers: dict[str, str],
                        timeout: float = 120.0,
                        handshake: Mapping[str, str] = MESH_CREDENTIAL) -> tuple[int, dict[str, str], bytes]:
    """The reference node server's `_relay_hop`, verbatim in substance: the caller the relay must keep serving.

    The one addition is ``handshake``: the mesh credential, presented when the WebSocket opens.
    """
    request_id = f"{time.time_ns():x}"
    payload = json.dumps({
        "request_id": request_id,
        "method": "POST",
        "path": path,
        "headers": headers,
        "body_base64": base64.b64encode(body).decode(),
    })
    with sync_ws.connect(relay_addr, open_timeout=timeout, additional_headers=dict(handshake)) as ws:
        ws.send(payload)
        raw = ws.recv(timeout=timeout)
    resp = json.loads(raw)
    status = int(resp.get("status", 503))
    resp_headers = {k.lower(): v for k, v in (resp.get("headers") or {}).items()}
    body_b64 = resp.get("body_base64")
    resp_body = base64.b64decode(body_b64) if body_b64 else (resp.get("body") or "").encode()
    return status, resp_headers, resp_body


def handshake_status(url: str, headers: Mapping[str, str] | None = None) -> tuple[int, str]:
    """The HTTP status and error message with which the relay refuses a WebSocket handshake."""
    try:
        with sync_ws.connect(url, additional_headers=dict(headers or {}), open_timeout=WAIT_S):
            pass
    except InvalidStatus as refused:
        return refused.response.status_code, json.loads(refused.response.body)["error"]["message"]
    pytest.fail(f"the handshake to {url} was accepted")


@pytest.fixture(scope="module")
def relay() -> Iterator[Service]:
    with start_service("relay", RELAY_ENV) as service:
        yield service


# --- the reference's JSON envelope ----------------------------------------------------------------


async def test_the_reference_caller_reaches_a_peer_through_the_json_envelope(relay: Service) -> None:
    async with serving(relay, EchoService()) as peer:
        body = bytes(range(256)) * 4
        status, headers, answer = await asyncio.to_thread(
            reference_relay_hop, peer.relay_addr, "/echo", body, {"X-Meshnet-Session": "s-1"})
    assert status == 200
    assert answer == body[::-1]
    assert headers["x-echo-path"] == "/echo"
    assert headers["x-echo-method"] == "POST"
    assert headers["x-echo-session"] == "s-1"


async def test_an_envelope_answer_has_the_reference_fields_and_echoes_the_request_id(relay: Service) -> None:
    async with serving(relay, EchoService()) as peer:
        def two_in_sequence() -> list[dict[str, object]]:
            with sync_ws.connect(peer.relay_addr, additional_headers=MESH_CREDENTIAL) as ws:
                answers = []
                for n in range(2):
                    ws.send(json.dumps({"request_id": f"r{n}", "method": "POST", "path": "/echo", "headers": {},
                                        "body_base64": base64.b64encode(b"abc%d" % n).decode()}))
                    answers.append(json.loads(ws.recv(timeout=WAIT_S)))
                return answers

        answers = await asyncio.to_thread(two_in_sequence)
    for n, answer in enumerate(answers):
        assert {"status", "headers", "body_base64"} <= answer.keys()
        assert answer["request_id"] == f"r{n}"
        assert base64.b64decode(answer["body_base64"]) == (b"abc%d" % n)[::-1]


async def test_a_malformed_envelope_gets_a_400_answer_naming_the_problem(relay: Service) -> None:
    async with serving(relay, EchoService()) as peer:
        def send_bad() -> dict[str, object]:
            with sync_ws.connect(peer.relay_addr) as ws:
                ws.send(json.dumps({"request_id": "bad", "method": "POST", "path": "/echo", "headers": {},
                                    "body_base64": "not base64!"}))
                return json.loads(ws.recv(timeout=WAIT_S))

        answer = await asyncio.to_thread(send_bad)
    assert answer["status"] == 400
    assert answer["request_id"] == "bad"
    assert "base64" in json.loads(base64.b64decode(answer["body_base64"]))["error"]["message"]


async def test_an_oversize_envelope_gets_a_413_answer(relay: Service) -> None:
    async with serving(relay, EchoService()) as peer:
        status, _, answer = await asyncio.to_thread(
            reference_relay_hop, peer.relay_addr, "/echo", b"x" * MAX_MESSAGE_BYTES, {})
    assert status == 413
    assert json.loads(answer)["error"]["code"] == "too_large"


# --- the binary multiplexed form ------------------------------------------------------------------


async def test_a_mux_request_round_trips_its_body_unencoded(relay: Service) -> None:
    body = bytes(range(256)) * 9  # 2.3 KB, one SmolLM2 hidden state
    async with serving(relay, EchoService()) as peer, caller() as relay_caller:
        status, headers, answer = await relay_caller.request(
            peer.relay_addr, "POST", "/echo", {"X-Meshnet-Session": "s-2"}, body, timeout=WAIT_S)
    assert (status, answer) == (200, body[::-1])
    assert headers["x-echo-session"] == "s-2"


async def test_many_requests_are_in_flight_at_once_on_one_mux_connection(relay: Service) -> None:
    service = EchoService()
    async with serving(relay, service) as peer, caller() as relay_caller:
        await eventually(lambda: _is(health(relay), "callers", 0), "earlier callers left")
        held = [asyncio.create_task(relay_caller.request(peer.relay_addr, "POST", "/hold", {}, b"", timeout=WAIT_S))
                for _ in range(MAX_INFLIGHT)]
        await eventually(lambda: service.holding == MAX_INFLIGHT, f"{MAX_INFLIGHT} requests held at the peer at once")
        assert (await health(relay))["callers"] == 1
        service.release.set()
        answers = await asyncio.gather(*held)
    assert [answer[2] for answer in answers] == [b"released"] * MAX_INFLIGHT


async def test_answers_find_their_own_requests_when_many_share_the_connection(relay: Service) -> None:
    async with serving(relay, EchoService()) as peer, caller() as relay_caller:
        for wave in range(5):
            bodies = [f"wave {wave} request {n}".encode() for n in range(MAX_INFLIGHT)]
            answers = await asyncio.gather(*(relay_caller.request(peer.relay_addr, "POST", "/echo", {}, body, WAIT_S)
                                             for body in bodies))
            assert [answer[2] for answer in answers] == [body[::-1] for body in bodies]


async def test_a_handler_that_fails_answers_500_and_the_peer_keeps_serving(relay: Service) -> None:
    async with serving(relay, EchoService()) as peer, caller() as relay_caller:
        status, _, answer = await relay_caller.request(peer.relay_addr, "POST", "/fail", {}, b"", WAIT_S)
        assert status == 500
        assert json.loads(answer)["error"]["code"] == "handler_failed"
        assert (await relay_caller.request(peer.relay_addr, "POST", "/echo", {}, b"ok", WAIT_S))[2] == b"ko"


# --- authentication and ids -----------------------------------------------------------------------


def test_a_peer_without_credentials_is_refused_401_at_the_handshake(relay: Service) -> None:
    status, message = handshake_status(f"{ws_url(relay)}/peer/anyone")
    assert status == 401
    assert "Authorization" in message


def test_a_peer_with_the_wrong_secret_is_refused_403_at_the_handshake(relay: Service) -> None:
    assert handshake_status(f"{ws_url(relay)}/peer/anyone", {"Authorization": "Bearer wrong"})[0] == 403


async def test_a_mux_caller_must_present_the_secret(relay: Service) -> None:
    async with serving(relay, EchoService()) as peer:
        mux = peer.relay_addr.replace("/rpc/", "/mux/")
        assert handshake_status(mux)[0] == 401
        assert handshake_status(mux, {"Authorization": "Bearer wrong"})[0] == 403
        wrong = RelayCaller("wrong")
        with pytest.raises(RelayError) as refused:
            await wrong.request(peer.relay_addr, "POST", "/echo", {}, b"", WAIT_S)
        await wrong.close()
    assert refused.value.code == "unauthorized"


async def test_an_rpc_caller_with_a_wrong_credential_is_refused_403(relay: Service) -> None:
    async with serving(relay, EchoService()) as peer:
        status, _ = await asyncio.to_thread(handshake_status, peer.relay_addr, {"Authorization": "Bearer wrong"})
        malformed, _ = await asyncio.to_thread(handshake_status, peer.relay_addr, {"Authorization": "Basic eA=="})
    assert (status, malformed) == (403, 401)


def test_a_peer_id_of_the_wrong_form_is_refused_400(relay: Service) -> None:
    status, message = handshake_status(f"{ws_url(relay)}/peer/bad%20id", {"Authorization": f"Bearer {TEST_SECRET}"})
    assert status == 400
    assert "peer id" in message


async def test_a_second_connection_cannot_take_over_a_live_peers_id(relay: Service) -> None:
    async with serving(relay, EchoService()) as peer, caller() as relay_caller:
        status, message = await asyncio.to_thread(
            handshake_status, f"{ws_url(relay)}/peer/{peer.peer_id}", {"Authorization": f"Bearer {TEST_SECRET}"})
        assert status == 409
        assert peer.peer_id in message
        assert (await relay_caller.request(peer.relay_addr, "POST", "/echo", {}, b"still mine", WAIT_S))[2] == \
            b"enim llits"


async def test_a_holder_that_no_longer_answers_is_replaced_by_the_new_connection(relay: Service) -> None:
    peer_id = f"ghost-{uuid.uuid4().hex[:8]}"
    # A connection that holds the id but never answers a ping: a link that died without a goodbye.
    ghost = await connect(f"{ws_url(relay)}/peer/{peer_id}",
                          additional_headers={"Authorization": f"Bearer {TEST_SECRET}"})
    try:
        async with serving(relay, EchoService(), peer_id) as peer, caller() as relay_caller:
            answer = await relay_caller.request(peer.relay_addr, "POST", "/echo", {}, b"mine now", WAIT_S)
            assert answer[2] == b"won enim"
        with pytest.raises(ConnectionClosed):
            while True:  # the unanswered ping, then the close
                await asyncio.wait_for(ghost.recv(), WAIT_S)
        assert ghost.close_code == 4409
    finally:
        await ghost.close()


# --- faults and bounds -----------------------------------------------------------------------------


async def test_a_caller_for_an_unknown_peer_gets_a_clear_error(relay: Service) -> None:
    address = f"{ws_url(relay)}/rpc/nobody-{uuid.uuid4().hex[:8]}"
    status, message = await asyncio.to_thread(handshake_status, address)
    assert status == 404
    assert "not connected" in message
    async with caller() as relay_caller:
        with pytest.raises(RelayError) as refused:
            await relay_caller.request(address, "POST", "/echo", {}, b"", WAIT_S)
    assert refused.value.code == "unknown_peer"
    assert "nobody-" in str(refused.value)


async def test_a_peer_that_left_is_an_unknown_peer_on_a_connection_opened_before(relay: Service) -> None:
    async with caller() as relay_caller:
        async with serving(relay, EchoService()) as peer:
            await relay_caller.request(peer.relay_addr, "POST", "/echo", {}, b"", WAIT_S)
        await eventually(lambda: _is(health(relay), "peers", 0), "the peer left")
        with pytest.raises(RelayError) as refused:
            await relay_caller.request(peer.relay_addr, "POST", "/echo", {}, b"", WAIT_S)
    assert refused.value.code == "unknown_peer"


async def test_an_oversize_request_is_refused_and_the_connection_serves_on(relay: Service) -> None:
    async with serving(relay, EchoService()) as peer, caller() as relay_caller:
        with pytest.raises(RelayError) as refused:
            await relay_caller.request(peer.relay_addr, "POST", "/echo", {}, b"x" * MAX_MESSAGE_BYTES, WAIT_S)
        assert refused.value.code == "too_large"
        assert (await relay_caller.request(peer.relay_addr, "POST", "/echo", {}, b"small", WAIT_S))[2] == b"llams"


async def test_an_oversize_answer_from_the_peer_is_refused_to_the_caller(relay: Service) -> None:
    async with serving(relay, EchoService()) as peer, caller() as relay_caller:
        with pytest.raises(RelayError) as refused:
            await relay_caller.request(peer.relay_addr, "POST", "/large", {"x-size": str(2 * MAX_MESSAGE_BYTES)},
                                       b"", WAIT_S)
        assert refused.value.code == "too_large"
        assert (await relay_caller.request(peer.relay_addr, "POST", "/echo", {}, b"ab", WAIT_S))[2] == b"ba"


async def test_requests_beyond_the_in_flight_bound_are_refused_busy_not_queued(relay: Service) -> None:
    service = EchoService()
    async with serving(relay, service) as peer, caller() as first, caller() as second:
        held = [asyncio.create_task(first.request(peer.relay_addr, "POST", "/hold", {}, b"", WAIT_S))
                for _ in range(MAX_INFLIGHT)]
        await eventually(lambda: service.holding == MAX_INFLIGHT, "the peer holds its limit of requests")
        with pytest.raises(RelayError) as refused:
            await second.request(peer.relay_addr, "POST", "/echo", {}, b"", WAIT_S)
        assert refused.value.code == "busy"
        service.release.set()
        assert all(answer[0] == 200 for answer in await asyncio.gather(*held))
        assert (await second.request(peer.relay_addr, "POST", "/echo", {}, b"next", WAIT_S))[2] == b"txen"


async def test_when_a_peer_disconnects_its_callers_fail_at_once(relay: Service) -> None:
    service = EchoService()
    async with caller() as relay_caller:
        async with serving(relay, service) as peer:
            held = [asyncio.create_task(relay_caller.request(peer.relay_addr, "POST", "/hold", {}, b"", 600.0))
                    for _ in range(3)]
            await eventually(lambda: service.holding == 3, "three requests in flight")
        # The requests could wait ten minutes; they must fail now, saying why.
        outcomes = await asyncio.gather(*held, return_exceptions=True)
    assert [getattr(outcome, "code", outcome) for outcome in outcomes] == ["peer_disconnected"] * 3


async def test_a_caller_that_stops_waiting_gets_a_timeout_and_the_peer_is_told(relay: Service) -> None:
    service = EchoService()
    async with serving(relay, service) as peer, caller() as relay_caller:
        with pytest.raises(RelayError) as refused:
            await relay_caller.request(peer.relay_addr, "POST", "/hold", {}, b"", timeout=0.3)
        assert refused.value.code == "timeout"
        await eventually(lambda: service.cancelled == 1, "the peer's handler was cancelled")


# --- health and metrics -----------------------------------------------------------------------------


async def test_health_and_metrics_count_peers_requests_and_bytes(relay: Service) -> None:
    async with serving(relay, EchoService()) as peer, caller() as relay_caller:
        await relay_caller.request(peer.relay_addr, "POST", "/echo", {}, b"12345", WAIT_S)
        health_answer = await fetch(relay, "/health")
        metrics = (await fetch(relay, "/metrics")).text
    assert health_answer.status_code == 200
    assert health_answer.json()["peers"] >= 1
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
               for line in metrics.splitlines() if line and not line.startswith("#")}
    assert samples["meshnet_relay_peers"] >= 1
    assert samples['meshnet_relay_requests_total{outcome="ok",transport="mux"}'] >= 1
    assert samples['meshnet_relay_bytes_total{direction="to_peer"}'] >= 5
    assert samples['meshnet_relay_bytes_total{direction="from_peer"}'] >= 5


# --- restart -------------------------------------------------------------------------------------------


async def test_after_a_relay_restart_the_peer_reconnects_and_requests_succeed_again() -> None:
    port = free_port()
    relay = start_service("relay", RELAY_ENV, port=port)
    service = EchoService()
    try:
        async with serving(relay, service, backoff_initial_s=0.05, backoff_max_s=0.5) as peer, \
                caller() as relay_caller:
            assert (await relay_caller.request(peer.relay_addr, "POST", "/echo", {}, b"before", WAIT_S))[2] == \
                b"erofeb"
            in_flight = asyncio.create_task(relay_caller.request(peer.relay_addr, "POST", "/hold", {}, b"", 600.0))
            await eventually(lambda: service.holding == 1, "a request in flight")

            relay.kill(signal.SIGKILL)
            with pytest.raises(RelayError) as dropped:
                await in_flight
            assert dropped.value.code == "disconnected"
            await eventually(lambda: not peer.connected.is_set(), "the peer noticed the relay went away")

            relay = start_service("relay", RELAY_ENV, port=port)
            await asyncio.wait_for(peer.connected.wait(), WAIT_S)
            assert (await relay_caller.request(peer.relay_addr, "POST", "/echo", {}, b"after", WAIT_S))[2] == \
                b"retfa"
    finally:
        relay.stop()
