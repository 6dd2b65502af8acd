"""Reading a request body with a bound: the node's frames and its OpenAI API both need it."""

from __future__ import annotations

from starlette.requests import ClientDisconnect, Request


class BodyTooLarge(Exception):
    """The body grew past the bound it was read with."""


class BodyIncomplete(Exception):
    """The sender went away before the body was complete."""


async def read_bounded(request: Request, max_bytes: int) -> bytes:
    """The body of ``request``, read chunk by chunk; :class:`BodyTooLarge` as soon as it passes ``max_bytes``."""
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise BodyTooLarge(f"body is longer than {max_bytes} bytes")
            chunks.append(chunk)
    except ClientDisconnect:
        raise BodyIncomplete("the sender went away before the body was complete") from None
    return b"".join(chunks)
