"""The WAN emulator of the benchmarks: bytes pass intact, each direction waits RTT/2, bandwidth is capped.

Only lower bounds are asserted (a proxy on a busy machine may be slower than
its link, never faster), so these tests do not depend on how busy the machine is.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator

import pytest

from benchmarks.wan_proxy import LinkShape, WanProxy, proxy_thread

RTT_MS = 200.0
"""A round trip long enough that no loopback exchange could take it by chance."""


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.close()


async def _started_echo() -> asyncio.Server:
    return await asyncio.start_server(_echo, "127.0.0.1", 0)


async def _proxied(shape: LinkShape) -> AsyncIterator[WanProxy]:
    server = await _started_echo()
    proxy = WanProxy("127.0.0.1", server.sockets[0].getsockname()[1], shape)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.close()
        server.close()


async def _exchange(port: int, payload: bytes) -> tuple[bytes, float]:
    """Send ``payload`` through the proxy to the echo server; what came back and the seconds it took."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    began = time.monotonic()
    writer.write(payload)
    await writer.drain()
    received = await reader.readexactly(len(payload))
    elapsed = time.monotonic() - began
    writer.close()
    return received, elapsed


def test_bytes_pass_intact_and_every_round_trip_takes_at_least_the_rtt() -> None:
    async def go() -> None:
        async for proxy in _proxied(LinkShape(rtt_ms=RTT_MS)):
            payload = os.urandom(200_000)
            received, elapsed = await _exchange(proxy.port, payload)
            assert received == payload
            assert elapsed >= RTT_MS / 1000 * 0.95
            assert proxy.bytes_forwarded == 2 * len(payload)

    asyncio.run(go())


def test_several_exchanges_on_one_connection_each_pay_the_round_trip() -> None:
    async def go() -> None:
        async for proxy in _proxied(LinkShape(rtt_ms=RTT_MS)):
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            began = time.monotonic()
            for index in range(3):
                message = f"step {index}".encode()
                writer.write(message)
                await writer.drain()
                assert await reader.readexactly(len(message)) == message
            assert time.monotonic() - began >= 3 * RTT_MS / 1000 * 0.95
            writer.close()

    asyncio.run(go())


def test_bandwidth_is_capped_in_each_direction() -> None:
    async def go() -> None:
        bandwidth = 200_000.0  # bytes a second
        async for proxy in _proxied(LinkShape(rtt_ms=0.0, bandwidth_bytes_s=bandwidth)):
            payload = os.urandom(100_000)
            received, elapsed = await _exchange(proxy.port, payload)
            assert received == payload
            # 0.5 s to send it there, 0.5 s to send it back (the echo pipelines; the sum is a lower bound
            # only in part, so ask for what one direction alone must take).
            assert elapsed >= len(payload) / bandwidth * 0.95

    asyncio.run(go())


def test_a_zero_rtt_link_is_transparent() -> None:
    async def go() -> None:
        async for proxy in _proxied(LinkShape()):
            payload = b"x" * 10
            received, _ = await _exchange(proxy.port, payload)
            assert received == payload

    asyncio.run(go())


def test_the_shape_changes_on_an_open_connection_from_another_thread() -> None:
    async def serve_echo(ready: asyncio.Future[int]) -> None:
        server = await _started_echo()
        ready.set_result(server.sockets[0].getsockname()[1])
        await asyncio.sleep(30)

    async def go() -> None:
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[int] = loop.create_future()
        echo = asyncio.create_task(serve_echo(ready))
        port = await ready
        with proxy_thread() as thread:
            proxy = thread.proxy(port, LinkShape())
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            writer.write(b"a")
            assert await reader.readexactly(1) == b"a"
            thread.set_shape(LinkShape(rtt_ms=RTT_MS))
            await asyncio.sleep(0.05)  # the shape reaches the proxy's loop
            began = time.monotonic()
            writer.write(b"b")
            assert await reader.readexactly(1) == b"b"
            assert time.monotonic() - began >= RTT_MS / 1000 * 0.95
            writer.close()
        echo.cancel()

    asyncio.run(go())


@pytest.mark.parametrize("bad", [{"rtt_ms": -1.0}, {"rtt_ms": 1e9}, {"bandwidth_bytes_s": 0.0}])
def test_a_link_shape_refuses_impossible_figures(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        LinkShape(**bad)


# --- the wan benchmarks' bookkeeping (no timing asserted) -------------------------------------------------------


def test_a_mesh_is_behind_wan_proxies_or_a_relay_not_both() -> None:
    from benchmarks.mesh import MeshSpec

    assert "WAN RTT 50 ms" in MeshSpec(model="m", num_layers=4, nodes=2, wan=LinkShape(rtt_ms=50.0)).describe()
    with pytest.raises(ValueError):
        MeshSpec(model="m", num_layers=4, nodes=2, wan=LinkShape(rtt_ms=50.0), relayed=frozenset({1}))


def test_the_wan_rows_name_each_node_count_and_rtt_with_the_bound_the_round_trips_set() -> None:
    from benchmarks import wan
    from benchmarks.timing import StreamTiming

    timings = {wan.label(n, rtt): [StreamTiming(tokens=11, first_s=0.5, last_s=1.5)]
               for n in wan.NODE_COUNTS for rtt in wan.RTTS_MS}
    outcome = wan.outcome(timings, max_tokens=11)
    assert len(outcome.rows) == 2 * len(wan.NODE_COUNTS) * len(wan.RTTS_MS)
    row = next(r for r in outcome.rows if r.label == "2 nodes, RTT 50 ms: decode")
    assert row.value.median == 10.0 and "at most 10.0 tok/s" in row.note


def test_the_wan_spec_rows_give_k_acceptance_and_the_ratio_to_off() -> None:
    from benchmarks import wan_spec
    from benchmarks.timing import StreamTiming

    def runs(rate: float, drafted: float, accepted: float, steps: float) -> list[wan_spec.SpecRun]:
        return [wan_spec.SpecRun(StreamTiming(tokens=11, first_s=0.0, last_s=10 / rate), drafted, accepted, steps)]

    results = {wan_spec.label(mode, name): runs(10.0 if mode == "off" else 25.0, 0 if mode == "off" else 40,
                                                 0 if mode == "off" else 30, 0 if mode == "off" else 10)
               for mode in wan_spec.MODES for name in wan_spec.PROMPTS}
    outcome = wan_spec.outcome(results, max_tokens=11)
    against = next(r for r in outcome.rows if r.label == "RTT 50 ms, speculate on, copying: against off")
    assert against.value.median == 2.5
    decode = next(r for r in outcome.rows if r.label == "RTT 50 ms, speculate on, copying: decode")
    assert decode.note == "k 4.0 per speculative step, 75% of drafts accepted"
