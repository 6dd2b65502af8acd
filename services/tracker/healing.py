"""The tracker's memory of placements, and healing: moving placed nodes onto layers that lost their last holder.

:class:`PlacementBook` (one per app, ``app.state.placement_book``) keeps, for this tracker:

- ranges handed out by ``POST /v1/placement`` and not registered yet (so nodes
  starting together are given different ranges), for :data:`PENDING_S`;
- each placed node's costs and budget, so it can be moved later;
- moves told and not yet carried out, so two nodes are not sent to one gap.

:func:`heal_move` runs on every heartbeat of a placed node (``POST /v1/nodes``):
once some layers of its model have had no holder for :data:`GAP_GRACE_S`, the
node is told (``RegistrationAnswer.move``) where :func:`.placement.heal` says it
should serve. Damped so placement never flaps: pinned nodes never move; a node
is told one move at a time, repeated on each heartbeat until it registers the
new range (or :data:`MOVE_TIMEOUT_S` pass); after a move it stays put for
:data:`MOVE_COOLDOWN_S`; and nothing moves while every layer is held.

All of it is this tracker's own memory: with a shared store, a node heartbeating to
another tracker is healed by that one once it has placed it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Final

from fastapi import Request

from meshwire.placement import PlacementAnswer
from meshwire.registry import NodeRegistration

from .placement import DEFAULT_KV_RESERVE_TOKENS, Holder, LayerCosts, Placement, heal, uncovered_runs
from .planner import Candidate
from .state import tracker_state

logger = logging.getLogger(__name__)

PENDING_S: Final = 300.0
"""How long a handed-out range is held for its node to load and register."""
MAX_BOOK_ENTRIES: Final = 1024
"""Most nodes remembered in each of the book's tables (the oldest is forgotten first)."""
GAP_GRACE_S: Final = 2.0
"""How long layers must have had no holder before a node is moved onto them (a node restarting in place
is given a moment; a dead node has already been silent for the registry's TTL)."""
MOVE_TIMEOUT_S: Final = 180.0
"""How long a told move is repeated and reserved before it is given up."""
MOVE_COOLDOWN_S: Final = 30.0
"""How long a node that moved stays where it is before it may be moved again."""


@dataclass(frozen=True)
class Reservation:
    model: str
    holder: Holder
    expires_at: float


@dataclass(frozen=True)
class PlacedNode:
    """What a placed node said it can hold, kept so it can be moved later."""

    model: str
    costs: LayerCosts
    budget_bytes: int
    seconds_per_layer: float


def _bounded_set(table: OrderedDict[str, object], key: str, value: object) -> None:
    table.pop(key, None)
    table[key] = value
    while len(table) > MAX_BOOK_ENTRIES:
        table.popitem(last=False)


class PlacementBook:
    """Reservations, placed nodes and moves (see the module doc); bounded, expiring."""

    def __init__(self) -> None:
        self._pending: OrderedDict[str, Reservation] = OrderedDict()
        self._placed: OrderedDict[str, PlacedNode] = OrderedDict()
        self._moves: OrderedDict[str, tuple[Placement, float]] = OrderedDict()
        self._moved_at: OrderedDict[str, float] = OrderedDict()
        self._uncovered_since: dict[str, float] = {}

    def pending(self, model: str, now: float, registered: set[str]) -> list[Holder]:
        """Live reservations and told moves of ``model`` not registered yet; expired ones are dropped."""
        for node_id in [k for k, v in self._pending.items() if v.expires_at <= now or k in registered]:
            del self._pending[node_id]
        moving = [Holder(node_id, move.start, move.end, self._placed[node_id].seconds_per_layer)
                  for node_id, (move, _) in self._moves.items()
                  if node_id in self._placed and self._placed[node_id].model == model]
        return [r.holder for r in self._pending.values() if r.model == model] + moving

    def hold(self, model: str, holder: Holder, now: float, placed: PlacedNode) -> None:
        """Reserve ``holder``'s range until it registers, and remember what the node can hold."""
        _bounded_set(self._pending, holder.node_id, Reservation(model, holder, now + PENDING_S))  # type: ignore[arg-type]
        _bounded_set(self._placed, holder.node_id, placed)  # type: ignore[arg-type]
        self._moves.pop(holder.node_id, None)

    def move_for(self, registration: NodeRegistration, candidates: list[Candidate], now: float) -> Placement | None:
        """The move to tell this heartbeating node, if any (see the module doc)."""
        node_id = registration.node_id
        placed = self._placed.get(node_id)
        if placed is None or registration.placement in (None, "pinned") or placed.model != registration.model:
            return None
        if (told := self._moves.get(node_id)) is not None:
            move, told_at = told
            if (registration.shard_start, registration.shard_end) == (move.start, move.end):
                del self._moves[node_id]
                _bounded_set(self._moved_at, node_id, now)  # type: ignore[arg-type]
                logger.info("node %s now holds layers %d-%d as told", node_id, move.start, move.end)
                return None
            if now - told_at < MOVE_TIMEOUT_S:
                return move
            del self._moves[node_id]
            logger.warning("node %s did not move to layers %d-%d within %.0f s", node_id, move.start, move.end,
                           MOVE_TIMEOUT_S)
        if now - self._moved_at.get(node_id, float("-inf")) < MOVE_COOLDOWN_S:
            return None
        n = placed.costs.num_layers
        others = [Holder(c.node_id, c.shard_start, c.shard_end) for c in candidates if c.node_id != node_id]
        others += [h for h in self.pending(registration.model, now, {c.node_id for c in candidates})
                   if h.node_id != node_id]
        own = Holder(node_id, registration.shard_start, registration.shard_end, placed.seconds_per_layer)
        if not uncovered_runs([*others, own], n):
            self._uncovered_since.pop(registration.model, None)
            return None
        since = self._uncovered_since.setdefault(registration.model, now)
        if now - since < GAP_GRACE_S:
            return None
        move = heal(placed.costs, placed.budget_bytes, own, others, DEFAULT_KV_RESERVE_TOKENS)
        if move is not None:
            _bounded_set(self._moves, node_id, (move, now))  # type: ignore[arg-type]
            logger.info("healing: node %s (layers %d-%d) is told to hold layers %d-%d of %s", node_id, own.start,
                        own.end, move.start, move.end, registration.model)
        return move


def book_of(request: Request) -> PlacementBook:
    """The app's placement book (made on first use)."""
    book = getattr(request.app.state, "placement_book", None)
    if book is None:
        book = request.app.state.placement_book = PlacementBook()
    return book


def heal_move(request: Request, registration: NodeRegistration) -> PlacementAnswer | None:
    """The move a heartbeating node is told in its answer, if any."""
    state = tracker_state(request)
    now = state.now()
    candidates = list(state.registry.candidates(registration.model, now))
    move = book_of(request).move_for(registration, candidates, now)
    if move is None:
        return None
    return PlacementAnswer(shard_start=move.start, shard_end=move.end, reason=move.reason,
                           kv_reserve_tokens=DEFAULT_KV_RESERVE_TOKENS)
