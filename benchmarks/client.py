"""Timing a chat completion through the OpenAI streaming API, as a client sees it.

One request per call, greedy (``temperature`` 0), ``stream_options.include_usage``
so the final chunk says how many tokens were generated. The first and last
content chunks' arrival times and the usage count make a
:class:`~benchmarks.timing.StreamTiming`, defined exactly like the
single-process one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import httpx
import orjson

from benchmarks.timing import StreamTiming
from meshwire.sse import parse_sse_line

CHAT_PATH: Final = "/v1/chat/completions"
REQUEST_TIMEOUT_S: Final = 300.0
"""Longest a benchmark request may take (a 2,048-token prefill on two slow cores included)."""
MAX_ERROR_CHARS: Final = 2000
"""Most characters of a failed answer quoted in the error."""
DONE: Final = "[DONE]"
WARMUP_MAX_TOKENS: Final = 8
"""Tokens of an untimed warm-up request (connections, first-call allocations on every hop)."""


class StreamFailed(RuntimeError):
    """The mesh answered an error, or the stream ended without content or usage."""


def chat_body(model: str, messages: Sequence[Mapping[str, str]], max_tokens: int, *, stream: bool = True) -> bytes:
    """The JSON body of a greedy chat completion."""
    body: dict[str, Any] = {"model": model, "messages": list(messages), "max_tokens": max_tokens,
                            "temperature": 0.0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return orjson.dumps(body)


async def timed_chat(client: httpx.AsyncClient, base_url: str, model: str,
                     messages: Sequence[Mapping[str, str]], max_tokens: int,
                     headers: Mapping[str, str] | None = None,
                     on_content: Callable[[float], None] | None = None) -> StreamTiming:
    """Stream one greedy chat completion from ``base_url`` and time its tokens.

    ``on_content`` is told the ``time.perf_counter()`` of every content chunk as it
    arrives, for a caller that may have to stop the stream before it ends.
    """
    began = time.perf_counter()
    first: float | None = None
    last: float | None = None
    usage: dict[str, Any] | None = None
    request_headers = {"Content-Type": "application/json", **(headers or {})}
    async with client.stream("POST", base_url.rstrip("/") + CHAT_PATH, headers=request_headers,
                             content=chat_body(model, messages, max_tokens),
                             timeout=REQUEST_TIMEOUT_S) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode("utf-8", errors="replace")
            raise StreamFailed(f"{base_url} answered {response.status_code}: {text[:MAX_ERROR_CHARS]}")
        async for line in response.aiter_lines():
            payload = parse_sse_line(line)
            if payload is None:
                continue
            if payload == DONE:
                break
            chunk = orjson.loads(payload)
            if "error" in chunk:
                raise StreamFailed(f"error event in the stream: {payload[:MAX_ERROR_CHARS]}")
            if _content(chunk):
                now = time.perf_counter()
                last = now - began
                first = last if first is None else first
                if on_content is not None:
                    on_content(now)
            if chunk.get("usage"):
                usage = chunk["usage"]
    if first is None or last is None:
        raise StreamFailed("the stream carried no content")
    if usage is None:
        raise StreamFailed("the stream ended without a usage chunk (stream_options.include_usage)")
    return StreamTiming(tokens=int(usage["completion_tokens"]), first_s=first, last_s=last,
                        prompt_tokens=int(usage["prompt_tokens"]))


def _content(chunk: Mapping[str, Any]) -> bool:
    choices = chunk.get("choices") or ()
    return any((choice.get("delta") or {}).get("content") for choice in choices)



def chat_once(base_url: str, model: str, messages: Sequence[Mapping[str, str]], max_tokens: int,
              headers: Mapping[str, str] | None = None) -> StreamTiming:
    """:func:`timed_chat` from synchronous code (a fresh connection: it costs time to first token only)."""

    async def go() -> StreamTiming:
        async with httpx.AsyncClient() as client:
            return await timed_chat(client, base_url, model, messages, max_tokens, headers)

    return asyncio.run(go())


def warm_up(base_url: str, model: str, messages: Sequence[Mapping[str, str]]) -> None:
    """One short untimed request: the first one through a new mesh pays for connections and first calls."""
    chat_once(base_url, model, messages, WARMUP_MAX_TOKENS)


def describe_timing(timing: StreamTiming) -> str:
    """A progress line's account of one timed generation."""
    return (f"{timing.tokens_per_s:.1f} tok/s, {timing.ms_per_token:.1f} ms/token, {timing.tokens} tokens, "
            f"first after {timing.ttft_s * 1000:.0f} ms")
