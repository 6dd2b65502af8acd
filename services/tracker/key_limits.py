"""Limits per client API key: requests per minute and requests in flight, shared by every tracker of a store.

With ``MESHNET_API_KEYS`` set, every front-door request (``POST
/v1/chat/completions``, ``/v1/completions``, ``/v1/responses``) carrying one of
the keys is admitted here first:

* ``key_requests_per_minute`` (``MESHNET_KEY_REQUESTS_PER_MINUTE``): at most
  that many admitted requests in any 60 s (a sliding window);
* ``key_max_streams`` (``MESHNET_KEY_MAX_STREAMS``): at most that many
  requests in flight at once, streamed or not, counted until the answer's
  last byte is sent (or the client leaves).

Beyond either the request is answered ``429`` with ``Retry-After`` (seconds
until the window frees a slot; 1 for streams) and OpenAI's error body
(``type`` ``rate_limit_error``, ``code`` ``rate_limit_exceeded``), which the
OpenAI SDK retries after that wait. 0 turns a limit off. A request without a
valid key is not counted: the route refuses it (401).

Where the limits are counted follows the store (``MESHNET_STORE``): in this
process's memory for ``memory``, in Redis for ``redis://`` so that several
trackers behind one address share each key's budget (a sorted set per key of
request times, and one of in-flight requests with leases this tracker renews
while they run, so a tracker that dies frees its slots within
:data:`STREAM_LEASE_S`). The clock of the shared window is Redis's.

Keys never appear in metrics, logs or the store (:class:`KeyNames`). Metrics
and logs name a key by its place in ``MESHNET_API_KEYS`` (``key-1``,
``key-2``, ...), which says nothing about the key: the public ``/metrics``
once named it by a prefix of its unsalted SHA-256, which a weak key was
guessed from offline. The shared store counts a key under an HMAC-SHA256 of
it keyed with the mesh secret (every tracker of a mesh computes the same
name; nobody without the secret can test a guess against it).

``n > 1`` (several choices in one request) runs ``n`` streams on the mesh, so
it takes ``n`` of the key's in-flight slots: the request's own, taken here
before the body is read, and ``n - 1`` more that the front door asks for
(:meth:`KeyLimiter.admit` with ``requests=0``) once it has read ``n``, left in
the scope (:data:`SCOPE_EXTRA_TICKETS`) for this middleware to free when the
request ends. The request counts once against the requests per minute.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import math
import secrets
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from meshwire import errors

logger = logging.getLogger(__name__)

WINDOW_S: Final = 60.0
"""The rate window: requests per minute."""
STREAM_LEASE_S: Final = 60.0
"""A shared in-flight slot lives this long unless its tracker renews it (a dead tracker's slots free up)."""
LEASE_RENEW_S: Final = STREAM_LEASE_S / 3
STREAM_RETRY_AFTER_S: Final = 1
"""``Retry-After`` of a request refused for too many in flight (a stream may end any moment)."""
STORE_ID_HEX: Final = 32
"""Hex digits of the HMAC a key is counted under in the shared store."""
LIMITED_PATHS: Final = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})
SCOPE_KEY_ID: Final = "meshnet.key_id"
"""Where the admitted key's label is left in the ASGI scope, for the token counters."""
SCOPE_KEY_STORE_ID: Final = "meshnet.key_store_id"
"""Where the admitted key's store id is left in the ASGI scope, for the front door to take more slots."""
SCOPE_EXTRA_TICKETS: Final = "meshnet.key_extra_tickets"
"""A list in the ASGI scope where the front door leaves the tickets of extra slots (``n > 1``) to free."""


class KeyNames:
    """What a configured API key is called: in metrics and logs, and in the shared store (see the module doc)."""

    def __init__(self, api_keys: Sequence[str], secret: str) -> None:
        self._labels = {key: f"key-{index}" for index, key in reversed(list(enumerate(api_keys, start=1)))}
        self._secret = secret.encode("utf-8")

    def label(self, key: str) -> str:
        """``key-N``: the key's 1-based place in ``MESHNET_API_KEYS`` (its first, if listed twice)."""
        return self._labels.get(key, "key-unknown")

    def store_id(self, key: str) -> str:
        """The key's name in the shared store: a keyed hash the store cannot test a guessed key against."""
        return hmac.new(self._secret, key.encode("utf-8"), hashlib.sha256).hexdigest()[:STORE_ID_HEX]


@dataclass(frozen=True)
class Refused:
    """A request over a key's limit: how long to wait, and why."""

    retry_after_s: int
    message: str


class LimitsUnavailable(Exception):
    """The shared store did not answer: the request is answered 503, not let through uncounted."""


class KeyLimiter(Protocol):
    """Admits a key's request (answering a ticket to release when it ends) or refuses it."""

    async def admit(self, who: str, *, requests: int = 1, streams: int = 1) -> str | Refused:
        """Count ``requests`` (0 or 1) against ``who``'s rate and take ``streams`` in-flight slots: a ticket,
        or why it is refused (nothing taken); :class:`LimitsUnavailable` when the store is away.
        ``who`` is the key's store id (:meth:`KeyNames.store_id`), never the key."""

    async def release(self, who: str, ticket: str) -> None:
        """The request ended: the slots its ticket took are free."""

    async def close(self) -> None:
        """Stop background work."""


