"""Many clients registering and looking up at once, against a real server."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from meshwire.bootstrap_client import AsyncBootstrapClient, RankRegistration
from services.bootstrap.registry import RegistryKind
from services.bootstrap.server import BootstrapServer
from services.bootstrap.settings import BootstrapSettings
from tests.bootstrap_samples import STAGES, cache_registration, registration

CLIENTS = 64
WORLD, DP = 64, 8
TP = WORLD // DP
TIMEOUT_S = 30.0
SIZES = "/route?engine_rank=-1&target_dp_group=-1"
TLS = ssl.create_default_context()
"""Shared by the clients: building one per client costs more than the requests (plain HTTP here)."""


def start(kind: RegistryKind = "addresses") -> BootstrapServer:
    return BootstrapServer(BootstrapSettings(host="127.0.0.1", port=0, registry=kind, access_log=False)).start()


@pytest.fixture
def server() -> Iterator[BootstrapServer]:
    with start() as running:
        yield running


def rank_body(rank: int) -> dict[str, Any]:
    return registration(rank, port=10_000 + rank, rank_ip=f"10.0.{rank // 256}.{rank % 256}",
                        world_size=WORLD, dp_size=DP)


async def put_from_own_client(url: str, body: dict[str, Any]) -> int:
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S, verify=TLS) as http:
        return (await http.put("/route", json=body)).status_code


async def get_from_own_client(url: str, target: str) -> Any:
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S, verify=TLS) as http:
        answer = await http.get(target)
        assert answer.status_code == 200, answer.text
        return answer.json()


async def test_many_ranks_register_at_once_and_each_is_found(server: BootstrapServer) -> None:
    statuses = await asyncio.gather(*(put_from_own_client(server.url, rank_body(r)) for r in range(CLIENTS)))
    assert statuses == [200] * CLIENTS

    answers = await asyncio.gather(*(
        get_from_own_client(server.url, f"/route?engine_rank={r % TP}&target_dp_group={r // TP}")
        for r in range(CLIENTS)))
    assert answers == [{"rank_ip": rank_body(r)["rank_ip"], "rank_port": 10_000 + r} for r in range(CLIENTS)]
    assert server.app.state.registry.registered_ranks == CLIENTS


async def test_decode_ranks_waiting_for_prefill_ranks_all_find_them(server: BootstrapServer) -> None:
    async def decode(rank: int) -> tuple[str, int]:
        async with AsyncBootstrapClient(server.url, timeout_s=TIMEOUT_S,
                                        transport=httpx.AsyncHTTPTransport(verify=TLS)) as bootstrap:
            address = await bootstrap.lookup_rank(rank % TP, rank // TP, wait_s=TIMEOUT_S)
            return address.rank_ip, address.rank_port

    async def prefill(rank: int) -> None:
        async with AsyncBootstrapClient(server.url, timeout_s=TIMEOUT_S,
                                        transport=httpx.AsyncHTTPTransport(verify=TLS)) as bootstrap:
            await bootstrap.register_rank(RankRegistration.model_validate(rank_body(rank)))

    lookups = [asyncio.ensure_future(decode(rank)) for rank in range(CLIENTS)]
    await asyncio.gather(*(prefill(rank) for rank in reversed(range(CLIENTS))))
    found = await asyncio.gather(*lookups)
    assert found == [(rank_body(r)["rank_ip"], 10_000 + r) for r in range(CLIENTS)]


async def test_concurrent_first_registrations_leave_exactly_one_of_the_sizes_sent(
        server: BootstrapServer) -> None:
    bodies = [registration(0, world_size=2 * (i + 1), dp_size=i + 1) for i in range(CLIENTS)]
    statuses = await asyncio.gather(*(put_from_own_client(server.url, body) for body in bodies))
    assert statuses == [200] * CLIENTS
    sizes = await get_from_own_client(server.url, SIZES)
    sent = {(body["world_size"], body["dp_size"]) for body in bodies}
    assert (sizes["prefill_tp_size"], sizes["prefill_dp_size"]) in sent


async def test_a_cache_node_s_ranks_register_the_same_layout_at_once() -> None:
    with start("cache-layouts") as server:
        statuses = await asyncio.gather(*(
            put_from_own_client(server.url, cache_registration(rank)) for rank in range(4)))
        assert statuses == [200] * 4
        info = await get_from_own_client(server.url, SIZES)
    assert info["cache_fields_by_stage"] == STAGES
    assert info["prefill_pp_size"] == len(STAGES)
