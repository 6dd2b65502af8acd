"""Forwarding a front-door request to the head node of its route, and its answer back.

The request that reaches the head is built afresh: the validated JSON body,
``Content-Type``, the tracker's signature (its route key) and the tracker's signed route in
``X-Meshnet-Route``. Nothing else the client sent is passed on, so neither a
client's ``Authorization`` (its API key) nor a route header it forged ever
reaches a node.

The answer is relayed chunk by chunk as it arrives: server-sent events are
never buffered, so each token reaches the client when the head emits it.
Only OpenAI answers are relayed (see :mod:`.head_answers`): a 2xx of JSON or
events, or an OpenAI error, rebuilt; anything else is a 502.

:func:`open_head` tells a response worth relaying from a head that failed
before it started answering (:class:`HeadRefused`), and from a head's
well-formed error that the client should get as it is (:class:`HeadError`):
after a refusal the caller reports the culprit and tries another route once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import anyio
import httpx
import orjson
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from meshwire import errors, headers, limits
from meshwire.fork import ChoiceGroup
from meshwire.hop_proof import TRACKER_SIGNER_PREFIX, sign_request
from meshwire.route_keys import SigningKey
from meshwire.routes import SignedRoute
from meshwire.sse import MEDIA_TYPE as SSE_MEDIA_TYPE
from meshwire.sse import sse_error

from .head_answers import (
    ERROR_STATUSES,
    bad_answer,
    media_type,
    parse_openai_error,
    relayable_success,
    relayed_error,
)
from .responses import HTTPError
from .route_lease import RouteLease

logger = logging.getLogger(__name__)

MAX_ERROR_BODY_BYTES: Final = 64 * limits.KIB
"""Most bytes of a head's error answer read (to judge it, and to decide whether to retry)."""
RETRIED_STATUSES: Final = frozenset({502, 503, 504})
"""A head answering these failed (or is full): its route is retried once without it."""
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


@dataclass(frozen=True)
class HeadError:
    """The head answered a well-formed OpenAI error that is the client's to read (a 400 naming a field...)."""

    error: HTTPError


@dataclass(frozen=True)
class PrefillOffer:
    """A prefill route the head may prefill a long prompt along, and from which prompt length."""

    route: SignedRoute
    min_prompt_tokens: int


def head_request_headers(route: SignedRoute, key: SigningKey, path: str, body: bytes, *,
                         progress: bool = False, prefill: PrefillOffer | None = None,
                         choice_group: ChoiceGroup | None = None) -> dict[str, str]:
    """The only headers a head receives from the tracker (``progress``: token ids in every stream event;
    ``prefill``: a prefill route for a prompt of at least its ``min_prompt_tokens``; ``choice_group``: the
    ``n > 1`` request this is one choice of, see ``meshwire.fork``).

    The request is signed with the tracker's route key (:mod:`meshwire.hop_proof`), which the head
    holds from ``GET /v1/keys``: no secret goes to the node.
    """
    sent = {
        "Content-Type": "application/json",
        "Accept": "application/json, text/event-stream",
        headers.ROUTE: route.token,
        **({headers.PROGRESS: "1"} if progress else {}),
    }
    if prefill is not None:
        sent[headers.PREFILL_ROUTE] = prefill.route.token
        sent[headers.PD_MIN_PROMPT_TOKENS] = str(prefill.min_prompt_tokens)
    if choice_group is not None:
        sent[headers.CHOICE_GROUP] = choice_group.header()
    return {**sent, **sign_request(key, f"{TRACKER_SIGNER_PREFIX}{key.kid}", path, sent, body)}


