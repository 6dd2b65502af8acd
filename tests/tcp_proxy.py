"""A TCP proxy in front of one test service that can stall a call, answer it by itself, or hold an answer.

A service that advertises the proxy's URL (``MESHNET_ADVERTISE``) is reached through it by the tracker
and the other nodes. Each connection's first request line (``POST /kv/pull HTTP/1.1``) is given to
:attr:`Proxy.policy`, which says what becomes of the connection:

* :data:`PIPE`: bytes go both ways to the service (the default);
* :data:`STALL`: the connection is accepted and never answered, until the caller closes it (a peer
  that hangs: no sleep involved, the caller's own timeout ends it);
* ``bytes``: that answer is sent and the connection closed (a peer that refuses, or answers junk).

:meth:`Proxy.hold_after_first_event` makes the next event stream that passes (``text/event-stream``)
stop after its first event until :meth:`Proxy.release`: a stream that is certainly still open while a
test looks at what it holds, however fast the service is.

The proxy runs its own event loop on a thread; :meth:`Proxy.close` stops it and every connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Final, Self

logger = logging.getLogger(__name__)

PIPE: Final = "pipe"
STALL: Final = "stall"
Action = str | bytes
READ_BYTES: Final = 1 << 16
HEADERS_END: Final = b"\r\n\r\n"
EVENT_STREAM: Final = b"text/event-stream"
START_TIMEOUT_S: Final = 10.0


def answer(status: int, body: bytes, content_type: str = "application/json") -> bytes:
    """A whole HTTP/1.1 answer that closes its connection."""
    head = (f"HTTP/1.1 {status} Test\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n")
    return head.encode() + body


class Proxy:
    """Listens on 127.0.0.1 (an ephemeral port) and forwards to ``127.0.0.1:target`` (see the module doc).

    ``target`` may be set after the proxy starts (a service started later on a port of its own choosing):
    connections wait for it."""

    def __init__(self, target: int | None = None) -> None:
        self.policy: Callable[[bytes], Action] = lambda line: PIPE
        self.stalled = threading.Event()
        """Set once a connection was stalled."""
        self.answered = threading.Event()
        """Set once a connection was answered by the proxy itself."""
        self.holding = threading.Event()
        """Set while an event stream is held after its first event."""
        self.lines: list[bytes] = []
        """Every connection's first request line, in order."""
        self._target = target
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._target_set: asyncio.Event | None = None
        self._released: asyncio.Event | None = None
        self._armed = False
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._thread = threading.Thread(target=self._run, name="test-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT_S):
            raise RuntimeError("the test proxy did not start")
        assert self._server is not None
        self.port: int = self._server.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def target(self) -> int | None:
        return self._target

    @target.setter
    def target(self, port: int) -> None:
        self._target = port
        self._loop.call_soon_threadsafe(self._set_target)

    def hold_after_first_event(self) -> None:
        """Hold the next event stream after its first event (:attr:`holding` is set then) until :meth:`release`."""
        self.holding.clear()
        self._loop.call_soon_threadsafe(self._arm)

    def release(self) -> None:
        """Let a held stream go on."""
        self._loop.call_soon_threadsafe(self._release)

    def close(self) -> None:
        if self._loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(START_TIMEOUT_S)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(START_TIMEOUT_S)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- on the proxy's loop --------------------------------------------------------------------------

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._target_set = asyncio.Event()
        self._released = asyncio.Event()
        if self._target is not None:
            self._target_set.set()
        self._server = self._loop.run_until_complete(asyncio.start_server(self._accept, "127.0.0.1", 0))
        self._ready.set()
        self._loop.run_forever()
        self._loop.close()

    def _set_target(self) -> None:
        assert self._target_set is not None
        self._target_set.set()

    def _arm(self) -> None:
        assert self._released is not None
        self._released.clear()
        self._armed = True

    def _release(self) -> None:
        assert self._released is not None
        self._released.set()

    async def _shutdown(self) -> None:
        assert self._server is not None and self._released is not None
        self._released.set()
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)  # type: ignore[arg-type]
        try:
            await self._serve(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            self._tasks.discard(task)  # type: ignore[arg-type]
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        line = await reader.readuntil(b"\r\n")
        self.lines.append(line.strip())
        action = self.policy(line)
        if action == STALL:
            self.stalled.set()
            while await reader.read(READ_BYTES):  # accepted, never answered, until the caller gives up
                pass
            return
        if isinstance(action, bytes):
            with contextlib.suppress(asyncio.IncompleteReadError):
                await reader.readuntil(HEADERS_END)
            writer.write(action)
            await writer.drain()
            self.answered.set()
            return
        assert self._target_set is not None
        await self._target_set.wait()
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._target)
        up_writer.write(line)
        try:
            await asyncio.gather(self._forward(reader, up_writer), self._backward(up_reader, writer))
        finally:
            up_writer.close()

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(READ_BYTES):
            writer.write(data)
            await writer.drain()
        with contextlib.suppress(OSError):
            writer.write_eof()

    async def _backward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The service's bytes back to the caller; an armed hold cuts the next event stream after its first event
        (a connection whose answer turns out not to be one is passed through from then on)."""
        pending, plain = b"", False
        while data := await reader.read(READ_BYTES):
            if plain or (not self._armed and not pending):
                writer.write(data)
                await writer.drain()
                continue
            pending += data
            cut = self._first_event_end(pending)
            if cut is None:
                continue
            if cut == 0 or not self._armed:
                plain = True
                writer.write(pending)
                pending = b""
                await writer.drain()
                continue
            self._armed = False
            writer.write(pending[:cut])
            await writer.drain()
            self.holding.set()
            assert self._released is not None
            await self._released.wait()
            self.holding.clear()
            writer.write(pending[cut:])
            pending, plain = b"", True
            await writer.drain()
        if pending:
            writer.write(pending)
        with contextlib.suppress(OSError):
            writer.write_eof()

    @staticmethod
    def _first_event_end(pending: bytes) -> int | None:
        """Where the first event of an event-stream answer in ``pending`` ends (with its chunk's CRLF); 0 when
        the answer is not an event stream; ``None`` while more bytes are needed to tell."""
        headers_end = pending.find(HEADERS_END)
        if headers_end < 0:
            return None
        if EVENT_STREAM not in pending[:headers_end].lower():
            return 0
        start = pending.find(b"data:", headers_end)
        end = pending.find(b"\n\n", start) if start >= 0 else -1
        if end < 0:
            return None
        end += 2
        return end + 2 if pending[end:end + 2] == b"\r\n" else end
