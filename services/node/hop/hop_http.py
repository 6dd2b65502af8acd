"""A lean HTTP/1.1 client for node-to-node frames.

A decode step sends one small frame per hop and waits for a small JSON
answer, once per token for as long as a stream lasts, so the client's own
cost is paid on every token. httpx spends most of a millisecond of Python on
each request (URL and header models, cookies, pool bookkeeping, anyio
layers); measured on a 2-node mesh, that was over half of the head's event
loop time. This client does only what a hop needs: keep-alive connections
per endpoint, one request at a time on each, the answer parsed by
``httptools`` (the parser uvicorn serves with), and every size and wait
bounded.

Errors say how far a request got, because the caller acts on it:
:class:`HopConnectFailed` means the hop was never reached (refused, or no
answer to the connect: a NAT drops packets), so the frame may go another way
(the relay); :class:`HopTimedOut` and :class:`HopBroken` mean it may have
been.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final
from urllib.parse import urlsplit

import httptools

READ_CHUNK_BYTES: Final = 64 * 1024
MAX_IDLE_PER_ENDPOINT: Final = 16
"""Idle keep-alive connections kept per endpoint; more are closed when they come back."""
MAX_HEADER_BYTES: Final = 64 * 1024
"""Largest answer head (status line and headers) accepted."""


class HopHttpError(Exception):
    """A request to a hop did not produce a complete answer."""


class HopConnectFailed(HopHttpError):
    """The hop was never reached: nothing was sent, so the request may safely go another way."""


class HopTimedOut(HopHttpError):
    """No complete answer in time (the hop may have received the request)."""


class HopBroken(HopHttpError):
    """The connection failed or the answer was malformed or too large (the hop may have received the request)."""


@dataclass(frozen=True)
class RawAnswer:
    """An answer: status, lower-cased headers, body."""

    status: int
    body: bytes
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class _Endpoint:
    host: str
    port: int
    tls: bool
    host_header: str


class _Connection:
    """One keep-alive connection to an endpoint."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    def usable(self) -> bool:
        """False when the peer closed it while idle (it has sent EOF or the transport is closing)."""
        return not self.reader.at_eof() and not self.writer.is_closing()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class _Answer:
    """httptools callbacks collecting one answer, bounded in size."""

    def __init__(self, max_body_bytes: int) -> None:
        self._max_body = max_body_bytes
        self.parser: httptools.HttpResponseParser | None = None
        self.keep_alive = False
        """Whether the connection may carry another request (read when the answer completes: the parser
        forgets it afterwards)."""
        self.headers: dict[str, str] = {}
        self.body = bytearray()
        self.head_bytes = 0
        self.complete = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self.head_bytes += len(name) + len(value)
        if self.head_bytes > MAX_HEADER_BYTES:
            raise HopBroken(f"answer headers longer than {MAX_HEADER_BYTES} bytes")
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_body(self, data: bytes) -> None:
        if len(self.body) + len(data) > self._max_body:
            raise HopBroken(f"answer longer than {self._max_body} bytes")
        self.body += data

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self.parser is not None and self.parser.should_keep_alive()


