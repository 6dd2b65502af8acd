"""An anonymous relay caller cannot make the relay buffer more than its small message bound.

The attack (issue 34, finding 8): open anonymous ``/rpc`` connections and send
each a message of nearly the relay's whole WebSocket bound (about 97 MiB by
default); the relay read each whole before its 16 KiB anonymous bound refused
it. ``meshnet relay`` now bounds every connection's messages at the anonymous
bound from the first byte and raises the bound only for a connection it
accepted with a credential (:mod:`services.relay.ws_protocol`).

A real relay (``meshnet relay``, with a 64 MiB message bound) and a real peer:
six anonymous callers each send a 48 MiB message at once; each connection is
closed ``1009`` (message too big), the relay's resident memory grows by far
less than one such message, and it goes on serving anonymous health checks
and an authenticated caller's multi-megabyte request, which still has the full
bound.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Final

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from meshwire import limits
from tests.procs import Service, start_service
from tests.test_relay_service import MESH_CREDENTIAL, WAIT_S, EchoService, serving

MAX_MESSAGE_BYTES: Final = 64 * limits.MIB
ATTACK_BYTES: Final = 48 * limits.MIB
ATTACKERS: Final = 6
MAX_GROWTH_BYTES: Final = 24 * limits.MIB
"""Half of one attack message: six of them read whole would be 288 MiB."""
AUTHENTICATED_BYTES: Final = 4 * limits.MIB


@pytest.fixture(scope="module")
def relay() -> Iterator[Service]:
    with start_service("relay", {"MESHNET_MAX_MESSAGE_BYTES": str(MAX_MESSAGE_BYTES),
                                 "MESHNET_MAX_INFLIGHT_BYTES_PER_PEER": str(2 * MAX_MESSAGE_BYTES),
                                 "MESHNET_MAX_ANONYMOUS_CALLERS_PER_ADDRESS": str(ATTACKERS)},
                       launcher="meshnet") as service:
        yield service


def rss_bytes(service: Service) -> int:
    for line in Path(f"/proc/{service.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def envelope(path: str, body: bytes, request_id: str = "r1") -> str:
    return json.dumps({"request_id": request_id, "method": "GET" if path == "/health" else "POST", "path": path,
                       "headers": {}, "body_base64": base64.b64encode(body).decode()})


class Peer(EchoService):
    """The echo service, with a public ``/health``."""

    async def __call__(self, method: str, path: str, headers: dict[str, str],
                       body: bytes) -> tuple[int, Mapping[str, str], bytes]:
        if path == "/health":
            return 200, {"content-type": "application/json"}, b'{"status": "ok"}'
        return await super().__call__(method, path, headers, body)


async def attack(address: str, message: str) -> int | None:
    """One anonymous caller sending ``message``: the close code it gets (``None``: it was answered)."""
    async with connect(address, open_timeout=WAIT_S, max_size=None) as ws:
        try:
            await ws.send(message)
            await asyncio.wait_for(ws.recv(), WAIT_S)
        except ConnectionClosed as exc:
            return exc.rcvd.code if exc.rcvd is not None else None
    return None


async def test_anonymous_callers_cannot_make_the_relay_buffer_big_messages(relay: Service) -> None:
    message = envelope("/health", b"x" * (ATTACK_BYTES * 3 // 4))
    async with serving(relay, Peer()) as peer:
        before = rss_bytes(relay)
        codes = await asyncio.gather(*(attack(peer.relay_addr, message) for _ in range(ATTACKERS)))
        growth = rss_bytes(relay) - before
        assert codes == [1009] * ATTACKERS, codes
        assert growth < MAX_GROWTH_BYTES, f"the relay grew by {growth / limits.MIB:.0f} MiB"

        async with connect(peer.relay_addr, open_timeout=WAIT_S) as ws:  # anonymous health still answered
            await ws.send(envelope("/health", b""))
            assert json.loads(await asyncio.wait_for(ws.recv(), WAIT_S))["status"] == 200

        body = bytes(range(256)) * (AUTHENTICATED_BYTES // 256)
        async with connect(peer.relay_addr, open_timeout=WAIT_S, additional_headers=MESH_CREDENTIAL,
                           max_size=None) as ws:  # the mesh's own callers keep the full bound
            await ws.send(envelope("/echo", body))
            answer = json.loads(await asyncio.wait_for(ws.recv(), WAIT_S))
        assert answer["status"] == 200, answer
        assert base64.b64decode(answer["body_base64"]) == body[::-1]
