"""The relay's open doors, closed: what an anonymous caller reaches, the budgets it cannot exhaust, bad answers.

Each test starts its own relay process (small bounds, so they are reached
cheaply, and caller counts no other test disturbs) and real peers: a
:class:`RelayPeer` serving a small recording handler, or a raw WebSocket peer
where the test needs an answer no :class:`RelayPeer` would send. Several
remote addresses are had from loopback: Linux delivers all of 127.0.0.0/8
locally, so a client bound to 127.0.0.2 is another address to the relay.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

import pydantic
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from meshwire import limits
from meshwire.envelope import encode_mux
from meshwire.relay_client import CLOSE_IDLE, MuxRequest, RelayError, read_mux
from services.relay.settings import RelaySettings
from tests.procs import Service, start_service
from tests.test_relay_service import (
    MESH_CREDENTIAL,
    WAIT_S,
    caller,
    eventually,
    health,
    serving,
    ws_url,
)

MAX_MESSAGE_BYTES = 64 * 1024
MAX_INFLIGHT = 8
BASE_ENV = {
    "MESHNET_MAX_MESSAGE_BYTES": str(MAX_MESSAGE_BYTES),
    "MESHNET_MAX_INFLIGHT_PER_PEER": str(MAX_INFLIGHT),
    "MESHNET_MAX_ANONYMOUS_INFLIGHT_PER_PEER": "2",
    "MESHNET_MAX_CALLERS": "8",
    "MESHNET_MAX_ANONYMOUS_CALLERS": "4",
    "MESHNET_MAX_ANONYMOUS_CALLERS_PER_ADDRESS": "2",
    # Idle sockets must stay open as long as a test holds them; the idle tests lower these.
    "MESHNET_ANONYMOUS_IDLE_TIMEOUT_S": "3600",
    "MESHNET_CALLER_IDLE_TIMEOUT_S": "3600",
}
OVERSIZE_HEADER = "a" * (limits.MAX_HEADER_VALUE_CHARS + 1)


class RecordingService:
    """What stands behind the relay: records every request that reaches it.

    ``/health`` answers 200 (held while :attr:`hold_health` is set, until
    :attr:`release`); ``/hold`` waits for :attr:`release`; ``/big-header``
    answers with a header over the relay's bound; anything else echoes.
    """

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, dict[str, str], bytes]] = []
        self.release = asyncio.Event()
        self.hold_health = False
        self.holding = 0

    async def __call__(self, method: str, path: str, headers: dict[str, str],
                       body: bytes) -> tuple[int, Mapping[str, str], bytes]:
        self.seen.append((method, path, headers, body))
        if path == "/hold" or (path == "/health" and self.hold_health):
            self.holding += 1
            try:
                await self.release.wait()
            finally:
                self.holding -= 1
        if path == "/health":
            return 200, {"content-type": "application/json"}, b'{"status": "ok"}'
        if path == "/big-header":
            return 200, {"x-big": OVERSIZE_HEADER}, b""
        return 200, {"x-path": path}, body[::-1]

    def paths(self) -> list[tuple[str, str]]:
        return [(method, path) for method, path, _, _ in self.seen]


@pytest.fixture
def relay_env() -> dict[str, str]:
    """The relay's environment for one test; a test may change it before asking for ``relay``."""
    return dict(BASE_ENV)


@pytest.fixture
def relay(relay_env: dict[str, str]) -> Iterator[Service]:
    with start_service("relay", relay_env) as service:
        yield service


def envelope(method: str, path: str, body: bytes = b"", headers: Mapping[str, str] | None = None,
             request_id: str = "r1") -> str:
    """A request in the reference's JSON envelope."""
    return json.dumps({"request_id": request_id, "method": method, "path": path, "headers": dict(headers or {}),
                       "body_base64": base64.b64encode(body).decode()})


