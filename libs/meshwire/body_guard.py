"""A deadline (and, where asked, a byte cap) on every request body, as ASGI middleware.

uvicorn has no body-read timeout: a client that sends its head and then its
body a byte a minute holds a connection and a task for as long as it likes.
:class:`BodyGuard` wraps the app's ``receive`` so that

* once the app starts reading the body, all of it must arrive within
  ``timeout_s`` (one timer per request, started by the first read); past
  that the client is answered ``408`` (``Connection: close``, so the server
  drops the connection) and the app's read raises
  :class:`BodyDeadlinePassed`, which the guard absorbs;
* with ``max_bytes`` set, a ``Content-Length`` over it is answered ``413``
  at once, before anything is read, and a body growing past it as it arrives
  is answered ``413`` as soon as the running count passes it.

The app still reads the body itself, when it chooses to: nothing is read
ahead, so a service that checks a credential before it reads a body (the
node's ``/forward``) still does. Whatever the app sends after the guard has
answered is dropped. The answers are JSON in the OpenAI error shape unless a
service passes its own ``render`` (the bootstrap's are ``text/plain``, as in
its reference).

The request head has its own deadline, in the server
(:mod:`meshwire.slow_clients`).

:func:`read_bounded` is the one way a handler reads a body with a bound of its
own (a frame's announced size, an API's ``max_body_bytes``): a
``Content-Length`` over the bound is refused before anything is read, a body
growing past it as soon as the count passes it (:class:`BodyTooLarge`), and a
sender that goes away mid-body is :class:`BodyIncomplete`. Each service turns
those into its own answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any, Final, Protocol

import orjson

from meshwire import errors

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
Render = Callable[[int, str], tuple[bytes, bytes]]
"""``(status, message)`` to ``(content_type, body)`` of a refusal."""

REQUEST_TIMEOUT: Final = 408
PAYLOAD_TOO_LARGE: Final = 413
_CODES: Final = {REQUEST_TIMEOUT: "body_timeout", PAYLOAD_TOO_LARGE: "body_too_large"}


class BodyTooLarge(Exception):
    """A body longer than the bound it was read with: its ``Content-Length`` said so (``declared``), or it grew
    past the bound as it arrived (``declared`` is ``None``)."""

    def __init__(self, max_bytes: int, declared: int | None = None) -> None:
        super().__init__(f"body is longer than {max_bytes} bytes")
        self.max_bytes = max_bytes
        self.declared = declared


class BodyIncomplete(Exception):
    """The sender went away before the body was complete."""


class BodySource(Protocol):
    """What :func:`read_bounded` reads: a request's headers and its ASGI ``receive`` (a Starlette ``Request``)."""

    @property
    def headers(self) -> Mapping[str, str]: ...

    @property
    def receive(self) -> Receive: ...


class BodyDeadlinePassed(Exception):
    """The body did not arrive within the deadline (the guard has answered 408)."""


class BodyOverCap(Exception):
    """The body grew past the cap while it arrived (the guard has answered 413)."""


def json_error(status: int, message: str) -> tuple[bytes, bytes]:
    """A refusal in the OpenAI error shape (the default)."""
    body = errors.error_body(message, errors.INVALID_REQUEST, _CODES.get(status))
    return b"application/json", orjson.dumps(body)


def plain_text(status: int, message: str) -> tuple[bytes, bytes]:
    """A refusal as ``text/plain`` (the bootstrap's reference answers so)."""
    return b"text/plain; charset=utf-8", message.encode("utf-8")


def declared_length(scope: Scope) -> int | None:
    """The request's ``Content-Length``, or ``None`` when it has none or an unreadable one."""
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-length":
            return _length(value.decode("latin-1"))
    return None


def _length(text: str | None) -> int | None:
    """A ``Content-Length`` value as a number; ``None`` when absent or unreadable (the server vets it, and the
    running count bounds the read whatever it says)."""
    if text is None:
        return None
    text = text.strip()
    return int(text) if text.isdigit() else None


