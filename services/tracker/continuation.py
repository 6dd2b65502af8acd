"""A streamed answer that outlives its head: the tracker relays it and, if the head dies, goes on elsewhere.

The tracker asks the head for progress (``X-Meshnet-Progress``, see
:mod:`meshwire.resume`): every stream event carries the ids of its tokens
(and the first one the sampler seed). :class:`ContinuedStream` relays the
events, stripping that extension, and keeps the history. When the head stops
answering before the stream's end, it reports the head, asks for a route that
avoids it, and sends the new head the same request with the history
(``meshnet_resume``): the new head replays the tokens and streams only what
follows. The client sees one stream: same id on every event, no second
opening, no repeated or missing text (greedy: identical to an uninterrupted
run; seeded sampling: the same draws). At most ``attempts`` new heads are
tried within ``deadline_s``; when none can go on, the stream ends with an
OpenAI error event and ``[DONE]``, never a silent cut. When there is no route
but the tracker is healing the gap (``no_route`` with ``healing``: placed nodes
are being moved onto the layers the dead head held, issue 36), the
continuation asks again every :data:`HEALING_POLL_S` within ``deadline_s``
(waiting is not counted as an attempt), as a head's failover does.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final

import httpx
import orjson
from pydantic import ValidationError

from meshwire import errors
from meshwire.resume import PROGRESS_KEY, Progress, Resume, resume_body
from meshwire.routes import SignedRoute
from meshwire.sse import DONE, sse_event

from .proxy import HeadError, HeadRefused
from .responses import HTTPError

logger = logging.getLogger(__name__)

HEALING_POLL_S: Final = 1.0
"""How often a continuation asks again for a route while the tracker says placed nodes are moving onto the gap
(as a head's failover does: services/node/head/failover.py)."""
EVENT_END: Final = b"\n\n"
MAX_EVENT_BYTES: Final = 4 << 20
"""Longest single stream event accepted from a head (a chunk with 20 log-probabilities per token is far smaller)."""

Event = dict[str, Any]
"""One stream event's JSON object."""


class Dropped(enum.Enum):
    """An event the client does not get (blank, or a new head's second opening)."""

    DROPPED = "dropped"


DROPPED: Final = Dropped.DROPPED

OpenHead = Callable[[SignedRoute, bytes], Awaitable["httpx.Response | HeadRefused | HeadError"]]
"""Send a body to a route's head (with progress asked for): its open stream, or why not."""
RouteFor = Callable[[set[str]], SignedRoute]
"""A route avoiding the given node ids (raises :class:`HTTPError` when there is none)."""


@dataclass
class StreamHistory:
    """What the client has been sent so far."""

    ids: list[int] = field(default_factory=list)
    seed: int | None = None
    response_id: str | None = None
    opened: bool = False
    """An opening event (the role) went out: a new head's is dropped."""
    finished: bool = False
    """A finish (or an error) went out: nothing is left to continue."""
    done: bool = False
    """``[DONE]`` went out."""
    usage: dict[str, Any] | None = None
    """The usage chunk's ``usage``, when the stream carried one."""
    first_token_at: float | None = None
    last_token_at: float | None = None
    """When (``time.perf_counter``) the first and the last token ids arrived (the tracker's speed measure)."""


class Cut(httpx.ReadError):
    """The tracker stopped relaying a head on purpose (a node of its route was revoked): continue elsewhere,
    without reporting the head as failed."""


class ContinuedStream:
    """The events of one streamed answer, across as many heads as it takes."""

    def __init__(self, *, body: bytes, route_for: RouteFor, open_head: OpenHead,
                 on_failed: Callable[[str, str], None], on_route: Callable[[SignedRoute | None], None],
                 attempts: int, deadline_s: float, cut: Callable[[], str | None] = lambda: None) -> None:
        self._body = body
        self._route_for = route_for
        self._open_head = open_head
        self._on_failed = on_failed
        self._on_route = on_route
        self._attempts = attempts
        self._deadline_s = deadline_s
        self._cut = cut
        """Asked before each event: a reason to leave the current route now (its event unused), or ``None``."""
        self.history = StreamHistory()

    async def events(self, upstream: httpx.Response, route: SignedRoute) -> AsyncIterator[bytes]:
        """The client's stream as server-sent events (see :meth:`payloads`)."""
        async for payload in self.payloads(upstream, route):
            yield DONE if payload is None else sse_event(orjson.dumps(payload))

    async def payloads(self, upstream: httpx.Response, route: SignedRoute) -> AsyncIterator[Event | None]:
        """The client's stream as parsed events (``None``: ``[DONE]``): ``upstream``'s, then a continuation's
        after each head that dies."""
        continuations = 0
        started = time.monotonic()
        while True:
            head = route.nodes[0].node_id
            cut = False
            try:
                async for payload in self._relay(upstream, first_of_head=continuations > 0):
                    yield payload
                return
            except httpx.HTTPError as exc:
                reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                cut = isinstance(exc, Cut)
            finally:
                await upstream.aclose()
            if self.history.finished:  # only the usage chunk or [DONE] was missing
                if not self.history.done:
                    yield None
                return
            if not cut:
                self._on_failed(head, f"broke mid-answer: {reason}")
            logger.warning("stream %s: head %s stopped answering after %d tokens (%s); continuing elsewhere",
                           self.history.response_id, head, len(self.history.ids), reason)
            # A cut head did nothing wrong: the node cut for (revoked: evicted; quarantined) is out of every new
            # route already, and the head may be the only one.
            avoid = set() if cut else {head}
            opened = None
            waited = False
            while opened is None:
                continuations += 1
                spent = time.monotonic() - started
                if continuations > self._attempts or spent > self._deadline_s:
                    bound = (f"{self._attempts} attempts" if continuations > self._attempts
                             else f"the {self._deadline_s:g} s deadline")
                    for payload in self._give_up(f"the head node {head} stopped answering mid-stream and no other "
                                                 f"head could continue within {bound}"):
                        yield payload
                    return
                try:
                    route = self._route_for(avoid)
                except HTTPError as exc:
                    if exc.body["error"].get("healing") is True and spent + HEALING_POLL_S <= self._deadline_s:
                        if not waited:
                            logger.info("stream %s: no route avoids %s yet; the tracker is healing the gap, "
                                        "asking again every %.0f s", self.history.response_id,
                                        ", ".join(sorted(avoid)), HEALING_POLL_S)
                        waited = True
                        continuations -= 1  # waiting for the gap to close is not another head tried
                        await asyncio.sleep(HEALING_POLL_S)
                        continue
                    for payload in self._give_up(f"the head node {head} stopped answering mid-stream and there "
                                                 f"is no route to continue on: {exc}"):
                        yield payload
                    return
                self._on_route(route)
                outcome = await self._open_head(route, self._continuation_body())
                if isinstance(outcome, httpx.Response):
                    opened = outcome
                    break
                self._on_route(None)
                if isinstance(outcome, HeadError):  # the new head refused the request itself: nothing to retry
                    for payload in self._give_up(str(outcome.error)):
                        yield payload
                    return
                avoid.add(outcome.culprit)
                if outcome.failed:
                    self._on_failed(outcome.culprit, outcome.reason)
            upstream = opened
            logger.info("stream %s continues on %s after %d tokens", self.history.response_id,
                        " -> ".join(node.node_id for node in route.nodes), len(self.history.ids))

    def _continuation_body(self) -> bytes:
        """The original request, with the history when there is one to continue from."""
        if self.history.seed is None:  # nothing was relayed: the new head starts afresh
            return self._body
        return resume_body(self._body, Resume(ids=tuple(self.history.ids), seed=self.history.seed))

    async def _relay(self, upstream: httpx.Response, *, first_of_head: bool) -> AsyncIterator[Event | None]:
        """``upstream``'s events as the client gets them (``None``: ``[DONE]``); the history follows each one."""
        buffer = b""
        skip_opening = first_of_head and self.history.opened
        async for chunk in upstream.aiter_bytes():
            buffer += chunk
            if len(buffer) > MAX_EVENT_BYTES and EVENT_END not in buffer:
                raise httpx.ReadError("the head sent an event longer than the tracker accepts")
            while EVENT_END in buffer:
                if (why := self._cut()) is not None:
                    raise Cut(why)
                raw, buffer = buffer.split(EVENT_END, 1)
                out = self._event(raw, skip_opening)
                skip_opening = skip_opening and out is DROPPED
                if out is not DROPPED:
                    yield out
        if buffer.strip():
            out = self._event(buffer, False)
            if out is not DROPPED:
                yield out
        if not self.history.done:
            raise httpx.RemoteProtocolError("the head's stream ended before its [DONE]")

    def _event(self, raw: bytes, skip_opening: bool) -> Event | None | Dropped:
        """One event for the client (``None``: ``[DONE]``; :data:`DROPPED`: nothing), recorded in the history."""
        data = b"".join(line[5:].strip() for line in raw.split(b"\n") if line.startswith(b"data:"))
        if not data:
            return DROPPED
        if data == DONE.strip()[5:].strip():
            self.history.finished = self.history.done = True
            return None
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError:
            raise httpx.RemoteProtocolError("the head sent an event that is not JSON") from None
        if not isinstance(event, dict):
            raise httpx.RemoteProtocolError("the head sent an event that is not a JSON object")
        progress = self._progress(event.pop(PROGRESS_KEY, None))
        if "error" in event:  # the head's own error: it is alive and has ended the answer
            self.history.finished = True
            return event
        if self._is_opening(event, progress):
            if skip_opening:
                return DROPPED
            self.history.opened = True
        if progress is not None:
            if progress.ids:
                self.history.last_token_at = time.perf_counter()
                if self.history.first_token_at is None:
                    self.history.first_token_at = self.history.last_token_at
            self.history.ids.extend(progress.ids)
            if progress.seed is not None and self.history.seed is None:
                self.history.seed = progress.seed
        if isinstance(event.get("usage"), dict):
            self.history.usage = event["usage"]
        choices = event.get("choices")
        if isinstance(choices, list) and any(isinstance(c, dict) and c.get("finish_reason") for c in choices):
            self.history.finished = True
        if self.history.response_id is None:
            self.history.response_id = event.get("id") if isinstance(event.get("id"), str) else None
        elif "id" in event:
            event["id"] = self.history.response_id
        if self._says_nothing(event):  # it carried ids only (text a tool call parser holds back)
            return DROPPED
        return event

    @staticmethod
    def _says_nothing(event: dict[str, Any]) -> bool:
        """A chunk whose one choice has an empty delta and nothing else: nothing for the client."""
        choices = event.get("choices")
        if event.get("usage") or not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            return False
        choice = choices[0]
        return choice.get("delta") == {} and not choice.get("finish_reason") and not choice.get("logprobs")

    @staticmethod
    def _progress(raw: Any) -> Progress | None:
        if raw is None:
            return None
        try:
            return Progress.model_validate(raw)
        except ValidationError:
            raise httpx.RemoteProtocolError("the head sent malformed progress") from None

    @staticmethod
    def _is_opening(event: dict[str, Any], progress: Progress | None) -> bool:
        """A chat stream's first event: the role, no text, no tokens."""
        if progress is not None and progress.ids:
            return False
        choices = event.get("choices")
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            return False
        delta = choices[0].get("delta")
        return isinstance(delta, dict) and delta.get("role") == "assistant" and not delta.get("content")

    def _give_up(self, message: str) -> tuple[Event, None]:
        """The stream's last events: the error (OpenAI's shape), then ``[DONE]``."""
        self.history.finished = self.history.done = True
        logger.warning("stream %s ends with an error: %s", self.history.response_id, message)
        return errors.error_body(message, errors.SERVER_ERROR, "head_failed"), None
