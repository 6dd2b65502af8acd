"""A Redis store's view: the registry this tracker plans routes from, kept as Redis says (no I/O here).

:class:`SharedView` is a :class:`~..registry.Registry` whose entries are copied from Redis
(:mod:`.redis` reads them and subscribes to the changes): :meth:`SharedView.load` replaces the
view with what a full read of Redis found, :meth:`SharedView.apply_event` applies one change
published on the store's channel. A failure the front door reports to the view is applied at
once and handed on, to be written to Redis so that every tracker backs the node off.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from typing import Any, Final, NamedTuple

from pydantic import ValidationError

from meshwire.registry import NodeRegistration

from ..registry import Registry, RegistryFull, RegistryPolicy

logger = logging.getLogger(__name__)

MAX_EVENT_BYTES: Final = 256 * 1024
"""Largest channel message read (a registration is at most 64 KiB)."""


class NodeRow(NamedTuple):
    """What Redis holds of one listed node: its hash, the milliseconds left on its lease and its backoff
    (``PTTL``: negative when none), and its failure run's count."""

    node_id: str
    record: dict[str, str]
    lease_ms: int
    backoff_ms: int
    failures: str | None


class SharedView(Registry):
    """The view of Redis routes are planned from; a failure reported to it is also written to Redis.

    The OpenAI front door reports a head that failed to the registry directly
    (synchronously); here that report is applied to the view at once and
    sent on to Redis in the background (``on_failure``), so every tracker backs the node off.
    """

    def __init__(self, policy: RegistryPolicy, on_failure: Callable[[str, str], None]) -> None:
        super().__init__(policy)
        self._on_failure = on_failure

    def report_failure(self, node_id: str, reason: str, now: float) -> float:
        backoff = super().report_failure(node_id, reason, now)
        self._on_failure(node_id, reason)
        return backoff

    def apply_record_safely(self, registration: NodeRegistration, lease: str, heartbeats: int, now: float,
                            age_s: float = 0.0, left: bool = False) -> None:
        """:meth:`apply_record`, or a warning when the view is full (the node is left out of this tracker's routes)."""
        try:
            self.apply_record(registration, lease, heartbeats, now, age_s=age_s, left=left)
        except RegistryFull:
            logger.warning("the view holds %d nodes already: a node Redis lists is left out of this tracker's "
                           "routes", self.policy.max_nodes)

    def load(self, rows: Sequence[NodeRow], full_lease_ms: int, now: float) -> int:
        """Make the view what ``rows`` (every node Redis lists) say; answers how many nodes it holds.

        ``full_lease_ms`` is a fresh lease's length: a lease with less left was last heard that much ago.
        """
        seen: set[str] = set()
        for row in rows:
            registration = registration_of(row.record.get("registration")) if row.record else None
            if registration is None or registration.node_id != row.node_id:
                continue
            live = int(row.lease_ms) > 0 and row.record.get("left") != "1"
            age_s = (full_lease_ms - int(row.lease_ms)) / 1000 if live else self.policy.ttl_s
            self.apply_record_safely(registration, row.record.get("lease", ""), int(row.record.get("heartbeats", 0)),
                                     now, age_s=age_s, left=not live)
            self.apply_failure(row.node_id, row.record.get("reason"), int(row.failures or 0),
                               max(int(row.backoff_ms), 0) / 1000, now)
            seen.add(row.node_id)
        for node_id in set(self.node_ids()) - seen:
            self.forget(node_id)
        return len(seen)

    def apply_event(self, data: str, now: float) -> int | None:
        """Apply one message of the store's channel; answers the store version it carries (``None``: dropped)."""
        if len(data) > MAX_EVENT_BYTES:
            logger.warning("dropped a store event of %d bytes (over %d)", len(data), MAX_EVENT_BYTES)
            return None
        try:
            event: dict[str, Any] = json.loads(data)
            kind, version = event["kind"], int(event["version"])
        except (ValueError, KeyError, TypeError):
            logger.warning("dropped a malformed store event: %.200s", data)
            return None
        if kind == "node":
            registration = registration_of(event.get("registration"))
            if registration is not None:
                self.apply_record_safely(registration, str(event.get("lease", "")), int(event.get("heartbeats", 0)),
                                         now)
        elif kind == "left":
            self.apply_offline(str(event.get("node_id", "")), now)
        elif kind == "failure":
            self.apply_failure(str(event.get("node_id", "")), event.get("reason"), int(event.get("failures", 0)),
                               int(event.get("backoff_ms", 0)) / 1000, now)
        return version


def registration_of(raw: object) -> NodeRegistration | None:
    """The registration a record or event holds (JSON as the node sent it), or ``None``."""
    if not isinstance(raw, str):
        return None
    try:
        return NodeRegistration.model_validate_json(raw)
    except ValidationError:
        return None


def endpoint_of(raw: str) -> str:
    """The endpoint of the registration ``raw`` holds, for a message naming who holds an id."""
    registration = registration_of(raw)
    return registration.endpoint if registration is not None else "an unknown endpoint"


def ms(seconds: float) -> int:
    """Whole milliseconds, at least 1 (Redis expiries)."""
    return max(int(seconds * 1000), 1)


def redact(url: str) -> str:
    """``url`` without a password, for logs and ``/health``."""
    scheme, sep, rest = url.partition("://")
    if "@" in rest:
        rest = "***@" + rest.split("@", 1)[1]
    return f"{scheme}{sep}{rest}"