async def open_head(client: httpx.AsyncClient, route: SignedRoute, path: str, body: bytes,
                    key: SigningKey, *, progress: bool = False, prefill: PrefillOffer | None = None,
                    choice_group: ChoiceGroup | None = None) -> httpx.Response | HeadRefused | HeadError:
    """Send ``body`` to the head's ``path``; return its streaming response, or why not to use it.

    A returned response is a relayable 2xx, open, and must be closed by the
    caller (its :class:`~.route_lease.RouteLease` closes it). A head's other answers are read
    (boundedly) and closed here: a well-formed OpenAI error is a
    :class:`HeadError`, a 502/503/504 or anything that is not an OpenAI
    answer a :class:`HeadRefused`.
    """
    head = route.nodes[0]
    request = client.build_request("POST", head.endpoint.rstrip("/") + path, content=body,
                                   headers=head_request_headers(route, key, path, body, progress=progress,
                                                                prefill=prefill, choice_group=choice_group))
    try:
        response = await client.send(request, stream=True)
    except httpx.HTTPError as exc:
        reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return HeadRefused(head.node_id, True, reason, HTTPError(
            502, f"the head node {head.node_id} could not be reached ({reason})", errors.SERVER_ERROR,
            "head_unreachable"))
    if relayable_success(response):
        return response
    status = response.status_code
    if response.is_success:  # a 2xx of another content type: not a completion
        await response.aclose()
        return _not_openai(head.node_id, response, f"content type {media_type(response)[:64] or 'none'!r}")
    raw = await _read_bounded(response)
    error = parse_openai_error(raw) if status in ERROR_STATUSES else None
    if error is None:
        return _not_openai(head.node_id, response, "a body that is not an OpenAI error" if raw else "no body")
    if status in RETRIED_STATUSES:
        return _refusal(status, error, response.headers.get("retry-after"), head.node_id)
    return HeadError(relayed_error(status, error, response.headers.get("retry-after")))


def _not_openai(head_id: str, response: httpx.Response, what: str) -> HeadRefused:
    """A head answered something other than an OpenAI answer: it failed, and the client may get a 502."""
    logger.warning("head %s answered HTTP %d with %s (%s); answering 502", head_id, response.status_code, what,
                   media_type(response)[:64] or "no content type")
    return HeadRefused(head_id, True, f"answered {response.status_code} with {what}",
                       bad_answer(head_id, response.status_code, what))


async def _read_bounded(response: httpx.Response) -> bytes:
    """At most :data:`MAX_ERROR_BODY_BYTES` (and one chunk) of a head's answer; the response is closed."""
    raw = bytearray()
    try:
        async for chunk in response.aiter_bytes():
            raw += chunk
            if len(raw) > MAX_ERROR_BODY_BYTES:
                break
    except httpx.HTTPError:
        pass
    finally:
        await response.aclose()
    return bytes(raw)


def _refusal(status: int, error: dict[str, Any], retry_after: str | None, head_id: str) -> HeadRefused:
    """A head's well-formed 502/503/504: whom it blames, and the error the client gets if no route works."""
    blamed = error.get("failed_node") or error.get("node_id")
    culprit = blamed if isinstance(blamed, str) and blamed else head_id
    passthrough = relayed_error(status, {**error, **({"failed_node": culprit} if status == 502 else {})},
                                retry_after)
    # 503 is a refusal for load (a full KV budget): avoid the node, but it did not fail.
    return HeadRefused(culprit, status != 503, str(error["message"]), passthrough)


def _is_event_stream(response: httpx.Response) -> bool:
    return media_type(response) == SSE_MEDIA_TYPE


async def relay(upstream: httpx.Response, on_broken: Callable[[str], None]) -> AsyncIterator[bytes]:
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
    """A head's answer relayed to the client as it arrives (``body``: :func:`relay`'s, or a continued stream's).

    The request's lease ends exactly once when the relay ends for any reason (done, client gone, head
    broken): the load leaves the route and the upstream response is closed.
    """

    def __init__(self, upstream: httpx.Response, lease: RouteLease, body: AsyncIterator[bytes]) -> None:
        relayed: Mapping[str, str] = {k: v for k, v in upstream.headers.items()
                                      if k.lower() in RELAYED_RESPONSE_HEADERS}
        extra = STREAM_HEADERS if _is_event_stream(upstream) else {}
        super().__init__(body, status_code=upstream.status_code, headers={**relayed, **extra})
        self._lease = lease

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._lease.end()


def first_byte_timer() -> Callable[[], float]:
    """A stopwatch: call it to get seconds since it was made."""
    started = time.perf_counter()
    return lambda: time.perf_counter() - started