async def ask(ws: ClientConnection, method: str, path: str, body: bytes = b"",
              headers: Mapping[str, str] | None = None, request_id: str = "r1") -> dict[str, Any]:
    """Send one envelope on ``ws`` and read its answer."""
    await ws.send(envelope(method, path, body, headers, request_id))
    return json.loads(await asyncio.wait_for(ws.recv(), WAIT_S))


def error_of(answer: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI error object inside an envelope answer."""
    return json.loads(base64.b64decode(answer["body_base64"]))["error"]


@contextlib.asynccontextmanager
async def rpc(address: str, *, source: str = "127.0.0.1",
              credential: bool = False) -> AsyncIterator[ClientConnection]:
    """An ``/rpc`` connection from ``source``, anonymous unless ``credential``."""
    ws = await connect(address, local_addr=(source, 0), open_timeout=WAIT_S,
                       additional_headers=MESH_CREDENTIAL if credential else None)
    try:
        yield ws
    finally:
        await ws.close()


async def refused(address: str, *, source: str = "127.0.0.1") -> tuple[int, str]:
    """The status and message with which an anonymous ``/rpc`` handshake from ``source`` is refused."""
    try:
        async with rpc(address, source=source):
            pass
    except InvalidStatus as exc:
        return exc.response.status_code, json.loads(exc.response.body or b"{}")["error"]["message"]
    pytest.fail(f"the handshake to {address} from {source} was accepted")


# --- what an anonymous caller reaches --------------------------------------------------------------


async def test_without_a_credential_rpc_reaches_the_peers_health_and_nothing_else(relay: Service) -> None:
    service = RecordingService()
    async with serving(relay, service) as peer, rpc(peer.relay_addr) as ws:
        health_answer = await ask(ws, "GET", "/health", b"smuggled", {"X-Meshnet-Route": "forged"}, "h1")
        answers = [await ask(ws, method, path, b"{}", request_id=f"n{n}") for n, (method, path) in enumerate(
            [("POST", "/forward"), ("POST", "/v1/chat/completions"), ("GET", "/metrics"), ("GET", "/health?x=1"),
             ("POST", "/health")])]
    assert health_answer["status"] == 200
    assert health_answer["request_id"] == "h1"
    assert json.loads(base64.b64decode(health_answer["body_base64"])) == {"status": "ok"}
    for n, answer in enumerate(answers):
        assert (answer["status"], answer["request_id"]) == (401, f"n{n}")
        assert error_of(answer)["code"] == "unauthorized"
        assert "GET /health" in error_of(answer)["message"]
    # Only the health check reached the peer, bare: no headers or body the caller added.
    assert service.seen == [("GET", "/health", {}, b"")]


async def test_with_the_mesh_credential_rpc_reaches_everything_the_peer_serves(relay: Service) -> None:
    service = RecordingService()
    async with serving(relay, service) as peer, rpc(peer.relay_addr, credential=True) as ws:
        forwarded = await ask(ws, "POST", "/forward", b"frame", {"X-Meshnet-Session": "s1"})
        chat = await ask(ws, "POST", "/v1/chat/completions", b"{}", request_id="r2")
    assert (forwarded["status"], base64.b64decode(forwarded["body_base64"])) == (200, b"emarf")
    assert chat["status"] == 200
    assert service.paths() == [("POST", "/forward"), ("POST", "/v1/chat/completions")]
    assert service.seen[0][2]["X-Meshnet-Session"] == "s1"


@pytest.mark.parametrize("relay_env", [{**BASE_ENV, "MESHNET_RPC_REQUIRES_AUTH": "true"}])
async def test_a_relay_that_requires_auth_refuses_anonymous_rpc_at_the_handshake(relay: Service) -> None:
    async with serving(relay, RecordingService()) as peer:
        status, message = await refused(peer.relay_addr)
        async with rpc(peer.relay_addr, credential=True) as ws:
            assert (await ask(ws, "GET", "/health"))["status"] == 200
    assert status == 401
    assert "Authorization" in message


async def test_an_anonymous_message_over_its_smaller_bound_is_refused_413(relay: Service) -> None:
    service = RecordingService()
    async with serving(relay, service) as peer, rpc(peer.relay_addr) as ws:
        answer = await ask(ws, "GET", "/health", b"x" * (32 * 1024))
        assert (await ask(ws, "GET", "/health", request_id="r2"))["status"] == 200
    assert answer["status"] == 413
    assert error_of(answer)["code"] == "too_large"
    assert service.paths() == [("GET", "/health")]


# --- caller budgets ----------------------------------------------------------------------------------


@pytest.mark.parametrize("relay_env", [{**BASE_ENV, "MESHNET_MAX_CALLERS": "2",
                                        "MESHNET_MAX_ANONYMOUS_CALLERS": "2"}])
async def test_idle_anonymous_sockets_beyond_their_cap_do_not_keep_a_mux_link_out(relay: Service) -> None:
    async with serving(relay, RecordingService()) as peer, contextlib.AsyncExitStack() as idle:
        # Four idle anonymous sockets, each from its own address: the anonymous cap admits two.
        statuses = []
        for n in range(4):
            try:
                await idle.enter_async_context(rpc(peer.relay_addr, source=f"127.0.0.{n + 1}"))
                statuses.append(101)
            except InvalidStatus as exc:
                statuses.append(exc.response.status_code)
        assert statuses == [101, 101, 503, 503]
        async with caller() as relay_caller:
            status, _, answer = await relay_caller.request(peer.relay_addr, "POST", "/echo", {}, b"mesh", WAIT_S)
        async with rpc(peer.relay_addr, credential=True) as ws:
            assert (await ask(ws, "POST", "/forward", b"ok"))["status"] == 200
    assert (status, answer) == (200, b"hsem")


async def test_one_address_holds_at_most_its_cap_of_anonymous_connections(relay: Service) -> None:
    async with serving(relay, RecordingService()) as peer:
        async with rpc(peer.relay_addr) as first, rpc(peer.relay_addr):
            status, message = await refused(peer.relay_addr)
            async with rpc(peer.relay_addr, source="127.0.0.2") as other:
                assert (await ask(other, "GET", "/health"))["status"] == 200
            assert (await ask(first, "GET", "/health"))["status"] == 200
        await eventually(lambda: _anonymous_callers(relay, 0), "the anonymous callers' places were freed")
        async with rpc(peer.relay_addr) as again:
            assert (await ask(again, "GET", "/health"))["status"] == 200
    assert status == 429
    assert "127.0.0.1" in message


async def _anonymous_callers(relay: Service, count: int) -> bool:
    return (await health(relay))["anonymous_callers"] == count


# --- in-flight budgets per peer ------------------------------------------------------------------------


async def test_anonymous_health_checks_never_take_the_meshes_in_flight_room(relay: Service) -> None:
    service = RecordingService()
    async with serving(relay, service) as peer, caller() as relay_caller:
        # The mesh's own requests fill their budget: a health check still gets through beside them.
        held = [asyncio.create_task(relay_caller.request(peer.relay_addr, "POST", "/hold", {}, b"", WAIT_S))
                for _ in range(MAX_INFLIGHT)]
        await eventually(lambda: service.holding == MAX_INFLIGHT, "the mesh's requests fill their budget")
        async with rpc(peer.relay_addr) as ws:
            assert (await ask(ws, "GET", "/health"))["status"] == 200
        service.release.set()
        assert [answer[0] for answer in await asyncio.gather(*held)] == [200] * MAX_INFLIGHT

        # Anonymous health checks fill theirs (two): the third is busy, and the mesh's requests pass.
        service.release.clear()
        service.hold_health = True
        async with rpc(peer.relay_addr) as one, rpc(peer.relay_addr, source="127.0.0.2") as two, \
                rpc(peer.relay_addr, source="127.0.0.3") as three:
            await one.send(envelope("GET", "/health"))
            await two.send(envelope("GET", "/health"))
            await eventually(lambda: service.holding == 2, "two health checks held at the peer")
            busy = await ask(three, "GET", "/health")
            assert (await relay_caller.request(peer.relay_addr, "POST", "/echo", {}, b"mesh", WAIT_S))[2] == b"hsem"
            service.release.set()
            for ws in (one, two):
                assert json.loads(await asyncio.wait_for(ws.recv(), WAIT_S))["status"] == 200
    assert busy["status"] == 503
    assert error_of(busy)["code"] == "busy"


@pytest.mark.parametrize("relay_env", [{**BASE_ENV, "MESHNET_MAX_INFLIGHT_BYTES_PER_PEER": str(2 * MAX_MESSAGE_BYTES)}])
async def test_bytes_in_flight_to_a_peer_are_bounded_across_requests(relay: Service) -> None:
    service = RecordingService()
    body = b"x" * (40 * 1024)  # three fit in 128 KiB, a fourth does not; each alone is well under a message
    async with serving(relay, service) as peer, caller() as relay_caller:
        held = [asyncio.create_task(relay_caller.request(peer.relay_addr, "POST", "/hold", {}, body, WAIT_S))
                for _ in range(3)]
        await eventually(lambda: service.holding == 3, "three large requests held at the peer")
        with pytest.raises(RelayError) as over:
            await relay_caller.request(peer.relay_addr, "POST", "/hold", {}, body, WAIT_S)
        small = await relay_caller.request(peer.relay_addr, "POST", "/echo", {}, b"small", WAIT_S)
        service.release.set()
        assert [answer[0] for answer in await asyncio.gather(*held)] == [200] * 3
        after = await relay_caller.request(peer.relay_addr, "POST", "/echo", {}, body, WAIT_S)
    assert over.value.code == "busy"
    assert "bytes" in str(over.value)
    assert small[2] == b"llams"
    assert after[2] == body[::-1]


def test_the_byte_budget_must_fit_the_largest_message() -> None:
    with pytest.raises(pydantic.ValidationError, match="max_inflight_bytes_per_peer"):
        RelaySettings(max_message_bytes=1 << 20, max_inflight_bytes_per_peer=1 << 19)


# --- idle callers ----------------------------------------------------------------------------------------


async def held_on_a_socket(address: str, service: RecordingService) -> ClientConnection:
    """A credentialed ``/rpc`` socket whose ``POST /hold`` is held at the peer.

    Under a short idle timeout the relay may close a new socket before its
    first message arrives (a slow machine); such a request was never served,
    so a new socket is opened until one gets its request through.
    """
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while asyncio.get_running_loop().time() < deadline:
        ws = await connect(address, additional_headers=MESH_CREDENTIAL, open_timeout=WAIT_S)
        with contextlib.suppress(ConnectionClosed):
            await ws.send(envelope("POST", "/hold"))
        await _held_or_closed(ws, service)
        if service.holding == 1:
            return ws
        await ws.close()
    pytest.fail("no socket kept its request until it reached the peer")


async def _held_or_closed(ws: ClientConnection, service: RecordingService) -> None:
    """Wait until the peer holds a request, or ``ws`` is closed."""
    closed = asyncio.ensure_future(ws.wait_closed())
    try:
        await eventually(lambda: service.holding == 1 or closed.done(), "the request held, or its socket closed")
    finally:
        closed.cancel()


@pytest.mark.parametrize("relay_env", [{**BASE_ENV, "MESHNET_ANONYMOUS_IDLE_TIMEOUT_S": "0.2",
                                        "MESHNET_CALLER_IDLE_TIMEOUT_S": "0.2"}])
async def test_idle_callers_are_closed_but_never_with_a_request_in_flight(relay: Service) -> None:
    service = RecordingService()
    async with serving(relay, service) as peer:
        busy = await held_on_a_socket(peer.relay_addr, service)
        try:
            # Opened after the request went out and closed for idleness: the busy socket has been quiet as long.
            async with rpc(peer.relay_addr) as idle:
                with pytest.raises(ConnectionClosed):
                    await asyncio.wait_for(idle.recv(), WAIT_S)
            assert idle.close_code == CLOSE_IDLE
            service.release.set()
            answer = json.loads(await asyncio.wait_for(busy.recv(), WAIT_S))
        finally:
            await busy.close()
    assert answer["status"] == 200
    assert answer["request_id"] == "r1"


@pytest.mark.parametrize("relay_env", [{**BASE_ENV, "MESHNET_CALLER_IDLE_TIMEOUT_S": "0.2"}])
async def test_a_mux_link_closed_idle_is_opened_again_for_the_next_request(relay: Service) -> None:
    async with serving(relay, RecordingService()) as peer, caller() as relay_caller:
        assert (await relay_caller.request(peer.relay_addr, "POST", "/echo", {}, b"one", WAIT_S))[2] == b"eno"
        await eventually(lambda: _callers(relay, 0), "the idle mux link was closed")
        assert (await relay_caller.request(peer.relay_addr, "POST", "/echo", {}, b"two", WAIT_S))[2] == b"owt"


async def _callers(relay: Service, count: int) -> bool:
    return (await health(relay))["callers"] == count


# --- answers that cannot be relayed ------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def raw_peer(relay: Service) -> AsyncIterator[str]:
    """A peer speaking the mux by hand: ``/big-header`` is answered with a header over the bound, the rest echoed.

    Yields the peer's ``relay_addr``.
    """
    peer_id = f"raw-{uuid.uuid4().hex[:8]}"
    ws = await connect(f"{ws_url(relay)}/peer/{peer_id}", additional_headers=MESH_CREDENTIAL)

    async def answer() -> None:
        async for data in ws:
            assert isinstance(data, bytes)
            request, body = read_mux(data)
            if not isinstance(request, MuxRequest):
                continue
            headers = {"x-big": OVERSIZE_HEADER} if request.path == "/big-header" else {"x-path": request.path}
            await ws.send(encode_mux({"kind": "response", "id": request.id, "status": 200, "headers": headers},
                                     body[::-1]))

    task = asyncio.create_task(answer())
    try:
        yield f"{ws_url(relay)}/rpc/{peer_id}"
    finally:
        await ws.close()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, ConnectionClosed):
            await task


async def test_a_peer_answer_with_an_oversize_header_is_answered_502_and_the_link_serves_on(relay: Service) -> None:
    async with raw_peer(relay) as relay_addr, rpc(relay_addr, credential=True) as ws, caller() as relay_caller:
        bad = await ask(ws, "POST", "/big-header", b"", request_id="big")
        good = await ask(ws, "POST", "/echo", b"next", request_id="next")
        with pytest.raises(RelayError) as bad_mux:
            await relay_caller.request(relay_addr, "POST", "/big-header", {}, b"", WAIT_S)
        good_mux = await relay_caller.request(relay_addr, "POST", "/echo", {}, b"after", WAIT_S)
    assert (bad["status"], bad["request_id"]) == (502, "big")
    assert error_of(bad)["code"] == "bad_answer"
    assert "x-big" in error_of(bad)["message"]
    assert (good["status"], base64.b64decode(good["body_base64"])) == (200, b"txen")
    assert bad_mux.value.code == "bad_answer"
    assert "x-big" in str(bad_mux.value)
    assert good_mux[2] == b"retfa"


async def test_a_relay_peer_whose_handler_answers_an_oversize_header_sends_a_502_instead(relay: Service) -> None:
    async with serving(relay, RecordingService()) as peer, rpc(peer.relay_addr, credential=True) as ws:
        bad = await ask(ws, "POST", "/big-header")
        good = await ask(ws, "POST", "/echo", b"ok", request_id="r2")
    assert bad["status"] == 502
    assert error_of(bad)["code"] == "bad_answer"
    assert "x-big" in error_of(bad)["message"]
    assert good["status"] == 200

