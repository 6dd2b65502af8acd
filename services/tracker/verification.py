"""Spot checks: receipts verified and kept, a hop's work compared with a shadow's, a wrong node found (issue 37).

How a step is checked. For a sampled fraction (``MESHNET_VERIFY_RATE``) of the
routes it plans, the tracker names a *shadow* in the signed route
(:class:`meshwire.routes.ShadowHop`): another node holding the same layers as
one hop: the route's tail, or a hop before it (the head included) whose output and
the shadow's are batch-invariant on the same path (:data:`COMPARED_HOPS`). The hop before it
(for the head's shadow, the head itself, with the step's token ids)
sends every frame of the session to both; the shadow runs them in its own
session (it holds the same KV state, having seen the same frames) and answers
only its receipt. Both receipts come back to the head with the step's answer,
and the head reports them (``POST /v1/receipts``). Two receipts of the same
route, session, hop, step and positions, with the same input hash, are compared
by their output hash: at a tail that is the tokens answered (greedy: the argmax;
seeded: the same draw), which honest replicas agree on whatever company their
rows were batched with (but for a pick so near a tie that the batch's rounding
flips it), so sampling is checked too; at a hop before the tail it is the hidden
states sent on, which two honest replicas on one batch-invariant path compute
to the same bits whatever their batches held.

Who is wrong. A disagreement between two nodes says one of them is wrong, not
which. A node is quarantined (:mod:`.quarantine`) when it disagreed with two
other nodes that themselves agreed with each other on some step: the majority
of three replicas. With only two replicas of a range, the disagreement is
reported (each node lists its disputes in ``GET /v1/nodes``, the metrics count
it) and nobody is guessed at.

What it costs is stated in the README; everything here is bounded: the window
of receipts kept, the steps waiting for their second receipt, the agreements
and disputes remembered.
"""

from __future__ import annotations

import itertools
import logging
import random
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from prometheus_client import CollectorRegistry, Counter

from meshwire.receipts import (
    Receipt,
    ReceiptProblem,
    SeenReceipts,
    parse_receipt,
    route_digest,
    verify_receipt,
)
from meshwire.route_keys import KeyProblem, public_key_from_text
from meshwire.routes import Route, RouteNode, ShadowHop

from .planner import Candidate
from .quarantine import Quarantine

logger = logging.getLogger(__name__)

DEFAULT_VERIFY_RATE: Final = 0.02
"""Fraction of routes (so of sessions, and of steps on average) that carry a shadow when a replica exists."""
MAX_WINDOW: Final = 4096
"""Most verified receipts kept (the most recent)."""
MAX_WAITING: Final = 4096
"""Most steps waiting for a second receipt to be compared with (the oldest forgotten first)."""
MAX_PAIRS: Final = 4096
"""Most node pairs remembered as having agreed; most disputes remembered."""
MAX_REPORT_RECEIPTS: Final = 256
"""Most receipts one report may carry."""
COMPARED_HOPS: Final = "tail, and hops whose output is batch-invariant"
"""Which hops a shadow checks. The tail, whose output is the tokens it answered, always. A hop before it outputs
hidden states, which a float32 row computed through torch's BLAS does not give the same bits alone and beside
other rows (the rounding of a B-row product, a few units in the last place: ``tests/test_batched_rows.py``); a hop
and its shadow batch a session's row with different company, so their exact hashes differ for honest nodes, and
three honest replicas would soon show one of them "wrong" by majority. Such a hop is compared only where it and
its shadow both register the same batch-invariant path (``rows_exact``: every product on meshnet's native
quantized CPU kernel, :mod:`services.node.model.rows_exact`), on which a row's output is the same bits whatever
rides with it. The head too: no hop before it sends it frames, so it sends its shadow (another head) each step's
token ids itself and signs a receipt of its own step (input: that frame; output: the hidden states it sent on)."""


@dataclass(frozen=True)
class NumberFormat:
    """How a node computes, as far as an exact comparison cares: two nodes are compared only where these agree."""

    dtype: object
    weights: object
    activations: object
    rows_exact: str | None = None
    """The batch-invariant path its hop output takes (``NodeRegistration.rows_exact``), or ``None``."""


def comparable(hop: NumberFormat | None, shadow: NumberFormat | None, tail: bool) -> bool:
    """Whether a hop and a would-be shadow of it can be compared by exact hash: the same dtype, weights and
    activations; and, unless the hop is the tail (compared on its tokens), the same batch-invariant path."""
    if hop is None or shadow is None:
        return hop is None and shadow is None and tail  # an unknown format: the tail only, as before
    same = (hop.dtype, hop.weights, hop.activations) == (shadow.dtype, shadow.weights, shadow.activations)
    return same and (tail or (hop.rows_exact is not None and hop.rows_exact == shadow.rows_exact))


class ReportRefused(ValueError):
    """A receipt report holds a receipt that is forged, altered, made elsewhere or replayed; nothing was kept."""


@dataclass(frozen=True)
class Kept:
    """A verified receipt, as the window keeps it."""

    receipt: Receipt
    encoded: str


@dataclass(frozen=True)
class Dispute:
    """Two nodes' receipts of the same step from the same input, with different outputs."""

    node_id: str
    peer: str
    evidence: tuple[str, str]
    """The node's receipt, then the peer's."""


def _step_key(receipt: Receipt) -> tuple[str, str, int, int, int, int, str]:
    fields = receipt.fields
    return (fields.route, fields.session, fields.hop_index, fields.step, fields.position_offset, fields.positions,
            fields.input_sha256)


class Verifier:
    """One tracker's receipts window, comparisons and verdicts."""

    def __init__(self, quarantine: Quarantine, registry: CollectorRegistry, rate: float | None = None,
                 rng: random.Random | None = None, clock: Callable[[], float] | None = None) -> None:
        self.quarantine = quarantine
        self.rate = DEFAULT_VERIFY_RATE if rate is None else rate
        self._rng = rng or random.Random()
        self._seen = SeenReceipts() if clock is None else SeenReceipts(clock=clock)
        self.window: deque[Kept] = deque(maxlen=MAX_WINDOW)
        self._waiting: OrderedDict[tuple[str, str, int, int, int, int, str], Kept] = OrderedDict()
        self._agreed: OrderedDict[frozenset[str], None] = OrderedDict()
        self.disputes: OrderedDict[frozenset[str], Dispute] = OrderedDict()
        self.checks = Counter("meshnet_verify_checks", "Steps compared between a hop and its shadow, by outcome "
                              "(agree, disagree)", ["outcome"], registry=registry)
        self.receipts = Counter("meshnet_verify_receipts", "Receipts reported by heads, by outcome (kept, refused)",
                                ["outcome"], registry=registry)
        self.verdicts = Counter("meshnet_verify_quarantined", "Nodes quarantined for computing wrong",
                                registry=registry)
        self.shadowed = Counter("meshnet_verify_shadowed_routes", "Routes planned with a shadow (spot-checked)",
                                registry=registry)

    # --- planning ---------------------------------------------------------------------------

    def shadow_for(self, hops: Sequence[RouteNode], candidates: Collection[Candidate],
                   formats: Callable[[], Mapping[str, NumberFormat]] | None = None) -> ShadowHop | None:
        """A shadow for one hop of ``hops``, or ``None``: another node holding the same layers (not on the route,
        not quarantined, not backed off, in the same number format). The tail always may be; a hop before it,
        the head included, only where it and the shadow name the same batch-invariant path
        (:data:`COMPARED_HOPS`). A head's shadow is another head, sent each step's token ids by the head itself
        (so never one reached only through a relay).

        Which one. A shadow whose disagreement with the hop would make a verdict comes first (the hop disagreed
        with a node the candidate agreed with, or the other way round); then one that was never compared with
        the hop while either is in an unresolved dispute (a comparison a verdict may still need); then the least
        loaded, at random among equals (hops and replicas alike). Load alone would pick the same idle replica
        again and again, so a wrong node would meet only one other replica and its disputes would never make a
        majority.

        When. A route is shadowed at :attr:`rate`, and also, whatever the draw, when it can make one of those
        comparisons a dispute still needs with a pair never compared (bounded: once per pair of nodes, until it
        is compared); rate 0 checks nothing.
        """
        if self.rate <= 0 or len(hops) < 2:
            return None
        drawn = self._rng.random() < self.rate
        if not drawn and not self.disputes:
            return None
        on_route = {hop.node_id for hop in hops}
        out = self.quarantine.ids()
        known = formats() if formats is not None else {}
        against = self._open_disputes(out)
        options: list[tuple[tuple[int, int, int], int, Candidate]] = []
        for index, hop in enumerate(hops):
            tail = index == len(hops) - 1
            hop_format = known.get(hop.node_id)
            for candidate in candidates:
                if (candidate.node_id in on_route or candidate.node_id in out or candidate.backoff
                        or (index == 0 and candidate.relay_addr is not None)  # the head dials its shadow itself
                        or candidate.role == "prefill" or candidate.kv_full or candidate.hop_key is None
                        or candidate.shard_end != hop.shard_end or not candidate.shard_start <= hop.start_layer
                        or not comparable(hop_format, known.get(candidate.node_id), tail)):
                    continue
                decisive, wanted = self._worth(hop.node_id, candidate.node_id, against)
                options.append(((-decisive, -wanted, candidate.active_sessions), index, candidate))
        if not options:
            return None
        best = min(rank for rank, _, _ in options)
        if not drawn and best[1] == 0:  # no comparison a dispute needs: the draw decides, and it said no
            return None
        index, chosen = self._rng.choice([(index, candidate) for rank, index, candidate in options if rank == best])
        hop = hops[index]
        self.shadowed.inc()
        return ShadowHop(hop_index=index, node=RouteNode(
            node_id=chosen.node_id, endpoint=chosen.endpoint, shard_start=chosen.shard_start,
            shard_end=chosen.shard_end, start_layer=hop.start_layer, relay_addr=chosen.relay_addr,
            hop_key=chosen.hop_key))

    def _open_disputes(self, out: frozenset[str]) -> dict[str, set[str]]:
        """Each node in an unresolved dispute (neither side quarantined): the nodes it disagreed with."""
        against: dict[str, set[str]] = {}
        for pair in self.disputes:
            if not pair & out:
                first, second = sorted(pair)
                against.setdefault(first, set()).add(second)
                against.setdefault(second, set()).add(first)
        return against

    def _worth(self, x: str, y: str, against: dict[str, set[str]]) -> tuple[int, int]:
        """What comparing ``x`` with ``y`` now is worth to the open disputes: (1 when a disagreement would make a
        verdict, else 0; 1 when the pair was never compared and either is disputed, else 0)."""
        if not against:
            return 0, 0
        pair = frozenset((x, y))
        if pair in self.disputes:
            return 0, 0
        decisive = any(frozenset((p, y)) in self._agreed for p in against.get(x, ()) if p != y) or any(
            frozenset((p, x)) in self._agreed for p in against.get(y, ()) if p != x)
        wanted = pair not in self._agreed and (x in against or y in against)
        return int(decisive), int(wanted)

    # --- reports ------------------------------------------------------------------------------

    def verify(self, route: Route, route_token: str, encoded: Sequence[str]) -> list[Kept]:
        """Every receipt of a report, verified against the route it was made on (the hop key the route names
        for its node), and new; :class:`ReportRefused` naming the first that is not (nothing kept then)."""
        if len(encoded) > MAX_REPORT_RECEIPTS:
            raise ReportRefused(f"a report carries at most {MAX_REPORT_RECEIPTS} receipts, not {len(encoded)}")
        digest = route_digest(route_token)
        kept: list[Kept] = []
        for number, text in enumerate(encoded):
            try:
                receipt = parse_receipt(text)
                fields = receipt.fields
                if fields.route != digest:
                    raise ReceiptProblem("the receipt was made on another route than the report names: a replay")
                placed = route.at(fields.hop_index, fields.node_id)
                if placed is None or placed[0].hop_key is None:
                    raise ReceiptProblem(f"the route does not name {fields.node_id[:100]} (with a hop key) at hop "
                                         f"{fields.hop_index}")
                verify_receipt(receipt, _key(placed[0].hop_key), route_token=route_token, session=fields.session,
                               node_id=fields.node_id, hop_index=fields.hop_index, step=fields.step,
                               position_offset=fields.position_offset, positions=fields.positions)
            except ReceiptProblem as exc:
                self.receipts.labels(outcome="refused").inc()
                raise ReportRefused(f"receipt {number}: {exc}") from None
            kept.append(Kept(receipt, text.strip()))
        fresh = [item for item in kept if self._seen.first_time(item.receipt)]
        if len(fresh) != len(kept):
            self.receipts.labels(outcome="refused").inc(len(kept) - len(fresh))
            raise ReportRefused("the report repeats a receipt already reported: a replay")
        return kept

    def keep(self, kept: Sequence[Kept]) -> list[Dispute]:
        """Add verified receipts to the window and compare each with the other receipt of its step, if any; the
        new disputes."""
        found: list[Dispute] = []
        for item in kept:
            self.window.append(item)
            self.receipts.labels(outcome="kept").inc()
            key = _step_key(item.receipt)
            other = self._waiting.get(key)
            if other is None:
                self._waiting[key] = item
                while len(self._waiting) > MAX_WAITING:
                    self._waiting.popitem(last=False)
                continue
            if other.receipt.fields.node_id == item.receipt.fields.node_id:
                continue
            del self._waiting[key]
            dispute = self._compare(other, item)
            if dispute is not None:
                found.append(dispute)
        return found

    def _compare(self, first: Kept, second: Kept) -> Dispute | None:
        a, b = first.receipt.fields, second.receipt.fields
        pair = frozenset((a.node_id, b.node_id))
        if a.output_sha256 == b.output_sha256:
            self.checks.labels(outcome="agree").inc()
            self._agreed[pair] = None
            self._agreed.move_to_end(pair)
            while len(self._agreed) > MAX_PAIRS:
                self._agreed.popitem(last=False)
            return None
        self.checks.labels(outcome="disagree").inc()
        dispute = Dispute(a.node_id, b.node_id, (first.encoded, second.encoded))
        if pair not in self.disputes:  # the first of a pair's disagreements is news; the rest are counted
            logger.warning("nodes %s and %s computed step %d of session %s differently from the same input",
                           a.node_id, b.node_id, a.step, a.session[:12])
        self.disputes.setdefault(pair, dispute)
        while len(self.disputes) > MAX_PAIRS:
            self.disputes.popitem(last=False)
        return dispute

    def verdicts_due(self) -> list[tuple[str, str, tuple[str, ...]]]:
        """The nodes shown wrong and not yet quarantined: each disagreed with two nodes that agree with each other.
        With the reason and evidence (its receipt and the two others')."""
        against: dict[str, dict[str, tuple[str, str]]] = {}
        for dispute in self.disputes.values():
            against.setdefault(dispute.node_id, {})[dispute.peer] = dispute.evidence
            against.setdefault(dispute.peer, {})[dispute.node_id] = (dispute.evidence[1], dispute.evidence[0])
        out = self.quarantine.ids()
        due: list[tuple[str, str, tuple[str, ...]]] = []
        for node_id, peers in against.items():
            if node_id in out:
                continue
            for p, q in itertools.combinations(sorted(peers), 2):
                if frozenset((p, q)) in self._agreed and p not in out and q not in out:
                    reason = (f"its output differed from those of {p} and {q} on the same input, and {p} and {q} "
                              "agree with each other")
                    due.append((node_id, reason, (peers[p][0], peers[p][1], peers[q][1])))
                    break
        return due

    def disputes_of(self, node_id: str) -> list[str]:
        """The nodes ``node_id`` disagreed with, unresolved (no third replica has settled it)."""
        return sorted({d.peer if d.node_id == node_id else d.node_id for d in self.disputes.values()
                       if node_id in (d.node_id, d.peer)})

    def forget(self, node_id: str) -> None:
        """Drop ``node_id``'s disputes (it was re-admitted: its record starts afresh)."""
        for pair in [pair for pair in self.disputes if node_id in pair]:
            del self.disputes[pair]


def verification_view(verifier: Verifier, node_id: str) -> dict[str, object]:
    """What ``GET /v1/nodes`` adds to a node: ``quarantined`` (with the reason and the receipts that show it), and
    the nodes it disagreed with where no third replica has settled who is wrong."""
    record = verifier.quarantine.get(node_id)
    view: dict[str, object] = {"quarantined": record is not None, "disputes": verifier.disputes_of(node_id)}
    if record is not None:
        view["quarantine"] = record.view()
    return view


def _key(text: str) -> Ed25519PublicKey:
    try:
        return public_key_from_text(text)
    except KeyProblem as exc:
        raise ReceiptProblem(f"the route's hop key is unreadable: {exc}") from None
