"""The OpenAI front door: what the OpenAI SDK talks to.

Routes:

- ``POST /v1/chat/completions``, ``POST /v1/completions`` and ``POST /v1/responses``: validated here
  (400 naming the field), given a route (404 unknown model, 503 naming the
  missing layers), and proxied to the route's head node, whose answer (JSON,
  or server-sent events) is relayed as it arrives; a head's error is relayed
  only as a well-formed OpenAI error, anything else becomes a 502 (see
  :mod:`.head_answers`). When the head fails before answering, it is
  reported and the request goes once more on a route that avoids it.
- ``GET /v1/models``: the models that have a complete route right now.
- ``GET /v1/models/{model}``: one of them.

With ``MESHNET_API_KEYS`` set, each route needs ``Authorization: Bearer <key>``
(401 otherwise, in OpenAI's shape).
"""

from __future__ import annotations

import logging
import secrets
import time
from typing import Final, Literal

import httpx
import orjson
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from meshwire import errors
from meshwire.fork import ChoiceGroup
from meshwire.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    SamplingRequest,
    validation_error_message,
    validation_error_param,
)
from meshwire.responses_api import ResponsesRequest
from meshwire.routes import SignedRoute

from .choices import ChoicePayloads, several_choices
from .collect import as_streamed
from .collect import collect as collected
from .continuation import ContinuedStream, StreamHistory
from .failure_reports import TRACKER, TooManyReports, run_of
from .key_limits import SCOPE_KEY_ID, LimitsUnavailable, Refused, take_choice_slots
from .proxy import HeadError, HeadRefused, PrefillOffer, ProxiedResponse, first_byte_timer, open_head
from .registry import UnknownNode
from .responses import HTTPError, read_body, require_api_key
from .state import TrackerState, tracker_state

logger = logging.getLogger(__name__)

Endpoint = Literal["chat", "completions", "responses"]
PATHS: Final[dict[Endpoint, str]] = {"chat": "/v1/chat/completions", "completions": "/v1/completions",
                                     "responses": "/v1/responses"}
SCHEMAS: Final[dict[Endpoint, type[SamplingRequest | ResponsesRequest]]] = {
    "chat": ChatCompletionRequest, "completions": CompletionRequest, "responses": ResponsesRequest}
ROUTE_ATTEMPTS: Final = 2
"""Routes tried per request: the first, and one more avoiding a head that failed."""
GROUP_ID_BYTES: Final = 8
"""Random bytes of the id marking the choices of one ``n > 1`` request as one group (``meshwire.fork``)."""

router = APIRouter()


def _parse(body: bytes, endpoint: Endpoint) -> SamplingRequest | ResponsesRequest:
    try:
        return SCHEMAS[endpoint].model_validate_json(body)
    except ValidationError as exc:
        raise HTTPError(400, validation_error_message(exc), errors.INVALID_REQUEST, "invalid_request",
                        validation_error_param(exc)) from None


def _with_model(body: bytes, model: str) -> bytes:
    """``body`` with its ``model`` replaced by the registered name the head knows."""
    payload = orjson.loads(body)
    payload["model"] = model
    return orjson.dumps(payload)


async def _front_door(request: Request, endpoint: Endpoint) -> Response:
    state = tracker_state(request)
    path = PATHS[endpoint]
    status = 500
    try:
        require_api_key(request, state.settings.api_keys)
        body = await read_body(request, state.settings.max_body_bytes)
        parsed = _parse(body, endpoint)
        model = state.resolve_model(parsed.model)
        if model != parsed.model:
            body = _with_model(body, model)
        continued = endpoint != "responses"  # chats and completions outlive their head (see .continuation)
        if isinstance(parsed, SamplingRequest) and parsed.choices > 1:
            key_id = request.scope.get(SCOPE_KEY_ID)
            await _take_choice_slots(state, request, parsed.choices)
            await state.trust.ready()
            shared = state.route_for(model, set())  # one route for every choice: its head prefills the prompt once
            group = secrets.token_hex(GROUP_ID_BYTES)
            response = await several_choices(
                lambda choice_body, index: _proxy_payloads(
                    state, model, path, choice_body, key_id, route=shared,
                    choice_group=ChoiceGroup(group, index, parsed.choices)), body, parsed,
                chat=endpoint == "chat")
            status = response.status_code
            return response
        if continued and not parsed.stream:
            body = as_streamed(body)  # assembled back into one answer here, across heads if need be
        response = await _proxy(state, model, path, body, stream=continued,
                                collect=None if not continued or parsed.stream else endpoint == "chat",
                                key_id=request.scope.get(SCOPE_KEY_ID))
        assert isinstance(response, Response)
        status = response.status_code
        return response
    except HTTPError as exc:
        status = exc.status
        raise
    finally:
        state.metrics.requests.labels(endpoint, str(status)).inc()


