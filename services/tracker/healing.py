"""The tracker's memory of placements, and healing: moving placed nodes so layers that lost their last holder are held.

:class:`PlacementBook` (one per app, ``app.state.placement_book``) keeps, for this tracker:

- ranges handed out by ``POST /v1/placement`` and not registered yet (so nodes
  starting together are given different ranges), for :data:`PENDING_S`;
- each placed node's costs and budget, so it can be moved later;
- moves told and not yet carried out, so two nodes are not sent to one gap;
- per model, why coverage cannot be restored when no plan covers it (``GET /v1/nodes``
  shows it as the model's ``healing``).

:func:`heal_move` runs on every heartbeat of a placed node (``POST /v1/nodes``):
once some layers of its model have had no holder for :data:`GAP_GRACE_S`, the
tracker plans new ranges for the live placed nodes of the model
(:func:`.placement_rebalance.rebalance`: spare replicas first, else the chain
of nodes re-cut, shrinking, growing or shifting live ranges within each node's
budget) and tells each heartbeating node its part (``RegistrationAnswer.move``).

Moves are carried out in an order that never uncovers a held layer: a node
whose new range drops layers (it shrinks or shifts) is told only once every
layer it drops is registered by another node; a node that only grows is told
at once. A node loads its new range while still serving its old one and then
registers it (services/node/runtime.py), so growers land first and shrinkers
follow; the plan keeps the nodes' order along the model, so no two moves wait
on each other. Damped so placement never flaps: pinned nodes never move; a node
is told one move at a time, repeated on each heartbeat until it registers the
new range (or :data:`MOVE_TIMEOUT_S` pass); after a move it stays put for
:data:`MOVE_COOLDOWN_S`; and while every layer is held, nodes move only to make
the mesh's slowest stage :data:`.placement_tune.TUNE_GAIN` times faster
(:func:`.placement_tune.tune`: the same moves, re-cut by speed once nobody is
joining or moving).

The book is this tracker's own memory; with a shared store, the ranges it hands
out and the moves it tells are also claims in the store (:mod:`.placement_claims`)
that the other trackers count, so two trackers neither give two nodes one gap nor
move nodes of one model at once. A node is moved only by the tracker that placed it.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict, deque
from collections.abc import Collection
from dataclasses import dataclass
from typing import Final, Literal

from fastapi import Request

from meshwire.placement import PlacementAnswer
from meshwire.registry import NodeRegistration

from .placement import Holder, LayerCosts, Placement, uncovered_runs
from .placement_claims import Claim, ClaimBook, LostRace
from .placement_rebalance import CannotCover, Movable, Plan, rebalance
from .placement_tune import tune
from .planner import Candidate
from .state import tracker_state
from .store import StoreUnavailable

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
MAX_HISTORY: Final = 64
"""Most recent move events remembered for ``GET /v1/nodes`` and the page."""
MoveEvent = Literal["told", "done", "given up"]
MoveWhy = Literal["healing", "speed"]
"""Why a node was moved: layers had lost their last holder, or a covered mesh was re-cut for speed."""


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


@dataclass(frozen=True)
class MoveRecord:
    """One event of a move, as ``GET /v1/nodes`` lists it under the model's ``moves``."""

    model: str
    node_id: str
    from_layers: tuple[int, int]
    to_layers: tuple[int, int]
    event: MoveEvent
    at: float
    why: MoveWhy = "healing"


@dataclass(frozen=True)
class Told:
    """A move told to a node and not carried out yet."""

    move: Placement
    kv_reserve_tokens: int
    told_at: float
    from_layers: tuple[int, int]
    """The range the node held when it was told."""
    why: MoveWhy = "healing"


