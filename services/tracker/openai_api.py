"""The OpenAI front door: what the OpenAI SDK talks to.

Routes:

- ``POST /v1/chat/completions``, ``POST /v1/completions`` and ``POST /v1/responses``: validated here
  (400 naming the field), given a route (404 unknown model, 503 naming the
  missing layers), and proxied to the route's head node, whose answer (JSON,
  or server-sent events) is relayed as it arrives; a head's error is relayed
  only as a well-formed OpenAI error, anything else becomes a 502 (see
  :mod:`.head_answers`). When the head fails before answering, it is
  reported and the request goes once more on a route that avoids it. Each kind of
  answer (streamed, assembled, ``n > 1``, relayed as it is) has its own path in
  :mod:`.forwarding`. With API keys on, ``n > 1`` takes ``n`` in-flight slots of the
  request's key (429 when it has not that many free; :mod:`.key_limits`).
- ``GET /v1/models``: the models that have a complete route right now.
- ``GET /v1/models/{model}``: one of them.

With ``MESHNET_API_KEYS`` set, each route needs ``Authorization: Bearer <key>``
(401 otherwise, in OpenAI's shape).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Final, Literal

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from meshwire import errors
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

from . import forwarding
from .collect import as_streamed
from .forwarding import Forward
from .key_limits import SCOPE_KEY_ID, LimitsUnavailable, Refused, take_choice_slots
from .responses import HTTPError, read_body, require_api_key
from .state import TrackerState, tracker_state

logger = logging.getLogger(__name__)

Endpoint = Literal["chat", "completions", "responses"]
PATHS: Final[dict[Endpoint, str]] = {"chat": "/v1/chat/completions", "completions": "/v1/completions",
                                     "responses": "/v1/responses"}
SCHEMAS: Final[dict[Endpoint, type[SamplingRequest | ResponsesRequest]]] = {
    "chat": ChatCompletionRequest, "completions": CompletionRequest, "responses": ResponsesRequest}

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
    """Answer one request of ``endpoint``, counting its status."""
    state = tracker_state(request)
    status = 500
    try:
        response = await _answer(request, state, endpoint)
        status = response.status_code
        return response
    except HTTPError as exc:
        status = exc.status
        raise
    finally:
        state.metrics.requests.labels(endpoint, str(status)).inc()


async def _answer(request: Request, state: TrackerState, endpoint: Endpoint) -> Response:
    """The request validated, its model resolved, and forwarded along the path its kind of answer takes."""
    require_api_key(request, state.settings.api_keys)
    body = await read_body(request, state.settings.max_body_bytes)
    parsed = _parse(body, endpoint)
    model = state.resolve_model(parsed.model)
    if model != parsed.model:
        body = _with_model(body, model)
    sent = Forward(model, PATHS[endpoint], body, key_id=request.scope.get(SCOPE_KEY_ID))
    if isinstance(parsed, SamplingRequest) and parsed.choices > 1:
        await _take_choice_slots(state, request, parsed.choices)
        return await forwarding.several(state, sent, parsed, chat=endpoint == "chat")
    if endpoint == "responses":  # chats and completions outlive their head (see .continuation); these do not
        return await forwarding.relayed(state, sent)
    if parsed.stream:
        return await forwarding.streamed(state, sent)
    # Asked of the head as a stream, and assembled back into one answer here, across heads if need be.
    return await forwarding.collected(state, replace(sent, body=as_streamed(body)), chat=endpoint == "chat")


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
