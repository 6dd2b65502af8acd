"""Forwarding one front-door request to a head node: one path per kind of answer the client gets.

Every path holds the request's :class:`~.route_lease.RouteLease` (its route's nodes carry it as
load until it ends, whatever ends it) and asks a route's head with :func:`open_route` (a second
route that avoids a head that failed to answer); then:

- :func:`relayed`: the head's answer relayed as it is, as it arrives (the Responses API);
- :func:`streamed`: a chat or completion stream relayed as it arrives and continued on another
  head when its head dies (:mod:`.continuation`);
- :func:`collected`: that stream assembled into the one JSON answer of a non-streamed request
  (:mod:`.collect`);
- :func:`several`: ``n > 1``, every choice such a stream of its own along one shared route
  (:func:`choice_payloads`), merged by :func:`.choices.several_choices`.

Chats and completions ask the head for progress, so that they outlive it; their tokens are
counted under the request's API key when the lease ends, and a stream that ran on its first
route from start to end is a measure of that route's nodes' speed (:mod:`.ratings`). A stream
through a node whose join token was revoked leaves its route at the next token (continued on
another, the head not reported). Failures are reported on the terms of :mod:`.failure_reports`:
what the tracker saw itself as the tracker's word, a hop a head blames as that head's word.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, replace
from typing import Final

import httpx
from fastapi.responses import Response

from meshwire.fork import ChoiceGroup
from meshwire.openai import SamplingRequest
from meshwire.routes import SignedRoute

from .choices import ChoicePayloads, several_choices
from .collect import collect
from .continuation import ContinuedStream, StreamHistory
from .failure_reports import TRACKER, TooManyReports, run_of
from .proxy import HeadError, HeadRefused, PrefillOffer, ProxiedResponse, first_byte_timer, open_head, relay
from .registry import UnknownNode
from .responses import HTTPError
from .route_lease import RouteLease
from .state import TrackerState
from .store import StoreUnavailable

logger = logging.getLogger(__name__)

ROUTE_ATTEMPTS: Final = 2
"""Routes tried per request: the first, and one more avoiding a head that failed."""
GROUP_ID_BYTES: Final = 8
"""Random bytes of the id marking the choices of one ``n > 1`` request as one group (``meshwire.fork``)."""


@dataclass(frozen=True)
class Forward:
    """What one request sends to a head, and how."""

    model: str
    """The registered model name (resolved from what the client typed)."""
    path: str
    """The head's path (the front door's own: ``/v1/chat/completions``...)."""
    body: bytes
    """The validated request, as the head gets it."""
    key_id: str | None = None
    """The API key's id the answer's tokens are counted under, when keys are on."""
    route: SignedRoute | None = None
    """The first route to try (else the mesh's choice)."""
    choice_group: ChoiceGroup | None = None
    """The ``n > 1`` request this is one choice of."""


async def relayed(state: TrackerState, sent: Forward) -> Response:
    """The head's answer relayed as it is, as it arrives; a head that breaks mid-answer is reported."""
    async with RouteLease(state.registry) as lease:
        upstream, route, _ = await open_route(state, sent, lease, progress=False)
        head = route.nodes[0].node_id
        body = relay(upstream, lambda reason: report(state, head, f"broke mid-answer: {reason}"))
        return ProxiedResponse(upstream, lease.hand_over(), body)


async def streamed(state: TrackerState, sent: Forward) -> Response:
    """A stream relayed as it arrives, continued on another head if its head dies."""
    async with RouteLease(state.registry) as lease:
        upstream, route, started = await open_route(state, sent, lease, progress=True)
        events = _continued(state, sent, lease, route, started).events(upstream, route)
        return ProxiedResponse(upstream, lease.hand_over(), events)


async def collected(state: TrackerState, sent: Forward, *, chat: bool) -> Response:
    """The one JSON answer (a chat's when ``chat``) assembled from the stream ``sent`` asks for, across heads."""
    async with RouteLease(state.registry) as lease:
        upstream, route, started = await open_route(state, sent, lease, progress=True)
        answer = await collect(_continued(state, sent, lease, route, started).payloads(upstream, route), chat=chat)
    return Response(answer, media_type="application/json")


async def choice_payloads(state: TrackerState, sent: Forward) -> ChoicePayloads:
    """One choice's stream as parsed events (continued across heads), and the close that ends its lease."""
    async with RouteLease(state.registry) as lease:
        upstream, route, started = await open_route(state, sent, lease, progress=True)
        payloads = _continued(state, sent, lease, route, started).payloads(upstream, route)
        return ChoicePayloads(payloads, lease.hand_over().end)


async def several(state: TrackerState, sent: Forward, parsed: SamplingRequest, *, chat: bool) -> Response:
    """``parsed.choices`` choices of one request along one route (its head prefills the prompt once)."""
    await state.trust.ready()
    shared = state.route_for(sent.model, set())
    group = secrets.token_hex(GROUP_ID_BYTES)

    async def open_choice(body: bytes, index: int) -> ChoicePayloads:
        choice = ChoiceGroup(group, index, parsed.choices)
        return await choice_payloads(state, replace(sent, body=body, route=shared, choice_group=choice))

    return await several_choices(open_choice, sent.body, parsed, chat=chat)


async def open_route(state: TrackerState, sent: Forward, lease: RouteLease, *,
                     progress: bool) -> tuple[httpx.Response, SignedRoute, float]:
    """A head's open, relayable answer to ``sent``, its route (held by ``lease``), and when
    (``time.perf_counter``) the request was sent to that head.

    A head that refuses or fails before answering is avoided (and reported when it failed) on one
    more route; raises the :class:`HTTPError` the client gets when no head answers (the last head's
    own error, when it gave one). A failed head's answer may blame a hop of its route: that is the
    head's word (a stranger named blames the head). ``progress``: ask for token ids in the events
    (to continue the stream).
    """
    exclude: set[str] = set()
    refused: HeadRefused | None = None
    await state.trust.ready()
    for attempt in range(ROUTE_ATTEMPTS):
        try:
            route = sent.route if attempt == 0 and sent.route is not None else state.route_for(sent.model, exclude)
        except HTTPError:
            if refused is not None:
                raise refused.error from None  # no other route: the head's own answer says most
            raise
        lease.hold(route)
        elapsed = first_byte_timer()
        started = time.perf_counter()
        outcome = await open_head(state.http(), route, sent.path, sent.body, state.trust.signing_key(),
                                  progress=progress, prefill=_prefill_offer(state, sent.model),
                                  choice_group=sent.choice_group)
        if isinstance(outcome, HeadError):
            raise outcome.error
        if isinstance(outcome, httpx.Response):
            state.metrics.first_byte.observe(elapsed())
            lease.keep_open(outcome)
            return outcome, route, started
        lease.hold(None)
        refused = outcome
        logger.warning("route %d for %s: head %s did not answer (%s); %s", attempt + 1, sent.model,
                       route.nodes[0].node_id, outcome.reason,
                       "trying another route" if attempt + 1 < ROUTE_ATTEMPTS else "giving up")
        culprit = _culprit(route, outcome.culprit)
        if outcome.failed:
            # The tracker saw the head fail itself; a hop the head blames is the head's word (see .failure_reports).
            report(state, culprit, outcome.reason, reporter=TRACKER if culprit == route.nodes[0].node_id
                   else route.nodes[0].node_id)
        exclude.add(culprit)
        if attempt + 1 < ROUTE_ATTEMPTS:
            state.metrics.proxy_retries.inc()
    assert refused is not None
    raise refused.error


def _continued(state: TrackerState, sent: Forward, lease: RouteLease, route: SignedRoute,
               started: float) -> ContinuedStream:
    """The stream's history kept and continued on another head if this one dies; the lease follows it from
    route to route, and the answer's tokens are counted when it ends. ``route`` is the first route (its head
    asked at ``started``): a stream that ends on it measures its nodes (:func:`_measure`)."""
    first = tuple(hop.node_id for hop in route.nodes)
    last = [first]  # the nodes of the route the stream is on (kept past the lease's end, which takes them off)

    def on_route(new: SignedRoute | None) -> None:
        lease.hold(new)
        last[0] = lease.nodes

    def cut() -> str | None:  # a node revoked or quarantined mid-stream: the stream moves to a route without it
        revoked = state.revoked.among(lease.nodes) if len(state.revoked) else None
        if revoked:
            return f"node {min(revoked)}'s join token was revoked"
        quarantined = state.verifier.quarantine.ids().intersection(lease.nodes)
        return f"node {min(quarantined)} was quarantined (it computed wrong)" if quarantined else None

    async def reopen(route: SignedRoute, body: bytes) -> httpx.Response | HeadRefused | HeadError:
        state.metrics.proxy_retries.inc()
        return await open_head(state.http(), route, sent.path, body, state.trust.signing_key(), progress=True)

    stream = ContinuedStream(body=sent.body, route_for=lambda avoid: state.route_for(sent.model, avoid),
                             open_head=reopen, on_failed=lambda node_id, reason: report(state, node_id, reason),
                             on_route=on_route, attempts=state.settings.continue_attempts,
                             deadline_s=state.settings.continue_deadline_s, cut=cut)
    key_id = sent.key_id
    if key_id is not None:
        lease.at_end(lambda: _count_tokens(state, key_id, stream.history))
    lease.at_end(lambda: _measure(state, route, first, last[0], stream.history, started))
    return stream


def _measure(state: TrackerState, route: SignedRoute, first: tuple[str, ...], current: tuple[str, ...],
             history: StreamHistory, started: float) -> None:
    """A stream that ran on one route to its end is a measure of that route's nodes (see :mod:`.ratings`)."""
    if first != current or not history.finished or history.first_token_at is None \
            or history.last_token_at is None:
        return
    state.ratings.observe(first, route.num_layers, history.first_token_at - started,
                          history.last_token_at - started, len(history.ids))


def _count_tokens(state: TrackerState, key_id: str, history: StreamHistory) -> None:
    """An answer's tokens under its API key: the usage when it came, else the tokens relayed."""
    usage = history.usage or {}
    completion = usage.get("completion_tokens")
    completion = completion if isinstance(completion, int) and completion >= 0 else len(history.ids)
    state.metrics.key_tokens.labels(key_id, "completion").inc(completion)
    prompt = usage.get("prompt_tokens")
    if isinstance(prompt, int) and prompt >= 0:
        state.metrics.key_tokens.labels(key_id, "prompt").inc(prompt)


def _prefill_offer(state: TrackerState, model: str) -> PrefillOffer | None:
    """A prefill route for the head to prefill a long prompt along, when the mesh has a ready prefill group."""
    route = state.prefill_route_for(model)
    return None if route is None else PrefillOffer(route, state.settings.pd_min_prompt_tokens)


def _culprit(route: SignedRoute, blamed: str) -> str:
    """The node a failed head's answer blames, when it is on the route; else the head (it named a stranger)."""
    return blamed if blamed in {hop.node_id for hop in route.nodes} else route.nodes[0].node_id


def report(state: TrackerState, node_id: str, reason: str, reporter: str = TRACKER) -> None:
    """Put a node that failed a front-door request into backoff (if it is still listed), on the terms of
    :mod:`.failure_reports`: ``reporter`` is :data:`TRACKER` when the tracker saw the failure itself. The gate
    may live in the shared store, so the report is judged in the background."""
    if state.registry.state(node_id, state.now()) is None:
        return  # forgotten meanwhile: nothing to back off
    try:
        task = asyncio.get_running_loop().create_task(_report(state, node_id, reason, reporter))
    except RuntimeError:
        return
    state.background.add(task)
    task.add_done_callback(state.background.discard)


async def _report(state: TrackerState, node_id: str, reason: str, reporter: str) -> None:
    now = state.now()
    try:
        await state.failure_gate.count(reporter, now)
        if await state.failure_gate.judge(run_of(state.registry, node_id), reporter, now) != "apply":
            return
        state.registry.report_failure(node_id, reason, state.now())
    except (TooManyReports, UnknownNode, StoreUnavailable):
        return
    state.metrics.failure_reports.inc()
