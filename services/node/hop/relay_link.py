"""Serving this node through a relay, for a node that other nodes cannot dial (behind NAT).

With ``--relay URL`` the node keeps one outbound connection to the relay
(``meshwire.relay_client.RelayPeer``) and registers the relay address with the
tracker as its ``relay_addr``. Each request that arrives over that connection
is handed to the node's own ASGI app in-process (:func:`asgi_handler`), so a
relayed ``/forward`` goes through exactly the same checks as a direct one.
A relayed answer is delivered whole (the relay carries one response per
request), which suits ``/forward``; streams are meant to be dialled directly.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final

ASGIApp = Callable[[dict[str, Any], Callable[[], Awaitable[dict[str, Any]]],
                    Callable[[dict[str, Any]], Awaitable[None]]], Awaitable[None]]
RelayHandler = Callable[[str, str, dict[str, str], bytes], Awaitable[tuple[int, Mapping[str, str], bytes]]]

RELAY_CLIENT: Final = ("relay", 0)
"""The ``client`` of a relayed request's ASGI scope."""
MAX_RELAYED_ANSWER_BYTES: Final = 96 << 20
"""A relayed answer larger than this is cut off with a 502 (the relay would refuse it anyway)."""


def asgi_handler(app: ASGIApp) -> RelayHandler:
    """A relay request handler that answers with ``app``, as if the request had come over HTTP."""

    async def handle(method: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, Mapping[str, str], bytes]:
        route, _, query = path.partition("?")
        scope: dict[str, Any] = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method.upper(),
            "scheme": "http", "path": route, "raw_path": route.encode("latin-1", "replace"),
            "query_string": query.encode("latin-1", "replace"), "root_path": "",
            "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()],
            "client": RELAY_CLIENT, "server": RELAY_CLIENT,
        }
        delivered = False
        answered = asyncio.Event()

        async def receive() -> dict[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await answered.wait()  # the caller never disconnects mid-request
            return {"type": "http.disconnect"}

        status = 500
        out_headers: dict[str, str] = {}
        chunks: list[bytes] = []
        size = 0

        async def send(message: dict[str, Any]) -> None:
            nonlocal status, size
            if message["type"] == "http.response.start":
                status = int(message["status"])
                out_headers.update((k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", []))
            elif message["type"] == "http.response.body":
                chunk = message.get("body", b"")
                size += len(chunk)
                if size <= MAX_RELAYED_ANSWER_BYTES:
                    chunks.append(chunk)
                if not message.get("more_body", False):
                    answered.set()

        await app(scope, receive, send)
        answered.set()
        if size > MAX_RELAYED_ANSWER_BYTES:
            return 502, {"content-type": "application/json"}, b'{"error": {"message": "answer too large to relay"}}'
        return status, out_headers, b"".join(chunks)

    return handle
