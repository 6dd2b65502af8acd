"""A lean HTTP/1.1 load generator for measuring a service's requests per second.

A load generator written with a full HTTP client would spend as much CPU as
the server it measures, and on two shared cores it would measure itself.
This one keeps ``concurrency`` keep-alive connections, each sending one
``GET`` after another and reading the answer by its ``Content-Length``, with
almost no work per request. Every answer must be 200: a refusal is counted
and reported, never mistaken for throughput.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

MAX_HEAD_BYTES: Final = 64 * 1024
"""Longest response head read (status line and headers)."""
MAX_BODY_BYTES: Final = 1 << 20
"""Longest response body read."""
CONNECT_TIMEOUT_S: Final = 10.0


class LoadError(RuntimeError):
    """The server answered something a plain 200 with ``Content-Length`` does not cover."""


@dataclass(frozen=True)
class LoadResult:
    """``ok`` 200 answers and ``refused`` other answers in ``seconds``."""

    ok: int
    refused: int
    seconds: float
    first_refusal: str | None = None

    @property
    def per_second(self) -> float:
        return self.ok / self.seconds


async def hammer(host: str, port: int, paths: Sequence[str], *, concurrency: int, duration_s: float) -> LoadResult:
    """GET ``paths`` round-robin over ``concurrency`` connections for ``duration_s`` seconds."""
    if not paths or concurrency < 1 or duration_s <= 0:
        raise ValueError("need at least one path, one connection and a positive duration")
    deadline = time.perf_counter() + duration_s
    began = time.perf_counter()
    outcomes = await asyncio.gather(*(_worker(host, port, paths, offset, deadline) for offset in range(concurrency)))
    seconds = time.perf_counter() - began
    refusals = [first for _, _, first in outcomes if first is not None]
    return LoadResult(ok=sum(ok for ok, _, _ in outcomes), refused=sum(bad for _, bad, _ in outcomes),
                      seconds=seconds, first_refusal=refusals[0] if refusals else None)


async def _worker(host: str, port: int, paths: Sequence[str], offset: int,
                  deadline: float) -> tuple[int, int, str | None]:
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), CONNECT_TIMEOUT_S)
    requests = [f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode("ascii") for path in paths]
    ok = refused = 0
    first_refusal: str | None = None
    try:
        for request in itertools.islice(itertools.cycle(requests), offset, None):
            if time.perf_counter() >= deadline:
                break
            writer.write(request)
            status, body = await _read_answer(reader)
            if status == 200:
                ok += 1
            else:
                refused += 1
                first_refusal = first_refusal or f"{status}: {body[:200]!r}"
    finally:
        writer.close()
    return ok, refused, first_refusal


async def _read_answer(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    if len(head) > MAX_HEAD_BYTES:
        raise LoadError(f"a response head of {len(head)} bytes")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    length: int | None = None
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value.strip())
        elif name.strip().lower() == "transfer-encoding":
            raise LoadError("chunked answers are not supported by this load generator")
    if length is None or length > MAX_BODY_BYTES:
        raise LoadError(f"an answer without a usable Content-Length ({length})")
    return status, await reader.readexactly(length)
