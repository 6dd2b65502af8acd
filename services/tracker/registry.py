"""The tracker's registry: which nodes exist, what they hold, and which may carry traffic.

Pure state, no I/O and no clock of its own: every method takes ``now``
(seconds on a monotonic clock), so tests drive time by hand and the rules
below are exact.

Leases. A node's first registration gets a random lease; its heartbeats (the
same body, re-posted) carry it back. Registering an id that is live under
another lease, or without one, is refused (:class:`LeaseConflict`), whatever
endpoint it names: endpoints are public, so knowing one proves nothing. A
node that restarted without its lease waits until its old entry expires
(``ttl_s``) or leaves it with its lease on the way down. Leaving
(:meth:`Registry.deregister`) needs the lease too (:class:`LeaseRequired`).
An id whose node has gone offline may be registered again by anyone.

Layer counts. Nodes of one model may report different ``num_layers``; the
model's count is the one the most live nodes report (a tie goes to the count
more live nodes' layer ranges fit in, then to the count whose reporter has
held its lease longest, so the answer does not flap), and a node reporting
another count is listed but kept out of routes. So no single
registration fixes a model's shape for everyone, and a count nobody live
reports any more is forgotten with its last reporter's lease.

States. ``joining`` (registered, no heartbeat yet), ``online``, ``suspect``
(silent for longer than ``suspect_s``, or serving a failure backoff) and
``offline`` (silent for longer than ``ttl_s``, or deregistered). Every state
but ``offline`` is routable (for a node that agrees on its model's layer
count). Offline nodes stay listed for ``offline_keep_s``
so an operator sees what died, then are forgotten.

Failures. A head that cannot reach a hop reports it; the node then serves a
backoff that doubles with each report in a run (``backoff_s``,
``2 x backoff_s``, ... up to ``backoff_max_s``); reports that arrive while a
backoff runs do not lengthen it (several heads report one failure), and a node
without a report for ``failure_reset_s`` starts over. A node in backoff is
routed through only where nobody else holds its layers (see :mod:`.planner`);
once its backoff ends it is back, and a restarted node (new lease) starts clean.

What it shows of each node and model (:meth:`Registry.snapshot`, :meth:`Registry.coverage`) is
:mod:`.node_views`.
"""

from __future__ import annotations

import hmac
import logging
import secrets
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from meshwire.headers import LEASE as LEASE_HEADER
from meshwire.registry import NodeRegistration, NodeState

from .failure_kinds import failure_kind
from .node_views import ModelCoverage, NodeInfo
from .planner import Candidate, layer_holders, missing_layers

logger = logging.getLogger(__name__)

LEASE_BYTES: Final = 24
"""Random bytes in a lease (32 URL-safe characters)."""
MAX_REASON_CHARS: Final = 512
"""Longest failure reason kept."""


class RegistryError(Exception):
    """A registry operation was refused; ``status`` and ``code`` say how to answer over HTTP."""

    status: int = 400
    code: str = "registry_error"


class LeaseConflict(RegistryError):
    """The id is live under another lease: a node cannot take another node's id."""

    status = 409
    code = "lease_conflict"


class LeaseRequired(RegistryError):
    """Leaving needs the node's lease (missing or wrong): nobody else may remove a live node."""

    status = 403
    code = "lease_required"


class RegistryFull(RegistryError):
    """The registry holds ``max_nodes`` live nodes already."""

    status = 503
    code = "registry_full"


class UnknownNode(RegistryError):
    """No node with that id is registered."""

    status = 404
    code = "unknown_node"


@dataclass(frozen=True)
class RegistryPolicy:
    """The registry's clocks and bounds (see the module doc for what each does)."""

    ttl_s: float = 6.0
    suspect_s: float = 3.0
    offline_keep_s: float = 300.0
    max_nodes: int = 1024
    backoff_s: float = 5.0
    backoff_max_s: float = 60.0
    failure_reset_s: float = 120.0


@dataclass(frozen=True)
class Registered:
    """The outcome of a registration: the lease to heartbeat with, and whether it is new."""

    lease: str
    new_lease: bool


@dataclass
class _Entry:
    """What the registry keeps about one node id (mutable; never leaves this module)."""

    registration: NodeRegistration
    lease: str
    registered_at: float
    last_seen: float
    heartbeats: int = 0
    left_at: float | None = None
    failures: int = 0
    last_failure_at: float | None = None
    backoff_until: float = float("-inf")
    last_failure_reason: str | None = None
    inflight: int = 0


def _same(lease: str, expected: str) -> bool:
    """Constant-time lease comparison."""
    return hmac.compare_digest(lease.encode("utf-8"), expected.encode("utf-8"))


def _vote(voters: Sequence[_Entry], present: Sequence[_Entry]) -> int:
    """The ``num_layers`` most ``voters`` report.

    A tie goes to the count that more of the ``present`` nodes' ranges fit in
    (a node holding layer 5 contradicts a count of 4), then to the count whose
    reporter registered first (so the answer does not flap), then to the smaller.
    """
    tally: dict[int, tuple[int, float]] = {}
    for entry in voters:
        count = entry.registration.num_layers
        assert count is not None
        reporters, earliest = tally.get(count, (0, float("inf")))
        tally[count] = (reporters + 1, min(earliest, entry.registered_at))

    def rank(count: int) -> tuple[int, int, float, int]:
        fitting = sum(e.registration.shard_end < count for e in present)
        return (tally[count][0], fitting, -tally[count][1], -count)

    return max(tally, key=rank)


def model_basename(model: str) -> str:
    """The last path component of a model name: ``/models/tiny/`` and ``org/tiny`` -> ``tiny``."""
    return model.rstrip("/\\").replace("\\", "/").rsplit("/", 1)[-1]


def resolve_model_name(requested: str, known: Iterable[str]) -> str | None:
    """The known model ``requested`` names: an exact match, else the one whose basename matches.

    ``None`` when nothing matches or the basename is ambiguous.
    """
    names = set(known)
    if requested in names:
        return requested
    wanted = model_basename(requested)
    matches = [name for name in names if model_basename(name) == wanted]
    return matches[0] if len(matches) == 1 else None


