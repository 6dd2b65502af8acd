"""A hop behind NAT: the hop client falls back to the relay when the direct path is dead, and remembers it.

A real relay process, and a real ``RelayPeer`` standing in for the hidden
node: it answers ``/forward`` with a token and counts what reached it. The
hop's direct endpoint is, in turn:

* a black hole: a listening socket whose accept queue is full, so a connect
  gets no answer at all, as when a NAT drops the packets (a connect timeout,
  not a refusal);
* a real HTTP server on the same port that counts what reaches it directly,
  which is how a test sees whether the client dialled the direct path.

The hop client's clock is the test's, so "the memory ran out" needs no sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import Final

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from meshwire.relay_client import RelayPeer
from meshwire.route_keys import SigningKey
from meshwire.routes import RouteNode
from services.node.hop.hop_client import ChainFailure, HopClient, send_along
from tests.procs import TEST_SECRET, Service, free_port, start_service

CONNECT_TIMEOUT_S: Final = 0.5
MEMORY_S: Final = 60.0
WAIT_S: Final = 20.0
TOKEN: Final = 7
FRAME_HEADERS: Final = {"X-Meshnet-Session": "s-relay-path"}


@pytest.fixture(scope="module")
def relay() -> Iterator[Service]:
    with start_service("relay") as service:
        yield service


class HiddenNode:
    """What the relay delivers to the node behind NAT: a forward answer, counted."""

    def __init__(self) -> None:
        self.forwards = 0

    async def __call__(self, method: str, path: str, headers: dict[str, str],
                       body: bytes) -> tuple[int, Mapping[str, str], bytes]:
        self.forwards += 1
        return 200, {"content-type": "application/json"}, b'{"token": %d, "node_timings_ms": {}}' % TOKEN


class DirectServer:
    """A real HTTP server on the hop's endpoint that counts the frames and probes that reach it directly."""

    def __init__(self) -> None:
        self.forwards = 0
        self.probes = 0

    def app(self) -> Starlette:
        async def forward(_: Request) -> Response:
            self.forwards += 1
            return JSONResponse({"token": TOKEN, "node_timings_ms": {}})

        async def health(_: Request) -> Response:
            self.probes += 1
            return JSONResponse({"status": "ok"})

        return Starlette(routes=[Route("/forward", forward, methods=["POST"]), Route("/health", health)])