async def read_bounded(request: BodySource, max_bytes: int) -> bytes:
    """The body of ``request``, read message by message through its ``receive``.

    :class:`BodyTooLarge` when its ``Content-Length`` is over ``max_bytes`` (nothing is read), or as soon as
    what arrives passes ``max_bytes``; :class:`BodyIncomplete` when the sender goes away first.
    """
    declared = _length(request.headers.get("content-length"))
    if declared is not None and declared > max_bytes:
        raise BodyTooLarge(max_bytes, declared)
    body = bytearray()
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            raise BodyIncomplete("the sender went away before the body was complete")
        if message["type"] != "http.request":
            continue
        body += message.get("body", b"")
        if len(body) > max_bytes:
            raise BodyTooLarge(max_bytes)
        if not message.get("more_body", False):
            return bytes(body)


class BodyGuard:
    """ASGI middleware: every body arrives within ``timeout_s`` of the app's first read (see the module doc)."""

    def __init__(self, app: ASGIApp, *, timeout_s: float, max_bytes: int | None = None,
                 render: Render = json_error) -> None:
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        self.app = app
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self.render = render

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = declared_length(scope)
        if self.max_bytes is not None and length is not None and length > self.max_bytes:
            logger.warning("refused a %d-byte request body (cap %d)", length, self.max_bytes)
            await self._refuse(send, PAYLOAD_TOO_LARGE, self._too_large())
            return
        exchange = _Exchange(self, receive, send)
        try:
            await self.app(scope, exchange.receive, exchange.send)
        except (BodyDeadlinePassed, BodyOverCap):
            return
        except Exception:
            if exchange.answered:
                return  # the app failed on the read the guard cut short: the client has its answer
            raise
        finally:
            exchange.stop_clock()

    def _too_large(self) -> str:
        return f"request body over {self.max_bytes} bytes"

    async def _refuse(self, send: Send, status: int, message: str) -> None:
        content_type, body = self.render(status, message)
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", content_type),
            (b"content-length", str(len(body)).encode("ascii")),
            (b"connection", b"close"),
        ]})
        await send({"type": "http.response.body", "body": body, "more_body": False})


class _Exchange:
    """One request's guarded ``receive`` and ``send``."""

    def __init__(self, guard: BodyGuard, receive: Receive, send: Send) -> None:
        self._guard = guard
        self._receive = receive
        self._send = send
        self._timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[Any] | None = None
        self._waiting = False
        self._expired = False
        self._received = 0
        self.body_complete = False
        self.started = False
        """The response has begun (the guard can no longer answer)."""
        self.answered = False
        """The guard answered: what the app sends is dropped."""

    async def receive(self) -> Message:
        if self.body_complete or self.answered:
            return await self._receive()  # after the body: the server's disconnect, with no deadline
        if self._timer is None:  # the first read starts the clock: one timer per request, not one per read
            self._task = asyncio.current_task()
            self._timer = asyncio.get_running_loop().call_later(self._guard.timeout_s, self._expire)
        if not self._expired:
            self._waiting = True
            try:
                message = await self._receive()
            except asyncio.CancelledError:
                if not self._expired or self._task is None or self._task.uncancel() > 0:
                    raise  # a cancellation of the request itself, not the deadline
            else:
                self._waiting = False
                return await self._took(message)
            finally:
                self._waiting = False
        logger.warning("cut off a client that did not send its body within %g s", self._guard.timeout_s)
        await self._answer(REQUEST_TIMEOUT, f"request body not received within {self._guard.timeout_s:g} s")
        raise BodyDeadlinePassed

    def _expire(self) -> None:
        self._expired = True
        if self._waiting and self._task is not None:
            self._task.cancel()

    async def _took(self, message: Message) -> Message:
        """``message`` counted against the cap; the clock stops once the body is complete."""
        if message["type"] != "http.request":
            self._complete()  # a disconnect: nothing more will come
            return message
        self._received += len(message.get("body", b""))
        cap = self._guard.max_bytes
        if cap is not None and self._received > cap:
            self._complete()
            logger.warning("refused a request body growing past %d bytes", cap)
            await self._answer(PAYLOAD_TOO_LARGE, self._guard._too_large())
            raise BodyOverCap
        if not message.get("more_body", False):
            self._complete()
        return message

    def _complete(self) -> None:
        self.body_complete = True
        self.stop_clock()

    def stop_clock(self) -> None:
        """No deadline any more (the body is complete, or the request is over)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def send(self, message: Message) -> None:
        if self.answered:
            return
        if message["type"] == "http.response.start":
            self.started = True
        await self._send(message)

    async def _answer(self, status: int, text: str) -> None:
        if self.started:
            return  # the app already answered: the server closes the connection when the app gives up
        self.answered = True
        await self._guard._refuse(self._send, status, text)