class Registry:
    """Nodes by id, their leases, states and failure backoffs."""

    def __init__(self, policy: RegistryPolicy = RegistryPolicy(),
                 new_lease: Callable[[], str] = lambda: secrets.token_urlsafe(LEASE_BYTES)) -> None:
        self.policy = policy
        self._new_lease = new_lease
        self._entries: dict[str, _Entry] = {}

    # --- states ---------------------------------------------------------------------------

    def _is_offline(self, entry: _Entry, now: float) -> bool:
        return entry.left_at is not None or now - entry.last_seen > self.policy.ttl_s

    def _state(self, entry: _Entry, now: float) -> NodeState:
        if self._is_offline(entry, now):
            return "offline"
        if entry.backoff_until > now or now - entry.last_seen > self.policy.suspect_s:
            return "suspect"
        return "joining" if entry.heartbeats == 0 else "online"

    def state(self, node_id: str, now: float) -> NodeState | None:
        """The state of ``node_id``, or ``None`` if it is not listed."""
        self.prune(now)
        entry = self._entries.get(node_id)
        return None if entry is None else self._state(entry, now)

    def prune(self, now: float) -> None:
        """Forget nodes that have been offline for longer than ``offline_keep_s``."""
        keep = self.policy.offline_keep_s
        for node_id in [
            node_id for node_id, entry in self._entries.items()
            if self._is_offline(entry, now) and now - self._went_offline_at(entry) > keep
        ]:
            logger.info("forgetting node %s, offline for more than %.0f s", node_id, keep)
            del self._entries[node_id]

    def _went_offline_at(self, entry: _Entry) -> float:
        expired_at = entry.last_seen + self.policy.ttl_s
        return expired_at if entry.left_at is None else min(entry.left_at, expired_at)

    # --- registration ------------------------------------------------------------------------

    def register(self, registration: NodeRegistration, lease: str | None, now: float) -> Registered:
        """Register a node or take its heartbeat; answers the lease it must present next time.

        Raises :class:`LeaseConflict` (the id is live and ``lease`` is not
        its) or :class:`RegistryFull`, in which case nothing changes.
        """
        self.prune(now)
        node_id = registration.node_id
        entry = self._entries.get(node_id)
        holds_lease = entry is not None and lease is not None and _same(lease, entry.lease)
        if entry is not None and not holds_lease and not self._is_offline(entry, now):
            expires_in = max(self.policy.ttl_s - (now - entry.last_seen), 0.0)
            what = "the lease sent is not its" if lease is not None else "send its lease"
            raise LeaseConflict(
                f"node id {node_id!r} is held by a live node (at {entry.registration.endpoint}) under a "
                f"lease; {what} in {LEASE_HEADER}, choose another id, or register after the entry expires "
                f"(in {expires_in:.1f} s without a heartbeat)"
            )
        self._warn_on_layer_count(registration, now)
        if entry is not None and holds_lease:
            # A heartbeat, or the same process back after a silence: it keeps its lease and failures.
            if self._is_offline(entry, now):
                logger.info("node %s is back after %.1f s of silence", node_id, now - entry.last_seen)
            entry.registration, entry.last_seen, entry.left_at = registration, now, None
            entry.heartbeats += 1
            return Registered(entry.lease, new_lease=False)
        if entry is None:
            self._make_room(now)
        # A new node, or a new owner of an id whose node went offline (a tracker restart looks the same).
        fresh = _Entry(registration=registration, lease=self._new_lease(), registered_at=now, last_seen=now,
                       inflight=entry.inflight if entry is not None else 0)
        self._entries[node_id] = fresh
        logger.info("node %s registered: %s, layers %d-%d of %s", node_id, registration.endpoint,
                    registration.shard_start, registration.shard_end, registration.model)
        return Registered(fresh.lease, new_lease=True)

    def _warn_on_layer_count(self, registration: NodeRegistration, now: float) -> None:
        """Say so when a node's ``num_layers`` differs from its model's count (it will not be routed)."""
        if registration.num_layers is None:
            return
        counted = self._layer_counts(now).get(registration.model)
        if counted is not None and counted != registration.num_layers:
            logger.warning("node %s says %s has %d layers, but its other nodes say %d: it stays out of routes "
                           "unless more nodes agree with it", registration.node_id, registration.model,
                           registration.num_layers, counted)

    def _make_room(self, now: float) -> None:
        if len(self._entries) < self.policy.max_nodes:
            return
        offline = [(self._went_offline_at(e), node_id) for node_id, e in self._entries.items()
                   if self._is_offline(e, now)]
        if not offline:
            raise RegistryFull(f"the tracker already holds {self.policy.max_nodes} live nodes")
        del self._entries[min(offline)[1]]

    def lease_of(self, node_id: str) -> str | None:
        """The lease ``node_id`` is registered under, or ``None`` (for an eviction, see the store)."""
        entry = self._entries.get(node_id)
        return None if entry is None else entry.lease

    def deregister(self, node_id: str, lease: str | None, now: float) -> None:
        """Mark ``node_id`` offline now (it stays listed for ``offline_keep_s``).

        Needs the node's lease: raises :class:`UnknownNode` or :class:`LeaseRequired`.
        """
        self.prune(now)
        entry = self._entries.get(node_id)
        if entry is None:
            raise UnknownNode(f"no node {node_id!r} is registered")
        if lease is None:
            raise LeaseRequired(f"leaving needs node {node_id!r}'s lease in {LEASE_HEADER}")
        if not _same(lease, entry.lease):
            raise LeaseRequired(f"the lease in {LEASE_HEADER} is not node {node_id!r}'s")
        if entry.left_at is None:
            entry.left_at = now
            logger.info("node %s left", node_id)

    # --- failures ---------------------------------------------------------------------------

    def report_failure(self, node_id: str, reason: str, now: float) -> float:
        """Record that a caller could not use ``node_id``; answers the backoff's remaining seconds."""
        self.prune(now)
        entry = self._entries.get(node_id)
        if entry is None:
            raise UnknownNode(f"no node {node_id!r} is registered")
        entry.last_failure_reason = failure_kind(reason)
        if entry.backoff_until > now:
            return entry.backoff_until - now
        recent = entry.last_failure_at is not None and now - entry.last_failure_at <= self.policy.failure_reset_s
        entry.failures = entry.failures + 1 if recent else 1
        backoff = min(self.policy.backoff_s * 2 ** (entry.failures - 1), self.policy.backoff_max_s)
        entry.last_failure_at = now
        entry.backoff_until = now + backoff
        logger.warning("node %s reported failing (%s: %s): backing off %.1f s (failure %d in a row)",
                       node_id, entry.last_failure_reason, reason[:MAX_REASON_CHARS], backoff, entry.failures)
        return backoff

    # --- in-flight requests ---------------------------------------------------------------------

    def begin_request(self, node_ids: Iterable[str]) -> None:
        """Count a front-door request now using ``node_ids`` (the planner sees it as load)."""
        for node_id in node_ids:
            if (entry := self._entries.get(node_id)) is not None:
                entry.inflight += 1

    def end_request(self, node_ids: Iterable[str]) -> None:
        """Undo :meth:`begin_request`."""
        for node_id in node_ids:
            if (entry := self._entries.get(node_id)) is not None:
                entry.inflight = max(entry.inflight - 1, 0)

    # --- mirroring a shared store -----------------------------------------------------------------
    # A tracker on a shared store (see :mod:`.store.redis`) keeps this registry as its view of the
    # store: the store decides leases and expiry, and these methods copy its verdicts in, so the
    # planner and every view read one consistent, synchronous registry whichever store is used.

    def apply_record(self, registration: NodeRegistration, lease: str, heartbeats: int, now: float,
                     age_s: float = 0.0, left: bool = False) -> None:
        """Copy one node as the shared store holds it: last heard ``age_s`` ago, departed if ``left``.

        The entry keeps its first-seen time and in-flight count while its lease is unchanged; a
        new lease starts a new entry (a restarted node starts clean, as in :meth:`register`).
        """
        node_id = registration.node_id
        entry = self._entries.get(node_id)
        if entry is None or not _same(lease, entry.lease):
            if entry is None and len(self._entries) >= self.policy.max_nodes:
                self._make_room(now)
            entry = _Entry(registration=registration, lease=lease, registered_at=now - age_s,
                           last_seen=now - age_s, inflight=entry.inflight if entry is not None else 0)
            self._entries[node_id] = entry
        entry.registration, entry.heartbeats = registration, heartbeats
        entry.last_seen = now - age_s
        entry.left_at = (entry.left_at if entry.left_at is not None else now) if left else None

    def apply_offline(self, node_id: str, now: float) -> None:
        """The shared store says ``node_id``'s lease ended (it left, or its key expired): offline now."""
        entry = self._entries.get(node_id)
        if entry is not None and entry.left_at is None:
            entry.left_at = now

    def apply_failure(self, node_id: str, reason: str | None, failures: int, backoff_remaining_s: float,
                      now: float) -> None:
        """Copy a failure run as the shared store holds it (it decides the backoff, not this registry)."""
        entry = self._entries.get(node_id)
        if entry is None:
            return
        if reason is not None:
            entry.last_failure_reason = failure_kind(reason)
        if backoff_remaining_s > 0:
            entry.failures = failures
            entry.last_failure_at = now
            entry.backoff_until = now + backoff_remaining_s

    def forget(self, node_id: str) -> None:
        """Drop ``node_id`` from the view (the shared store no longer lists it)."""
        self._entries.pop(node_id, None)

    def node_ids(self) -> tuple[str, ...]:
        """Every listed node id."""
        return tuple(self._entries)

    # --- views --------------------------------------------------------------------------------------

    def models(self, now: float) -> dict[str, int]:
        """Every listed model and its number of layers (see the module doc for how nodes settle it)."""
        self.prune(now)
        return self._layer_counts(now)

    def _layer_counts(self, now: float) -> dict[str, int]:
        """Each listed model's layer count, by vote of its live nodes.

        Live nodes that report ``num_layers`` vote (ties: see :func:`_vote`).
        Without a live report the listed (offline) reports vote, for the
        record; without any, the count reaches up to the highest layer a live
        (else listed) node holds.
        """
        by_model: dict[str, list[_Entry]] = {}
        for entry in self._entries.values():
            by_model.setdefault(entry.registration.model, []).append(entry)
        counts: dict[str, int] = {}
        for model, entries in by_model.items():
            live = [e for e in entries if not self._is_offline(e, now)]
            present = live or entries
            voters = [e for e in live if e.registration.num_layers is not None] or \
                     [e for e in entries if e.registration.num_layers is not None]
            if voters:
                counts[model] = _vote(voters, present)
            else:
                counts[model] = max(e.registration.shard_end + 1 for e in (live or entries))
        return counts

    def _agrees(self, entry: _Entry, counts: dict[str, int]) -> bool:
        reg = entry.registration
        count = counts.get(reg.model)
        if count is None:
            return True
        return reg.shard_end < count and (reg.num_layers is None or reg.num_layers == count)

    def candidates(self, model: str, now: float) -> tuple[Candidate, ...]:
        """The routable nodes of ``model`` (live, agreeing on its layer count), with their load."""
        self.prune(now)
        counts = self._layer_counts(now)
        out: list[Candidate] = []
        for entry in self._entries.values():
            reg = entry.registration
            if reg.model != model or self._is_offline(entry, now) or not self._agrees(entry, counts):
                continue
            out.append(Candidate(
                node_id=reg.node_id, endpoint=reg.endpoint, shard_start=reg.shard_start, shard_end=reg.shard_end,
                relay_addr=reg.relay_addr, hop_key=reg.hop_key, active_sessions=max(reg.active_sessions, entry.inflight),
                kv_free_tokens=reg.kv_free_tokens, kv_capacity_tokens=reg.kv_capacity_tokens,
                decode_tokens_per_s=reg.decode_tokens_per_s, backoff=entry.backoff_until > now,
                failure_age_s=None if entry.last_failure_at is None else now - entry.last_failure_at,
                role=reg.role, pd_rank=reg.pd_rank,
            ))
        return tuple(out)

    def coverage(self, now: float) -> tuple[ModelCoverage, ...]:
        """Per model: its layers, which are missing, and how many routable nodes hold each."""
        out: list[ModelCoverage] = []
        for model, num_layers in sorted(self.models(now).items()):
            ranges = [(c.shard_start, c.shard_end) for c in self.candidates(model, now) if c.shard_end < num_layers]
            missing = missing_layers(ranges, num_layers)
            out.append(ModelCoverage(
                model=model, num_layers=num_layers, complete=not missing, missing=missing,
                layer_holders=layer_holders(ranges, num_layers), nodes_routable=len(ranges),
                nodes_listed=sum(e.registration.model == model for e in self._entries.values()),
            ))
        return tuple(out)

    def snapshot(self, now: float) -> tuple[NodeInfo, ...]:
        """Every listed node, by model then first layer then id."""
        self.prune(now)
        counts = self._layer_counts(now)
        infos = [self._info(entry, now, self._agrees(entry, counts)) for entry in self._entries.values()]
        return tuple(sorted(infos, key=lambda n: (n.model, n.shard_start, n.node_id)))

    def _info(self, entry: _Entry, now: float, agreed: bool) -> NodeInfo:
        reg = entry.registration
        state = self._state(entry, now)
        return NodeInfo(
            node_id=reg.node_id, model=reg.model, endpoint=reg.endpoint, shard_start=reg.shard_start,
            shard_end=reg.shard_end, num_layers=reg.num_layers, relay_addr=reg.relay_addr, dtype=reg.dtype,
            device=reg.device, weights=reg.weights, activations=reg.activations, rows_exact=reg.rows_exact,
            weight_bytes=reg.weight_bytes, kv_bytes=reg.kv_bytes,
            state=state, routable=state != "offline" and agreed, num_layers_agreed=agreed,
            active_sessions=reg.active_sessions,
            inflight_requests=entry.inflight, kv_free_tokens=reg.kv_free_tokens,
            kv_capacity_tokens=reg.kv_capacity_tokens, decode_tokens_per_s=reg.decode_tokens_per_s,
            last_heartbeat_age_s=round(max(now - entry.last_seen, 0.0), 3),
            registered_for_s=round(max(now - entry.registered_at, 0.0), 3), heartbeats=entry.heartbeats,
            failures=entry.failures, backoff_remaining_s=round(max(entry.backoff_until - now, 0.0), 3),
            last_failure_reason=entry.last_failure_reason, role=reg.role, pd_rank=reg.pd_rank, placement=reg.placement,
        )

    def __len__(self) -> int:
        return len(self._entries)
