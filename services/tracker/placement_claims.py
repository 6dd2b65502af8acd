"""Placement claims in the store: the ranges every tracker of a mesh has handed out or told, bounded by TTL.

Each tracker keeps its own :class:`.healing.PlacementBook` (what it placed, what it
told, cooldowns). With several trackers on one store (``MESHNET_STORE=redis://``),
two of them could give two joining nodes the same gap, or both move a node onto
the gap a death left. So every range a tracker hands out (``pending``, until the
node registers or :data:`.healing.PENDING_S` pass) and every move it tells
(``move``, until the node holds its new range or :data:`.healing.MOVE_TIMEOUT_S`
pass) is also a :class:`Claim` in one small document per model in the store,
changed by compare-and-swap (``swap_doc``: one atomic script in Redis), so a
decision is made against the claims it replaces or is made again:

- placing a node reads the other trackers' live claims as holders, decides, and
  writes its claim in the same swap;
- a new move is told only while no other tracker has a move of the model under
  way and no other tracker claims the node; a tracker that loses the race
  withdraws its move before the node hears of it.

Claims expire by wall time (each carries ``expires_at``) and are pruned on every
write; the document holds at most :data:`MAX_CLAIMS`. A tracker's own claims are
known to it already (its book), so only other trackers' are read back.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Collection
from typing import Final, Literal, TypeVar

import orjson
from pydantic import BaseModel, Field, ValidationError

from meshwire.fields import STRICT_MODEL, LayerIndex, NodeId

from .placement import Holder
from .planner import Candidate
from .store import NodeStore

logger = logging.getLogger(__name__)

DOC_PREFIX: Final = "placement:"
"""The store document of a model's claims is this prefix and the model's name."""
MAX_CLAIMS: Final = 1024
"""Most claims one model's document keeps (the soonest to expire are dropped first)."""
SWAP_ATTEMPTS: Final = 8
"""Tries of one change before giving up on a document other trackers keep changing."""
OWNER_BYTES: Final = 8

ClaimKind = Literal["pending", "move"]
T = TypeVar("T")


class Claim(BaseModel):
    """A range a tracker handed a node (``pending``) or told it to move to (``move``), until ``expires_at``."""

    model_config = STRICT_MODEL

    node_id: NodeId
    owner: str = Field(min_length=1, max_length=64)
    """The tracker that made it (a random id per tracker process)."""
    kind: ClaimKind
    start: LayerIndex
    end: LayerIndex
    seconds_per_layer: float = Field(ge=0, le=3600, allow_inf_nan=False)
    expires_at: float = Field(allow_inf_nan=False)
    """Wall time (``time.time()``) after which nobody counts it."""

    def holder(self) -> Holder:
        return Holder(self.node_id, self.start, self.end, self.seconds_per_layer)


class _Doc(BaseModel):
    model_config = STRICT_MODEL

    claims: tuple[Claim, ...] = ()


class LostRace(Exception):
    """Another tracker's claim stands in the way of this change (raised by a change to call it off)."""


class ClaimBook:
    """This tracker's access to the shared claims (see the module doc)."""

    def __init__(self, store: NodeStore, wall: Callable[[], float] = time.time) -> None:
        self._store = store
        self._wall = wall
        self.owner = secrets.token_hex(OWNER_BYTES)

    async def others(self, model: str, live: Collection[Candidate]) -> list[Claim]:
        """Other trackers' claims on ``model`` that still stand: not expired, and not yet fulfilled (a
        ``pending`` node that registered, a ``move`` whose node holds its new range)."""
        return self._standing(self._parse(await self._store.read_doc(DOC_PREFIX + model)), live)

    async def change(self, model: str, live: Collection[Candidate],
                     edit: Callable[[list[Claim], list[Claim]], tuple[list[Claim], T]]) -> T:
        """Apply ``edit`` atomically: given the other trackers' standing claims of ``model`` and this tracker's
        own, it answers the claims of this tracker to keep and a result. Retried while other trackers change
        the document; ``edit`` raises :class:`LostRace` (or anything else) to change nothing."""
        name = DOC_PREFIX + model
        for _ in range(SWAP_ATTEMPTS):
            stored = await self._store.read_doc(name)
            claims = [c for c in self._parse(stored) if c.expires_at > self._wall()]
            mine, result = edit(self._standing(claims, live), [c for c in claims if c.owner == self.owner])
            kept = sorted([*(c for c in claims if c.owner != self.owner), *mine], key=lambda c: -c.expires_at)
            new = orjson.dumps(_Doc(claims=tuple(kept[:MAX_CLAIMS])).model_dump(mode="json")).decode()
            if await self._store.swap_doc(name, stored, new):
                return result
        raise LostRace(f"the placement claims of {model!r} kept changing under this tracker")

    def claim(self, node_id: str, kind: ClaimKind, holder: Holder, ttl_s: float) -> Claim:
        return Claim(node_id=node_id, owner=self.owner, kind=kind, start=holder.start, end=holder.end,
                     seconds_per_layer=max(holder.seconds_per_layer, 0.0), expires_at=self._wall() + ttl_s)

    def _standing(self, claims: list[Claim], live: Collection[Candidate]) -> list[Claim]:
        now = self._wall()
        held = {c.node_id: (c.shard_start, c.shard_end) for c in live}
        return [c for c in claims if c.owner != self.owner and c.expires_at > now
                and not (c.kind == "pending" and c.node_id in held)
                and not (c.kind == "move" and held.get(c.node_id) == (c.start, c.end))]

    @staticmethod
    def _parse(stored: str | None) -> list[Claim]:
        if not stored:
            return []
        try:
            return list(_Doc.model_validate_json(stored).claims)
        except ValidationError as exc:
            logger.warning("ignoring an unreadable placement claims document: %s", exc.errors()[0]["msg"])
            return []
