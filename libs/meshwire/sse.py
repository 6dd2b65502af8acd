"""Server-sent events framing for OpenAI streams, written once.

A stream is a sequence of ``data: <json>\\n\\n`` events ending with
``data: [DONE]\\n\\n``. Services yield these bytes from a streaming response;
clients read them back with :func:`parse_sse_line`.
"""

from __future__ import annotations

from typing import Final

from pydantic import BaseModel

MEDIA_TYPE: Final = "text/event-stream"
DONE: Final = b"data: [DONE]\n\n"
"""The event that ends an OpenAI stream."""
_DATA: Final = "data:"


def sse_event(chunk: BaseModel | bytes) -> bytes:
    """One ``data:`` event carrying ``chunk`` (a model, or JSON bytes)."""
    payload = chunk if isinstance(chunk, bytes) else chunk.model_dump_json().encode("utf-8")
    return b"data: " + payload + b"\n\n"


def sse_error(body: bytes) -> bytes:
    """An error event inside a stream that already started (the error body as JSON bytes)."""
    return sse_event(body)


def parse_sse_line(line: str) -> str | None:
    """The payload of a ``data:`` line, or ``None`` for blank lines, comments and other fields."""
    if not line.startswith(_DATA):
        return None
    return line[len(_DATA):].strip()
