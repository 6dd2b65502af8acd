"""Placement: which layers a node that joins without ``--layers`` should hold.

This module is pure (no clock, no I/O): it receives what one layer costs the
asking node, the node's memory budget and the ranges live nodes hold now, and
answers one inclusive range and why.

The rules, in order:

1. **Cover every layer first.** While some layers have no holder, the node takes
   the uncovered run it can hold most of (filled from the run's start, or from its
   end where that holds more, e.g. when the run's first layer carries the
   embedding); ties go to the lower layer.
2. **Then speed up the slowest stage.** Once covered, every distinct held range is
   a stage; a layer's time is one over the sum of its holders' speeds (replicas
   serve in parallel), and a stage's time the sum over its layers, so a stage of
   ``n`` layers at ``s`` seconds a layer held by ``r`` equal replicas takes
   ``n x s / r``. The node takes a replica of the slowest stage it can hold (all
   of it, else as much of it as fits); ties go to the lower range.
3. **Memory bounds everything.** A range fits when its weights (``layer_bytes``
   a layer, plus the embedding on the first layer and the LM head on the last)
   and ``kv_reserve_tokens`` tokens of KV cache per layer stay within the
   budget. Speed never buys the asking node layers here: a node that claims to be
   fast gets no more than its memory holds (once the model is covered, the tracker
   re-cuts the placed nodes by speed within their budgets: :mod:`.placement_tune`),
   and every speed figure is clamped to
   [:data:`MIN_SECONDS_PER_LAYER`, :data:`MAX_SECONDS_PER_LAYER`] so one absurd
   claim (1e300 tokens a second) cannot dwarf every honest figure.

A node that cannot hold a single layer anywhere is refused (:class:`CannotHoldLayer`),
naming its budget and what the cheapest layer needs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from meshwire.placement import PlacementReason

MIN_SECONDS_PER_LAYER: Final = 1e-6
"""Fastest speed claim believed: a microsecond a layer for one decode row."""
MAX_SECONDS_PER_LAYER: Final = 60.0
"""Slowest speed believed: a minute a layer."""
DEFAULT_SECONDS_PER_LAYER: Final = 1e-3
"""A holder's speed where it reported none and nobody else did either."""
DEFAULT_KV_RESERVE_TOKENS: Final = 1024
"""Tokens of KV cache each placed layer keeps room for within the node's budget."""


class CannotHoldLayer(ValueError):
    """The node's budget is smaller than the cheapest single layer (with its KV room) needs."""

    def __init__(self, budget_bytes: int, needed_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.needed_bytes = needed_bytes
        super().__init__(f"a memory budget of {format_bytes(budget_bytes)} cannot hold one layer of this model: "
                         f"one layer needs {format_bytes(needed_bytes)} (weights and KV room)")


@dataclass(frozen=True)
class LayerCosts:
    """What the model's layers cost the asking node, in the format it will hold them."""

    num_layers: int
    layer_bytes: int
    """Weights of one decoder layer."""
    kv_bytes_per_token: int
    """KV cache of one token in one layer."""
    head_bytes: int = 0
    """Extra weights of the first layer's holder (the embedding)."""
    tail_bytes: int = 0
    """Extra weights of the last layer's holder (the final norm and LM head)."""

    @property
    def tail_extra_layers(self) -> float:
        """The LM head's decode cost counted in layers: its bytes over a layer's (a decode row reads every
        weight once, so on the memory-bound devices nodes run on its time follows its bytes)."""
        return self.tail_bytes / self.layer_bytes if self.layer_bytes > 0 else 0.0

    def needed_bytes(self, start: int, end: int, kv_reserve_tokens: int) -> int:
        """Bytes layers ``start..end`` take with ``kv_reserve_tokens`` tokens of KV room each."""
        count = end - start + 1
        extra = (self.head_bytes if start == 0 else 0) + (self.tail_bytes if end == self.num_layers - 1 else 0)
        return count * (self.layer_bytes + kv_reserve_tokens * self.kv_bytes_per_token) + extra


@dataclass(frozen=True)
class Holder:
    """A live node of the model and the range it holds, with its speed (seconds a layer; 0: unknown)."""

    node_id: str
    start: int
    end: int
    seconds_per_layer: float = 0.0


@dataclass(frozen=True)
class Placement:
    """The range a node is told to load (inclusive) and why."""

    start: int
    end: int
    reason: PlacementReason


def clamp_speed(seconds_per_layer: float) -> float:
    """A speed figure within what is believed (see the module doc)."""
    return min(max(seconds_per_layer, MIN_SECONDS_PER_LAYER), MAX_SECONDS_PER_LAYER)


def format_bytes(count: int) -> str:
    """``count`` bytes for a person: ``1.0 MiB``, ``512 B``."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{count} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def uncovered_runs(holders: Iterable[Holder], num_layers: int) -> list[tuple[int, int]]:
    """Inclusive runs of layers no holder holds, lowest first."""
    held = [False] * num_layers
    for holder in holders:
        for layer in range(max(holder.start, 0), min(holder.end, num_layers - 1) + 1):
            held[layer] = True
    runs: list[tuple[int, int]] = []
    layer = 0
    while layer < num_layers:
        if held[layer]:
            layer += 1
            continue
        first = layer
        while layer < num_layers and not held[layer]:
            layer += 1
        runs.append((first, layer - 1))
    return runs


def _longest_anchored(costs: LayerCosts, budget: int, low: int, high: int, kv_tokens: int) -> list[tuple[int, int]]:
    """The longest fitting ranges inside ``low..high`` that start at ``low`` and that end at ``high``."""
    found: list[tuple[int, int]] = []
    for anchored_at_start in (True, False):
        count = 0
        while count < high - low + 1:
            start, end = (low, low + count) if anchored_at_start else (high - count, high)
            if costs.needed_bytes(start, end, kv_tokens) > budget:
                break
            count += 1
        if count:
            found.append((low, low + count - 1) if anchored_at_start else (high - count + 1, high))
    return found


def _best_within(costs: LayerCosts, budget: int, first: int, last: int, kv_tokens: int) -> tuple[int, int] | None:
    """The longest range inside ``first..last`` that fits, from the run's start or its end; ties to the start.

    Only where nothing fits at either edge (the edge layer carries an embedding or LM head too big for the
    budget) does it look just inside that layer, so runs are filled from their edges and not split.
    """
    n = costs.num_layers
    found = _longest_anchored(costs, budget, first, last, kv_tokens)
    if not found:
        inner_first = first + 1 if first == 0 else first
        inner_last = last - 1 if last == n - 1 else last
        if inner_first <= inner_last:
            found = _longest_anchored(costs, budget, inner_first, inner_last, kv_tokens)
    return min(found, key=lambda r: (r[0] - r[1], r[0])) if found else None


def stage_times(holders: Sequence[Holder], num_layers: int,
                tail_extra_layers: float = 0.0) -> dict[tuple[int, int], float]:
    """Seconds a decode row spends in each distinct held range, replicas serving in parallel.

    ``tail_extra_layers``: the LM head's cost in layers (:meth:`LayerCosts.tail_extra_layers`), added to
    every stage that ends at the last layer, shared by those stages' holders as a layer is.
    """
    known = [h.seconds_per_layer for h in holders if h.seconds_per_layer > 0]
    fallback = sorted(known)[len(known) // 2] if known else DEFAULT_SECONDS_PER_LAYER
    rate = [0.0] * (num_layers + 1)  # layers a second each layer's holders run together; the LM head last
    for holder in holders:
        seconds = clamp_speed(holder.seconds_per_layer if holder.seconds_per_layer > 0 else fallback)
        for layer in range(holder.start, holder.end + 1):
            rate[layer] += 1.0 / seconds
        if holder.end == num_layers - 1:
            rate[num_layers] += 1.0 / seconds
    tail_s = tail_extra_layers / rate[num_layers] if tail_extra_layers > 0 and rate[num_layers] > 0 else 0.0
    return {(h.start, h.end): sum(1.0 / rate[layer] for layer in range(h.start, h.end + 1))
            + (tail_s if h.end == num_layers - 1 else 0.0) for h in holders}


def place(costs: LayerCosts, budget_bytes: int, holders: Iterable[Holder],
          kv_reserve_tokens: int = DEFAULT_KV_RESERVE_TOKENS) -> Placement:
    """Where a node with ``budget_bytes`` should serve, given who holds what now (see the module doc)."""
    n = costs.num_layers
    valid = sorted((h for h in holders if 0 <= h.start <= h.end < n), key=lambda h: (h.start, h.end, h.node_id))
    cheapest = min(costs.needed_bytes(layer, layer, kv_reserve_tokens) for layer in {0, min(1, n - 1), n - 1})
    if cheapest > budget_bytes:
        raise CannotHoldLayer(budget_bytes, cheapest)
    covering: list[tuple[int, int]] = []
    for first, last in uncovered_runs(valid, n):
        if (found := _best_within(costs, budget_bytes, first, last, kv_reserve_tokens)) is not None:
            covering.append(found)
    if covering:
        start, end = min(covering, key=lambda r: (-(r[1] - r[0]), r[0]))
        return Placement(start, end, "covering")
    times = stage_times(valid, n)
    for (first, last), _ in sorted(times.items(), key=lambda item: (-round(item[1], 12), item[0])):
        if (found := _best_within(costs, budget_bytes, first, last, kv_reserve_tokens)) is not None:
            return Placement(found[0], found[1], "replica")
    # Every stage's layers are out of reach (each carries an embedding or LM head too big): one layer anywhere.
    for layer in range(n):
        if costs.needed_bytes(layer, layer, kv_reserve_tokens) <= budget_bytes:
            return Placement(layer, layer, "replica")
    raise CannotHoldLayer(budget_bytes, cheapest)  # pragma: no cover - the cheapest layer fits, checked above

