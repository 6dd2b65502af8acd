"""meshwire.body_guard in-process: a body in time passes whole, a late one is answered 408, a growing one 413;
and read_bounded, the one bounded body read every service's handlers use.

The app here reads its body the way the services do (``receive`` until
``more_body`` is false); a body that never comes is a ``receive`` that never
returns. Every wait is bounded far above the guard's deadline.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from meshwire.body_guard import BodyGuard, BodyIncomplete, BodyTooLarge, plain_text, read_bounded

DEADLINE_S = 0.05
BOUND_S = 30.0


class Exchange:
    """A request's receive side (chunks, then a stall if asked) and what was sent back."""

    def __init__(self, chunks: list[bytes], stall: bool = False) -> None:
        self.chunks = list(chunks)
        self.stall = stall
        self.sent: list[dict[str, Any]] = []

    async def receive(self) -> dict[str, Any]:
        if self.chunks:
            chunk = self.chunks.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(self.chunks) or self.stall}
        await asyncio.Event().wait()  # the client sends nothing more
        raise AssertionError("unreachable")

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    @property
    def status(self) -> int:
        return next(m["status"] for m in self.sent if m["type"] == "http.response.start")

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")


async def echo(scope: dict[str, Any], receive: Any, send: Any) -> None:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body})


SCOPE: dict[str, Any] = {"type": "http", "method": "POST", "path": "/", "headers": []}


async def test_a_body_that_arrives_in_time_reaches_the_app_whole() -> None:
    exchange = Exchange([b"ab", b"cd", b"ef"])
    await asyncio.wait_for(BodyGuard(echo, timeout_s=BOUND_S)(SCOPE, exchange.receive, exchange.send), BOUND_S)
    assert (exchange.status, exchange.body) == (200, b"abcdef")


async def test_a_body_that_stops_coming_is_answered_408_and_the_app_s_answer_is_dropped() -> None:
    exchange = Exchange([b"ab"], stall=True)
    await asyncio.wait_for(BodyGuard(echo, timeout_s=DEADLINE_S)(SCOPE, exchange.receive, exchange.send), BOUND_S)
    assert exchange.status == 408
    assert orjson.loads(exchange.body)["error"]["code"] == "body_timeout"
    assert (b"connection", b"close") in exchange.sent[0]["headers"]
    assert len(exchange.sent) == 2


async def test_a_request_cancelled_for_another_reason_is_not_mistaken_for_a_late_body() -> None:
    exchange = Exchange([b"ab"], stall=True)
    task = asyncio.create_task(BodyGuard(echo, timeout_s=BOUND_S)(SCOPE, exchange.receive, exchange.send))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, BOUND_S)
    assert exchange.sent == []


async def test_a_chunked_body_growing_past_the_cap_is_answered_413_as_it_passes() -> None:
    exchange = Exchange([b"x" * 40, b"x" * 40, b"x" * 40])
    guard = BodyGuard(echo, timeout_s=BOUND_S, max_bytes=64, render=plain_text)
    await asyncio.wait_for(guard(SCOPE, exchange.receive, exchange.send), BOUND_S)
    assert (exchange.status, exchange.body) == (413, b"request body over 64 bytes")


async def test_a_declared_length_over_the_cap_is_answered_before_anything_is_read() -> None:
    exchange = Exchange([b"never read"])
    scope = {**SCOPE, "headers": [(b"content-length", b"1000")]}
    await BodyGuard(echo, timeout_s=BOUND_S, max_bytes=64)(scope, exchange.receive, exchange.send)
    assert exchange.status == 413 and exchange.chunks == [b"never read"]


# --- read_bounded: a handler's own bound ------------------------------------------------------------

class Request:
    """What read_bounded reads (a Starlette request's ``headers`` and ``receive``), over an :class:`Exchange`."""

    def __init__(self, exchange: Exchange, headers: dict[str, str] | None = None,
                 disconnect: bool = False) -> None:
        self.headers = headers or {}
        self.exchange = exchange
        self.disconnect = disconnect

    async def receive(self) -> dict[str, Any]:
        if self.disconnect and not self.exchange.chunks:
            return {"type": "http.disconnect"}
        return await self.exchange.receive()


async def read(request: Request, max_bytes: int) -> bytes:
    return await asyncio.wait_for(read_bounded(request, max_bytes), BOUND_S)


async def test_a_body_within_the_bound_is_read_whole_from_every_message() -> None:
    exchange = Exchange([b"ab", b"", b"cd"])
    assert await read(Request(exchange, {"content-length": "4"}), 4) == b"abcd"


async def test_a_declared_length_over_the_bound_is_refused_before_anything_is_read() -> None:
    exchange = Exchange([b"never read"])
    with pytest.raises(BodyTooLarge) as refused:
        await read(Request(exchange, {"content-length": "1000"}), 64)
    assert (refused.value.declared, refused.value.max_bytes) == (1000, 64)
    assert exchange.chunks == [b"never read"]


async def test_a_body_growing_past_the_bound_is_refused_as_it_passes_and_the_rest_is_not_read() -> None:
    exchange = Exchange([b"x" * 40, b"x" * 40, b"never read"])
    with pytest.raises(BodyTooLarge) as refused:
        await read(Request(exchange), 64)
    assert refused.value.declared is None
    assert exchange.chunks == [b"never read"]


async def test_an_unreadable_declared_length_is_no_licence_to_read_past_the_bound() -> None:
    exchange = Exchange([b"x" * 40, b"x" * 40])
    with pytest.raises(BodyTooLarge):
        await read(Request(exchange, {"content-length": "lots"}), 64)


async def test_a_sender_that_goes_away_mid_body_leaves_it_incomplete() -> None:
    exchange = Exchange([b"ab"], stall=True)
    with pytest.raises(BodyIncomplete):
        await read(Request(exchange, disconnect=True), 64)
