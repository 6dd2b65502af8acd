"""Quarantine: the nodes shown to compute wrong, kept out of every route until an operator re-admits them (issue 37).

A record names the node, says why in words, and carries the signed receipts
that show it (its own receipt of a step, and those of the replicas that
computed the same step from the same input and agreed with each other), so
anyone holding the mesh's hop keys can check the verdict.

The book is kept in the tracker's store as one document (:data:`QUARANTINE_DOC`,
swapped whole, the same way as the route-signing key ring), so every tracker
of a shared (Redis) store sees the same quarantine: a tracker reads it again
when it answers ``GET /v1/nodes`` or ``GET /v1/verify``, on an admin call, and
when it takes a receipt report and its copy is older than :data:`REFRESH_S`
(heads report every half second while they serve). Until then, routes planned
by a tracker that did not itself quarantine the node can still name it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Final

import orjson
from pydantic import BaseModel, Field, ValidationError

from meshwire import limits
from meshwire.fields import STRICT_MODEL
from meshwire.receipts import MAX_RECEIPT_CHARS

from .store import NodeStore

logger = logging.getLogger(__name__)

QUARANTINE_DOC: Final = "quarantine"
"""The store document the quarantine book lives in."""
MAX_QUARANTINED: Final = 1024
"""Most nodes quarantined at once (a mesh with more wrong nodes than this has other problems)."""
MAX_EVIDENCE: Final = 4
"""Most receipts kept as a record's evidence."""
MAX_REASON_CHARS: Final = 500
SWAP_ATTEMPTS: Final = 5
"""Compare-and-swap attempts on the document before a change is given up (another tracker kept changing it)."""
REFRESH_S: Final = 5.0
"""How stale a tracker's copy of the book may get while it plans routes (it reads the store again after)."""


class QuarantineRecord(BaseModel):
    """One quarantined node: why, since when, and the receipts that show it."""

    model_config = STRICT_MODEL

    node_id: str = Field(min_length=1, max_length=limits.MAX_ID_CHARS)
    reason: str = Field(min_length=1, max_length=MAX_REASON_CHARS)
    since: float
    """Unix seconds."""
    evidence: tuple[str, ...] = Field(default=(), max_length=MAX_EVIDENCE)
    """Encoded receipts (:mod:`meshwire.receipts`): the node's own first, then those it disagreed with."""

    def view(self) -> dict[str, object]:
        """As ``GET /v1/nodes`` shows it."""
        return {"reason": self.reason, "since": self.since, "receipts": list(self.evidence)}


class _Book(BaseModel):
    model_config = STRICT_MODEL

    nodes: dict[str, QuarantineRecord] = Field(default_factory=dict, max_length=MAX_QUARANTINED)


def _check_evidence(evidence: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(item[:MAX_RECEIPT_CHARS] for item in evidence[:MAX_EVIDENCE])


class Quarantine:
    """This tracker's copy of the quarantine book, and its changes written through to the store."""

    def __init__(self, store: NodeStore, clock: Callable[[], float] = time.monotonic) -> None:
        self._store = store
        self._clock = clock
        self._records: dict[str, QuarantineRecord] = {}
        self._read_at: float | None = None

    def ids(self) -> frozenset[str]:
        """The quarantined node ids, as this tracker last read them."""
        return frozenset(self._records)

    def get(self, node_id: str) -> QuarantineRecord | None:
        return self._records.get(node_id)

    def records(self) -> tuple[QuarantineRecord, ...]:
        return tuple(self._records.values())

    @property
    def stale(self) -> bool:
        """Whether the book should be read again from the store (:data:`REFRESH_S`)."""
        return self._read_at is None or self._clock() - self._read_at >= REFRESH_S

    async def refresh(self) -> None:
        """Read the book from the store (a store that is away leaves this tracker's copy as it was)."""
        try:
            self._records = self._parse(await self._store.read_doc(QUARANTINE_DOC)).nodes
            self._read_at = self._clock()
        except Exception as exc:  # noqa: BLE001 - the store's own errors; routes go on with the last copy
            logger.warning("could not read the quarantine from the store: %s", exc)

    async def add(self, node_id: str, reason: str, evidence: tuple[str, ...]) -> QuarantineRecord:
        """Quarantine ``node_id`` (a node already quarantined keeps its first record)."""
        record = QuarantineRecord(node_id=node_id, reason=reason[:MAX_REASON_CHARS], since=time.time(),
                                  evidence=_check_evidence(evidence))
        await self._change(lambda book: book if node_id in book or len(book) >= MAX_QUARANTINED
                           else {**book, node_id: record})
        logger.warning("node %s quarantined: %s", node_id, reason)
        return self._records.get(node_id, record)

    async def remove(self, node_id: str) -> bool:
        """Re-admit ``node_id``; ``False`` when it was not quarantined."""
        await self.refresh()
        if node_id not in self._records:
            return False
        await self._change(lambda book: {key: value for key, value in book.items() if key != node_id})
        logger.warning("node %s re-admitted from quarantine", node_id)
        return True

    async def _change(self, edit: Callable[[dict[str, QuarantineRecord]], dict[str, QuarantineRecord]]) -> None:
        for _ in range(SWAP_ATTEMPTS):
            stored = await self._store.read_doc(QUARANTINE_DOC)
            book = edit(dict(self._parse(stored).nodes))
            new = orjson.dumps(_Book(nodes=book).model_dump(mode="json")).decode()
            if await self._store.swap_doc(QUARANTINE_DOC, stored, new):
                self._records = book
                self._read_at = self._clock()
                return
        raise RuntimeError("the quarantine document kept changing under this tracker; try again")

    @staticmethod
    def _parse(stored: str | None) -> _Book:
        if not stored:
            return _Book()
        try:
            raw = orjson.loads(stored)
            nodes = {key: QuarantineRecord(node_id=value["node_id"], reason=value["reason"],
                                           since=float(value["since"]), evidence=tuple(value.get("evidence", ())))
                     for key, value in raw.get("nodes", {}).items()}
            return _Book(nodes=nodes)
        except (orjson.JSONDecodeError, ValidationError, KeyError, TypeError, ValueError, AttributeError) as exc:
            logger.error("the stored quarantine is unreadable (%s); treating it as empty", exc)
            return _Book()