class PlacementBook:
    """Reservations, placed nodes, moves and healing notes (see the module doc); bounded, expiring."""

    def __init__(self) -> None:
        self._pending: OrderedDict[str, Reservation] = OrderedDict()
        self._placed: OrderedDict[str, PlacedNode] = OrderedDict()
        self._moves: OrderedDict[str, Told] = OrderedDict()
        self._moved_at: OrderedDict[str, float] = OrderedDict()
        self._uncovered_since: dict[str, float] = {}
        self._plans: dict[str, tuple[object, Plan | CannotCover]] = {}  # the last plan of each model, by its inputs
        self._notes: dict[str, str] = {}
        self._history: deque[MoveRecord] = deque(maxlen=MAX_HISTORY)

    def pending(self, model: str, now: float, registered: set[str]) -> list[Holder]:
        """Live reservations and told moves of ``model`` not registered yet; expired ones are dropped."""
        for node_id in [k for k, v in self._pending.items() if v.expires_at <= now or k in registered]:
            del self._pending[node_id]
        moving = [Holder(node_id, told.move.start, told.move.end, self._placed[node_id].seconds_per_layer)
                  for node_id, told in self._moves.items()
                  if node_id in self._placed and self._placed[node_id].model == model]
        return [r.holder for r in self._pending.values() if r.model == model] + moving

    def hold(self, model: str, holder: Holder, now: float, placed: PlacedNode) -> None:
        """Reserve ``holder``'s range until it registers, and remember what the node can hold."""
        _bounded_set(self._pending, holder.node_id, Reservation(model, holder, now + PENDING_S))  # type: ignore[arg-type]
        _bounded_set(self._placed, holder.node_id, placed)  # type: ignore[arg-type]
        self._moves.pop(holder.node_id, None)

    def note(self, model: str) -> str | None:
        """Why coverage of ``model`` cannot be restored now, if that is so."""
        return self._notes.get(model)

    def may_heal(self, model: str, live: Collection[str]) -> bool:
        """Whether a gap in ``model`` may be filled by moving nodes: some of the ``live`` node ids were placed
        here for it, and no plan has said coverage cannot be restored. A route's 503 says so (``healing``),
        and a head's failover then waits for the gap to close within its budget instead of giving up at once."""
        return model not in self._notes and any(
            (placed := self._placed.get(node_id)) is not None and placed.model == model for node_id in live)

    def history(self, model: str) -> list[MoveRecord]:
        """The recent move events of ``model``, oldest first."""
        return [record for record in self._history if record.model == model]

    def _record(self, registration: NodeRegistration, told: Told, event: MoveEvent, now: float) -> None:
        self._history.append(MoveRecord(registration.model, registration.node_id, told.from_layers,
                                        (told.move.start, told.move.end), event, now, told.why))

    def placed_here(self, node_id: str) -> bool:
        """Whether this tracker placed ``node_id`` (and so may move it)."""
        return node_id in self._placed

    def told(self, node_id: str) -> Told | None:
        """The move told to ``node_id`` and not carried out yet, if any."""
        return self._moves.get(node_id)

    def withdraw(self, node_id: str) -> None:
        """Forget the move just told to ``node_id`` (another tracker claimed the model's moves first)."""
        if self._moves.pop(node_id, None) is not None and self._history and \
                (self._history[-1].node_id, self._history[-1].event) == (node_id, "told"):
            self._history.pop()

    def move_for(self, registration: NodeRegistration, candidates: list[Candidate], now: float,
                 shared: Collection[Holder] = (), hold_new: bool = False) -> tuple[Placement, int] | None:
        """The move (and KV room a layer) to tell this heartbeating node, if any (see the module doc).

        ``shared``: ranges other trackers of the store handed out or told (:mod:`.placement_claims`), counted
        as this tracker's own pending ones; ``hold_new``: tell no new move now (another tracker is moving
        nodes of the model), only repeat one told already."""
        node_id = registration.node_id
        placed = self._placed.get(node_id)
        if placed is not None and (registration.placement in (None, "pinned") or placed.model != registration.model):
            del self._placed[node_id]  # restarted pinned, or on another model: no longer this tracker's to move
            placed = None
        if placed is None:
            return None
        if (told := self._moves.get(node_id)) is not None:
            if (registration.shard_start, registration.shard_end) == (told.move.start, told.move.end):
                del self._moves[node_id]
                _bounded_set(self._moved_at, node_id, now)  # type: ignore[arg-type]
                self._record(registration, told, "done", now)
                logger.info("node %s now holds layers %d-%d as told", node_id, told.move.start, told.move.end)
                return None
            if now - told.told_at < MOVE_TIMEOUT_S:
                return told.move, told.kv_reserve_tokens
            del self._moves[node_id]
            self._record(registration, told, "given up", now)
            logger.warning("node %s did not move to layers %d-%d within %.0f s", node_id, told.move.start,
                           told.move.end, MOVE_TIMEOUT_S)
        if hold_new or now - self._moved_at.get(node_id, float("-inf")) < MOVE_COOLDOWN_S:
            return None
        model, n = registration.model, placed.costs.num_layers
        live = [c for c in candidates if c.node_id != node_id]
        live.append(Candidate(node_id, registration.endpoint, registration.shard_start, registration.shard_end,
                              role=registration.role))
        pending = self.pending(model, now, {c.node_id for c in live})
        pending += [h for h in shared if h.node_id not in {p.node_id for p in pending}]
        if not uncovered_runs([*(Holder(c.node_id, c.shard_start, c.shard_end) for c in live), *pending], n):
            self._uncovered_since.pop(model, None)
            self._notes.pop(model, None)
            plan = None if pending else self._plan(model, n, live, pending, now, tuning=True)
        else:
            since = self._uncovered_since.setdefault(model, now)
            if now - since < GAP_GRACE_S:
                return None
            plan = self._plan(model, n, live, pending, now)
        if plan is None or (move := plan.moves.get(node_id)) is None:
            return None
        dropped = set(range(registration.shard_start, registration.shard_end + 1)) - set(range(move.start,
                                                                                            move.end + 1))
        if any(not any(c.shard_start <= layer <= c.shard_end for c in live if c.node_id != node_id)
               for layer in dropped):
            logger.debug("node %s waits: layers it would drop are not held by another node yet", node_id)
            return None
        why: MoveWhy = "healing" if self._uncovered_since.get(model) is not None else "speed"
        told = Told(move, plan.kv_reserve_tokens, now, (registration.shard_start, registration.shard_end), why)
        _bounded_set(self._moves, node_id, told)  # type: ignore[arg-type]
        self._record(registration, told, "told", now)
        logger.info("%s: node %s (layers %d-%d) is told to hold layers %d-%d of %s (%d tokens of KV room a "
                    "layer)", "healing" if why == "healing" else "tuning for speed",
                    node_id, registration.shard_start, registration.shard_end, move.start, move.end, model,
                    plan.kv_reserve_tokens)
        return move, plan.kv_reserve_tokens

    def _plan(self, model: str, num_layers: int, live: list[Candidate], pending: list[Holder],
              now: float, tuning: bool = False) -> Plan | None:
        """The healing plan of ``model`` for these live nodes, or with ``tuning`` (every layer held, nobody
        joining or moving) the re-cut for speed (:func:`.placement_tune.tune`); the last one is reused while
        nothing changed."""
        moving = {h.node_id for h in pending}
        movable = [Movable(Holder(c.node_id, c.shard_start, c.shard_end, self._placed[c.node_id].seconds_per_layer),
                           self._placed[c.node_id].costs, self._placed[c.node_id].budget_bytes)
                   for c in live if c.node_id in self._placed and self._placed[c.node_id].model == model
                   and c.node_id not in moving and c.role == "both"
                   and now - self._moved_at.get(c.node_id, float("-inf")) >= MOVE_COOLDOWN_S]
        movers = {m.holder.node_id for m in movable}
        fixed = [Holder(c.node_id, c.shard_start, c.shard_end,
                        placed.seconds_per_layer if (placed := self._placed.get(c.node_id)) is not None else 0.0)
                 for c in live if c.node_id not in movers and c.node_id not in moving] + pending
        key = (tuning, sorted((m.holder.node_id, m.holder.start, m.holder.end, m.budget_bytes) for m in movable),
               sorted((h.node_id, h.start, h.end) for h in fixed))
        cached = self._plans.get(model)
        if cached is not None and cached[0] == key:
            result = cached[1]
        else:
            try:
                result = tune(movable, fixed, num_layers) if tuning else rebalance(movable, fixed, num_layers)
            except CannotCover as exc:
                result = exc
                if self._notes.get(model) != str(exc):
                    logger.warning("healing %s: %s", model, exc)
            self._plans[model] = (key, result)
            while len(self._plans) > MAX_BOOK_ENTRIES:
                self._plans.pop(next(iter(self._plans)))
        if isinstance(result, CannotCover):
            self._notes[model] = str(result)
            return None
        self._notes.pop(model, None)
        return result


