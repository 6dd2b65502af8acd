"""A request's JSON body, read boundedly: 413 over the limit, 400 when the client goes away mid-body.

One small piece on purpose: the bounded reading behind it is shared (:mod:`services.node.api.bodies`).
"""

from __future__ import annotations

from starlette.requests import Request

from services.node.api.api_error import ApiError
from services.node.api.bodies import BodyIncomplete, BodyTooLarge, read_bounded


async def read_json_body(request: Request, max_bytes: int) -> bytes:
    """The request body, refusing (413) one over ``max_bytes``."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(413, f"request body of {declared} bytes is over the {max_bytes}-byte limit", "too_large")
    try:
        return await read_bounded(request, max_bytes)
    except BodyTooLarge:
        raise ApiError(413, f"request body is over the {max_bytes}-byte limit", "too_large") from None
    except BodyIncomplete:
        raise ApiError(400, "the client went away before the request body was complete") from None

