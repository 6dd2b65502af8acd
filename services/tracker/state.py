"""What one running tracker holds, and the two questions every route asks of it.

:class:`TrackerState` bundles the settings, the store (and its registry), the metrics, the
clock and the HTTP client to head nodes; the app keeps one in
``app.state.tracker``. :meth:`TrackerState.resolve_model` and
:meth:`TrackerState.route_for` turn the registry's answers into the errors the
design card names: an unknown model is a 404, a model without a complete route
a 503 naming the missing layers.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Final

import httpx
from fastapi import Request

from meshwire import errors, limits
from meshwire.pd_group import PrefillAssignment
from meshwire.registry import NodeRegistration
from meshwire.routes import Route, RouteNode, SignedRoute, issue_signed_route

from .failure_reports import Gate, LocalGate
from .key_limits import KeyLimiter
from .metrics import TrackerMetrics
from .pd_routes import PREFILL_ROLE, plan_prefill_route, prefill_group
from .planner import Candidate, IncompleteCoverage, RouteTooLong, format_ranges, plan_route
from .quarantine import Quarantine
from .ratings import Ratings
from .registry import Registry, RegistryPolicy, resolve_model_name
from .responses import HTTPError
from .revocations import Revocations
from .settings import TrackerSettings
from .store import NodeStore, open_store
from .trust import NoSigningKey, TrackerTrust
from .verification import NumberFormat, Verifier

logger = logging.getLogger(__name__)

MAX_MODELS_NAMED: Final = 10
"""Most known model names listed in a 404's message."""
MAX_EXCLUDED: Final = 256
"""Most node ids one ``exclude`` may name."""


