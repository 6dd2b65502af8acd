"""The lean hop client against real sockets: keep-alive, stale connections, bounds, and how far a failure got."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from services.node.hop.hop_http import HopBroken, HopConnectFailed, HopHttp, HopTimedOut
from tests.procs import free_port

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{\"token\":7}"


class Server:
    """A raw HTTP/1.1 server whose behaviour each test writes; counts connections and requests."""

    def __init__(self) -> None:
        self.connections = 0
        self.requests: list[bytes] = []

    async def read_request(self, reader: asyncio.StreamReader) -> bytes | None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        body = await reader.readexactly(length)
        self.requests.append(head + body)
        return body


@contextlib.asynccontextmanager
async def serve(handler: Callable[[Server, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
                ) -> AsyncIterator[tuple[Server, str]]:
    state = Server()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        state.connections += 1
        with contextlib.suppress(Exception):
            await handler(state, reader, writer)
        writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield state, f"http://127.0.0.1:{port}"
    finally:
        server.close()


async def keep_alive(state: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        await state.read_request(reader)
        writer.write(OK)
        await writer.drain()


def client(max_answer_bytes: int = 1 << 20) -> HopHttp:
    return HopHttp(connect_timeout_s=2.0, max_answer_bytes=max_answer_bytes)


async def test_requests_reuse_one_keep_alive_connection_and_carry_headers_and_body() -> None:
    async with serve(keep_alive) as (state, url):
        http = client()
        for _ in range(5):
            answer = await http.request("POST", url, "/forward", {"X-Test": "yes"}, b"frame", 5.0)
            assert (answer.status, answer.body) == (200, b'{"token":7}')
            assert answer.headers["content-type"] == "application/json"
        assert state.connections == 1
        assert state.requests[0].startswith(b"POST /forward HTTP/1.1\r\n")
        assert b"\r\nX-Test: yes\r\n" in state.requests[0] and state.requests[0].endswith(b"\r\n\r\nframe")
        await http.aclose()


async def test_concurrent_requests_each_get_a_connection() -> None:
    async def slow(state: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await state.read_request(reader)
            await asyncio.sleep(0.2)
            writer.write(OK)
            await writer.drain()

    async with serve(slow) as (state, url):
        http = client()
        answers = await asyncio.gather(*(http.request("POST", url, "/f", {}, b"", 5.0) for _ in range(4)))
        assert [a.status for a in answers] == [200] * 4 and state.connections == 4
        await http.aclose()


async def test_a_connection_the_server_closed_while_idle_is_replaced_without_an_error() -> None:
    async def one_per_connection(state: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await state.read_request(reader)
        writer.write(OK)  # keep-alive promised, then the server closes the idle connection (its timeout)
        await writer.drain()

    async with serve(one_per_connection) as (state, url):
        http = client()
        for _ in range(3):
            assert (await http.request("POST", url, "/f", {}, b"x", 5.0)).status == 200
            await asyncio.sleep(0.05)
        assert state.connections == 3
        await http.aclose()


async def test_chunked_and_connection_close_answers_are_read_whole() -> None:
    async def chunked(state: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await state.read_request(reader)
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\nTransfer-Encoding: chunked\r\nRetry-After: 2\r\n"
                     b"Connection: close\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
        await writer.drain()

    async with serve(chunked) as (state, url):
        http = client()
        answer = await http.request("POST", url, "/f", {}, b"", 5.0)
        assert (answer.status, answer.body, answer.headers["retry-after"]) == (503, b"hello world", "2")
        await http.request("POST", url, "/f", {}, b"", 5.0)
        assert state.connections == 2, "a connection the server said it closes is not reused"


async def test_an_answer_over_the_bound_is_refused() -> None:
    async def big(state: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await state.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5000\r\n\r\n" + b"x" * 5000)
        await writer.drain()

    async with serve(big) as (_, url):
        with pytest.raises(HopBroken, match="longer than 1000 bytes"):
            await client(max_answer_bytes=1000).request("POST", url, "/f", {}, b"", 5.0)


async def test_a_refused_connection_says_the_hop_was_never_reached() -> None:
    with pytest.raises(HopConnectFailed, match="cannot connect"):
        await client().request("POST", f"http://127.0.0.1:{free_port()}", "/f", {}, b"", 5.0)


async def test_a_hop_that_never_answers_times_out() -> None:
    async def silent(state: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await state.read_request(reader)
        await asyncio.sleep(30)

    async with serve(silent) as (_, url):
        with pytest.raises(HopTimedOut, match="no answer within 0.3 s"):
            await client().request("POST", url, "/f", {}, b"", 0.3)


async def test_a_hop_that_dies_mid_answer_is_broken_not_unreached() -> None:
    async def dies(state: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await state.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
        await writer.drain()

    async with serve(dies) as (_, url):
        with pytest.raises(HopBroken, match="middle of its answer"):
            await client().request("POST", url, "/f", {}, b"", 5.0)


async def test_a_garbled_answer_is_broken() -> None:
    async def garbage(state: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await state.read_request(reader)
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()

    async with serve(garbage) as (_, url):
        with pytest.raises(HopBroken, match="malformed answer"):
            await client().request("POST", url, "/f", {}, b"", 5.0)


async def test_header_values_cannot_smuggle_lines() -> None:
    with pytest.raises(ValueError, match="line break"):
        await client().request("POST", "http://127.0.0.1:1", "/f", {"X-Bad": "a\r\nInjected: 1"}, b"", 5.0)


def test_a_connect_that_is_never_answered_is_a_connect_failure() -> None:
    """A listening socket with a full backlog stands in for a NAT that drops packets."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        fillers = []
        try:
            for _ in range(8):  # fill the accept queue so further SYNs go unanswered
                filler = socket.socket()
                filler.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    filler.connect(("127.0.0.1", port))
                fillers.append(filler)

            async def go() -> None:
                await HopHttp(connect_timeout_s=0.5, max_answer_bytes=1000).request(
                    "POST", f"http://127.0.0.1:{port}", "/f", {}, b"", 5.0)

            with pytest.raises(HopConnectFailed):
                asyncio.run(go())
        finally:
            for filler in fillers:
                filler.close()
