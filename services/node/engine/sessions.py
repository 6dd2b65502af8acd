"""The session table of one node: a KV cache per session, and the KV budget.

A session is one generation passing through this node. It owns this node's
KV cache for the session's tokens, the step counter that orders its frames,
the tokens of KV it reserved, when it was last used, and a lock that
serialises its steps. The tail also keeps the session's sampler here.

The budget is counted in KV tokens *reserved*, not used: a session reserves
``prompt + max_tokens`` when it opens, so a node never admits more sessions
than it can finish, and refuses a new one up front (the caller answers 503
with ``Retry-After``) instead of running out of memory half way. A session
that outgrows its reservation may grow while the budget has room.

A session is freed when it is closed, or by the idle sweeper after
``idle_timeout_s`` without a step (a head that vanished must not pin memory).

A prefill node's session of a prefill/decode handoff (:attr:`Session.hold`)
is *held* once its prompt ran (:meth:`SessionTable.hold`): decode nodes pull
its KV, and it is freed when every layer was pulled or ``handoff_ttl_s`` after
it was held, whichever comes first. The table counts held sessions and their
bytes, which the node bounds.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Final, Literal, Protocol

from services.node.sampling.sampler import Sampler

logger = logging.getLogger(__name__)

RETRY_AFTER_S: Final = 2
"""What a refused session is told to wait before trying again (``Retry-After``)."""
SWEEP_INTERVAL_MAX_S: Final = 5.0
"""The idle sweeper looks at least this often (more often for short idle timeouts)."""

RefusalCode = Literal["kv_budget", "too_many_sessions", "draining"]
LOG_TAG_CHARS: Final = 12
"""Hex characters of a session's log tag (48 bits: unique enough to follow one session through logs)."""


def log_tag(session_id: str) -> str:
    """What logs show of a session: a short hash, never the id.

    A session id is the key that steps or closes a session, so logs (read by
    more people than the mesh's operators) must not hand it out.
    """
    return "s#" + hashlib.sha256(session_id.encode("utf-8")).hexdigest()[:LOG_TAG_CHARS]


def route_key(route_token: str) -> str:
    """The fingerprint of a signed route a session is bound to (see :attr:`Session.route_key`)."""
    return hashlib.sha256(route_token.encode("utf-8")).hexdigest()


class KVCache(Protocol):
    """What the table needs of a session's cache (``services.node.model.shard.ShardCache``)."""

    @property
    def seq_len(self) -> int: ...

    def nbytes(self) -> int: ...

    def truncate(self, length: int) -> None: ...


class SessionRefused(Exception):
    """A session cannot be opened or grown here now; answer 503 with ``Retry-After``."""

    def __init__(self, code: RefusalCode, message: str, retry_after_s: int = RETRY_AFTER_S) -> None:
        super().__init__(message)
        self.code: RefusalCode = code
        self.retry_after_s = retry_after_s


class SessionExists(Exception):
    """A session with this id is already open on this node."""


@dataclass(eq=False)
class Session:
    """One session on this node. Mutated only by the holder of :attr:`lock`."""

    session_id: str
    cache: KVCache
    reserved_tokens: int
    last_used: float
    next_step: int = 0
    """The ``X-Meshnet-Step`` the next frame must carry."""
    sampler: Sampler | None = None
    """The tail's sampler, created on the first frame that samples."""
    replayed_ids: list[int] = field(default_factory=list)
    """At the tail of a replayed grammar-constrained session: the generated ids its frames carried
    (``X-Meshnet-Sample-Ids``), fed to the grammar when the sampler is created."""
    closed: bool = False
    route_key: str | None = None
    """Fingerprint of the signed route that opened the session (``None``: a head's own session).
    Only frames carrying that same route may step or close it, so a route token for another
    request, even a validly signed or expired one, cannot touch this session."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    hold: bool = False
    """A prefill route's session: its KV is kept for decode nodes to pull once its prompt ran."""
    held_until: float | None = None
    """When a held session is freed if it was not pulled whole (``None``: not held yet)."""
    pulled_layers: set[int] = field(default_factory=set)
    """Layers whose KV a decode node has pulled to the end."""
    handoff_for: str | None = None
    """A held session: the digest of the decode route it is held for (only that route's nodes may pull it)."""
    pull_proofs: set[bytes] = field(default_factory=set)
    """The signatures of the pulls answered (a replayed pull is refused)."""

    @property
    def position(self) -> int:
        """Tokens the session's KV cache holds: the position of its next token."""
        return self.cache.seq_len


class SessionTable:
    """The open sessions of a node, with KV budget accounting and idle expiry.

    Used from the event loop only (no thread safety needed); tensors live in
    the caches, which only the compute worker touches.
    """

    def __init__(self, *, kv_budget_tokens: int, max_sessions: int, idle_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic, handoff_ttl_s: float | None = None) -> None:
        self.kv_budget_tokens = kv_budget_tokens
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
        self.handoff_ttl_s = handoff_ttl_s
        self.on_handoff_expired: Callable[[int], None] | None = None
        """Called with the number of held handoffs a sweep freed unpulled."""
        self._clock = clock
        self._sessions: dict[str, Session] = {}
        self._draining = False

    # --- figures ------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._sessions

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._sessions.values()))

    @property
    def reserved_tokens(self) -> int:
        """KV tokens reserved by all open sessions."""
        return sum(s.reserved_tokens for s in self._sessions.values())

    @property
    def free_tokens(self) -> int:
        """KV tokens a new session could still reserve."""
        return max(0, self.kv_budget_tokens - self.reserved_tokens)

    @property
    def used_tokens(self) -> int:
        """KV tokens actually held in caches now."""
        return sum(s.position for s in self._sessions.values())

    def cache_bytes(self) -> int:
        """Bytes of key/value tensors held by all open sessions."""
        return sum(s.cache.nbytes() for s in self._sessions.values())

    @property
    def handoffs(self) -> int:
        """Sessions kept (or being prefilled) for a handoff."""
        return sum(s.hold for s in self._sessions.values())

    def handoff_bytes(self) -> int:
        """Bytes of KV the handoff sessions take."""
        return sum(s.cache.nbytes() for s in self._sessions.values() if s.hold)

    def hold(self, session: Session) -> None:
        """Keep ``session``'s KV for a handoff, until pulled or ``handoff_ttl_s`` from now."""
        session.hold = True
        ttl = self.handoff_ttl_s if self.handoff_ttl_s is not None else self.idle_timeout_s
        session.held_until = self._clock() + ttl

    @property
    def draining(self) -> bool:
        return self._draining

    def drain(self) -> None:
        """Refuse new sessions from now on (shutdown); open ones may finish."""
        self._draining = True

    # --- lifecycle ------------------------------------------------------------------

    def open(self, session_id: str, reserve_tokens: int, cache: KVCache, route_key: str | None = None) -> Session:
        """Open ``session_id`` reserving ``reserve_tokens`` of KV, or refuse it.

        Raises :class:`SessionRefused` when draining, at ``max_sessions``, or
        when the reservation does not fit the budget; :class:`SessionExists`
        when the id is taken.
        """
        if self._draining:
            raise SessionRefused("draining", "this node is shutting down and takes no new sessions")
        if session_id in self._sessions:
            raise SessionExists(f"session {session_id} is already open on this node")
        if len(self._sessions) >= self.max_sessions:
            raise SessionRefused("too_many_sessions",
                                 f"this node holds its maximum of {self.max_sessions} sessions")
        reserve = max(1, reserve_tokens)
        if reserve > self.free_tokens:
            raise SessionRefused(
                "kv_budget",
                f"session needs {reserve} KV tokens, this node has {self.free_tokens} of "
                f"{self.kv_budget_tokens} free",
            )
        session = Session(session_id=session_id, cache=cache, reserved_tokens=reserve, last_used=self._clock(),
                          route_key=route_key)
        self._sessions[session_id] = session
        logger.debug("opened session %s reserving %d KV tokens", log_tag(session_id), reserve)
        return session

    def get(self, session_id: str) -> Session | None:
        """The open session ``session_id``, or ``None``."""
        return self._sessions.get(session_id)

    def touch(self, session: Session) -> None:
        """Mark ``session`` as used now (postpones its idle expiry)."""
        session.last_used = self._clock()

    def ensure_room(self, session: Session, tokens_after_step: int) -> None:
        """Grow ``session``'s reservation to ``tokens_after_step`` if needed and the budget allows.

        Raises :class:`SessionRefused` (``kv_budget``) when it does not fit.
        """
        extra = tokens_after_step - session.reserved_tokens
        if extra <= 0:
            return
        if extra > self.free_tokens:
            raise SessionRefused(
                "kv_budget",
                f"session {session.session_id} would hold {tokens_after_step} KV tokens, over its "
                f"reservation of {session.reserved_tokens}, and this node has {self.free_tokens} free",
            )
        session.reserved_tokens = tokens_after_step

    def close(self, session_id: str) -> bool:
        """Free ``session_id``'s KV cache and reservation; ``False`` when it was not open."""
        session = self._sessions.pop(session_id, None)
        if session is None:
            return False
        session.closed = True
        session.sampler = None
        logger.debug("closed session %s after %d tokens", log_tag(session_id), session.position)
        return True

    def sweep(self) -> list[str]:
        """Close every session idle for ``idle_timeout_s`` and not mid-step; their ids."""
        now = self._clock()
        handoffs = [
            s.session_id for s in self._sessions.values()
            if s.held_until is not None and now >= s.held_until and not s.lock.locked()
        ]
        expired = [
            s.session_id for s in self._sessions.values()
            if now - s.last_used >= self.idle_timeout_s and not s.lock.locked() and s.session_id not in handoffs
        ]
        for session_id in handoffs + expired:
            self.close(session_id)
        if handoffs:
            logger.info("freed %d handoff(s) never pulled whole: %s", len(handoffs), ", ".join(map(log_tag, handoffs)))
            if self.on_handoff_expired is not None:
                self.on_handoff_expired(len(handoffs))
        if expired:
            logger.info("closed %d idle session(s): %s", len(expired), ", ".join(map(log_tag, expired)))
        return expired

    def sweep_interval_s(self) -> float:
        """How often the sweeper looks: a quarter of the idle timeout (or handoff TTL), at most
        :data:`SWEEP_INTERVAL_MAX_S`."""
        shortest = self.idle_timeout_s if self.handoff_ttl_s is None else min(self.idle_timeout_s, self.handoff_ttl_s)
        return min(SWEEP_INTERVAL_MAX_S, shortest / 4)


async def run_sweeper(table: SessionTable, on_expired: Callable[[int], None] | None = None) -> None:
    """Close idle sessions forever (cancel the task to stop); ``on_expired(n)`` after each sweep that closed some."""
    while True:
        await asyncio.sleep(table.sweep_interval_s())
        try:
            expired = table.sweep()
            if expired and on_expired is not None:
                on_expired(len(expired))
        except Exception:  # a sweeper that dies would leak every later idle session
            logger.exception("idle sweep failed")
