"""Read every request body under a byte cap and a deadline, before the routes run.

The reference reads at most 4 MiB of a request with a 10 s socket timeout.
uvicorn has no body-read timeout and no body cap, so this ASGI middleware
enforces both from inside the app, whatever server runs it:

* a ``Content-Length`` over the cap is answered 413 at once, before any of
  the body is read;
* a body that grows past the cap as it arrives (chunked) is answered 413 as
  soon as the running count passes it;
* a body not received in full within the deadline is answered 408.

Each such answer carries ``Connection: close``, so the server drops the
connection instead of draining what the client still sends. A body that was
read in full is handed to the app as one message: the routes then read it
with ``await request.body()`` at no further risk.

The request head (line and headers) arrives before the app is called; its
own deadline is the server's (:mod:`services.bootstrap.head_deadline`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Final

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.bootstrap import refusals

logger = logging.getLogger(__name__)

_CLOSE: Final = (b"connection", b"close")


class BodyTooLarge(Exception):
    """The body passed the cap while it was being read."""


class ClientGone(Exception):
    """The client disconnected before its body was complete."""


def declared_length(scope: Scope) -> int | None:
    """The request's ``Content-Length``, or ``None`` when it has none or an unreadable one."""
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-length":
            text = value.decode("latin-1").strip()
            return int(text) if text.isdigit() else None
    return None


async def read_capped(receive: Receive, max_bytes: int) -> bytes:
    """Collect the body from ``receive``; :class:`BodyTooLarge` as soon as it passes ``max_bytes``."""
    chunks: list[bytes] = []
    total = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk: bytes = message.get("body", b"")
        total += len(chunk)
        if total > max_bytes:
            raise BodyTooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def refuse(send: Send, status: int, message: str) -> None:
    """Answer ``status`` with a text/plain ``message`` and close the connection."""
    body = message.encode("utf-8")
    await send({
        "type": "http.response.start",
        "status": status,
        "headers": [
            (b"content-type", b"text/plain; charset=utf-8"),
            (b"content-length", str(len(body)).encode("ascii")),
            _CLOSE,
        ],
    })
    await send({"type": "http.response.body", "body": body, "more_body": False})


class BodyGuard:
    """ASGI middleware: the body is read whole (capped, within a deadline) before ``app`` runs."""

    def __init__(self, app: ASGIApp, *, max_bytes: int, timeout_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = declared_length(scope)
        if length is not None and length > self.max_bytes:
            logger.warning("refused a %d-byte request body (cap %d)", length, self.max_bytes)
            await refuse(send, refusals.PAYLOAD_TOO_LARGE, self._too_large())
            return
        try:
            async with asyncio.timeout(self.timeout_s):
                body = await read_capped(receive, self.max_bytes)
        except BodyTooLarge:
            logger.warning("refused a request body growing past %d bytes", self.max_bytes)
            await refuse(send, refusals.PAYLOAD_TOO_LARGE, self._too_large())
            return
        except TimeoutError:
            logger.warning("cut off a client that did not send its body within %g s", self.timeout_s)
            await refuse(send, refusals.REQUEST_TIMEOUT,
                         f"request body not received within {self.timeout_s:g} s")
            return
        except ClientGone:
            return
        await self.app(scope, _replay(body, receive), send)

    def _too_large(self) -> str:
        return f"request body over {self.max_bytes} bytes"


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that yields ``body`` once, then defers to the server's (disconnects)."""
    delivered = False

    async def replay() -> Message:
        nonlocal delivered
        if delivered:
            return await receive()
        delivered = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay
