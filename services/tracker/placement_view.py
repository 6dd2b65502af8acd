"""What ``GET /v1/nodes`` shows of placement for each model: its stages as the tracker rates them, and healing.

- ``stages``: every distinct range live nodes hold, with its holders and the
  seconds a decode row spends in it (:func:`.placement.stage_times`: a layer's
  time is one over the sum of its holders' speeds), from the tracker's own
  figures (:meth:`.ratings.Ratings.rated`: what its streams measured, a new
  node's clamped claim until then). The slowest stage is the one the next
  node without ``--layers`` is given a replica of; ``slowest`` marks it.
- ``healing``: why layers nobody holds cannot be held again by moving placed
  nodes (:meth:`.healing.PlacementBook.note`), or ``None``.
- ``moves``: the recent move events (``told``, ``done``, ``given up``), each with
  the node, the range it left and the one it was told, why (``healing``: layers had
  lost their last holder; ``speed``: a covered mesh re-cut, :mod:`.placement_tune`),
  and how many seconds ago.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import Request

from .healing import book_of
from .placement import Holder, stage_times
from .planner import Candidate
from .state import tracker_state


def seconds_per_layer(candidate: Candidate) -> float:
    """A node's speed as seconds a layer for one decode row (0: nothing known), from its rated steps a second."""
    layers = candidate.shard_end - candidate.shard_start + 1
    return 1.0 / (candidate.decode_tokens_per_s * layers) if candidate.decode_tokens_per_s > 0 else 0.0


def rated_holders(request: Request, model: str, now: float, exclude: str | None = None) -> list[Holder]:
    """The live holders of ``model`` with the speeds the tracker rates them at (see the module doc)."""
    state = tracker_state(request)
    candidates = [c for c in state.registry.candidates(model, now) if c.node_id != exclude]
    return [Holder(c.node_id, c.shard_start, c.shard_end, seconds_per_layer(c)) for c in state.ratings.rated(candidates)]


def stages(holders: Sequence[Holder], num_layers: int) -> list[dict[str, Any]]:
    """Each distinct held range, its holders and its seconds a decode row, layer order; the slowest marked."""
    valid = [h for h in holders if 0 <= h.start <= h.end < num_layers]
    times = stage_times(valid, num_layers)
    slowest = max(times.items(), key=lambda item: (round(item[1], 12), -item[0][0]))[0] if times else None
    return [{"shard_start": start, "shard_end": end, "seconds_per_token": round(seconds, 6),
             "holders": sorted(h.node_id for h in valid if (h.start, h.end) == (start, end)),
             "slowest": (start, end) == slowest}
            for (start, end), seconds in sorted(times.items())]


def model_placement(request: Request, model: str, num_layers: int) -> dict[str, Any]:
    """The ``stages`` and ``healing`` of one model's ``GET /v1/nodes`` entry."""
    now = tracker_state(request).now()
    book = book_of(request)
    moves = [{"node_id": r.node_id, "from_layers": list(r.from_layers), "to_layers": list(r.to_layers),
              "event": r.event, "why": r.why, "age_s": round(now - r.at, 1)} for r in book.history(model)]
    return {"stages": stages(rated_holders(request, model, now), num_layers), "healing": book.note(model),
            "moves": moves}
