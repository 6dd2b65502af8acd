"""The tracker's registry: which nodes exist, what they hold, and which may carry traffic.

Pure state, no I/O and no clock of its own: every method takes ``now``
(seconds on a monotonic clock), so tests drive time by hand and the rules
below are exact.

Leases. A node's first registration gets a random lease; its heartbeats (the
same body, re-posted) carry it back. Registering an id that is live under
another lease is refused (:class:`LeaseConflict`), so a node cannot take over
another node's id, with one exception: a node re-registering at the same
endpoint without its lease is that node restarted (nothing else can listen on
its address), and gets a fresh lease. An id whose node has gone offline may be
registered again by anyone.

States. ``joining`` (registered, no heartbeat yet), ``online``, ``suspect``
(silent for longer than ``suspect_s``, or serving a failure backoff) and
``offline`` (silent for longer than ``ttl_s``, or deregistered). Every state
but ``offline`` is routable. Offline nodes stay listed for ``offline_keep_s``
so an operator sees what died, then are forgotten.

Failures. A head that cannot reach a hop reports it; the node then serves a
backoff that doubles with each report in a run (``backoff_s``,
``2 x backoff_s``, ... up to ``backoff_max_s``); reports that arrive while a
backoff runs do not lengthen it (several heads report one failure), and a node
without a report for ``failure_reset_s`` starts over. A node in backoff is
routed through only where nobody else holds its layers (see :mod:`.planner`);
once its backoff ends it is back, and a restarted node (new lease) starts clean.
"""

from __future__ import annotations

import hmac
import logging
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Final

from pydantic import BaseModel

from meshwire.fields import STRICT_MODEL, DType
from meshwire.headers import LEASE as LEASE_HEADER
from meshwire.registry import NodeRegistration, NodeState

from .planner import Candidate, LayerRange, layer_holders, missing_layers

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


class LayerCountMismatch(RegistryError):
    """The node says its model has a different number of layers than the live nodes of that model."""

    status = 409
    code = "num_layers_mismatch"


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


class NodeInfo(BaseModel):
    """One node as ``GET /v1/nodes`` shows it: identity, shard, state, load and health."""

    model_config = STRICT_MODEL

    node_id: str
    model: str
    endpoint: str
    shard_start: int
    shard_end: int
    num_layers: int | None
    relay_addr: str | None
    dtype: DType | None
    device: str | None
    state: NodeState
    routable: bool
    active_sessions: int
    inflight_requests: int
    """Front-door requests the tracker is proxying through this node right now."""
    kv_free_tokens: int
    kv_capacity_tokens: int
    decode_tokens_per_s: float
    last_heartbeat_age_s: float
    registered_for_s: float
    """Seconds since this lease was first registered."""
    heartbeats: int
    failures: int
    """Failure reports in the current run."""
    backoff_remaining_s: float
    last_failure_reason: str | None


class ModelCoverage(BaseModel):
    """How well the routable nodes of one model cover its layers."""

    model_config = STRICT_MODEL

    model: str
    num_layers: int
    complete: bool
    """Whether a route exists right now."""
    missing: tuple[LayerRange, ...]
    """Inclusive layer ranges no routable node holds."""
    layer_holders: tuple[int, ...]
    """How many routable nodes hold each layer, layer 0 first."""
    nodes_routable: int
    nodes_listed: int


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

        Raises :class:`LeaseConflict`, :class:`LayerCountMismatch` or :class:`RegistryFull`,
        in which case nothing changes.
        """
        self.prune(now)
        node_id = registration.node_id
        entry = self._entries.get(node_id)
        holds_lease = entry is not None and lease is not None and _same(lease, entry.lease)
        if entry is not None and not holds_lease and not self._is_offline(entry, now):
            if registration.endpoint != entry.registration.endpoint:
                raise LeaseConflict(
                    f"node id {node_id!r} is registered by the node at {entry.registration.endpoint}; "
                    f"choose another id or send that node's lease in {LEASE_HEADER}"
                )
            logger.info("node %s re-registered at %s without its lease: treating it as restarted",
                        node_id, registration.endpoint)
        self._check_layer_count(registration, now)
        if entry is not None and holds_lease:
            # A heartbeat, or the same process back after a silence: it keeps its lease and failures.
            if self._is_offline(entry, now):
                logger.info("node %s is back after %.1f s of silence", node_id, now - entry.last_seen)
            entry.registration, entry.last_seen, entry.left_at = registration, now, None
            entry.heartbeats += 1
            return Registered(entry.lease, new_lease=False)
        if entry is None:
            self._make_room(now)
        # A new node, a node restarted at its own endpoint, or a new owner of an offline id.
        fresh = _Entry(registration=registration, lease=self._new_lease(), registered_at=now, last_seen=now,
                       inflight=entry.inflight if entry is not None else 0)
        self._entries[node_id] = fresh
        logger.info("node %s registered: %s, layers %d-%d of %s", node_id, registration.endpoint,
                    registration.shard_start, registration.shard_end, registration.model)
        return Registered(fresh.lease, new_lease=True)

    def _check_layer_count(self, registration: NodeRegistration, now: float) -> None:
        if registration.num_layers is None:
            return
        for other in self._entries.values():
            reg = other.registration
            if (reg.node_id != registration.node_id and reg.model == registration.model
                    and reg.num_layers is not None and reg.num_layers != registration.num_layers
                    and not self._is_offline(other, now)):
                raise LayerCountMismatch(
                    f"node {registration.node_id} says {registration.model} has {registration.num_layers} "
                    f"layers, but node {reg.node_id} says {reg.num_layers}"
                )

    def _make_room(self, now: float) -> None:
        if len(self._entries) < self.policy.max_nodes:
            return
        offline = [(self._went_offline_at(e), node_id) for node_id, e in self._entries.items()
                   if self._is_offline(e, now)]
        if not offline:
            raise RegistryFull(f"the tracker already holds {self.policy.max_nodes} live nodes")
        del self._entries[min(offline)[1]]

    def deregister(self, node_id: str, lease: str | None, now: float) -> None:
        """Mark ``node_id`` offline now (it stays listed for ``offline_keep_s``).

        A lease, when given, must be the node's; raises :class:`UnknownNode` or :class:`LeaseConflict`.
        """
        self.prune(now)
        entry = self._entries.get(node_id)
        if entry is None:
            raise UnknownNode(f"no node {node_id!r} is registered")
        if lease is not None and not _same(lease, entry.lease):
            raise LeaseConflict(f"the lease does not match node {node_id!r}'s")
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
        entry.last_failure_reason = reason[:MAX_REASON_CHARS]
        if entry.backoff_until > now:
            return entry.backoff_until - now
        recent = entry.last_failure_at is not None and now - entry.last_failure_at <= self.policy.failure_reset_s
        entry.failures = entry.failures + 1 if recent else 1
        backoff = min(self.policy.backoff_s * 2 ** (entry.failures - 1), self.policy.backoff_max_s)
        entry.last_failure_at = now
        entry.backoff_until = now + backoff
        logger.warning("node %s reported failing (%s): backing off %.1f s (failure %d in a row)",
                       node_id, entry.last_failure_reason, backoff, entry.failures)
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

    # --- views --------------------------------------------------------------------------------------

    def models(self, now: float) -> dict[str, int]:
        """Every listed model and its number of layers.

        The layer count is what the model's nodes report (live ones first); a
        model none of whose nodes reports it counts up to its highest held layer.
        """
        self.prune(now)
        reported: dict[str, tuple[bool, int]] = {}
        highest: dict[str, int] = {}
        for entry in self._entries.values():
            reg = entry.registration
            highest[reg.model] = max(highest.get(reg.model, 0), reg.shard_end + 1)
            if reg.num_layers is not None:
                live = not self._is_offline(entry, now)
                if reg.model not in reported or (live and not reported[reg.model][0]):
                    reported[reg.model] = (live, reg.num_layers)
        return {model: reported[model][1] if model in reported else count for model, count in highest.items()}

    def candidates(self, model: str, now: float) -> tuple[Candidate, ...]:
        """The routable nodes of ``model``, with their load as the planner weighs it."""
        self.prune(now)
        out: list[Candidate] = []
        for entry in self._entries.values():
            reg = entry.registration
            if reg.model != model or self._is_offline(entry, now):
                continue
            out.append(Candidate(
                node_id=reg.node_id, endpoint=reg.endpoint, shard_start=reg.shard_start, shard_end=reg.shard_end,
                relay_addr=reg.relay_addr, active_sessions=max(reg.active_sessions, entry.inflight),
                kv_free_tokens=reg.kv_free_tokens, kv_capacity_tokens=reg.kv_capacity_tokens,
                decode_tokens_per_s=reg.decode_tokens_per_s, backoff=entry.backoff_until > now,
                failure_age_s=None if entry.last_failure_at is None else now - entry.last_failure_at,
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
        infos = [self._info(entry, now) for entry in self._entries.values()]
        return tuple(sorted(infos, key=lambda n: (n.model, n.shard_start, n.node_id)))

    def _info(self, entry: _Entry, now: float) -> NodeInfo:
        reg = entry.registration
        state = self._state(entry, now)
        return NodeInfo(
            node_id=reg.node_id, model=reg.model, endpoint=reg.endpoint, shard_start=reg.shard_start,
            shard_end=reg.shard_end, num_layers=reg.num_layers, relay_addr=reg.relay_addr, dtype=reg.dtype,
            device=reg.device, state=state, routable=state != "offline", active_sessions=reg.active_sessions,
            inflight_requests=entry.inflight, kv_free_tokens=reg.kv_free_tokens,
            kv_capacity_tokens=reg.kv_capacity_tokens, decode_tokens_per_s=reg.decode_tokens_per_s,
            last_heartbeat_age_s=round(max(now - entry.last_seen, 0.0), 3),
            registered_for_s=round(max(now - entry.registered_at, 0.0), 3), heartbeats=entry.heartbeats,
            failures=entry.failures, backoff_remaining_s=round(max(entry.backoff_until - now, 0.0), 3),
            last_failure_reason=entry.last_failure_reason,
        )

    def __len__(self) -> int:
        return len(self._entries)
