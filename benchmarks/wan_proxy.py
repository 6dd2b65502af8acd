"""A userspace WAN emulator: a TCP proxy that delays each direction by RTT/2 and caps its bandwidth.

This kernel has no ``netem``, so the ``wan`` benchmark puts one of these in
front of every node: the node listens on its own port, advertises the proxy's
(``MESHNET_ADVERTISE``), and every byte another service sends it (the tracker
forwarding a request to a head, a hop sending a frame to the next) crosses the
proxy both ways. A route of N nodes then pays what it pays between machines:
each hop one round trip per step.

Each direction of each connection is modelled as a link of its own:

* **bandwidth**: a chunk read at ``t`` leaves the sender's side when the link
  has finished sending what came before it, and takes ``len / bandwidth`` to
  send (serialisation, the bottleneck of a slow link);
* **latency**: it then arrives ``RTT / 2`` later, in order.

The link's figures (:class:`LinkShape`) can be changed while connections are
open (:meth:`WanProxy.set_shape`): one mesh serves every RTT of a benchmark,
so the model is loaded once. Bytes pass unchanged; a side that closes is
closed on the other side once what it sent has been delivered.

:class:`ProxyThread` runs proxies on an event loop of their own in a
background thread, for benchmarks written as synchronous code.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

logger = logging.getLogger(__name__)

READ_CHUNK_BYTES: Final = 64 * 1024
"""Most bytes read from a socket at once (one chunk on the emulated link)."""
MAX_RTT_MS: Final = 10_000.0
"""Longest round trip a link may be given."""
MAX_QUEUED_CHUNKS: Final = 1024
"""Chunks in flight on one direction before the proxy stops reading from the sender (back-pressure)."""
CONNECT_TIMEOUT_S: Final = 10.0
"""How long a proxy waits to reach its target for a new connection."""
_EOF: Final = None


@dataclass(frozen=True)
class LinkShape:
    """What a link between two machines costs: a round trip and a bandwidth (``None``: unlimited)."""

    rtt_ms: float = 0.0
    bandwidth_bytes_s: float | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.rtt_ms <= MAX_RTT_MS:
            raise ValueError(f"rtt_ms must be in 0..{MAX_RTT_MS}, got {self.rtt_ms}")
        if self.bandwidth_bytes_s is not None and self.bandwidth_bytes_s <= 0:
            raise ValueError(f"bandwidth must be positive, got {self.bandwidth_bytes_s}")

    @property
    def one_way_s(self) -> float:
        return self.rtt_ms / 2000.0

    def send_s(self, nbytes: int) -> float:
        """Seconds the link takes to put ``nbytes`` on the wire."""
        return 0.0 if self.bandwidth_bytes_s is None else nbytes / self.bandwidth_bytes_s

    def describe(self) -> str:
        bandwidth = "unlimited" if self.bandwidth_bytes_s is None else f"{self.bandwidth_bytes_s * 8 / 1e6:g} Mbit/s"
        return f"RTT {self.rtt_ms:g} ms, {bandwidth}"


def mbit(megabits_per_s: float) -> float:
    """Bytes a second of a link of ``megabits_per_s``."""
    return megabits_per_s * 1e6 / 8


class WanProxy:
    """Listens on ``listen_host:port`` and forwards every connection to ``target``, shaped by :class:`LinkShape`."""

    def __init__(self, target_host: str, target_port: int, shape: LinkShape, *, listen_host: str = "127.0.0.1",
                 listen_port: int = 0) -> None:
        self.target_host = target_host
        self.target_port = target_port
        self.shape = shape
        self._listen = (listen_host, listen_port)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.bytes_forwarded = 0
        """Bytes carried so far, both directions together."""

    @property
    def port(self) -> int:
        """The port the proxy listens on (once started)."""
        assert self._server is not None, "start the proxy first"
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        return f"http://{self._listen[0]}:{self.port}"

    def set_shape(self, shape: LinkShape) -> None:
        """Shape every chunk read from now on, on open connections too."""
        self.shape = shape

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._connection, self._listen[0], self._listen[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    async def _connection(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            try:
                target_reader, target_writer = await asyncio.wait_for(
                    asyncio.open_connection(self.target_host, self.target_port), CONNECT_TIMEOUT_S)
            except (OSError, TimeoutError) as exc:
                logger.info("proxy could not reach %s:%d: %s", self.target_host, self.target_port, exc)
                client_writer.close()
                return
            await asyncio.gather(self._direction(client_reader, target_writer),
                                 self._direction(target_reader, client_writer), return_exceptions=True)
        finally:
            self._tasks.discard(task)
            with contextlib.suppress(Exception):
                client_writer.close()

    async def _direction(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Carry one direction: read chunks, stamp when each arrives, deliver each at its time."""
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue(MAX_QUEUED_CHUNKS)
        deliver = asyncio.create_task(self._deliver(queue, writer))
        link_free = 0.0
        try:
            while True:
                chunk = await reader.read(READ_CHUNK_BYTES)
                if not chunk:
                    break
                shape = self.shape
                now = time.monotonic()
                link_free = max(now, link_free) + shape.send_s(len(chunk))
                await queue.put((link_free + shape.one_way_s, chunk))
        except (ConnectionError, OSError):
            pass
        finally:
            await queue.put(_EOF)
            await asyncio.gather(deliver, return_exceptions=True)

    async def _deliver(self, queue: asyncio.Queue[tuple[float, bytes] | None], writer: asyncio.StreamWriter) -> None:
        try:
            while (item := await queue.get()) is not _EOF:
                due, chunk = item
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(chunk)
                await writer.drain()
                self.bytes_forwarded += len(chunk)
            if writer.can_write_eof():
                writer.write_eof()
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()


class ProxyThread:
    """An event loop in a background thread that runs :class:`WanProxy` instances for synchronous code."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="wan-proxy", daemon=True)
        self._thread.start()
        self.proxies: list[WanProxy] = []

    def proxy(self, target_port: int, shape: LinkShape, *, target_host: str = "127.0.0.1") -> WanProxy:
        """A started proxy in front of ``target_host:target_port``."""
        proxy = WanProxy(target_host, target_port, shape)
        asyncio.run_coroutine_threadsafe(proxy.start(), self._loop).result()
        self.proxies.append(proxy)
        return proxy

    def set_shape(self, shape: LinkShape) -> None:
        """Give every proxy of this thread the link ``shape``."""
        for proxy in self.proxies:
            self._loop.call_soon_threadsafe(proxy.set_shape, shape)

    def close(self) -> None:
        for proxy in self.proxies:
            asyncio.run_coroutine_threadsafe(proxy.close(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


@contextlib.contextmanager
def proxy_thread() -> Iterator[ProxyThread]:
    """A :class:`ProxyThread`, closed (every proxy with it) on exit."""
    thread = ProxyThread()
    try:
        yield thread
    finally:
        thread.close()
