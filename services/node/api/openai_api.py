"""The head's OpenAI-compatible endpoints: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses``.

Each request goes through the same steps, each in a module of its own:

1. who asks (:mod:`~services.node.api.caller`): only the mesh (the tracker, signing with its route key, or
   the shared secret on a node without a join token) or a client holding one of the node's ``api_keys``;
   anyone else gets 401/403 before the body is read;
2. the request made ready (:mod:`~services.node.api.preparation`): validated (400 naming the field),
   tokenised, its grammar checked, routed (:mod:`~services.node.api.request_route`: the tracker's signed
   route in ``X-Meshnet-Route`` must name this head first, 403 ``bad_route`` otherwise; without one a head
   that holds every layer serves alone, and any other head asks the tracker for a route);
3. the head's generation (:mod:`services.node.head.generation`) up to its first event: errors found before
   the first token (busy route, no route) are plain HTTP errors (:mod:`~services.node.api.api_error`);
4. the answer rendered, streamed as server-sent events (:mod:`~services.node.api.streams`) or collected
   whole (:mod:`~services.node.api.collected`). The streamed text equals the collected text: both are the
   concatenation of the same :class:`~services.node.head.events.TextDelta` events.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from meshwire import headers as h
from meshwire import openai as oa
from meshwire import sse
from meshwire.responses_api import ResponseEvents
from services.node.api.api_error import ApiError, from_failure
from services.node.api.caller import Caller, check_caller
from services.node.api.collected import chat_completion, collect, completion, first_event, response
from services.node.api.head_node import HeadNode
from services.node.api.preparation import Prepared, RequestPreparer
from services.node.api.streams import SSE_HEADERS, ChatStream, CompletionStream, response_events
from services.node.head.events import GenerationEvent
from services.node.head.failures import GenerationFailed
from services.node.head.tokens import HeadTokenizer


class OpenAIService:
    """The head's OpenAI endpoints over one node (:class:`HeadNode`)."""

    def __init__(self, node: HeadNode) -> None:
        self._node = node
        self._preparer = RequestPreparer(node)

    async def chat(self, request: Request) -> Response:
        """``POST /v1/chat/completions``."""
        return await self._serve(request, oa.ChatCompletionRequest, chat=True)

    async def completions(self, request: Request) -> Response:
        """``POST /v1/completions`` (a raw prompt, no chat template)."""
        return await self._serve(request, oa.CompletionRequest, chat=False)

    async def responses(self, request: Request) -> Response:
        """``POST /v1/responses``: the Responses API, served as the chat it means (:mod:`meshwire.responses_api`)."""
        try:
            caller = await self._caller(request)
            parsed, prepared = await self._preparer.prepare_response(request, caller)
            events = self._events(prepared)
            first = await first_event(events)
        except ApiError as exc:
            return exc.response()
        except GenerationFailed as exc:
            return from_failure(exc).response()
        builder = ResponseEvents(parsed, self._node.model_id, oa.now_s())
        if parsed.stream:
            return StreamingResponse(response_events(builder, first, events), media_type=sse.MEDIA_TYPE,
                                     headers=SSE_HEADERS)
        try:
            answer = await collect(first, events)
        except GenerationFailed as exc:
            return from_failure(exc).response()
        return Response(orjson.dumps(response(builder, answer)), media_type="application/json")

    async def _serve(self, request: Request, schema: type[oa.SamplingRequest], *, chat: bool) -> Response:
        try:  # before anything else is read: only the mesh (the tracker) or a client key may ask
            caller = await self._caller(request)
            prepared = await self._preparer.prepare(request, schema, chat=chat, caller=caller)
            response_id = oa.new_id("chatcmpl" if chat else "cmpl")
            events = self._events(prepared)
            first = await first_event(events)  # errors before the first token are plain HTTP errors
        except ApiError as exc:
            return exc.response()
        except GenerationFailed as exc:
            return from_failure(exc).response()
        if prepared.stream:
            progress = caller.from_mesh and request.headers.get(h.PROGRESS) == "1"
            return self._stream(response_id, prepared, first, events, chat=chat, progress=progress)
        try:
            answer = await collect(first, events)
        except GenerationFailed as exc:
            return from_failure(exc).response()
        tokenizer, model = self._tokenizer(prepared), self._node.model_id
        body: oa.ChatCompletion | oa.Completion = (
            chat_completion(response_id, model, answer, tokenizer, prepared.tool_parser()) if chat
            else completion(response_id, model, answer, tokenizer))
        return Response(body.model_dump_json(), media_type="application/json")

    def _stream(self, response_id: str, prepared: Prepared, first: GenerationEvent,
                events: AsyncIterator[GenerationEvent], *, chat: bool, progress: bool) -> Response:
        """The answer as server-sent events; with ``progress`` (the tracker asked), each carrying its ids."""
        render = ChatStream if chat else CompletionStream
        stream = render(response_id, self._node.model_id, prepared.include_usage, self._tokenizer(prepared),
                        seed=prepared.generation.sampling.seed if progress else None, tools=prepared.tool_parser())
        return StreamingResponse(stream.events(first, events), media_type=sse.MEDIA_TYPE, headers=SSE_HEADERS)

    async def _caller(self, request: Request) -> Caller:
        return await check_caller(request, self._node.settings, self._node.hop_auth)

    def _tokenizer(self, prepared: Prepared) -> HeadTokenizer | None:
        """The tokenizer that renders log-probabilities, when the request asked for them."""
        return self._node.generator.tokenizer if prepared.logprobs and self._node.generator else None

    def _events(self, prepared: Prepared) -> AsyncIterator[GenerationEvent]:
        assert self._node.generator is not None
        return self._node.generator.generate(prepared.generation, prepared.hop)
