"""Finding 2 of issue 34: a node reaching a peer through the relay the peer registered gives it nothing reusable.

A joined node ``mallory`` registers an endpoint that refuses connections and a
``relay_addr`` of its own, a listener. The honest hop before it falls back to
that "relay". It used to send ``Authorization: Bearer <its join token>``; now
it sends a proof signed with its hop key, bound to ``mallory`` and the signed
route naming both, which opens nothing else on the real relay (a process
holding the test's route keys, as it would hold the tracker's).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any, Final

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from meshwire import headers as h
from meshwire.relay_client import RelayPeer
from meshwire.routes import Route, RouteNode, plan_start_layers, sign_route
from services.node.hop.hop_client import HopClient, HopUnreachable
from tests.procs import (
    TEST_ROUTE_KEY,
    TEST_ROUTE_KEYS,
    TEST_SECRET,
    Service,
    free_port,
    node_hop_key,
    start_service,
)

JOIN_TOKEN: Final = "mnj_the-honest-nodes-own-join-token"
WAIT_S: Final = 20.0
BIG_FRAME_BYTES: Final = 256 * 1024
"""A hop frame sixteen times the relay's anonymous message bound (16 KiB)."""


@pytest.fixture(scope="module")
def relay() -> Iterator[Service]:
    with start_service("relay", {"MESHNET_ROUTE_KEYS": TEST_ROUTE_KEYS}) as service:
        yield service


class Listener:
    """A TCP listener posing as a relay: it records the first request it gets, then hangs up."""

    def __init__(self) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(4)
        self.port = int(self._sock.getsockname()[1])
        self.captured = b""
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            conn, _ = self._sock.accept()
            with conn:
                conn.settimeout(WAIT_S)
                while b"\r\n\r\n" not in self.captured:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    self.captured += chunk

    def headers(self) -> dict[str, str]:
        lines = self.captured.split(b"\r\n\r\n")[0].decode().split("\r\n")[1:]
        return {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}

    def close(self) -> None:
        self._sock.close()
        self._thread.join(timeout=WAIT_S)


def route(*nodes: RouteNode) -> str:
    return sign_route(Route(model="tiny", nodes=plan_start_layers(list(nodes)), num_layers=4), TEST_ROUTE_KEY)


def hop(name: str, endpoint: str, relay_addr: str | None) -> RouteNode:
    return RouteNode(node_id=name, endpoint=endpoint, shard_start=2, shard_end=3, start_layer=2,
                     relay_addr=relay_addr, hop_key=node_hop_key(name).public_text)


FRONT: Final = RouteNode(node_id="front", endpoint="http://127.0.0.1:9", shard_start=0, shard_end=1, start_layer=0,
                         hop_key=node_hop_key("front").public_text)


@contextlib.asynccontextmanager
async def honest_front(own_relays: tuple[str, ...] = ()) -> AsyncIterator[HopClient]:
    """The honest hop ``front``: it holds a join token, and its own hop key."""
    async with httpx.AsyncClient() as http:
        client = HopClient(http, JOIN_TOKEN, timeout_s=WAIT_S, node_id="front", hop_key=node_hop_key("front"),
                           connect_timeout_s=2.0, own_relays=own_relays)
        try:
            yield client
        finally:
            await client.aclose()


class Peer:
    """A peer behind NAT on the real relay that answers every request with a token."""

    async def __call__(self, method: str, path: str, headers: dict[str, str],
                       body: bytes) -> tuple[int, Mapping[str, str], bytes]:
        return 200, {"content-type": "application/json"}, b'{"token": 5, "node_timings_ms": {}}'


@contextlib.asynccontextmanager
async def peer_on(relay: Service, peer_id: str, service: Any = None) -> AsyncIterator[str]:
    peer = RelayPeer(f"ws://{relay.host}:{relay.port}", peer_id, TEST_SECRET, service or Peer())
    task = asyncio.create_task(peer.run())
    try:
        await asyncio.wait_for(peer.connected.wait(), WAIT_S)
        yield peer.relay_addr
    finally:
        await peer.close()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def handshake_status(url: str, headers: Mapping[str, str]) -> int:
    try:
        async with connect(url, additional_headers=dict(headers), open_timeout=WAIT_S):
            return 101
    except InvalidStatus as exc:
        return exc.response.status_code