@dataclass
class TrackerState:
    """The tracker's state and collaborators (one per app)."""

    settings: TrackerSettings
    store: NodeStore
    metrics: TrackerMetrics
    trust: TrackerTrust
    clock: Callable[[], float] = time.monotonic
    client: httpx.AsyncClient | None = field(default=None)
    """The HTTP client to head nodes; opened and closed by the app's lifespan."""
    key_limiter: KeyLimiter | None = None
    """Counts each API key's requests against its limits (with ``MESHNET_API_KEYS`` set)."""
    ratings: Ratings = field(default_factory=Ratings)
    """Each node's speed as measured on the streams relayed (the planner's speeds, :mod:`.ratings`): the store's,
    so shared by every tracker of a Redis store."""
    failure_gate: Gate = field(default_factory=lambda: LocalGate(window_s=120.0))
    """Who may put a node in failure backoff, how often, on whose word (:mod:`.failure_reports`): the store's."""
    background: set[asyncio.Task[None]] = field(default_factory=set)
    """Failure reports being judged and applied in the background (held here until done)."""
    may_heal: Callable[[str, Collection[str]], bool] = lambda _model, _live: False
    """Whether a gap in a model may close by itself: the placement book's answer for the live node ids
    (:meth:`.healing.PlacementBook.may_heal`, wired by the app). A no-route answer then says ``healing``, and
    whoever waits on the route (a head's failover, the tracker's own stream continuation) asks again."""
    verifier: Verifier = field(init=False)
    """Receipts, spot checks and the quarantine (:mod:`.verification`), on this tracker's store and metrics."""

    def __post_init__(self) -> None:
        self.verifier = Verifier(Quarantine(self.store, self.clock), self.metrics.registry,
                                 rate=self.settings.verify_rate)

    @classmethod
    def create(cls, settings: TrackerSettings, clock: Callable[[], float] = time.monotonic) -> TrackerState:
        store = open_store(settings.store, RegistryPolicy(
            ttl_s=settings.node_ttl_s, suspect_s=settings.suspect_s, offline_keep_s=settings.offline_keep_s,
            max_nodes=settings.max_nodes, backoff_s=settings.failure_backoff_s,
            backoff_max_s=settings.failure_backoff_max_s, failure_reset_s=settings.failure_reset_s,
        ), clock)
        metrics = TrackerMetrics(nodes=lambda: store.registry.snapshot(clock()),
                                 coverage=lambda: store.registry.coverage(clock()),
                                 store_up=lambda: store.available)
        limiter = (store.key_limiter(settings.key_requests_per_minute, settings.key_max_streams)
                   if settings.api_keys else None)
        trust = TrackerTrust(store, secret=settings.secret, route_ttl_s=settings.route_ttl_s,
                             rotate_s=settings.route_key_rotate_s, lead_s=settings.route_key_lead_s)
        return cls(settings=settings, store=store, metrics=metrics, trust=trust, clock=clock, key_limiter=limiter,
                   ratings=store.ratings, failure_gate=store.failure_gate(settings.failure_reset_s))

    @property
    def revoked(self) -> Revocations:
        """Node ids whose join token was revoked, through any tracker of the store (until they join again by a
        valid token): the streams this tracker relays through them leave their route at the next token, and
        every node is told in its heartbeat answer (:mod:`.revocations`)."""
        return self.store.revocations

    @property
    def registry(self) -> Registry:
        """The registry routes are planned from: the store's own, or its view of a shared store."""
        return self.store.registry

    def now(self) -> float:
        return self.clock()

    def http(self) -> httpx.AsyncClient:
        if self.client is None:
            raise RuntimeError("the tracker's HTTP client is not open (is the app's lifespan running?)")
        return self.client

    def resolve_model(self, requested: str) -> str:
        """The registered model name ``requested`` means (exact, or a unique basename); 404 otherwise."""
        known = self.registry.models(self.now())
        resolved = resolve_model_name(requested, known)
        if resolved is None:
            raise self._unknown_model(requested, known)
        return resolved

    @staticmethod
    def _unknown_model(requested: str, known: Collection[str]) -> HTTPError:
        names = sorted(known)[:MAX_MODELS_NAMED]
        hint = f"; this mesh serves {', '.join(repr(n) for n in names)}" if names else "; no node has registered"
        return HTTPError(404, f"The model {requested[:200]!r} does not exist{hint}.",
                         errors.INVALID_REQUEST, "model_not_found", "model")

    def route_for(self, model: str, exclude: Collection[str] = ()) -> SignedRoute:
        """A signed route through live nodes for ``model`` (a resolved name); 503 naming any gap."""
        now = self.now()
        models = self.registry.models(now)
        num_layers = models.get(model)
        if num_layers is None:  # forgotten since it was resolved
            raise self._unknown_model(model, models)
        candidates = self.ratings.rated(self.registry.candidates(model, now))
        try:
            hops = _plan_decode_route(candidates, num_layers, frozenset(exclude) | self.verifier.quarantine.ids())
        except IncompleteCoverage as gap:
            self.metrics.routes.labels("incomplete").inc()
            excluded = f" (excluding {', '.join(sorted(exclude))})" if exclude else ""
            healing = self.may_heal(model, {c.node_id for c in candidates} - set(exclude))
            raise HTTPError(
                503, f"No complete route for model {model!r}: no live node holds layers "
                     f"{format_ranges(gap.missing)} of {num_layers}{excluded}.",
                errors.UNAVAILABLE, "no_route", "model",
                headers={"Retry-After": str(math.ceil(self.settings.heartbeat_s))},
                missing_layers=[list(r) for r in gap.missing], num_layers=num_layers,
                **({"healing": True} if healing else {}),  # placed nodes may be moved onto the gap: ask again
            ) from None
        except RouteTooLong as exc:
            self.metrics.routes.labels("incomplete").inc()
            raise HTTPError(503, str(exc), errors.UNAVAILABLE, "route_too_long", "model") from None
        self.metrics.routes.labels("planned").inc()
        route = Route(model=model, nodes=hops, num_layers=num_layers,
                      shadow=self.verifier.shadow_for(hops, [c for c in candidates if c.node_id not in exclude],
                                                      self._formats))
        try:
            key = self.trust.signing_key()
        except NoSigningKey as exc:
            raise store_unavailable(str(exc), self.settings.heartbeat_s) from None
        return issue_signed_route(route, key, ttl_s=self.settings.route_ttl_s, now=time.time())

    def _formats(self) -> dict[str, NumberFormat]:
        """Each node's number format (dtype, weights, activations, batch-invariant path): a shadow is compared bit
        for bit, so it must match (int8 rows and float32 rows of one quantized layer compute different bits), and a
        hop before the tail is compared only where both name the same batch-invariant path."""
        return {node.node_id: NumberFormat(node.dtype, node.weights, node.activations or "float32", node.rows_exact)
                for node in self.registry.snapshot(self.now())}

    def prefill_route_for(self, model: str) -> SignedRoute | None:
        """A signed route through a ready replica of ``model``'s prefill group, or ``None`` (no prefill/decode split)."""
        now = self.now()
        num_layers = self.registry.models(now).get(model)
        if num_layers is None:
            return None
        hops = plan_prefill_route(self.registry.candidates(model, now), num_layers)
        if hops is None:
            return None
        self.metrics.routes.labels("prefill").inc()
        route = Route(model=model, nodes=hops, num_layers=num_layers)
        try:
            key = self.trust.signing_key()
        except NoSigningKey:
            return None  # the key ring is away: no prefill route, the request takes today's path
        return issue_signed_route(route, key, ttl_s=self.settings.route_ttl_s, now=time.time())

    def prefill_assignment(self, registration: NodeRegistration) -> PrefillAssignment | None:
        """A prefill node's place in its model's prefill group (what it registers in the bootstrap registry)."""
        if registration.role != PREFILL_ROLE:
            return None
        num_layers = self.registry.models(self.now()).get(registration.model)
        if num_layers is None:
            return None
        group = prefill_group(self.registry.candidates(registration.model, self.now()), num_layers)
        return None if group is None else group.assignment(registration.node_id)


def _plan_decode_route(candidates: Collection[Candidate], num_layers: int,
                       exclude: frozenset[str]) -> tuple[RouteNode, ...]:
    """A route for a whole request or its decode: prefill-only nodes only where nobody else holds their layers."""
    others = [c for c in candidates if c.role != PREFILL_ROLE]
    if len(others) == len(candidates):
        return plan_route(candidates, num_layers, exclude=exclude)
    try:
        return plan_route(others, num_layers, exclude=exclude)
    except (IncompleteCoverage, RouteTooLong):
        return plan_route(candidates, num_layers, exclude=exclude)


def store_unavailable(reason: str, retry_after_s: float) -> HTTPError:
    """The 503 every request that needs the store gets while it is away (with ``Retry-After``)."""
    return HTTPError(503, f"The tracker's store is unavailable: {reason[:300]}. Retry shortly.",
                     errors.UNAVAILABLE, errors.STORE_UNAVAILABLE, None,
                     headers={"Retry-After": str(max(math.ceil(retry_after_s), 1))})


def tracker_state(request: Request) -> TrackerState:
    """The :class:`TrackerState` of the app serving ``request``."""
    state: TrackerState = request.app.state.tracker
    return state


def parse_exclude(values: list[str]) -> frozenset[str]:
    """Node ids from ``exclude=a,b`` and/or repeated ``exclude=`` parameters; bounded."""
    ids = {part.strip() for value in values for part in value.split(",") if part.strip()}
    if len(ids) > MAX_EXCLUDED:
        raise HTTPError(400, f"exclude lists more than {MAX_EXCLUDED} nodes",
                        errors.INVALID_REQUEST, "too_many_excluded", "exclude")
    if any(len(node_id) > limits.MAX_ID_CHARS for node_id in ids):
        raise HTTPError(400, f"a node id in exclude is longer than {limits.MAX_ID_CHARS} characters",
                        errors.INVALID_REQUEST, "bad_exclude", "exclude")
    return frozenset(ids)
