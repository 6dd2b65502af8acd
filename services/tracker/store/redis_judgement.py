"""The tracker's judgement of nodes in Redis: measured speeds and the failure gate, shared by every tracker.

:mod:`..ratings` and :mod:`..failure_reports` say what the rules are; here is
where a Redis store keeps their state, so two trackers agree on how fast a
node is and on whether a report backs it off (issue 34):

- ``rating:{id}`` (a hash: ``layer_s``, ``ttft_s``, ``streams``; expires
  :data:`RATING_TTL_S` after its last observation): each stream a tracker
  measures is folded into it by one script (:data:`FOLD`, the same moving
  average as in memory), which publishes the new record on ``ratings``;
  every tracker's :class:`RedisRatings` takes it into the speeds it plans
  with, and reads the records of the listed nodes when it (re)loads its view.
- ``reports:{reporter}`` (a sorted set of report times, at most the rate's
  count, expiring after a minute) and ``reporters:{run}`` / ``lone:{run}``
  (who reported a node registration in the window, at most
  :data:`~..failure_reports.MAX_REPORTERS`, and whether a lone report already
  backed it off; both expire with the window), under a digest of the run:
  :class:`RedisGate` applies :class:`~..failure_reports.FailureGate`'s rules
  with one script each (:data:`COUNT`, :data:`JUDGE`), timed by Redis's clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import secrets
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Final

from redis.asyncio import Redis
from redis.exceptions import RedisError

from ..failure_reports import (
    CORROBORATING_REPORTERS,
    MAX_REPORTERS,
    RATE_WINDOW_S,
    REPORTS_PER_MINUTE,
    TRACKER,
    TooManyReports,
    Verdict,
)
from ..ratings import MIN_OBSERVED_S, SMOOTHING, Ratings
from .base import StoreUnavailable

logger = logging.getLogger(__name__)

RATING_TTL_S: Final = 86400.0
"""How long a node's measured record outlives its last observation in Redis."""
MAX_RATING_EVENT_BYTES: Final = 1024

FOLD: Final = """
local layer_s = tonumber(ARGV[1])
local ttft_s = tonumber(ARGV[2])
local smoothing = tonumber(ARGV[3])
local cur = redis.call('HMGET', KEYS[1], 'layer_s', 'ttft_s', 'streams')
local streams = 1
if cur[1] then
  layer_s = tonumber(cur[1]) + smoothing * (layer_s - tonumber(cur[1]))
  ttft_s = tonumber(cur[2]) + smoothing * (ttft_s - tonumber(cur[2]))
  streams = tonumber(cur[3]) + 1
end
local ls, ts = string.format('%.17g', layer_s), string.format('%.17g', ttft_s)
redis.call('HSET', KEYS[1], 'layer_s', ls, 'ttft_s', ts, 'streams', streams)
redis.call('PEXPIRE', KEYS[1], ARGV[4])
redis.call('PUBLISH', ARGV[5], cjson.encode({node_id=ARGV[6], layer_s=ls, ttft_s=ts, streams=streams}))
return streams
"""
"""KEYS: the node's rating. ARGV: seconds per layer, time to first token, smoothing, record ms, channel, node id."""