@contextlib.contextmanager
def black_hole() -> Iterator[int]:
    """A port where a connect is never answered (the accept queue is full and nobody accepts)."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = int(listener.getsockname()[1])
    fillers = []
    for _ in range(3):
        filler = socket.socket()
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            filler.connect(("127.0.0.1", port))
        fillers.append(filler)
    try:
        yield port
    finally:
        for sock in [*fillers, listener]:
            sock.close()


@contextlib.asynccontextmanager
async def direct_server(port: int) -> AsyncIterator[DirectServer]:
    server = DirectServer()
    config = uvicorn.Config(server.app(), host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    uv = uvicorn.Server(config)
    task = asyncio.create_task(uv.serve())
    try:
        await eventually(lambda: uv.started, "the direct server to listen")
        yield server
    finally:
        uv.should_exit = True
        await task


@contextlib.asynccontextmanager
async def hidden_node(relay: Service) -> AsyncIterator[tuple[HiddenNode, str]]:
    """The node behind NAT, connected to the relay; yields it and its ``relay_addr``."""
    node = HiddenNode()
    peer = RelayPeer(f"ws://{relay.host}:{relay.port}", f"hidden-{uuid.uuid4().hex[:8]}", TEST_SECRET, node)
    task = asyncio.create_task(peer.run())
    try:
        await asyncio.wait_for(peer.connected.wait(), WAIT_S)
        yield node, peer.relay_addr
    finally:
        await peer.close()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def eventually(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"never happened: {what}")
        await asyncio.sleep(0.02)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def hop(port: int, relay_addr: str | None) -> RouteNode:
    return RouteNode(node_id="hidden", endpoint=f"http://127.0.0.1:{port}", shard_start=2, shard_end=3,
                     start_layer=2, relay_addr=relay_addr)


@contextlib.asynccontextmanager
async def hop_client(clock: Clock, relay: Service) -> AsyncIterator[HopClient]:
    """A hop client whose operator configured ``relay`` (it shows that relay the mesh secret)."""
    async with httpx.AsyncClient() as http:
        client = HopClient(http, TEST_SECRET, timeout_s=WAIT_S, node_id="head", hop_key=SigningKey.generate(),
                           connect_timeout_s=CONNECT_TIMEOUT_S, relay_only_ttl_s=MEMORY_S, clock=clock,
                           own_relays=(f"ws://{relay.host}:{relay.port}",))
        try:
            yield client
        finally:
            await client.aclose()


async def send(client: HopClient, node: RouteNode) -> int | None:
    return (await send_along(client, node, FRAME_HEADERS, b"")).token


async def test_a_hop_whose_direct_path_drops_packets_is_reached_through_its_relay_and_the_relay_is_remembered(
        relay: Service) -> None:
    clock = Clock()
    async with hidden_node(relay) as (node, relay_addr), hop_client(clock, relay) as client:
        with black_hole() as port:
            assert await send(client, hop(port, relay_addr)) == TOKEN
            assert node.forwards == 1
        async with direct_server(port) as direct:
            assert await send(client, hop(port, relay_addr)) == TOKEN
            assert (node.forwards, direct.forwards, direct.probes) == (2, 0, 0), \
                "a path known to be dead is not dialled again for every frame"


async def test_when_the_memory_runs_out_the_direct_path_is_probed_aside_and_used_once_it_answers(
        relay: Service) -> None:
    clock = Clock()
    async with hidden_node(relay) as (node, relay_addr), hop_client(clock, relay) as client:
        with black_hole() as port:
            assert await send(client, hop(port, relay_addr)) == TOKEN
        async with direct_server(port) as direct:
            clock.now += MEMORY_S + 1
            assert await send(client, hop(port, relay_addr)) == TOKEN
            assert (node.forwards, direct.forwards) == (2, 0), "the frame does not wait for the probe"
            await eventually(lambda: direct.probes == 1, "the direct path to be probed")
            await eventually(lambda: not client.relay_only(f"http://127.0.0.1:{port}"),
                             "the probe to bring the hop back to its direct path")
            assert await send(client, hop(port, relay_addr)) == TOKEN
            assert (node.forwards, direct.forwards) == (2, 1)


async def test_a_hop_without_a_relay_whose_connect_times_out_is_reported_as_failed_by_name(relay: Service) -> None:
    async with hop_client(Clock(), relay) as client:
        with black_hole() as port, pytest.raises(ChainFailure) as failure:
            await send(client, hop(port, relay_addr=None))
    assert failure.value.status == 502 and failure.value.failed_node == "hidden"
    assert failure.value.body["error"]["code"] == "hop_failed"


async def test_closing_the_hop_client_closes_its_relay_connection(relay: Service) -> None:
    async def callers() -> int:
        async with httpx.AsyncClient() as http:
            return int((await http.get(f"{relay.url}/health")).json()["callers"])

    before = await callers()
    async with hidden_node(relay) as (_, relay_addr):
        async with hop_client(Clock(), relay) as client:
            with black_hole() as port:
                await send(client, hop(port, relay_addr))
            assert await callers() == before + 1
        deadline = time.monotonic() + WAIT_S
        while await callers() != before:
            assert time.monotonic() < deadline, "the relay still counts the closed hop client's connection"
            await asyncio.sleep(0.05)


def test_the_black_hole_leaves_a_connect_unanswered_where_a_closed_port_refuses_it() -> None:
    """What makes these tests mean something: the black hole is a timeout, not a refusal."""
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{free_port()}/", timeout=httpx.Timeout(WAIT_S, connect=WAIT_S))
    with black_hole() as port, pytest.raises(httpx.ConnectTimeout):
        httpx.get(f"http://127.0.0.1:{port}/", timeout=httpx.Timeout(WAIT_S, connect=CONNECT_TIMEOUT_S))
