"""Forwarding a front-door request to the head node of its route, and its answer back.

The request that reaches the head is built afresh: the validated JSON body,
``Content-Type``, the mesh's bearer secret and the tracker's signed route in
``X-Meshnet-Route``. Nothing else the client sent is passed on, so neither a
client's ``Authorization`` (its API key) nor a route header it forged ever
reaches a node.

The answer is relayed chunk by chunk as it arrives: server-sent events are
never buffered, so each token reaches the client when the head emits it.

:func:`open_head` tells a response worth relaying from a head that failed
before it started answering (:class:`HeadRefused`): the caller then reports
the culprit and tries another route once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import anyio
import httpx
import orjson
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from meshwire import errors, headers, limits
from meshwire.auth import bearer_headers
from meshwire.routes import SignedRoute
from meshwire.sse import MEDIA_TYPE as SSE_MEDIA_TYPE
from meshwire.sse import sse_error

from .responses import HTTPError

logger = logging.getLogger(__name__)

MAX_ERROR_BODY_BYTES: Final = 64 * limits.KIB
"""Most bytes of a head's error answer read to decide whether to retry."""
RELAYED_RESPONSE_HEADERS: Final = frozenset({"content-type", "cache-control", "retry-after", "x-request-id"})
"""Headers of the head's answer passed back to the client (hop-by-hop and length headers are not)."""
STREAM_HEADERS: Final = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
"""Added to event streams so no proxy in front of the tracker buffers them."""


@dataclass(frozen=True)
class HeadRefused:
    """The head did not start a usable answer.

    ``culprit`` is the node to avoid on the next route; ``failed`` says whether
    it failed (report it) or only refused for load (a full KV budget: just avoid it).
    ``error`` is what the client gets if no other route works.
    """

    culprit: str
    failed: bool
    reason: str
    error: HTTPError


def head_request_headers(route: SignedRoute, secret: str) -> dict[str, str]:
    """The only headers a head receives from the tracker."""
    return {
        "Content-Type": "application/json",
        "Accept": "application/json, text/event-stream",
        headers.ROUTE: route.token,
        **bearer_headers(secret),
    }


async def open_head(client: httpx.AsyncClient, route: SignedRoute, path: str, body: bytes,
                    secret: str) -> httpx.Response | HeadRefused:
    """Send ``body`` to the head's ``path``; return its streaming response, or why not to use it.

    A returned response is open and must be closed by the caller (see :class:`ProxiedResponse`).
    """
    head = route.nodes[0]
    request = client.build_request("POST", head.endpoint.rstrip("/") + path, content=body,
                                   headers=head_request_headers(route, secret))
    try:
        response = await client.send(request, stream=True)
    except httpx.HTTPError as exc:
        reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return HeadRefused(head.node_id, True, reason, HTTPError(
            502, f"the head node {head.node_id} could not be reached ({reason})", errors.SERVER_ERROR,
            "head_unreachable"))
    if response.status_code not in (502, 503, 504):
        return response
    return await _refusal(response, head.node_id)


async def _refusal(response: httpx.Response, head_id: str) -> HeadRefused:
    """Read (boundedly) a head's 502/503/504 and decide whom it blames."""
    try:
        raw = bytearray()
        async for chunk in response.aiter_bytes():
            raw += chunk
            if len(raw) > MAX_ERROR_BODY_BYTES:
                break
    except httpx.HTTPError:
        pass
    finally:
        await response.aclose()
    error = _error_of(bytes(raw))
    blamed = error.get("failed_node") or error.get("node_id")
    culprit = blamed if isinstance(blamed, str) and blamed else head_id
    message = str(error.get("message") or f"the head node {head_id} answered {response.status_code}")
    retry_after = response.headers.get("retry-after")
    passthrough = HTTPError(
        response.status_code, message, str(error.get("type") or errors.SERVER_ERROR),
        error.get("code") if isinstance(error.get("code"), str) else None,
        headers={"Retry-After": retry_after} if retry_after and retry_after.isdigit() else None,
        **({"failed_node": culprit} if response.status_code == 502 else {}),
    )
    # 503 is a refusal for load (a full KV budget): avoid the node, but it did not fail.
    return HeadRefused(culprit, response.status_code != 503, message, passthrough)


def _error_of(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return {}
    error = body.get("error") if isinstance(body, dict) else None
    return error if isinstance(error, dict) else {}


def _is_event_stream(response: httpx.Response) -> bool:
    return response.headers.get("content-type", "").split(";")[0].strip().lower() == SSE_MEDIA_TYPE


async def _relay(upstream: httpx.Response, on_broken: Callable[[str], None]) -> AsyncIterator[bytes]:
    """The head's body, chunk by chunk as it arrives; an error event if the head breaks mid-stream."""
    try:
        async for chunk in upstream.aiter_bytes():
            yield chunk
    except httpx.HTTPError as exc:
        reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        on_broken(reason)
        if _is_event_stream(upstream):
            yield sse_error(orjson.dumps(errors.error_body(
                f"the head node stopped answering mid-stream ({reason})", errors.SERVER_ERROR, "head_failed")))


class ProxiedResponse(StreamingResponse):
    """A head's answer relayed to the client as it arrives.

    ``on_close`` runs exactly once when the relay ends for any reason (done,
    client gone, head broken); the upstream response is always closed.
    """

    def __init__(self, upstream: httpx.Response, on_broken: Callable[[str], None],
                 on_close: Callable[[], Awaitable[None] | None]) -> None:
        relayed: Mapping[str, str] = {k: v for k, v in upstream.headers.items()
                                      if k.lower() in RELAYED_RESPONSE_HEADERS}
        extra = STREAM_HEADERS if _is_event_stream(upstream) else {}
        super().__init__(_relay(upstream, on_broken), status_code=upstream.status_code,
                         headers={**relayed, **extra})
        self._upstream = upstream
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._upstream.aclose()
                outcome = self._on_close()
                if outcome is not None:
                    await outcome


def first_byte_timer() -> Callable[[], float]:
    """A stopwatch: call it to get seconds since it was made."""
    started = time.perf_counter()
    return lambda: time.perf_counter() - started