def _rate_refusal(rpm: int, wait_s: float) -> Refused:
    return Refused(max(1, math.ceil(wait_s)),
                   f"Rate limit reached for this API key: {rpm} requests per minute. "
                   f"Try again in {max(1, math.ceil(wait_s))} s.")


def _streams_refusal(max_streams: int, streams: int) -> Refused:
    wanted = f" (this needs {streams} more)" if streams > 1 else ""
    return Refused(STREAM_RETRY_AFTER_S,
                   f"Rate limit reached for this API key: {max_streams} streams in flight at once{wanted}. "
                   "Try again when one has finished.")


def _ticket(streams: int) -> str:
    """A fresh ticket naming how many slots it holds (``<hex>.<streams>``)."""
    return f"{secrets.token_hex(8)}.{streams}"


def _slots(ticket: str) -> list[str]:
    """The in-flight slot names a ticket holds."""
    head, _, count = ticket.partition(".")
    return [f"{head}.{index}" for index in range(int(count) if count.isdigit() else 1)]


class MemoryKeyLimiter:
    """Limits counted in this process (the ``memory`` store: one tracker)."""

    def __init__(self, requests_per_minute: int, max_streams: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._rpm = requests_per_minute
        self._max_streams = max_streams
        self._clock = clock
        self._recent: dict[str, deque[float]] = {}
        self._in_flight: Counter[str] = Counter()

    async def admit(self, who: str, *, requests: int = 1, streams: int = 1) -> str | Refused:
        if self._max_streams and self._in_flight[who] + streams > self._max_streams:
            return _streams_refusal(self._max_streams, streams)
        if self._rpm and requests:
            now = self._clock()
            recent = self._recent.setdefault(who, deque())
            while recent and recent[0] <= now - WINDOW_S:
                recent.popleft()
            if len(recent) >= self._rpm:
                return _rate_refusal(self._rpm, recent[0] + WINDOW_S - now)
            recent.append(now)
        self._in_flight[who] += streams
        return _ticket(streams)

    async def release(self, who: str, ticket: str) -> None:
        self._in_flight[who] -= len(_slots(ticket))
        if self._in_flight[who] <= 0:
            del self._in_flight[who]

    async def close(self) -> None:
        return None


_ADMIT: Final = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rpm, max_streams = tonumber(ARGV[1]), tonumber(ARGV[2])
local window, lease = tonumber(ARGV[3]), tonumber(ARGV[4])
local streams, requests = tonumber(ARGV[6]), tonumber(ARGV[7])
if max_streams > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  if redis.call('ZCARD', KEYS[2]) + streams > max_streams then return {'streams', 0} end
end
if rpm > 0 and requests > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
  if redis.call('ZCARD', KEYS[1]) >= rpm then
    local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
    return {'rate', tonumber(oldest[2]) + window - now}
  end
  redis.call('ZADD', KEYS[1], now, ARGV[5])
  redis.call('PEXPIRE', KEYS[1], window)
end
if max_streams > 0 then
  for i = 0, streams - 1 do redis.call('ZADD', KEYS[2], now + lease, ARGV[5] .. '.' .. i) end
  redis.call('PEXPIRE', KEYS[2], lease)
end
return {'ok', 0}
"""
"""KEYS: the key's request times, its in-flight leases. ARGV: rpm, max streams, window ms, lease ms, ticket's
random part, streams to take, requests to count (0 or 1)."""

_RENEW: Final = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', now + lease, ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], lease)
return 1
"""


class RedisKeyLimiter:
    """Limits counted in Redis, shared by every tracker of the store (see the module doc)."""

    def __init__(self, redis: Any, prefix: str, requests_per_minute: int, max_streams: int) -> None:
        self._redis = redis
        self._prefix = prefix
        self._rpm = requests_per_minute
        self._max_streams = max_streams
        self._admit = redis.register_script(_ADMIT)
        self._renew = redis.register_script(_RENEW)
        self._held: dict[str, set[str]] = {}
        self._renewer: asyncio.Task[None] | None = None

    def _keys(self, kid: str) -> list[str]:
        return [f"{self._prefix}keyrate:{kid}", f"{self._prefix}keyflight:{kid}"]

    async def admit(self, who: str, *, requests: int = 1, streams: int = 1) -> str | Refused:
        from redis.exceptions import RedisError

        kid = who
        ticket = _ticket(streams)
        try:
            verdict, wait_ms = await self._admit(keys=self._keys(kid), args=[
                self._rpm, self._max_streams, int(WINDOW_S * 1000), int(STREAM_LEASE_S * 1000),
                ticket.partition(".")[0], streams, requests])
        except RedisError as exc:
            raise LimitsUnavailable(f"the store keeping the API keys' limits did not answer: {exc}") from None
        verdict = verdict.decode() if isinstance(verdict, bytes) else str(verdict)
        if verdict == "streams":
            return _streams_refusal(self._max_streams, streams)
        if verdict == "rate":
            return _rate_refusal(self._rpm, int(wait_ms) / 1000)
        if self._max_streams:
            self._held.setdefault(kid, set()).add(ticket)
            if self._renewer is None or self._renewer.done():
                self._renewer = asyncio.create_task(self._renew_leases(), name="key-limit-leases")
        return ticket

    async def release(self, who: str, ticket: str) -> None:
        if not self._max_streams:
            return
        from redis.exceptions import RedisError

        kid = who
        held = self._held.get(kid, set())
        held.discard(ticket)
        if not held:
            self._held.pop(kid, None)
        try:
            await self._redis.zrem(self._keys(kid)[1], *_slots(ticket))
        except RedisError as exc:  # its lease lapses within STREAM_LEASE_S
            logger.warning("could not free an in-flight slot of %s in the store: %s", kid, exc)

    async def _renew_leases(self) -> None:
        from redis.exceptions import RedisError

        while self._held:
            await asyncio.sleep(LEASE_RENEW_S)
            for kid, tickets in list(self._held.items()):
                if not tickets:
                    continue
                try:
                    await self._renew(keys=[self._keys(kid)[1]], args=[int(STREAM_LEASE_S * 1000),
                                                                           *(slot for t in tickets for slot in _slots(t))])
                except RedisError as exc:
                    logger.warning("could not renew the in-flight slots of %s: %s", kid, exc)

    async def close(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer
            self._renewer = None


def _matching_key(scope: Scope, api_keys: Sequence[str]) -> str | None:
    """The configured key the request's ``Authorization: Bearer`` carries, compared in constant time."""
    authorization = next((value for name, value in scope.get("headers", ()) if name == b"authorization"), b"")
    scheme, _, offered = authorization.decode("latin-1").strip().partition(" ")
    offered = offered.strip()
    if scheme.lower() != "bearer" or not offered:
        return None
    found = None
    for key in api_keys:  # every key compared: the timing says nothing about which one is close
        if hmac.compare_digest(offered.encode("utf-8"), key.encode("utf-8")):
            found = key
    return found


async def _answer(send: Send, status: int, body: dict[str, Any], retry_after_s: int) -> None:
    payload = orjson.dumps(body)
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode("ascii")),
        (b"retry-after", str(retry_after_s).encode("ascii")),
    ]})
    await send({"type": "http.response.body", "body": payload, "more_body": False})