class HopHttp:
    """Keep-alive HTTP/1.1 requests to hops; safe for many concurrent requests (one connection each)."""

    def __init__(self, *, connect_timeout_s: float, max_answer_bytes: int, tls: ssl.SSLContext | None = None) -> None:
        """``tls`` verifies ``https://`` hops (default: the system's roots)."""
        self._connect_timeout_s = connect_timeout_s
        self._max_answer_bytes = max_answer_bytes
        self._endpoints: dict[str, _Endpoint] = {}
        self._idle: dict[_Endpoint, deque[_Connection]] = {}
        self._tls: ssl.SSLContext | None = tls

    async def request(self, method: str, base_url: str, path: str, headers: Mapping[str, str], body: bytes,
                      timeout_s: float) -> RawAnswer:
        """Send one request to ``base_url`` + ``path``; the whole exchange is bounded by ``timeout_s``."""
        endpoint = self._endpoint(base_url)
        head = _request_head(method, path, endpoint.host_header, headers, len(body))
        try:
            async with asyncio.timeout(timeout_s):
                conn = self._take_idle(endpoint)
                if conn is not None:
                    try:
                        return await self._exchange(endpoint, conn, head, body)
                    except _ClosedBeforeAnswer:
                        pass  # the peer closed this idle connection as we used it: nothing was answered
                conn = await self._connect(endpoint)
                try:
                    return await self._exchange(endpoint, conn, head, body)
                except _ClosedBeforeAnswer as exc:
                    raise HopBroken(str(exc)) from None
        except TimeoutError:
            raise HopTimedOut(f"no answer within {timeout_s:g} s") from None

    async def aclose(self) -> None:
        """Close every idle connection."""
        for idle in self._idle.values():
            while idle:
                idle.popleft().close()

    def _endpoint(self, base_url: str) -> _Endpoint:
        found = self._endpoints.get(base_url)
        if found is None:
            parts = urlsplit(base_url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise HopConnectFailed(f"{base_url!r} is not an http(s) URL")
            tls = parts.scheme == "https"
            port = parts.port or (443 if tls else 80)
            found = _Endpoint(host=parts.hostname, port=port, tls=tls, host_header=parts.netloc)
            self._endpoints[base_url] = found
        return found

    def _take_idle(self, endpoint: _Endpoint) -> _Connection | None:
        idle = self._idle.get(endpoint)
        while idle:
            conn = idle.pop()
            if conn.usable():
                return conn
            conn.close()
        return None

    def _give_back(self, endpoint: _Endpoint, conn: _Connection) -> None:
        idle = self._idle.setdefault(endpoint, deque())
        if len(idle) >= MAX_IDLE_PER_ENDPOINT:
            conn.close()
        else:
            idle.append(conn)

    async def _connect(self, endpoint: _Endpoint) -> _Connection:
        tls = None
        if endpoint.tls:
            if self._tls is None:
                self._tls = ssl.create_default_context()
            tls = self._tls
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                reader, writer = await asyncio.open_connection(endpoint.host, endpoint.port, ssl=tls,
                                                               limit=READ_CHUNK_BYTES)
        except TimeoutError:
            raise HopConnectFailed(f"no answer to the connect within {self._connect_timeout_s:g} s") from None
        except OSError as exc:
            raise HopConnectFailed(f"cannot connect: {exc.strerror or exc}") from None
        return _Connection(reader, writer)

    async def _exchange(self, endpoint: _Endpoint, conn: _Connection, head: bytes, body: bytes) -> RawAnswer:
        """Write the request and read the answer; the connection goes back to the pool only when clean."""
        answer = _Answer(self._max_answer_bytes)
        parser = httptools.HttpResponseParser(answer)
        answer.parser = parser
        received = 0
        clean = False
        try:
            conn.writer.write(head + body if len(body) < READ_CHUNK_BYTES else head)
            if len(body) >= READ_CHUNK_BYTES:
                conn.writer.write(body)
            await conn.writer.drain()
            while not answer.complete:
                data = await conn.reader.read(READ_CHUNK_BYTES)
                if not data:
                    if received == 0:
                        raise _ClosedBeforeAnswer("the hop closed the connection without answering")
                    raise HopBroken("the hop closed the connection in the middle of its answer")
                received += len(data)
                parser.feed_data(data)
            clean = answer.keep_alive
        except (ConnectionError, OSError) as exc:
            if received == 0:
                raise _ClosedBeforeAnswer(f"connection lost before an answer: {exc}") from None
            raise HopBroken(f"connection lost: {exc}") from None
        except httptools.HttpParserError as exc:
            if isinstance(exc.__context__, HopBroken):  # a bound enforced by a callback
                raise exc.__context__ from None
            raise HopBroken(f"malformed answer: {exc}") from None
        finally:
            if clean:
                self._give_back(endpoint, conn)
            else:
                conn.close()
        return RawAnswer(status=parser.get_status_code(), body=bytes(answer.body), headers=answer.headers)


class _ClosedBeforeAnswer(Exception):
    """The connection ended before any byte of an answer (on a reused connection: try a fresh one)."""


def _request_head(method: str, path: str, host: str, headers: Mapping[str, str], length: int) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", f"Content-Length: {length}"]
    for name, value in headers.items():
        if any(c in name or c in value for c in "\r\n"):
            raise ValueError(f"header {name!r} holds a line break")
        lines.append(f"{name}: {value}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
