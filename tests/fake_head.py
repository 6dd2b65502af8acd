"""A fake head node for attack tests: it answers chats as a meshnet head would, slowly, and counts them.

``uvicorn tests.fake_head:app`` serves ``GET /health``, ``GET /served`` (how
many chats it answered) and ``POST /v1/chat/completions``: a stream of
:data:`TOKENS` tokens with the progress extension the tracker asks heads for
(``meshwire.resume``), one every ``FAKE_HEAD_DELAY_S`` seconds. It checks no
signature: it is what a dishonest member runs behind its registration.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Final

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

TOKENS: Final = 3
DELAY_S: Final = float(os.environ.get("FAKE_HEAD_DELAY_S", "0.5"))
served = 0


def _event(delta: dict[str, str], ids: list[int], finish: str | None = None, seed: int | None = None) -> bytes:
    progress = {"ids": ids, **({"seed": seed} if seed is not None else {})}
    chunk = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0, "model": "fake",
             "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], "meshnet": progress}
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


async def _stream() -> AsyncIterator[bytes]:
    yield _event({"role": "assistant", "content": ""}, [], seed=1)
    for index in range(TOKENS):
        await asyncio.sleep(DELAY_S)
        yield _event({"content": "x"}, [5 + index], "length" if index == TOKENS - 1 else None)
    yield b"data: [DONE]\n\n"


async def chat(request: Request) -> StreamingResponse:
    global served
    await request.body()
    served += 1
    return StreamingResponse(_stream(), media_type="text/event-stream")


async def health(request: Request) -> JSONResponse:
    return JSONResponse({"status": "ok"})


async def count(request: Request) -> JSONResponse:
    return JSONResponse({"served": served})


app = Starlette(routes=[Route("/health", health), Route("/served", count),
                        Route("/v1/chat/completions", chat, methods=["POST"])])