class KeyLimits:
    """ASGI middleware: each front-door request with a valid key is admitted by ``limiter`` or answered 429.

    ``count(label, status)`` is called once per such request with the key's
    label (:meth:`KeyNames.label`) and the status it was answered (the
    per-key request counter). ``secret`` keys the store ids (the mesh secret).
    """

    def __init__(self, app: ASGIApp, *, api_keys: Sequence[str], limiter: KeyLimiter,
                 count: Callable[[str, int], None], secret: str = "") -> None:
        self.app = app
        self.api_keys = tuple(api_keys)
        self.names = KeyNames(self.api_keys, secret)
        self.limiter = limiter
        self.count = count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in LIMITED_PATHS:
            await self.app(scope, receive, send)
            return
        key = _matching_key(scope, self.api_keys)
        if key is None:  # no key or a wrong one: the route answers 401, nothing is counted
            await self.app(scope, receive, send)
            return
        label, who = self.names.label(key), self.names.store_id(key)
        try:
            verdict = await self.limiter.admit(who)
        except LimitsUnavailable as exc:
            logger.warning("%s", exc)
            await _answer(send, 503, errors.error_body(str(exc), errors.UNAVAILABLE, errors.STORE_UNAVAILABLE), 1)
            self.count(label, 503)
            return
        if isinstance(verdict, Refused):
            logger.info("%s refused: %s", label, verdict.message)
            await _answer(send, 429, errors.error_body(verdict.message, errors.RATE_LIMIT, "rate_limit_exceeded"),
                          verdict.retry_after_s)
            self.count(label, 429)
            return
        scope[SCOPE_KEY_ID] = label
        scope[SCOPE_KEY_STORE_ID] = who
        extra: list[str] = []
        scope[SCOPE_EXTRA_TICKETS] = extra
        status = 500

        async def noted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, noted)
        finally:
            for ticket in (verdict, *extra):
                await asyncio.shield(self.limiter.release(who, ticket))
            self.count(label, status)


async def take_choice_slots(limiter: KeyLimiter | None, scope: Scope, choices: int) -> Refused | None:
    """Take the ``choices - 1`` further in-flight slots an ``n > 1`` request needs (its first is taken);
    the refusal when the key has not that many free (nothing is taken then). Freed when the request ends."""
    who = scope.get(SCOPE_KEY_STORE_ID)
    extra = scope.get(SCOPE_EXTRA_TICKETS)
    if limiter is None or who is None or extra is None or choices <= 1:
        return None
    verdict = await limiter.admit(who, requests=0, streams=choices - 1)
    if isinstance(verdict, Refused):
        return Refused(verdict.retry_after_s, f"{verdict.message} This request asks for {choices} choices, "
                                              f"and each choice is a stream.")
    extra.append(verdict)
    return None