async def _take_choice_slots(state: TrackerState, request: Request, choices: int) -> None:
    """An ``n > 1`` request runs ``n`` streams: it takes one in-flight slot of its API key per choice (429 when
    the key has not that many free; see :mod:`.key_limits`)."""
    try:
        refused = await take_choice_slots(state.key_limiter, request.scope, choices)
    except LimitsUnavailable as exc:
        raise HTTPError(503, str(exc), errors.UNAVAILABLE, errors.STORE_UNAVAILABLE,
                        headers={"Retry-After": "1"}) from None
    if isinstance(refused, Refused):
        raise HTTPError(429, refused.message, errors.RATE_LIMIT, "rate_limit_exceeded",
                        headers={"Retry-After": str(refused.retry_after_s)})


async def _proxy(state: TrackerState, model: str, path: str, body: bytes, *, stream: bool = False,
                 collect: bool | None = None, key_id: str | None = None,
                 raw: bool = False, route: SignedRoute | None = None,
                 choice_group: ChoiceGroup | None = None) -> Response | ChoicePayloads:
    """Send ``body`` along a route, and along a second one if the first head fails to answer.

    A streamed chat or completion asks the head for progress, so that if the
    head dies mid-answer the stream goes on from another head
    (:mod:`.continuation`). With ``collect`` set (``True``: a chat), the stream
    is assembled into the non-streamed answer the client asked for. With
    ``key_id`` (an API key's id), the answer's tokens are counted under it. ``route`` is the first route
    to try (else the mesh's choice), ``choice_group`` the ``n > 1`` request this is one choice of.
    """
    exclude: set[str] = set()
    refused: HeadRefused | None = None
    await state.trust.ready()
    for attempt in range(ROUTE_ATTEMPTS):
        try:
            route = route if attempt == 0 and route is not None else state.route_for(model, exclude)
        except HTTPError:
            if refused is not None:
                raise refused.error from None  # no other route: the head's own answer says most
            raise
        node_ids = [hop.node_id for hop in route.nodes]
        state.registry.begin_request(node_ids)
        elapsed = first_byte_timer()
        started = time.perf_counter()
        outcome = await open_head(state.http(), route, path, body, state.trust.signing_key(), progress=stream,
                                  prefill=_prefill_offer(state, model), choice_group=choice_group)
        if isinstance(outcome, HeadError):
            state.registry.end_request(node_ids)
            raise outcome.error
        if not isinstance(outcome, HeadRefused):
            state.metrics.first_byte.observe(elapsed())
            head = route.nodes[0].node_id

            def on_broken(reason: str, head: str = head) -> None:
                _report(state, head, f"broke mid-answer: {reason}")

            def on_close(node_ids: list[str] = node_ids) -> None:
                state.registry.end_request(node_ids)

            if stream:
                return await _continued(state, model, path, body, route, outcome, collect, key_id, raw=raw,
                                        started=started)
            return ProxiedResponse(outcome, on_broken=on_broken, on_close=on_close)
        state.registry.end_request(node_ids)
        refused = outcome
        logger.warning("route %d for %s: head %s did not answer (%s); %s", attempt + 1, model,
                       route.nodes[0].node_id, outcome.reason,
                       "trying another route" if attempt + 1 < ROUTE_ATTEMPTS else "giving up")
        culprit = _culprit(route, outcome.culprit)
        if outcome.failed:
            # The tracker saw the head fail itself; a hop the head blames is the head's word (see .failure_reports).
            _report(state, culprit, outcome.reason, reporter=TRACKER if culprit == route.nodes[0].node_id
                    else route.nodes[0].node_id)
        exclude.add(culprit)
        if attempt + 1 < ROUTE_ATTEMPTS:
            state.metrics.proxy_retries.inc()
    assert refused is not None
    raise refused.error


async def _proxy_payloads(state: TrackerState, model: str, path: str, body: bytes, key_id: str | None, *,
                          route: SignedRoute | None = None,
                          choice_group: ChoiceGroup | None = None) -> ChoicePayloads:
    """One streamed answer's parsed events (continued across heads), for a caller that assembles several;
    its tokens counted under ``key_id`` (``route``, ``choice_group``: see :func:`_proxy`)."""
    outcome = await _proxy(state, model, path, body, stream=True, key_id=key_id, raw=True, route=route,
                           choice_group=choice_group)
    assert isinstance(outcome, ChoicePayloads)
    return outcome


