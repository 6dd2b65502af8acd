"""The tracker's registry in Redis: several trackers serve one mesh, and any of them may die.

Keys (all under :data:`PREFIX`; one Redis database per mesh):

- ``lease:{id}``: the node's lease, a key with an expiry of the node TTL plus
  :data:`LEASE_GRACE_S`. A heartbeat refreshes it; Redis expires it. There is
  no expiry loop here: Redis does what it is built for.
- ``node:{id}``: a hash (``registration`` JSON as the node sent it, ``lease``,
  ``heartbeats``, ``left``, ``reason``) kept for ``offline_keep_s`` after the
  lease ends, so an operator still sees what died.
- ``nodes``: the set of listed ids (bounded by ``max_nodes`` live leases).
- ``failures:{id}`` and ``backoff:{id}``: a failure run (expires after
  ``failure_reset_s``) and its backoff (expires when the backoff ends).
- ``doc:{name}`` (the route-signing key ring, see :mod:`..trust`) and
  ``join_tokens`` (a hash: token id to its record, the secret only hashed):
  what every tracker of the mesh must agree on to sign routes and admit nodes.
- ``rating:{id}``, ``reports:{reporter}``, ``reporters:{run}`` and
  ``lone:{run}``: measured speeds and the failure gate, shared by every
  tracker (:mod:`.redis_judgement`; the records of listed nodes are read
  with the view, and changes published on ``ratings``).
- ``revoked`` (a hash: node id to the wall time its join token was revoked,
  bounded by :data:`~..revocations.MAX_REVOKED`) and its channel
  ``revocations``: every tracker cuts its streams through a revoked node at
  their next token and tells its nodes (:mod:`..revocations`).
- ``version`` and ``epoch``: a counter bumped by every change of membership
  or state, and a random id a Redis that restarted empty lacks.

Every change is one Lua script (:mod:`.redis_scripts`; atomic across trackers: two trackers cannot
hand one id to two nodes) that also ``PUBLISH``es the change on ``events``.
Each tracker keeps a :class:`~..registry.Registry` as its *view* of Redis,
loaded whole on connect and kept current from that channel and from Redis's
``expired`` keyspace events, so a joined, suspect or departed node is seen by
every tracker at once, and routes are planned from memory at memory speed.

Reads that plan a route first call :meth:`RedisStore.fresh`: one ``MGET`` of
``version`` and ``epoch``. A view behind the version waits (briefly) for the
channel to deliver, else reloads; a changed epoch (Redis restarted empty)
reloads at once. So a node whose registration any tracker has answered is
routable through every tracker at once, and after Redis comes back empty the
view is empty too (no route names a lease Redis no longer holds) until the
nodes' next heartbeats, which register them again (one heartbeat interval,
well within one TTL).

The view expires a node :data:`LEASE_GRACE_S` before its Redis key does, so
the planner never names a node whose lease key has expired while the channel
is slower than that grace.

Redis away: the tracker says so rather than guess. ``/health`` answers 503
with the reason; registrations, routes and chats answer 503 with
``Retry-After``; the tracker reconnects with a bounded backoff and reloads
its view before it serves again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any, Final

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from meshwire.headers import LEASE as LEASE_HEADER
from meshwire.registry import NodeRegistration

from ..failure_reports import Gate
from ..join_tokens import MAX_TOKENS, JoinTokenRecord
from ..key_limits import KeyLimiter, RedisKeyLimiter
from ..registry import (
    LEASE_BYTES,
    MAX_REASON_CHARS,
    LeaseConflict,
    LeaseRequired,
    Registered,
    Registry,
    RegistryFull,
    RegistryPolicy,
    UnknownNode,
)
from ..revocations import Revocations
from . import redis_scripts as scripts
from .base import StoreHealth, StoreUnavailable
from .redis_judgement import RedisGate, RedisRatings, spawner
from .redis_view import NodeRow, SharedView, endpoint_of, ms, redact

logger = logging.getLogger(__name__)

PREFIX: Final = "meshnet:"
LEASE_GRACE_S: Final = 1.0
"""A lease key outlives the view's idea of it by this much (the channel's latency budget)."""
REDIS_TIMEOUT_S: Final = 2.0
"""Longest wait for one Redis command or connection; a slower Redis counts as away."""
CATCH_UP_S: Final = 1.0
"""Longest wait for the channel to deliver a change :meth:`RedisStore.fresh` knows of, before reloading."""
RECONNECT_MIN_S: Final = 0.1
RECONNECT_MAX_S: Final = 2.0
"""Bounds of the backoff between attempts to reach a Redis that is away."""
POLL_S: Final = 1.0
"""How long one wait for a channel message lasts (the listener checks its connection in between)."""
CLOSE_RETRY_S: Final = 0.5
"""How long :meth:`RedisStore.close` waits for its tasks before cancelling them again."""
MAX_CONNECTIONS: Final = 64
"""Most connections one tracker opens to Redis for commands."""
MAX_PENDING_EVENTS: Final = 100_000
"""Most channel messages held while a reload reads Redis."""


class RedisStore:
    """Node records, leases, backoffs and load in Redis; a pub/sub-fed view in this tracker."""

    kind = "redis"

    def __init__(self, url: str, policy: RegistryPolicy, clock: Callable[[], float]) -> None:
        self.url = url
        self.policy = policy
        self._clock = clock
        self._view = SharedView(policy, self._send_failure)
        self.registry: Registry = self._view
        self.revocations = Revocations()
        common: dict[str, Any] = {"decode_responses": True, "socket_timeout": REDIS_TIMEOUT_S,
                                  "socket_connect_timeout": REDIS_TIMEOUT_S}
        # Commands retry once: a pooled connection broken by a Redis restart is reopened, not an error.
        self._redis: Redis = Redis.from_url(url, retry=Retry(NoBackoff(), 1), max_connections=MAX_CONNECTIONS,
                                            **common)
        # The channel never retries by itself: a lost subscription must reload the view, not resume silently.
        self._sub: Redis = Redis.from_url(url, retry=Retry(NoBackoff(), 0), **common)
        self._db = int(self._redis.connection_pool.connection_kwargs.get("db", 0) or 0)
        self._register = self._redis.register_script(scripts.REGISTER)
        self._deregister = self._redis.register_script(scripts.DEREGISTER)
        self._failure = self._redis.register_script(scripts.FAILURE)
        self._swap = self._redis.register_script(scripts.SWAP)
        self._down: str | None = "not connected yet"
        self._epoch: str | None = None
        self._applied = 0
        self._delivered = asyncio.Event()
        self._reload_lock = asyncio.Lock()
        self._pending: list[tuple[str, str]] = []
        self._next_read: asyncio.Future[tuple[str | None, str | None]] | None = None
        self._read_lock = asyncio.Lock()
        """Channel messages that arrived while a reload read Redis, applied after it in their order."""
        self._listener: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self.ratings = RedisRatings(self._redis, PREFIX, spawner(self._background))
        """Measured speeds, shared with every tracker of the store (:mod:`.redis_judgement`)."""
        self._closing = False
        """Set by :meth:`close`: the listener returns rather than reconnect, even if its cancellation was lost."""
        self._connected = asyncio.Event()

    # --- keys -----------------------------------------------------------------------------------

    @staticmethod
    def _key(kind: str, node_id: str | None = None) -> str:
        """``meshnet:{kind}`` or, with a node id, ``meshnet:{kind}:{node_id}`` (``""``: the prefix of such keys)."""
        return f"{PREFIX}{kind}" if node_id is None else f"{PREFIX}{kind}:{node_id}"

    @property
    def _channel(self) -> str:
        return self._key("events")

    @property
    def _revocation_channel(self) -> str:
        return self._key("revocations")

    @property
    def _expired_channel(self) -> str:
        return f"__keyevent@{self._db}__:expired"

    @property
    def _lease_ms(self) -> int:
        return ms(self.policy.ttl_s + LEASE_GRACE_S)

    @property
    def _record_ms(self) -> int:
        return ms(self.policy.ttl_s + LEASE_GRACE_S + self.policy.offline_keep_s)

    @property
    def available(self) -> bool:
        return self._down is None

    # --- lifespan --------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start listening; returns once the view is loaded, or after one connect timeout (then: away)."""
        self._listener = asyncio.create_task(self._listen(), name="redis-store-listener")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._connected.wait(), REDIS_TIMEOUT_S * 2)
        if self._down:
            logger.warning("store %s is away (%s): the tracker answers 503 until it is back", redact(self.url),
                           self._down)

    async def close(self) -> None:
        """Stop the listener and background writes, then the connections.

        redis-py's ``get_message(timeout=...)`` can turn a cancellation that
        lands inside its own timeout into a ``TimeoutError`` (a ``RedisError``),
        which the listener takes for a lost connection: awaiting the task after
        one ``cancel()`` then waited for ever (a tracker's shutdown hung, and
        so did a test under load). So the listener also watches
        ``_closing``, and every task is cancelled again until it ends.
        """
        self._closing = True
        tasks = [t for t in (self._listener, *self._background) if t is not None]
        while pending := [task for task in tasks if not task.done()]:
            for task in pending:
                task.cancel()
            await asyncio.wait(pending, timeout=CLOSE_RETRY_S)
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                task.result()
        await self._redis.aclose()
        await self._sub.aclose()

    # --- writes ------------------------------------------------------------------------------------

    async def register(self, registration: NodeRegistration, lease: str | None, now: float) -> Registered:
        node_id = registration.node_id
        body = registration.model_dump_json()
        answer = await self._call(
            self._register,
            [self._key("lease", node_id), self._key("node", node_id), self._key("nodes"), self._key("version")],
            [lease or "", secrets.token_urlsafe(LEASE_BYTES), body, self._lease_ms, self._record_ms,
             self.policy.max_nodes, self._channel, node_id, self._key("node", ""), self._key("lease", ""),
             ms(LEASE_GRACE_S)],
        )
        if answer[0] == "conflict":
            expires_in = max(int(answer[1]), 0) / 1000 - LEASE_GRACE_S
            endpoint = endpoint_of(answer[2])
            what = "the lease sent is not its" if lease is not None else "send its lease"
            raise LeaseConflict(
                f"node id {node_id!r} is held by a live node (at {endpoint}) under a lease; {what} in "
                f"{LEASE_HEADER}, choose another id, or register after the entry expires "
                f"(in {max(expires_in, 0.0):.1f} s without a heartbeat)")
        if answer[0] == "full":
            raise RegistryFull(f"the mesh already holds {self.policy.max_nodes} live nodes")
        _, granted, fresh, version, heartbeats = answer
        self._apply_node(registration, granted, int(heartbeats), int(version), now)
        if int(fresh):
            logger.info("node %s registered: %s, layers %d-%d of %s", node_id, registration.endpoint,
                        registration.shard_start, registration.shard_end, registration.model)
        return Registered(granted, new_lease=bool(int(fresh)))

    async def deregister(self, node_id: str, lease: str | None, now: float) -> None:
        answer = await self._call(
            self._deregister, [self._key("lease", node_id), self._key("node", node_id), self._key("version")],
            [lease or "", ms(self.policy.offline_keep_s), self._channel, node_id])
        if answer[0] == "unknown":
            raise UnknownNode(f"no node {node_id!r} is registered")
        if answer[0] == "missing":
            raise LeaseRequired(f"leaving needs node {node_id!r}'s lease in {LEASE_HEADER}")
        if answer[0] == "wrong":
            raise LeaseRequired(f"the lease in {LEASE_HEADER} is not node {node_id!r}'s")
        self.registry.apply_offline(node_id, now)
        logger.info("node %s left", node_id)

    async def report_failure(self, node_id: str, reason: str, now: float) -> float:
        reason = reason[:MAX_REASON_CHARS]
        answer = await self._call(
            self._failure, [self._key("node", node_id), self._key("failures", node_id), self._key("backoff", node_id),
                            self._key("version")],
            [reason, ms(self.policy.backoff_s), ms(self.policy.backoff_max_s), ms(self.policy.failure_reset_s),
             self._channel, node_id])
        if answer[0] == "unknown":
            raise UnknownNode(f"no node {node_id!r} is registered")
        backoff_s = int(answer[1]) / 1000
        self.registry.apply_failure(node_id, reason, self._failures_of(node_id), backoff_s, now)
        logger.warning("node %s reported failing (%s): backing off %.1f s", node_id, reason, backoff_s)
        return backoff_s

    def _failures_of(self, node_id: str) -> int:
        info = next((n for n in self.registry.snapshot(self._clock()) if n.node_id == node_id), None)
        return info.failures if info is not None else 0

    def _send_failure(self, node_id: str, reason: str) -> None:
        """Write a failure the front door reported to the view on to Redis (in the background)."""
        async def send() -> None:
            with contextlib.suppress(StoreUnavailable, UnknownNode):
                await self.report_failure(node_id, reason, self._clock())

        with contextlib.suppress(RuntimeError):  # no running loop: nothing to send from
            task = asyncio.get_running_loop().create_task(send())
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _call(self, script: Any, keys: list[str], args: list[Any]) -> list[Any]:
        if self._down is not None:
            raise StoreUnavailable(self._down)
        try:
            answer: list[Any] = await script(keys=keys, args=args)
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"store {redact(self.url)} unreachable: {exc}") from None
        return answer

    async def evict(self, node_id: str, now: float) -> bool:
        lease = await self._command(self._redis.hget(self._key("node", node_id), "lease"))
        if not lease:
            return False
        try:
            await self.deregister(node_id, lease, now)
        except (UnknownNode, LeaseRequired):
            return False
        return True

    async def revoke_node(self, node_id: str, at: float) -> None:
        """Write the revocation to the shared hash and publish it; drop what is past the book's bounds."""
        self.revocations.add(node_id, at)
        await self._publish_revocation(node_id, at)
        stored = _revoked_times(await self._command(self._redis.hgetall(self._key("revoked"))))
        book = Revocations()
        book.replace(stored, time.time())
        if stale := set(stored) - book.among(stored):
            await self._command(self._redis.hdel(self._key("revoked"), *stale))

    async def lift_revocation(self, node_id: str) -> None:
        self.revocations.discard(node_id)
        await self._publish_revocation(node_id, None)

    async def _publish_revocation(self, node_id: str, at: float | None) -> None:
        async def write() -> None:
            async with self._redis.pipeline(transaction=True) as pipe:
                if at is None:
                    pipe.hdel(self._key("revoked"), node_id)
                else:
                    pipe.hset(self._key("revoked"), node_id, repr(at))
                pipe.publish(self._revocation_channel, json.dumps({"node_id": node_id, "at": at}))
                await pipe.execute()

        await self._command(write())

    def _apply_revocation(self, data: str) -> None:
        try:
            event = json.loads(data)
            node_id, at = str(event["node_id"]), event["at"]
        except (ValueError, KeyError, TypeError):
            logger.warning("dropped a malformed revocation event: %.200s", data)
            return
        if at is None:
            self.revocations.discard(node_id)
        elif isinstance(at, (int, float)):
            logger.info("node %s's join token was revoked (published in the store): its streams move", node_id)
            self.revocations.add(node_id, float(at))

    # --- trust ----------------------------------------------------------------------------------------

    async def _command(self, awaitable: Any) -> Any:
        if self._down is not None:
            raise StoreUnavailable(self._down)
        try:
            return await awaitable
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"store {redact(self.url)} unreachable: {exc}") from None

    async def read_doc(self, name: str) -> str | None:
        value = await self._command(self._redis.get(self._key("doc", name)))
        return value or None

    async def swap_doc(self, name: str, expected: str | None, new: str) -> bool:
        answer = await self._call(self._swap, [self._key("doc", name)], [expected or "", new])
        return bool(int(answer))  # type: ignore[call-overload]

    async def put_token(self, record: JoinTokenRecord) -> None:
        key = self._key("join_tokens")
        known = await self._command(self._redis.hexists(key, record.token_id))
        if not known and int(await self._command(self._redis.hlen(key))) >= MAX_TOKENS:
            raise ValueError(f"the mesh already keeps {MAX_TOKENS} join tokens; revoke and prune some")
        await self._command(self._redis.hset(key, record.token_id, record.model_dump_json()))

    async def get_token(self, token_id: str) -> JoinTokenRecord | None:
        raw = await self._command(self._redis.hget(self._key("join_tokens"), token_id))
        return None if not raw else JoinTokenRecord.parse(raw)

    async def all_tokens(self) -> list[JoinTokenRecord]:
        raw = await self._command(self._redis.hvals(self._key("join_tokens")))
        return [record for text in raw[:MAX_TOKENS] if (record := JoinTokenRecord.parse(text)) is not None]

    # --- reads -------------------------------------------------------------------------------------

    async def fresh(self) -> None:
        if self._down is not None:
            raise StoreUnavailable(self._down)
        try:
            version, epoch = await self._read_version()
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"store {redact(self.url)} unreachable: {exc}") from None
        if epoch is None or epoch != self._epoch:
            logger.info("store epoch changed (Redis restarted or was emptied): reloading the view")
            await self._reload()
            return
        wanted = int(version or 0)
        if self._applied >= wanted:
            return
        try:
            await asyncio.wait_for(self._delivered_up_to(wanted), CATCH_UP_S)
        except TimeoutError:
            logger.warning("the store's channel is %d changes behind: reloading the view", wanted - self._applied)
            await self._reload()

    async def _read_version(self) -> tuple[str | None, str | None]:
        """``version`` and ``epoch``, read by one ``MGET`` sent after this call began.

        Callers that arrive while a read is in flight share the next one (each
        still sees Redis as it was after it arrived), so a busy tracker sends
        one ``MGET`` per round trip rather than one per request.
        """
        shared = self._next_read
        if shared is None:
            shared = self._next_read = asyncio.get_running_loop().create_future()
            task = asyncio.create_task(self._send_read(shared))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        return await asyncio.shield(shared)

    async def _send_read(self, shared: asyncio.Future[tuple[str | None, str | None]]) -> None:
        async with self._read_lock:  # one read in flight; whoever asks meanwhile joins the next
            if self._next_read is shared:
                self._next_read = None
            try:
                version, epoch = await self._redis.mget(self._key("version"), self._key("epoch"))
            except BaseException as exc:
                shared.set_exception(exc if isinstance(exc, Exception) else RedisError("read cancelled"))
                shared.exception()  # retrieved here too: nobody may be left to await it
                if not isinstance(exc, Exception):
                    raise
                return
            shared.set_result((version, epoch))

    async def _delivered_up_to(self, version: int) -> None:
        while self._applied < version:
            delivered = self._delivered
            await delivered.wait()

    def failure_gate(self, window_s: float) -> Gate:
        """The failure reports' gate in this Redis, shared by every tracker of the mesh."""
        return RedisGate(self._redis, PREFIX, window_s)

    def key_limiter(self, requests_per_minute: int, max_streams: int) -> KeyLimiter:
        """The API keys' limits in this Redis, shared by every tracker of the mesh."""
        return RedisKeyLimiter(self._redis, PREFIX, requests_per_minute, max_streams)

    async def health(self) -> StoreHealth:
        if self._down is not None:
            return StoreHealth(ok=False, reason=self._down)
        try:
            await self._redis.ping()
        except (RedisError, OSError) as exc:
            return StoreHealth(ok=False, reason=f"store {redact(self.url)} unreachable: {exc}")
        return StoreHealth(ok=True)

    # --- the view ------------------------------------------------------------------------------------

    async def _reload(self) -> None:
        """Load the whole view from Redis (on connect, after a restart, or when the channel fell behind)."""
        async with self._reload_lock:
            try:
                await self._redis.set(self._key("epoch"), secrets.token_hex(8), nx=True)
                version, epoch = await self._redis.mget(self._key("version"), self._key("epoch"))
                ids = sorted(await self._redis.smembers(self._key("nodes")))
                async with self._redis.pipeline(transaction=False) as pipe:
                    for node_id in ids:
                        pipe.hgetall(self._key("node", node_id))
                        pipe.pttl(self._key("lease", node_id))
                        pipe.pttl(self._key("backoff", node_id))
                        pipe.get(self._key("failures", node_id))
                        pipe.hgetall(self.ratings.key(node_id))
                    rows = await pipe.execute()
                revoked = await self._redis.hgetall(self._key("revoked"))
            except (RedisError, OSError) as exc:
                raise StoreUnavailable(f"store {redact(self.url)} unreachable: {exc}") from None
            held = self._view.load(
                [NodeRow(node_id, *rows[5 * index: 5 * index + 4]) for index, node_id in enumerate(ids)],
                self._lease_ms, self._clock())
            self.ratings.load(ids, [rows[5 * index + 4] for index in range(len(ids))])
            self.revocations.replace(_revoked_times(revoked), time.time())
            self._epoch = epoch
            self._applied = int(version or 0)
            pending, self._pending = self._pending, []
            for channel, data in pending:  # newer than (or as new as) what was read: they win, in order
                self._apply_event(channel, data)
            self._wake()
            logger.info("store view loaded from %s: %d nodes (version %d)", redact(self.url), held,
                        self._applied)

    def _apply_node(self, registration: NodeRegistration, lease: str, heartbeats: int, version: int,
                    now: float) -> None:
        self._view.apply_record_safely(registration, lease, heartbeats, now)
        self._applied = max(self._applied, version)
        self._wake()

    def _wake(self) -> None:
        delivered, self._delivered = self._delivered, asyncio.Event()
        delivered.set()

    def _on_event(self, channel: str, data: str) -> None:
        """Apply one channel message, or hold it while a reload reads Redis (it must not be overwritten)."""
        if self._reload_lock.locked():
            if len(self._pending) < MAX_PENDING_EVENTS:
                self._pending.append((channel, data))
            return  # past the bound the reload's own read is at most one reload behind: the fence catches up
        self._apply_event(channel, data)

    def _apply_event(self, channel: str, data: str) -> None:
        now = self._clock()
        if channel == self._revocation_channel:
            self._apply_revocation(data)
            return
        if channel == self.ratings.channel:
            self.ratings.apply_event(data)
            return
        if channel == self._expired_channel:
            prefix = self._key("lease", "")
            if data.startswith(prefix):
                node_id = data[len(prefix):]
                logger.info("node %s: its lease expired in Redis", node_id)
                self.registry.apply_offline(node_id, now)
            return
        version = self._view.apply_event(data, now)
        if version is not None:
            self._applied = max(self._applied, version)
            self._wake()

    async def _listen(self) -> None:
        """Subscribe, load the view, apply every change as it comes; on loss, say so and start over."""
        delay = RECONNECT_MIN_S
        while True:
            try:
                async with self._sub.pubsub(ignore_subscribe_messages=True) as pubsub:
                    await pubsub.subscribe(self._channel, self._expired_channel, self._revocation_channel,
                                           self.ratings.channel)
                    await self._enable_expiry_events()
                    self._epoch = None
                    await self._reload()
                    if self._down is not None:
                        logger.info("store %s connected", redact(self.url))
                    self._down = None
                    self._connected.set()
                    delay = RECONNECT_MIN_S
                    while True:
                        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=POLL_S)
                        if message is None:
                            await pubsub.ping()
                            continue
                        if message.get("type") == "message":
                            self._on_event(str(message["channel"]), str(message["data"]))
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError, StoreUnavailable) as exc:
                if self._closing:  # a cancellation redis-py turned into a timeout (see close)
                    return
                reason = f"store {redact(self.url)} unreachable: {exc}"
                if self._down is None:
                    logger.warning("%s; answering 503 until it is back", reason)
                self._down = reason
                self._connected.clear()
            await asyncio.sleep(delay)
            delay = min(delay * 2, RECONNECT_MAX_S)

    async def _enable_expiry_events(self) -> None:
        """Ask Redis for ``expired`` keyspace events (best effort: a managed Redis may forbid ``CONFIG``)."""
        try:
            current = (await self._sub.config_get("notify-keyspace-events")).get("notify-keyspace-events", "")
            wanted = "".join(sorted(set(current) | {"E", "x"}))
            if not {"E", "x"} <= set(current) and "A" not in current:
                await self._sub.config_set("notify-keyspace-events", wanted)
        except RedisError as exc:
            logger.warning("could not enable Redis expiry events (%s): expired leases leave this tracker's "
                           "view by its own clock, %.1f s before their keys", exc, LEASE_GRACE_S)


def _revoked_times(raw: dict[str, str]) -> dict[str, float]:
    """The ``revoked`` hash as node id to wall time (entries that are not a number are dropped)."""
    out: dict[str, float] = {}
    for node_id, text in raw.items():
        with contextlib.suppress(ValueError):
            out[node_id] = float(text)
    return out