COUNT: Final = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[1]))
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  return {0, tonumber(oldest[2]) + tonumber(ARGV[1]) - now}
end
redis.call('ZADD', KEYS[1], now, ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return {1, 0}
"""
"""KEYS: the reporter's report times. ARGV: window ms, most reports in it, a unique member for this report."""

JUDGE: Final = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window = tonumber(ARGV[2])
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  if now - tonumber(all[i + 1]) > window then redis.call('HDEL', KEYS[1], all[i]) end
end
redis.call('HSET', KEYS[1], ARGV[1], now)
if redis.call('HLEN', KEYS[1]) > tonumber(ARGV[3]) then
  local left = redis.call('HGETALL', KEYS[1])
  local oldest, at = nil, nil
  for i = 1, #left, 2 do
    if at == nil or tonumber(left[i + 1]) < at then oldest, at = left[i], tonumber(left[i + 1]) end
  end
  redis.call('HDEL', KEYS[1], oldest)
end
redis.call('PEXPIRE', KEYS[1], window)
if ARGV[1] == ARGV[4] or redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[5]) then return 'apply' end
if redis.call('SET', KEYS[2], now, 'PX', window, 'NX') then return 'apply' end
return 'noted'
"""
"""KEYS: the run's reporters, its lone-report mark. ARGV: reporter, window ms, most reporters, the tracker's
name, reporters that corroborate."""


def _ms(seconds: float) -> int:
    return max(int(seconds * 1000), 1)


class RedisRatings(Ratings):
    """Speeds folded into Redis and taken from its channel: what every tracker of the store plans with."""

    def __init__(self, redis: Redis, prefix: str, spawn: Callable[[Coroutine[Any, Any, None]], None]) -> None:
        super().__init__()
        self._redis = redis
        self._prefix = prefix
        self._spawn = spawn
        self._fold_script = redis.register_script(FOLD)

    @property
    def channel(self) -> str:
        return f"{self._prefix}ratings"

    def key(self, node_id: str) -> str:
        return f"{self._prefix}rating:{node_id}"

    def observed(self, node_ids: list[str], layer_s: float, ttft_s: float) -> None:
        """Fold the observation into each node's shared record too (in the background; best effort)."""
        async def fold() -> None:
            for node_id in node_ids:
                try:
                    await self._fold_script(keys=[self.key(node_id)],
                                            args=[repr(layer_s), repr(ttft_s), repr(SMOOTHING), _ms(RATING_TTL_S),
                                                  self.channel, node_id])
                except (RedisError, OSError) as exc:
                    logger.warning("could not share node %s's measured speed: %s", node_id, exc)
                    return

        self._spawn(fold())

    def apply_event(self, data: str) -> None:
        """A record another tracker (or this one) folded, as published on :attr:`channel`."""
        if len(data) > MAX_RATING_EVENT_BYTES:
            return
        try:
            event = json.loads(data)
            self.set_measured(str(event["node_id"]), float(event["layer_s"]), int(event["streams"]),
                              float(event["ttft_s"]))
        except (ValueError, KeyError, TypeError):
            logger.warning("dropped a malformed rating event: %.200s", data)

    def load(self, node_ids: Sequence[str], rows: Sequence[dict[str, str]]) -> None:
        """Take the records of ``node_ids`` as a (re)load of the view read them."""
        for node_id, row in zip(node_ids, rows, strict=True):
            if row:
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    self.set_measured(node_id, max(float(row["layer_s"]), MIN_OBSERVED_S), int(row["streams"]),
                                      float(row["ttft_s"]))


class RedisGate:
    """:class:`~..failure_reports.FailureGate`'s rules applied in Redis (one script a decision): shared by every
    tracker of the store. ``now`` is ignored: Redis's clock times every report."""

    def __init__(self, redis: Redis, prefix: str, window_s: float, per_minute: int = REPORTS_PER_MINUTE) -> None:
        self._redis = redis
        self._prefix = prefix
        self._window_ms = _ms(window_s)
        self._per_minute = per_minute
        self._count = redis.register_script(COUNT)
        self._judge = redis.register_script(JUDGE)

    async def count(self, reporter: str, now: float) -> None:
        member = secrets.token_hex(8)  # unique across trackers: two reports in one millisecond are two
        answer = await self._call(self._count, [f"{self._prefix}reports:{_digest(reporter)}"],
                                  [_ms(RATE_WINDOW_S), self._per_minute, member])
        if not int(answer[0]):
            raise TooManyReports(max(int(answer[1]), 0) / 1000)

    async def judge(self, run: str, reporter: str, now: float) -> Verdict:
        digest = _digest(run)
        answer = await self._call(self._judge, [f"{self._prefix}reporters:{digest}", f"{self._prefix}lone:{digest}"],
                                  [reporter, self._window_ms, MAX_REPORTERS, TRACKER, CORROBORATING_REPORTERS])
        return "apply" if answer == "apply" else "noted"

    async def _call(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        try:
            return await script(keys=keys, args=args)
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"store unreachable: {exc}") from None


def _digest(text: str) -> str:
    """A bounded key part for any reporter name or node registration."""
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def spawner(background: set[asyncio.Task[None]]) -> Callable[[Coroutine[Any, Any, None]], None]:
    """Run a coroutine in the background, kept in ``background`` until done (dropped where no loop runs)."""
    def spawn(work: Coroutine[Any, Any, None]) -> None:
        try:
            task = asyncio.get_running_loop().create_task(work)
        except RuntimeError:
            work.close()
            return
        background.add(task)
        task.add_done_callback(background.discard)

    return spawn