async def _continued(state: TrackerState, model: str, path: str, body: bytes, route: SignedRoute,
                     upstream: httpx.Response, collect: bool | None, key_id: str | None, *,
                     raw: bool = False, started: float | None = None) -> Response | ChoicePayloads:
    """The head's stream relayed with its history kept, continued on another head if this one dies.

    ``raw``: the parsed events and a closer, for :func:`.choices.several_choices`, instead of a response."""
    current = [hop.node_id for hop in route.nodes]

    def on_route(new: SignedRoute | None) -> None:  # the request's load follows it from route to route
        state.registry.end_request(current)
        current[:] = [] if new is None else [hop.node_id for hop in new.nodes]
        state.registry.begin_request(current)

    first = [hop.node_id for hop in route.nodes]

    def on_close() -> None:
        state.registry.end_request(current)
        if key_id is not None:
            _count_tokens(state, key_id, stream.history)
        _measure(state, route, first, current, stream.history, started)

    def route_for(avoid: set[str]) -> SignedRoute:
        return state.route_for(model, avoid)

    async def reopen(new: SignedRoute, new_body: bytes) -> httpx.Response | HeadRefused | HeadError:
        state.metrics.proxy_retries.inc()
        return await open_head(state.http(), new, path, new_body, state.trust.signing_key(), progress=True)

    def cut() -> str | None:  # a node revoked mid-stream: the stream moves to a route without it at once
        revoked = state.revoked.intersection(current) if state.revoked else None
        return f"node {min(revoked)}'s join token was revoked" if revoked else None

    stream = ContinuedStream(body=body, route_for=route_for, open_head=reopen,
                             on_failed=lambda node_id, reason: _report(state, node_id, reason), on_route=on_route,
                             attempts=state.settings.continue_attempts,
                             deadline_s=state.settings.continue_deadline_s, cut=cut)
    if raw:
        async def close() -> None:
            await upstream.aclose()
            on_close()
        return ChoicePayloads(stream.payloads(upstream, route), close)
    if collect is not None:
        try:
            return Response(await collected(stream.payloads(upstream, route), chat=collect),
                            media_type="application/json")
        finally:
            await upstream.aclose()
            on_close()
    return ProxiedResponse(upstream, on_broken=lambda _: None, on_close=on_close,
                           body=stream.events(upstream, route))


def _measure(state: TrackerState, route: SignedRoute, first: list[str], current: list[str],
             history: StreamHistory, started: float | None) -> None:
    """A stream that ran on one route to its end is a measure of that route's nodes (see :mod:`.ratings`)."""
    if started is None or first != current or not history.finished or history.first_token_at is None \
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


def _report(state: TrackerState, node_id: str, reason: str, reporter: str = TRACKER) -> None:
    """Put a node that failed a front-door request into backoff (if it is still listed), on the terms of
    :mod:`.failure_reports`: ``reporter`` is :data:`TRACKER` when the tracker saw the failure itself."""
    now = state.now()
    if state.registry.state(node_id, now) is None:
        return  # forgotten meanwhile: nothing to back off
    try:
        state.failure_gate.count(reporter, now)
    except TooManyReports:
        return
    if state.failure_gate.judge(run_of(state.registry, node_id), reporter, now) != "apply":
        return
    try:
        state.registry.report_failure(node_id, reason, now)
    except UnknownNode:
        return
    state.metrics.failure_reports.inc()


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    """OpenAI chat completions, streamed or not, served by the mesh."""
    return await _front_door(request, "chat")


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    """OpenAI (legacy) text completions, streamed or not, served by the mesh."""
    return await _front_door(request, "completions")


@router.post("/v1/responses")
async def responses(request: Request) -> Response:
    """OpenAI Responses (text in, text out), streamed or not, served by the mesh; nothing is stored."""
    return await _front_door(request, "responses")


def _complete_models(state: TrackerState) -> list[str]:
    return [model.model for model in state.registry.coverage(state.now()) if model.complete]


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    """The models a request can be routed for right now."""
    state = tracker_state(request)
    require_api_key(request, state.settings.api_keys)
    cards = tuple(ModelCard(id=model) for model in _complete_models(state))
    return JSONResponse(ModelList(data=cards).model_dump(mode="json"))


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, request: Request) -> JSONResponse:
    """One servable model (exact name or unique basename); 404 otherwise."""
    state = tracker_state(request)
    require_api_key(request, state.settings.api_keys)
    resolved = state.resolve_model(model)
    if resolved not in _complete_models(state):
        state.route_for(resolved)  # raises the 503 that names the missing layers
    return JSONResponse(ModelCard(id=resolved).model_dump(mode="json"))
