"""A request's JSON body, read boundedly: 413 over the limit, 400 when the client goes away mid-body.

One small piece on purpose: the bounded reading behind it is shared (:func:`meshwire.body_guard.read_bounded`).
"""

from __future__ import annotations

from starlette.requests import Request

from meshwire.body_guard import BodyIncomplete, BodyTooLarge, read_bounded
from services.node.api.api_error import ApiError


async def read_json_body(request: Request, max_bytes: int) -> bytes:
    """The request body, refusing (413) one over ``max_bytes`` (before reading it, when its length says so)."""
    try:
        return await read_bounded(request, max_bytes)
    except BodyTooLarge as exc:
        if exc.declared is not None:
            raise ApiError(413, f"request body of {exc.declared} bytes is over the {max_bytes}-byte limit",
                           "too_large") from None
        raise ApiError(413, f"request body is over the {max_bytes}-byte limit", "too_large") from None
    except BodyIncomplete:
        raise ApiError(400, "the client went away before the request body was complete") from None