def book_of(request: Request) -> PlacementBook:
    """The app's placement book (made on first use)."""
    book = getattr(request.app.state, "placement_book", None)
    if book is None:
        book = request.app.state.placement_book = PlacementBook()
    return book


def claims_of(request: Request) -> ClaimBook:
    """The app's placement claims in the store (made on first use)."""
    claims = getattr(request.app.state, "placement_claims", None)
    if claims is None:
        claims = request.app.state.placement_claims = ClaimBook(tracker_state(request).store)
    return claims


async def heal_move(request: Request, registration: NodeRegistration) -> PlacementAnswer | None:
    """The move a heartbeating node is told in its answer, if any; with the other trackers' claims counted,
    and a new move claimed in the store before the node hears of it (:mod:`.placement_claims`)."""
    state = tracker_state(request)
    now = state.now()
    book, claims = book_of(request), claims_of(request)
    node_id, model = registration.node_id, registration.model
    candidates = list(state.registry.candidates(model, now))
    if not book.placed_here(node_id):
        return None
    try:
        others: list[Claim] | None = await claims.others(model, candidates)
    except StoreUnavailable:
        others = None  # the store is away: no new move while the other trackers' cannot be seen
    shared = [c.holder() for c in others or ()]
    hold_new = others is None or any(c.kind == "move" or c.node_id == node_id for c in others)
    before = book.told(node_id)
    told = book.move_for(registration, candidates, now, shared, hold_new)
    after = book.told(node_id)
    if before is not None and after is None:  # carried out or given up: its claim goes
        with contextlib.suppress(StoreUnavailable, LostRace):
            await claims.change(model, candidates, lambda _, mine: ([c for c in mine if c.node_id != node_id], None))
    if told is None:
        return None
    if before is None and after is not None:  # a new move: claimed in the store, or withdrawn

        def claim_move(standing: list[Claim], mine: list[Claim]) -> tuple[list[Claim], None]:
            if any(c.kind == "move" or c.node_id == node_id for c in standing):
                raise LostRace(f"another tracker is moving nodes of {model!r}")
            move = Holder(node_id, after.move.start, after.move.end, 0.0)
            return [*(c for c in mine if c.node_id != node_id), claims.claim(node_id, "move", move, MOVE_TIMEOUT_S)], None

        try:
            await claims.change(model, candidates, claim_move)
        except (LostRace, StoreUnavailable) as exc:
            book.withdraw(node_id)
            logger.info("node %s is not moved now: %s", node_id, exc)
            return None
    move, kv_reserve_tokens = told
    return PlacementAnswer(shard_start=move.start, shard_end=move.end, reason=move.reason,
                           kv_reserve_tokens=kv_reserve_tokens)