async def test_a_relay_a_peer_chose_receives_no_reusable_credential(relay: Service) -> None:
    listener = Listener()
    mallory = hop("mallory", f"http://127.0.0.1:{free_port()}", f"ws://127.0.0.1:{listener.port}/rpc/mallory")
    token = route(FRONT, mallory)
    try:
        async with honest_front() as front:
            with pytest.raises(HopUnreachable):
                await front.post_frame(mallory, {h.ROUTE: token, h.SESSION: "s-1"}, b"frame")
        await asyncio.to_thread(listener.close)
    finally:
        listener.close()
    captured = listener.headers()
    assert listener.captured, "the honest hop never dialled the peer's relay"
    assert JOIN_TOKEN.encode() not in listener.captured and TEST_SECRET.encode() not in listener.captured
    assert "authorization" not in captured
    assert captured["x-meshnet-signer"] == "front" and "x-meshnet-proof" in captured

    # What the listener learned opens no other peer on the real relay, whichever way it is replayed.
    async with peer_on(relay, f"honest-{uuid.uuid4().hex[:6]}") as honest_addr:
        honest_id = honest_addr.rsplit("/", 1)[1]
        replayed = {name: value for name, value in captured.items() if name.startswith("x-meshnet-")}
        status = await handshake_status(f"ws://{relay.host}:{relay.port}/mux/{honest_id}", replayed)
        assert status == 403


async def test_a_hop_reaches_a_peer_through_its_relay_with_the_peer_bound_proof(relay: Service) -> None:
    async with peer_on(relay, f"hidden-{uuid.uuid4().hex[:6]}") as relay_addr:
        hidden = hop(relay_addr.rsplit("/", 1)[1], f"http://127.0.0.1:{free_port()}", relay_addr)
        async with honest_front() as front:
            answer = await front.post_frame(hidden, {h.ROUTE: route(FRONT, hidden), h.SESSION: "s-2"}, b"frame")
            assert answer.status == 200 and answer.json()["token"] == 5
            with pytest.raises(HopUnreachable):  # no signed route to show: a peer's relay gets nothing at all
                await front.post_frame(hidden, {h.SESSION: "s-3"}, b"frame")


async def test_the_relay_this_nodes_operator_configured_still_takes_its_credential(relay: Service) -> None:
    async with peer_on(relay, f"hidden-{uuid.uuid4().hex[:6]}") as relay_addr:
        hidden = hop(relay_addr.rsplit("/", 1)[1], f"http://127.0.0.1:{free_port()}", relay_addr)
        async with httpx.AsyncClient() as http:
            client = HopClient(http, TEST_SECRET, timeout_s=WAIT_S, node_id="front", hop_key=node_hop_key("front"),
                               connect_timeout_s=2.0, own_relays=(f"ws://{relay.host}:{relay.port}",))
            try:
                answer = await client.post_frame(hidden, {h.SESSION: "s-4"}, b"frame")
            finally:
                await client.aclose()
        assert answer.status == 200


async def test_a_frame_larger_than_an_anonymous_message_passes_with_the_peer_bound_proof() -> None:
    """Under ``meshnet relay`` (whose WebSocket parser bounds anonymous callers' messages) a node's signed
    handshake counts as a credential: a hop frame far over the anonymous bound reaches the peer."""
    with start_service("relay", {"MESHNET_ROUTE_KEYS": TEST_ROUTE_KEYS}, launcher="meshnet") as relay_cli:
        async with peer_on(relay_cli, f"hidden-{uuid.uuid4().hex[:6]}") as relay_addr:
            hidden = hop(relay_addr.rsplit("/", 1)[1], f"http://127.0.0.1:{free_port()}", relay_addr)
            async with honest_front() as front:
                answer = await front.post_frame(hidden, {h.ROUTE: route(FRONT, hidden), h.SESSION: "s-big"},
                                                b"x" * BIG_FRAME_BYTES)
                assert answer.status == 200 and answer.json()["token"] == 5


class BigAnswerPeer:
    """A peer whose every answer is far over the relay's anonymous message bound."""

    async def __call__(self, method: str, path: str, headers: dict[str, str],
                       body: bytes) -> tuple[int, Mapping[str, str], bytes]:
        return 200, {"content-type": "application/octet-stream"}, b"y" * BIG_FRAME_BYTES


async def test_a_peer_that_registered_with_its_credential_answers_past_the_anonymous_bound() -> None:
    """Under ``meshnet relay`` the peer's own link (its credential checked) carries answers of full size."""
    with start_service("relay", {"MESHNET_ROUTE_KEYS": TEST_ROUTE_KEYS}, launcher="meshnet") as relay_cli:
        async with peer_on(relay_cli, f"hidden-{uuid.uuid4().hex[:6]}", BigAnswerPeer()) as relay_addr:
            hidden = hop(relay_addr.rsplit("/", 1)[1], f"http://127.0.0.1:{free_port()}", relay_addr)
            async with honest_front() as front:
                answer = await front.post_frame(hidden, {h.ROUTE: route(FRONT, hidden), h.SESSION: "s-answer"},
                                                b"frame")
                assert answer.status == 200 and len(answer.body) == BIG_FRAME_BYTES
