"""The ``meshwire`` bootstrap client: what a prefill or decode worker uses to reach the service."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from pydantic import ValidationError
from starlette.types import Receive, Scope, Send

from meshwire.bootstrap_client import (
    AsyncBootstrapClient,
    BootstrapError,
    BootstrapRefused,
    BootstrapUnavailable,
    PrefillInfo,
    RankAddress,
    RankNotRegistered,
    RankRegistration,
    RetryPolicy,
)
from services.bootstrap.app import create_app
from services.bootstrap.server import BootstrapServer
from services.bootstrap.settings import BootstrapSettings
from tests.bootstrap_samples import STAGES, layout
from tests.procs import free_port

FAST_RETRY = RetryPolicy(attempts=4, backoff_s=0.01, max_backoff_s=0.05)
PATIENT_RETRY = RetryPolicy(attempts=1000, backoff_s=0.01, max_backoff_s=0.05)
WAIT_S = 30.0


def settings(**changes: Any) -> BootstrapSettings:
    return BootstrapSettings(host="127.0.0.1", port=0, access_log=False, **changes)


@pytest.fixture
def server() -> Iterator[BootstrapServer]:
    with BootstrapServer(settings()) as running:
        yield running


def prefill_rank(engine_rank: int, port: int = 7000) -> RankRegistration:
    return RankRegistration(world_size=4, dp_size=2, rank_ip="10.0.0.1", rank_port=port, engine_rank=engine_rank)


class AttemptCountingTransport(httpx.AsyncHTTPTransport):
    """A real async transport that counts the attempts made through it, answered or failed."""

    def __init__(self) -> None:
        super().__init__()
        self.attempts = 0
        self.attempted = asyncio.Event()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.attempts += 1
        try:
            return await super().handle_async_request(request)
        finally:
            self.attempted.set()


class AsyncCountingTransport(httpx.AsyncHTTPTransport):
    """A real async transport that counts the answers received through it."""

    def __init__(self) -> None:
        super().__init__()
        self.answers = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await super().handle_async_request(request)
        self.answers += 1
        return response


async def answers_seen(transport: AsyncCountingTransport, count: int) -> None:
    while transport.answers < count:
        await asyncio.sleep(0.01)


# --- the three calls --------------------------------------------------------------------------------

async def test_a_prefill_rank_registers_and_a_decode_rank_finds_it(server: BootstrapServer) -> None:
    async with AsyncBootstrapClient(server.url) as bootstrap:
        assert await bootstrap.health()
        assert not (await bootstrap.get_sizes()).registered
        await bootstrap.register_rank(prefill_rank(3, port=7003))
        assert await bootstrap.get_sizes() == PrefillInfo(prefill_tp_size=4, prefill_dp_size=2, prefill_pp_size=1)
        assert await bootstrap.lookup_rank(engine_rank=1, dp_group=1) == RankAddress(rank_ip="10.0.0.1",
                                                                                     rank_port=7003)


async def test_a_cache_node_registers_its_layout_through_the_client() -> None:
    with BootstrapServer(settings(registry="cache-layouts")) as server:
        async with AsyncBootstrapClient(server.url) as bootstrap:
            await bootstrap.register_rank(RankRegistration(
                world_size=4, dp_size=2, rank_ip="10.0.0.1", rank_port=7000, engine_rank=0,
                pp_size=2, cache_layout=layout(), cache_fields_by_stage=STAGES))
            info = await bootstrap.get_sizes()
    assert info.cache_layout == layout()
    assert info.cache_fields_by_stage == (("layer.0.kv",), ("layer.1.kv",))
    assert info.prefill_pp_size == 2


async def test_a_refusal_raises_with_the_service_s_text() -> None:
    with BootstrapServer(settings(registry="cache-layouts")) as server:
        async with AsyncBootstrapClient(server.url) as bootstrap:
            with pytest.raises(BootstrapRefused) as refused:
                await bootstrap.register_rank(prefill_rank(0))
    assert (refused.value.status, refused.value.message) == (500, "CachePD bootstrap layout must be a string")


async def test_a_rank_not_registered_raises_at_once_without_waiting(server: BootstrapServer) -> None:
    async with AsyncBootstrapClient(server.url) as bootstrap:
        with pytest.raises(RankNotRegistered):
            await bootstrap.lookup_rank(engine_rank=0, dp_group=5)


# --- retries and timeouts ---------------------------------------------------------------------------

async def test_an_unreachable_service_is_tried_as_often_as_the_policy_says() -> None:
    transport = AttemptCountingTransport()
    async with AsyncBootstrapClient(f"http://127.0.0.1:{free_port()}", retry=FAST_RETRY,
                                    transport=transport) as bootstrap:
        with pytest.raises(BootstrapUnavailable, match="failed 4 attempts"):
            await bootstrap.get_sizes()
    assert transport.attempts == 4


async def test_a_registration_retries_until_the_service_comes_up() -> None:
    port = free_port()
    transport = AttemptCountingTransport()
    async with AsyncBootstrapClient(f"http://127.0.0.1:{port}", retry=PATIENT_RETRY,
                                    transport=transport) as client:
        registered = asyncio.ensure_future(client.register_rank(prefill_rank(0)))
        await asyncio.wait_for(transport.attempted.wait(), WAIT_S)  # a first attempt has failed: nothing listens
        assert not registered.done()
        with BootstrapServer(BootstrapSettings(host="127.0.0.1", port=port, access_log=False)) as server:
            await asyncio.wait_for(registered, WAIT_S)
            assert server.app.state.registry.registered_ranks == 1
    assert transport.attempts >= 2


async def test_a_service_that_never_answers_times_out_and_is_unavailable() -> None:
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()  # connections are accepted by the kernel, and never answered
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        async with AsyncBootstrapClient(url, timeout_s=0.2,
                                        retry=RetryPolicy(attempts=2, backoff_s=0.0)) as bootstrap:
            with pytest.raises(BootstrapUnavailable, match="Timeout"):
                await bootstrap.get_sizes()


class BusyFirst:
    """An ASGI app answering 503 to its first ``busy`` requests, then passing them to ``app``."""

    def __init__(self, app: Any, busy: int) -> None:
        self.app = app
        self.busy = busy
        self.requests = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.requests += 1
        if self.requests <= self.busy:
            await send({"type": "http.response.start", "status": 503, "headers": []})
            await send({"type": "http.response.body", "body": b"busy"})
            return
        await self.app(scope, receive, send)


async def test_a_503_is_retried_and_then_succeeds() -> None:
    front = BusyFirst(create_app(settings()), busy=2)
    async with AsyncBootstrapClient("http://bootstrap", retry=FAST_RETRY,
                                    transport=httpx.ASGITransport(app=front)) as bootstrap:
        await bootstrap.register_rank(prefill_rank(0))
    assert front.requests == 3


async def test_a_503_that_persists_is_unavailable() -> None:
    front = BusyFirst(create_app(settings()), busy=100)
    async with AsyncBootstrapClient("http://bootstrap", retry=FAST_RETRY,
                                    transport=httpx.ASGITransport(app=front)) as bootstrap:
        with pytest.raises(BootstrapUnavailable, match="503"):
            await bootstrap.get_sizes()
    assert front.requests == FAST_RETRY.attempts


# --- waiting for registrations ----------------------------------------------------------------------

async def test_a_lookup_waits_for_the_rank_to_register(server: BootstrapServer) -> None:
    transport = AsyncCountingTransport()
    async with AsyncBootstrapClient(server.url, transport=transport) as decode, \
            AsyncBootstrapClient(server.url) as prefill:
        waiting = asyncio.ensure_future(decode.lookup_rank(engine_rank=1, dp_group=1, wait_s=WAIT_S))
        await answers_seen(transport, 1)  # the rank was not there yet
        await prefill.register_rank(prefill_rank(3, port=7003))
        assert (await waiting).rank_port == 7003


async def test_a_lookup_that_waits_in_vain_raises(server: BootstrapServer) -> None:
    async with AsyncBootstrapClient(server.url, retry=FAST_RETRY) as decode:
        with pytest.raises(RankNotRegistered):
            await decode.lookup_rank(engine_rank=0, dp_group=0, wait_s=0.1)


async def test_sizes_can_be_waited_for(server: BootstrapServer) -> None:
    transport = AsyncCountingTransport()
    async with AsyncBootstrapClient(server.url, transport=transport) as decode, \
            AsyncBootstrapClient(server.url) as prefill:
        waiting = asyncio.ensure_future(decode.get_sizes(wait_s=WAIT_S))
        await answers_seen(transport, 1)
        await prefill.register_rank(prefill_rank(0))
        sizes = await waiting
    assert (sizes.prefill_tp_size, sizes.prefill_dp_size) == (4, 2)


async def test_the_async_client_reports_health_and_lookups(server: BootstrapServer) -> None:
    async with AsyncBootstrapClient(server.url) as bootstrap:
        assert await bootstrap.health()
        await bootstrap.register_rank(prefill_rank(0, port=7000))
        assert await bootstrap.lookup_rank(0, 0) == RankAddress(rank_ip="10.0.0.1", rank_port=7000)


# --- answers are bounded and checked ----------------------------------------------------------------

def fixed_answer(status: int, body: bytes) -> Any:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": body})
    return app


@pytest.mark.parametrize(("status", "body", "error"), [
    (200, b"x" * (2 << 20), "over"),
    (200, b"not json", "not a PrefillInfo"),
    (200, orjson.dumps({"prefill_tp_size": "4", "prefill_dp_size": 2, "prefill_pp_size": 1}), "PrefillInfo"),
])
async def test_an_answer_too_large_or_malformed_is_an_error(status: int, body: bytes, error: str) -> None:
    transport = httpx.ASGITransport(app=fixed_answer(status, body))
    async with AsyncBootstrapClient("http://bootstrap", transport=transport) as bootstrap:
        with pytest.raises(BootstrapError, match=error):
            await bootstrap.get_sizes()


async def test_the_client_is_not_fooled_by_a_health_check_of_a_dead_service() -> None:
    async with AsyncBootstrapClient(f"http://127.0.0.1:{free_port()}") as bootstrap:
        assert not await bootstrap.health()


# --- the registration model -------------------------------------------------------------------------

def test_a_registration_sends_only_the_keys_it_has() -> None:
    assert orjson.loads(prefill_rank(3, port=7003).wire()) == {
        "role": "Prefill", "world_size": 4, "dp_size": 2, "rank_ip": "10.0.0.1",
        "rank_port": 7003, "engine_rank": 3,
    }


@pytest.mark.parametrize("change", [
    {"rank_port": 0}, {"rank_port": 70_000}, {"world_size": 0}, {"engine_rank": -1}, {"rank_ip": ""},
    {"role": "Encoder"}, {"rank_port": "7000"}, {"unknown": 1},
])
def test_a_registration_refuses_what_the_service_would_misplace(change: dict[str, Any]) -> None:
    fields: dict[str, Any] = {"world_size": 4, "dp_size": 2, "rank_ip": "h", "rank_port": 7000, "engine_rank": 0}
    with pytest.raises(ValidationError):
        RankRegistration(**{**fields, **change})


def test_a_retry_policy_waits_longer_each_time_up_to_its_cap() -> None:
    assert list(RetryPolicy(attempts=5, backoff_s=0.1, max_backoff_s=0.3).pauses()) == [0.0, 0.1, 0.2, 0.3, 0.3]
    with pytest.raises(ValueError):
        RetryPolicy(attempts=0)
