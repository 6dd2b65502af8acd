"""Who may put a node in failure backoff, how often, and on whose word.

A failure report (``POST /v1/nodes/{id}/failures``) keeps a node out of
routes for a while, so it is a lever on other people's nodes. Anyone holding
a join token could pull it for any node, and a hop could make the head
before it report a node of its choosing (``failed_node`` in a 502). The rules:

1. **Who** (checked by the endpoint, see :mod:`.mesh_api`): a report names the
   signed route the failure happened on (``route``: a route this tracker's key
   signed, expired for at most :data:`ROUTE_GRACE_S`), it comes from that
   route's head (the join token's node; with the mesh secret, the head is the
   reporter), and the node it names is another hop of that route.
2. **How often**: at most :data:`REPORTS_PER_MINUTE` reports a reporter, in any
   60 s (429 beyond).
3. **On whose word** (:class:`FailureGate`): one reporter alone puts a node in
   backoff once in ``window_s`` (the registry's ``failure_reset_s``), for the
   first, shortest backoff; its further reports in that window are noted, not
   applied. A report is applied as it always was (a backoff that grows on
   repeats) once a second reporter has reported the node in the window, or
   when the tracker saw the failure itself (a head it could not reach, or that
   broke mid-answer: :data:`TRACKER`). So one member cannot keep an honest
   node in backoff for long; a node that really fails is reported by every
   head that meets it, and a dead one leaves routes anyway when its
   heartbeats stop.

With one tracker the gate lives in its memory (:class:`LocalGate`); with a
shared store (Redis) it lives there (:mod:`.store.redis_judgement`), each
decision one atomic script, so every tracker of the store applies the same
rules to the same reports: a lone reporter gets its one backoff in the window
whichever trackers it reports to. Every size is bounded (:data:`MAX_NODES`, :data:`MAX_REPORTERS`). A node is
judged per registration (:func:`run_of`: its id and lease), so a node that
restarted starts clean, as its backoff does.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Final, Literal, Protocol

from .registry import Registry

REPORTS_PER_MINUTE: Final = 30
"""Most failure reports one reporter may make in any 60 s."""
RATE_WINDOW_S: Final = 60.0
ROUTE_GRACE_S: Final = 600.0
"""How long after its expiry a route may still be named by a report (a stream outlives its route)."""
CORROBORATING_REPORTERS: Final = 2
"""Distinct reporters (in the window) whose word puts a node in a growing backoff."""
TRACKER: Final = "tracker"
"""The reporter name of failures the tracker saw itself."""
MAX_NODES: Final = 4096
"""Most nodes whose recent reporters are remembered (the oldest forgotten first)."""
MAX_REPORTERS: Final = 64
"""Most reporters remembered per node, and per-reporter rate windows kept (times this)."""

Verdict = Literal["apply", "noted"]
"""``apply``: hand the report to the store (backoff); ``noted``: a lone reporter's repeat, kept out."""


def run_of(registry: Registry, node_id: str) -> str:
    """The key a node's reports are judged under: its id and the lease it is registered with now."""
    return f"{node_id}\n{registry.lease_of(node_id) or ''}"


@dataclass
class _Reporters:
    """Who reported one node, and when; and whether a lone report already earned it a backoff."""

    last: dict[str, float]
    lone_applied_at: float | None = None


class TooManyReports(Exception):
    """The reporter made :data:`REPORTS_PER_MINUTE` reports in the last minute; ``retry_after_s`` until one ages out."""

    def __init__(self, retry_after_s: float) -> None:
        super().__init__(f"at most {REPORTS_PER_MINUTE} failure reports a minute from one reporter")
        self.retry_after_s = retry_after_s


class FailureGate:
    """The rate and corroboration rules of failure reports (see the module doc); pure, ``now`` passed in."""

    def __init__(self, window_s: float, per_minute: int = REPORTS_PER_MINUTE) -> None:
        self._window_s = window_s
        self._per_minute = per_minute
        self._nodes: OrderedDict[str, _Reporters] = OrderedDict()
        self._rates: OrderedDict[str, deque[float]] = OrderedDict()

    def count(self, reporter: str, now: float) -> None:
        """Count one report of ``reporter``; :class:`TooManyReports` when it is over its rate (not counted)."""
        recent = self._rates.pop(reporter, None) or deque()
        while recent and recent[0] <= now - RATE_WINDOW_S:
            recent.popleft()
        self._rates[reporter] = recent
        if len(recent) >= self._per_minute:
            raise TooManyReports(recent[0] + RATE_WINDOW_S - now)
        recent.append(now)
        while len(self._rates) > MAX_NODES * MAX_REPORTERS // 16:
            self._rates.popitem(last=False)

    def judge(self, node_id: str, reporter: str, now: float) -> Verdict:
        """Whether ``reporter``'s report of ``node_id`` goes to the store now (see the module doc)."""
        entry = self._nodes.pop(node_id, None) or _Reporters(last={})
        self._nodes[node_id] = entry
        while len(self._nodes) > MAX_NODES:
            self._nodes.popitem(last=False)
        entry.last = {who: at for who, at in entry.last.items() if now - at <= self._window_s}
        if entry.lone_applied_at is not None and now - entry.lone_applied_at > self._window_s:
            entry.lone_applied_at = None
        entry.last[reporter] = now
        if len(entry.last) > MAX_REPORTERS:
            oldest = min(entry.last, key=entry.last.__getitem__)
            del entry.last[oldest]
        if reporter == TRACKER or len(entry.last) >= CORROBORATING_REPORTERS:
            return "apply"
        if entry.lone_applied_at is None:
            entry.lone_applied_at = now
            return "apply"
        return "noted"


class Gate(Protocol):
    """Where the rules are applied: this tracker's memory (:class:`LocalGate`) or the shared store."""

    async def count(self, reporter: str, now: float) -> None:
        """:meth:`FailureGate.count`: :class:`TooManyReports` when ``reporter`` is over its rate."""

    async def judge(self, run: str, reporter: str, now: float) -> Verdict:
        """:meth:`FailureGate.judge` of the node registration ``run`` (:func:`run_of`)."""


class LocalGate:
    """The rules in this tracker's memory (a :class:`FailureGate`), behind the store-shared :class:`Gate` API."""

    def __init__(self, window_s: float) -> None:
        self.gate = FailureGate(window_s)

    async def count(self, reporter: str, now: float) -> None:
        self.gate.count(reporter, now)

    async def judge(self, run: str, reporter: str, now: float) -> Verdict:
        return self.gate.judge(run, reporter, now)
