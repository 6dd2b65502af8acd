"""The head's OpenAI-compatible endpoints: ``/v1/chat/completions`` and ``/v1/completions``.

Only the mesh may call them: the tracker (a request signed with its route key,
see :mod:`meshwire.hop_proof`; or the shared secret on a node without a join token), or a client holding one of the node's ``api_keys`` (the
tracker's client keys, given to the node too). Anything else is refused
with 401/403 before the body is read, so nobody who merely reaches a node can
spend the mesh's sessions and KV budget.

The tracker proxies client requests here with the signed route in
``X-Meshnet-Route``; the head checks the route names it first (403
``bad_route`` otherwise). Without a route a head that holds every layer
serves alone, and any other head asks the tracker for a route.

Requests are validated with :mod:`meshwire.openai` (400 naming the field).
Streams are server-sent events: a first chunk with the role, one chunk per
piece of text as tokens are produced, a final chunk with ``finish_reason``,
a usage chunk when ``stream_options.include_usage``, then ``data: [DONE]``.
Errors found before the first token (busy route, no route) are plain HTTP
errors; a failure after the stream began (failover gave up) ends it with an
error event, then ``data: [DONE]``. The
streamed text equals the non-streamed text: both are the concatenation of
the same :class:`~services.node.head.generation.TextDelta` events.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Protocol

import orjson
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from meshwire import errors, sse
from meshwire import headers as h
from meshwire import openai as oa
from meshwire.auth import check_bearer, check_bearer_any
from meshwire.body_guard import BodyIncomplete, BodyTooLarge, read_bounded
from meshwire.fork import ChoiceGroup
from meshwire.hop_proof import TRACKER_SIGNER_PREFIX, ProofProblem, check_claim, read_claim
from meshwire.limits import MAX_HEADER_VALUE_CHARS
from meshwire.responses_api import ResponseEvents, ResponsesRequest, usage_of
from meshwire.resume import RESUME_KEY, Progress, Resume, take_resume, with_progress
from meshwire.sampling_params import MAX_GRAMMAR_CHARS, SamplingParams
from meshwire.tool_calls import ToolCallAssembler, ToolCallParser
from services.node.api.logprob_render import chat_logprobs, completion_logprobs, echo_logprobs, joined
from services.node.head.generation import (
    Echo,
    Finished,
    GenerationEvent,
    GenerationFailed,
    GenerationRequest,
    TextDelta,
    TokenInfo,
    pick_seed,
    sent_text,
)
from services.node.head.tokens import HeadTokenizer, TemplateError
from services.node.hop.routing import NoRoute, RoutedHop, RouteRefused, verify_hop, verify_prefill_route
from services.node.pd.pd_head import PrefillPlan
from services.node.sampling.grammar import GrammarError, grammar_for_schema
from services.node.sampling.tool_grammar import arguments_schema, tool_grammar

if TYPE_CHECKING:
    from services.node.head.generation import Generator
    from services.node.head.sampling_defaults import SamplingDefaults
    from services.node.hop.routing import TrackerRoutes
    from services.node.hop.trust import RouteTrust
    from services.node.model.shard import Shard
    from services.node.pd.kv_pull import KvPuller
    from services.node.sampling.grammar import GrammarEngine
    from services.node.settings import NodeSettings, NodeState

logger = logging.getLogger(__name__)

DEFAULT_CHAT_MAX_TOKENS: Final = 1024
"""``max_tokens`` of a chat request that gives none (bounded so a session's KV reservation is too)."""
_STATUS_TYPES: Final = {
    400: errors.INVALID_REQUEST, 401: errors.AUTHENTICATION, 403: errors.PERMISSION, 404: errors.NOT_FOUND, 409: errors.INVALID_REQUEST,
    413: errors.INVALID_REQUEST, 502: errors.SERVER_ERROR, 503: errors.UNAVAILABLE,
}


class ApiError(Exception):
    """An OpenAI-shaped error answer."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 retry_after: str | None = None, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.param = param
        self.retry_after = retry_after
        self.extra = extra

    def body(self) -> dict[str, Any]:
        return errors.error_body(str(self), _STATUS_TYPES.get(self.status, errors.SERVER_ERROR), self.code,
                                 self.param, **self.extra)

    def response(self) -> Response:
        headers = {"Retry-After": self.retry_after} if self.retry_after else None
        return Response(orjson.dumps(self.body()), status_code=self.status, media_type="application/json",
                        headers=headers)


def _finish_reason(finished: Finished, tools: ToolCallParser | None) -> oa.FinishReason:
    """``tool_calls`` for an answer that ended by itself after calling tools, else the generator's reason."""
    if tools is not None and tools.called and finished.finish_reason == "stop":
        return "tool_calls"
    return finished.finish_reason


def _delta_of(content: str, tool_calls: list[dict[str, Any]]) -> oa.Delta:
    """A chunk's delta: content text, tool call entries, or both."""
    return oa.Delta(content=content or None,
                    tool_calls=tuple(oa.ToolCallDelta.model_validate(call) for call in tool_calls) or None)


def _chat_message(text: str, tools: ToolCallParser | None,
                  finished: Finished) -> tuple[oa.AssistantMessage, oa.FinishReason]:
    """A non-streamed answer's message and finish reason: its text, or (with tools) its content and calls."""
    if tools is None:
        return oa.AssistantMessage(content=text), finished.finish_reason
    parsed = tools.feed(text)
    held = tools.flush()
    assembler = ToolCallAssembler()
    assembler.add(parsed.deltas())
    calls = assembler.result()
    content = parsed.content + held.content
    message = oa.AssistantMessage(content=content or (None if calls else ""),
                                  tool_calls=None if calls is None else
                                  tuple(oa.ToolCall.model_validate(call) for call in calls))
    return message, _finish_reason(finished, tools)


def _from_failure(exc: GenerationFailed) -> ApiError:
    extra = {"failed_node": exc.failed_node} if exc.failed_node else {}
    return ApiError(exc.status, str(exc), exc.code, retry_after=exc.retry_after, **extra)


@dataclass(frozen=True)
class Prepared:
    """A validated request, tokenised, with its route: ready to generate."""

    generation: GenerationRequest
    hop: RoutedHop | None
    stream: bool
    include_usage: bool
    tools: bool = False
    """The answer may hold tool calls: its text is read by a :class:`ToolCallParser`."""
    sent: str = ""
    """The text already sent of a continued answer (``meshwire.resume``): what primes the tool call parser."""

    @property
    def logprobs(self) -> bool:
        """Whether the answer carries log-probabilities."""
        return self.generation.sampling.logprobs is not None

    def tool_parser(self) -> ToolCallParser | None:
        """A parser for this answer's tool calls, past the text already sent (``None``: no tools)."""
        if not self.tools:
            return None
        parser = ToolCallParser()
        parser.feed(self.sent)
        return parser


class HeadNode(Protocol):
    """What the OpenAI endpoints read of the node they serve (``services.node.runtime.NodeRuntime`` is one).

    Named here, not imported, so the API wing never reaches up into the runtime that wires it.
    """

    node_id: str
    model_id: str
    state: NodeState
    settings: NodeSettings
    shard: Shard | None
    generator: Generator | None
    grammar: GrammarEngine | None
    puller: KvPuller | None
    sampling_defaults: SamplingDefaults
    tracker_routes: TrackerRoutes
    trust: RouteTrust


class OpenAIService:
    """The head's OpenAI endpoints over one node (:class:`HeadNode`)."""

    def __init__(self, node: HeadNode) -> None:
        self._node = node

    async def chat(self, request: Request) -> Response:
        """``POST /v1/chat/completions``."""
        return await self._serve(request, oa.ChatCompletionRequest, chat=True)

    async def completions(self, request: Request) -> Response:
        """``POST /v1/completions`` (a raw prompt, no chat template)."""
        return await self._serve(request, oa.CompletionRequest, chat=False)

    async def _serve(self, request: Request, schema: type[oa.SamplingRequest], *, chat: bool) -> Response:
        try:  # before anything else is read: only the mesh (the tracker) or a client key may ask
            from_mesh, body = await self._caller(request)
            prepared = await self._prepare(request, schema, chat=chat, from_mesh=from_mesh, body=body)
            response_id = oa.new_id("chatcmpl" if chat else "cmpl")
            events = self._events(prepared)
            first = await _first_event(events)  # errors before the first token are plain HTTP errors
        except ApiError as exc:
            return exc.response()
        except GenerationFailed as exc:
            return _from_failure(exc).response()
        tokenizer = self._node.generator.tokenizer if prepared.logprobs and self._node.generator else None
        if prepared.stream:
            render = ChatStream if chat else CompletionStream
            progress = from_mesh and request.headers.get(h.PROGRESS) == "1"
            stream = render(response_id, self._node.model_id, prepared.include_usage, tokenizer,
                            seed=prepared.generation.sampling.seed if progress else None,
                            tools=prepared.tool_parser())
            return StreamingResponse(stream.events(first, events), media_type=sse.MEDIA_TYPE,
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            text, tokens, finished, echo = await _collect(first, events)
        except GenerationFailed as exc:
            return _from_failure(exc).response()
        usage = oa.Usage.of(finished.prompt_tokens, finished.completion_tokens)
        body: Any
        if chat:
            logprobs = None if tokenizer is None else chat_logprobs(tokenizer, tokens)
            message, finish_reason = _chat_message(text, prepared.tool_parser(), finished)
            body = oa.ChatCompletion(id=response_id, created=oa.now_s(), model=self._node.model_id, usage=usage,
                                     choices=(oa.ChatChoice(message=message, finish_reason=finish_reason,
                                                            logprobs=logprobs),))
        else:
            start = 0 if echo is None else len(echo.text)
            legacy = None if tokenizer is None else completion_logprobs(tokenizer, tokens, start)
            if echo is not None:
                text = echo.text + text
                if legacy is not None and tokenizer is not None:
                    legacy = joined(echo_logprobs(tokenizer, echo), legacy)
            body = oa.Completion(id=response_id, created=oa.now_s(), model=self._node.model_id, usage=usage,
                                 choices=(oa.CompletionChoice(text=text, finish_reason=finished.finish_reason,
                                                              logprobs=legacy),))
        return Response(body.model_dump_json(), media_type="application/json")

    # --- preparation ------------------------------------------------------------------

    async def responses(self, request: Request) -> Response:
        """``POST /v1/responses``: the Responses API, served as the chat it means (:mod:`meshwire.responses_api`)."""
        try:
            _, body = await self._caller(request)
            self._check_head()
            if body is None:
                body = await _read_json_body(request, self._node.settings.max_body_bytes)
            parsed = self._validate(body, ResponsesRequest)
            assert isinstance(parsed, ResponsesRequest)
            try:
                chat = parsed.to_chat()
            except ValidationError as exc:
                raise ApiError(400, oa.validation_error_message(exc), "invalid_request",
                               oa.validation_error_param(exc)) from None
            prepared = await self._prepare_parsed(request, chat, chat=True)
            events = self._events(prepared)
            first = await _first_event(events)
        except ApiError as exc:
            return exc.response()
        except GenerationFailed as exc:
            return _from_failure(exc).response()
        builder = ResponseEvents(parsed, self._node.model_id, oa.now_s())
        if parsed.stream:
            return StreamingResponse(_response_events(builder, first, events), media_type=sse.MEDIA_TYPE,
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            text, _, finished, _ = await _collect(first, events)
        except GenerationFailed as exc:
            return _from_failure(exc).response()
        body = builder.response("incomplete" if finished.finish_reason == "length" else "completed", text,
                                usage_of(finished.prompt_tokens, finished.completion_tokens))
        return Response(orjson.dumps(body), media_type="application/json")

    def _check_head(self) -> None:
        node = self._node
        shard = node.shard
        if shard is None or node.state != "ready":
            raise ApiError(503, f"this node is {node.state}", "not_ready", retry_after="2")
        if node.generator is None:
            raise ApiError(409, f"this node holds layers {shard.start}-{shard.end}, not layer 0: it is not a head; "
                                "send chat requests to the tracker", "not_head")

    async def _read(self, request: Request, schema: type[BaseModel]) -> BaseModel:
        """The request body, validated against ``schema`` (400 naming the field)."""
        return self._validate(await _read_json_body(request, self._node.settings.max_body_bytes), schema)

    @staticmethod
    def _validate(body: bytes, schema: type[BaseModel]) -> BaseModel:
        try:
            return schema.model_validate_json(body)
        except ValidationError as exc:
            raise ApiError(400, oa.validation_error_message(exc), "invalid_request",
                           oa.validation_error_param(exc)) from None

    async def _caller(self, request: Request) -> tuple[bool, bytes | None]:
        """Who asks: ``(from_mesh, body)``; :class:`ApiError` 401/403 for anyone but the mesh or a client key.

        The tracker signs its requests with its route key (:mod:`meshwire.hop_proof`): the proof
        covers the body, which is read (boundedly) to check it and handed back. A node without a
        join token also takes the shared secret as the mesh's credential, as before; client API
        keys (``MESHNET_API_KEYS``) are clients.
        """
        node = self._node
        settings = node.settings
        if any(name in request.headers for name in ("x-meshnet-signer", "x-meshnet-proof")):
            try:
                claim = read_claim(request.headers)
            except ProofProblem as exc:
                raise ApiError(exc.status, str(exc), "unauthorized") from None
            if not claim.signer.startswith(TRACKER_SIGNER_PREFIX):
                raise ApiError(403, f"{claim.signer[:100]} may not call a head's API; only the tracker signs here",
                               "forbidden")
            kid = claim.signer[len(TRACKER_SIGNER_PREFIX):]
            await node.trust.ensure_kid(kid)
            key = node.trust.keys.get(kid)
            if key is None:
                raise ApiError(403, f"{kid[:64]!r} is not one of the tracker's keys this node holds", "forbidden")
            body = await _read_json_body(request, settings.max_body_bytes)
            try:
                check_claim(claim, key, request.url.path, request.headers, body)
            except ProofProblem as exc:
                raise ApiError(exc.status, str(exc), "forbidden") from None
            return True, body
        legacy = () if settings.join_token else (settings.secret,)
        failure = check_bearer_any(request.headers.get("authorization"), (*legacy, *settings.api_keys))
        if failure is not None:
            raise ApiError(failure.status, failure.message, failure.code)
        from_mesh = bool(legacy) and check_bearer(request.headers.get("authorization"), settings.secret) is None
        return from_mesh, None

    async def _prepare(self, request: Request, schema: type[oa.SamplingRequest], *, chat: bool,
                       from_mesh: bool, body: bytes | None = None) -> Prepared:
        self._check_head()
        if body is None:
            body = await _read_json_body(request, self._node.settings.max_body_bytes)
        resume = None
        if from_mesh:  # only the tracker continues a stream whose head died (meshwire.resume)
            try:
                body, resume = take_resume(body)
            except ValueError as exc:
                raise ApiError(400, f"{RESUME_KEY} is not a stream to continue: {str(exc)[:200]}",
                               "invalid_request", RESUME_KEY) from None
        parsed = self._validate(body, schema)
        assert isinstance(parsed, oa.SamplingRequest)
        return await self._prepare_parsed(request, parsed, chat=chat, resume=resume, from_mesh=from_mesh)

    async def _prepare_parsed(self, request: Request, parsed: oa.SamplingRequest, *, chat: bool,
                              resume: Resume | None = None, from_mesh: bool = False) -> Prepared:
        node = self._node
        generator = node.generator
        assert generator is not None
        if request.headers.get(h.ROUTE) is None:  # with a route, the tracker has matched the name already
            self._check_model_name(parsed.model)
        tools = isinstance(parsed, oa.ChatCompletionRequest) and parsed.wants_tools
        if tools:
            self._check_tools(generator.tokenizer)
        if parsed.choices > 1:
            raise ApiError(400, f"n={parsed.choices}: a head serves one choice a request; the tracker's front door "
                                "serves n > 1, as one session per choice", "invalid_request", "n")
        hop = await self._route(request)
        try:
            if isinstance(parsed, oa.ChatCompletionRequest):
                messages = [m.template_dict() for m in parsed.messages]
                shown = [tool.model_dump(exclude_none=True, exclude={"function": {"strict"}})
                         for tool in parsed.tools or ()] if tools else None
                prompt = await asyncio.to_thread(generator.tokenizer.encode_chat, messages, shown)
            else:
                assert isinstance(parsed, oa.CompletionRequest)
                prompt = await asyncio.to_thread(generator.tokenizer.encode_text, parsed.prompt)
        except TemplateError as exc:
            raise ApiError(400, str(exc), "invalid_request", "messages") from None
        if tools:
            assert isinstance(parsed, oa.ChatCompletionRequest)
            grammar = await self._tool_grammar(parsed)
        else:
            grammar = await self._grammar(parsed.response_format)
        generation = self._generation_request(parsed, prompt, chat=chat, resume=resume, grammar=grammar)
        plan = self._prefill_plan(request, len(prompt))
        if plan is not None:
            generation = dataclasses.replace(generation, prefill=plan)
        group = request.headers.get(h.CHOICE_GROUP) if from_mesh else None
        if group is not None:
            try:
                generation = dataclasses.replace(generation, group=ChoiceGroup.parse(group))
            except ValueError as exc:
                raise ApiError(400, str(exc), "bad_header") from None
        sent = "" if not (tools and generation.resume) else await asyncio.to_thread(
            sent_text, generator.tokenizer, generation.stop, generation.resume)
        return Prepared(generation=generation, hop=hop, stream=parsed.stream, include_usage=parsed.include_usage,
                        tools=tools, sent=sent)

    async def _grammar(self, response_format: oa.ResponseFormat | None) -> str | None:
        """The grammar a structured output asks for (``None``: free text), checked by the engine (400 if not)."""
        if response_format is None or isinstance(response_format, oa.TextFormat):
            return None
        engine = self._node.grammar
        if engine is None:
            raise ApiError(503, "this node has no grammar engine yet", "not_ready", retry_after="2")
        schema = response_format.json_schema.json_schema if isinstance(response_format, oa.JsonSchemaFormat) else None
        param = "response_format.json_schema.schema" if isinstance(response_format, oa.JsonSchemaFormat) \
            else "response_format"
        try:
            grammar = grammar_for_schema(schema)
            await asyncio.to_thread(engine.check, grammar)
        except GrammarError as exc:
            raise ApiError(400, str(exc), "invalid_schema", param) from None
        return grammar

    def _check_tools(self, tokenizer: HeadTokenizer) -> None:
        """Refuse (400) a request that offers tools the served model cannot be shown."""
        if not tokenizer.supports_tools:
            raise ApiError(400, f"tools cannot be used with {self._node.model_id}: the model's chat template has no "
                                "tool support (it never renders a tools list); send tool_choice 'none' or no tools",
                           "unsupported_parameter", "tools")

    async def _tool_grammar(self, parsed: oa.ChatCompletionRequest) -> str:
        """The grammar of an answer with tools (:mod:`services.node.sampling.tool_grammar`), checked by the engine: a
        function whose parameters it cannot enforce is a 400 naming that function."""
        engine = self._node.grammar
        if engine is None:
            raise ApiError(503, "this node has no grammar engine yet", "not_ready", retry_after="2")
        tools = parsed.tools or ()
        for index, tool in enumerate(tools):
            try:
                await asyncio.to_thread(engine.check, grammar_for_schema(arguments_schema(tool.function)))
            except GrammarError as exc:
                raise ApiError(400, f"the parameters of function {tool.function.name!r}: {exc}", "invalid_schema",
                               f"tools[{index}].function.parameters") from None
        grammar = tool_grammar(tools, parsed.tool_choice, parallel=parsed.parallel_tool_calls is not False)
        if len(grammar) > MAX_GRAMMAR_CHARS:
            raise ApiError(400, f"the tools' grammar is {len(grammar)} characters, over the {MAX_GRAMMAR_CHARS} "
                                "that travel along a route; offer fewer tools or smaller parameters schemas",
                           "invalid_schema", "tools")
        try:
            await asyncio.to_thread(engine.check, grammar)
        except GrammarError as exc:
            raise ApiError(400, f"the tools cannot be enforced: {exc}", "invalid_schema", "tools") from None
        return grammar

    def _check_model_name(self, model: str) -> None:
        node = self._node
        if model not in (node.model_id, node.settings.model, Path(node.settings.model).name):
            raise ApiError(404, f"model {model!r} is not served here; this node serves {node.model_id!r}",
                           "model_not_found", "model")

    def _generation_request(self, parsed: oa.SamplingRequest, prompt: list[int], *, chat: bool,
                            resume: Resume | None = None, grammar: str | None = None) -> GenerationRequest:
        node = self._node
        assert node.shard is not None
        context = int(getattr(node.shard.config, "max_position_embeddings", 0) or 0) or None
        if not prompt:
            raise ApiError(400, "the prompt is empty", "invalid_request", "prompt")
        limit = node.settings.max_prompt_tokens if context is None else min(node.settings.max_prompt_tokens,
                                                                             context - 1)
        if len(prompt) > limit:
            raise ApiError(400, f"the prompt is {len(prompt)} tokens, over this mesh's limit of {limit}",
                           "context_length_exceeded", "messages" if chat else "prompt")
        wanted = parsed.token_budget(DEFAULT_CHAT_MAX_TOKENS) if chat else parsed.token_budget()
        max_tokens = wanted if context is None else max(1, min(wanted, context - len(prompt)))
        defaults = node.sampling_defaults
        bias = parsed.logit_bias_pairs
        if bias and bias[-1][0] >= node.shard.vocab_size:
            raise ApiError(400, f"logit_bias names token {bias[-1][0]}, but this model's vocabulary has "
                                f"{node.shard.vocab_size} tokens", "invalid_request", "logit_bias")
        sampling = SamplingParams(
            temperature=float(defaults.temperature if parsed.temperature is None else parsed.temperature),
            top_p=float(defaults.top_p if parsed.top_p is None else parsed.top_p),
            top_k=defaults.top_k if parsed.top_k is None else parsed.top_k,
            seed=resume.seed if resume is not None else pick_seed(parsed.seed),
            logit_bias=bias,
            logprobs=parsed.top_logprobs_wanted,
            grammar=grammar,
        )
        if grammar is not None and len(orjson.dumps(sampling.model_dump())) > MAX_HEADER_VALUE_CHARS:
            param = "tools" if isinstance(parsed, oa.ChatCompletionRequest) and parsed.wants_tools \
                else "response_format"
            raise ApiError(400, f"the {param} schema is too large to send along the route with these "
                                "sampling parameters; make it (or logit_bias) smaller", "invalid_schema", param)
        resumed = () if resume is None else resume.ids
        if any(token >= node.shard.vocab_size for token in resumed):
            raise ApiError(400, f"{RESUME_KEY} names a token outside this model's vocabulary", "invalid_request",
                           RESUME_KEY)
        if len(resumed) >= max_tokens:
            raise ApiError(400, f"{RESUME_KEY} holds {len(resumed)} tokens: the answer is already complete",
                           "invalid_request", RESUME_KEY)
        echo = parsed.prompt if isinstance(parsed, oa.CompletionRequest) and parsed.echo else None
        return GenerationRequest(prompt_ids=tuple(prompt), max_tokens=max_tokens, stop=parsed.stop_sequences,
                                 sampling=sampling, resume=tuple(resumed), echo=echo)

    async def _route(self, request: Request) -> RoutedHop | None:
        """The route to run along: the tracker's (verified), none (alone), or one asked of the tracker."""
        node = self._node
        assert node.shard is not None
        token = request.headers.get(h.ROUTE)
        if token is None:
            if node.shard.is_tail:
                return None
            try:
                signed = await node.tracker_routes.fetch(node.model_id)
            except NoRoute as exc:
                raise ApiError(exc.status, str(exc), "no_route") from None
            token = signed.token
        try:
            await node.trust.ensure(token)
            return verify_hop(token, 0, keys=node.trust.keys, node_id=node.node_id, model_id=node.model_id,
                              shard=node.shard)
        except RouteRefused as exc:
            raise ApiError(403, str(exc), "bad_route") from None

    def _prefill_plan(self, request: Request, prompt_tokens: int) -> PrefillPlan | None:
        """The tracker's prefill route for this request, when its prompt is long enough to use it."""
        node = self._node
        token = request.headers.get(h.PREFILL_ROUTE)
        if token is None or node.generator is None or node.puller is None or node.shard is None:
            return None
        try:
            least = int(request.headers.get(h.PD_MIN_PROMPT_TOKENS) or "0")
        except ValueError:
            raise ApiError(400, f"{h.PD_MIN_PROMPT_TOKENS} is not an integer", "bad_header") from None
        if prompt_tokens < max(least, 1):
            return None
        try:
            hop = verify_prefill_route(token, keys=node.trust.keys, model_id=node.model_id,
                                       num_layers=node.shard.num_layers)
        except RouteRefused as exc:
            raise ApiError(403, f"prefill route: {exc}", "bad_route") from None
        return PrefillPlan(hop)

    def _events(self, prepared: Prepared) -> AsyncIterator[GenerationEvent]:
        assert self._node.generator is not None
        return self._node.generator.generate(prepared.generation, prepared.hop)


async def _read_json_body(request: Request, max_bytes: int) -> bytes:
    """The request body, refusing (413) one over ``max_bytes``."""
    try:
        return await read_bounded(request, max_bytes)
    except BodyTooLarge as exc:
        if exc.declared is not None:
            raise ApiError(413, f"request body of {exc.declared} bytes is over the {max_bytes}-byte limit",
                           "too_large") from None
        raise ApiError(413, f"request body is over the {max_bytes}-byte limit", "too_large") from None
    except BodyIncomplete:
        raise ApiError(400, "the client went away before the request body was complete") from None


async def _response_events(builder: ResponseEvents, first: GenerationEvent,
                           rest: AsyncIterator[GenerationEvent]) -> AsyncIterator[bytes]:
    """The Responses API's event stream of one answer."""
    pieces: list[str] = []
    try:
        for event in builder.opening():
            yield event
        event = first
        while not isinstance(event, Finished):
            if event.text:
                pieces.append(event.text)
                yield builder.delta(event.text)
            event = await anext(rest)
        usage = usage_of(event.prompt_tokens, event.completion_tokens)
        for closing in builder.closing("".join(pieces), event.finish_reason == "length", usage):
            yield closing
    except GenerationFailed as exc:
        logger.warning("response %s failed after it began: %s", builder.response_id, exc)
        yield builder.failure(_from_failure(exc).body()["error"])
    finally:
        await rest.aclose()  # type: ignore[attr-defined]


async def _first_event(events: AsyncIterator[GenerationEvent]) -> GenerationEvent:
    """The first event; on failure the generator is closed (which closes its session)."""
    try:
        return await anext(events)
    except BaseException:
        await events.aclose()  # type: ignore[attr-defined]
        raise


async def _collect(first: GenerationEvent,
                   events: AsyncIterator[GenerationEvent]) -> tuple[str, list[TokenInfo], Finished, Echo | None]:
    """The whole answer: its text, its tokens' log-probabilities (when asked for), how it finished, the
    prompt it echoes (a completion's ``echo``)."""
    pieces: list[str] = []
    tokens: list[TokenInfo] = []
    echo = None
    event = first
    try:
        while not isinstance(event, Finished):
            pieces.append(event.text)
            tokens.extend(event.tokens)
            echo = echo or event.echo
            event = await anext(events)
    finally:
        await events.aclose()  # type: ignore[attr-defined]
    return "".join(pieces), tokens, event, echo


class _Stream:
    """Server-sent events of one answer; subclasses say how a chunk looks."""

    def __init__(self, response_id: str, model: str, include_usage: bool,
                 tokenizer: HeadTokenizer | None = None, *, seed: int | None = None,
                 tools: ToolCallParser | None = None) -> None:
        self.response_id = response_id
        self.tools = tools
        """Set when the answer may hold tool calls: its text goes out as content and ``delta.tool_calls``."""
        self.progress_seed = seed
        """Set when the tracker asked for progress (meshwire.resume): each event carries its token ids."""
        self.model = model
        self.include_usage = include_usage
        self.tokenizer = tokenizer
        """Set when the request asked for log-probabilities: each chunk carries those of the tokens it completes."""
        self.created = oa.now_s()

    async def events(self, first: GenerationEvent, rest: AsyncIterator[GenerationEvent]) -> AsyncIterator[bytes]:
        """SSE bytes: opening, a chunk per text delta, the finish chunk, usage, ``[DONE]``."""
        try:
            opening = self.opening()
            if opening is not None:
                yield self._event(opening, ())
            event = first
            while not isinstance(event, Finished):
                chunk = self.text_chunk(event)
                if chunk is not None or self.progress_seed is not None:  # the tracker needs every event's ids
                    yield self._event(chunk if chunk is not None else self.empty_chunk(), event.ids)
                event = await anext(rest)
            for chunk in self.final_chunks(event):
                yield sse.sse_event(chunk)
            if self.include_usage:
                yield sse.sse_event(self.usage_chunk(oa.Usage.of(event.prompt_tokens, event.completion_tokens)))
            yield sse.DONE
        except GenerationFailed as exc:
            logger.warning("stream %s failed after it began: %s", self.response_id, exc)
            yield sse.sse_error(orjson.dumps(_from_failure(exc).body()))
            yield sse.DONE  # the stream still ends as every OpenAI stream does
        finally:
            await rest.aclose()  # type: ignore[attr-defined]

    def _event(self, chunk: BaseModel, ids: tuple[int, ...]) -> bytes:
        """One stream event; with progress asked for, the ids of its tokens (and, once, the seed) added."""
        if self.progress_seed is None:
            return sse.sse_event(chunk)
        progress = Progress(ids=ids, seed=self.progress_seed if not self._told_seed else None)
        self._told_seed = True
        return sse.sse_event(with_progress(chunk.model_dump(mode="json", exclude_none=False), progress))

    _told_seed = False

    def opening(self) -> Any | None:
        return None

    def text_chunk(self, delta: TextDelta) -> Any | None:
        """The chunk of a text delta (``None``: it has nothing for the client yet)."""
        raise NotImplementedError

    def empty_chunk(self) -> Any:
        """A chunk saying nothing: carries the ids of a delta whose text is held back (tracker streams only)."""
        raise NotImplementedError

    def final_chunks(self, finished: Finished) -> tuple[Any, ...]:
        """The chunks that end the answer: the finish chunk (and what was held back until the end)."""
        return (self.finish_chunk(finished),)

    def finish_chunk(self, finished: Finished) -> Any:
        raise NotImplementedError

    def usage_chunk(self, usage: oa.Usage) -> Any:
        raise NotImplementedError


class ChatStream(_Stream):
    """``chat.completion.chunk`` events."""

    def _chunk(self, **fields: Any) -> oa.ChatCompletionChunk:
        return oa.ChatCompletionChunk(id=self.response_id, created=self.created, model=self.model, **fields)

    def opening(self) -> oa.ChatCompletionChunk:
        return self._chunk(choices=(oa.ChunkChoice(delta=oa.Delta(role="assistant", content="")),))

    def text_chunk(self, delta: TextDelta) -> oa.ChatCompletionChunk | None:
        logprobs = None if self.tokenizer is None else chat_logprobs(self.tokenizer, delta.tokens)
        if self.tools is None:
            return self._chunk(choices=(oa.ChunkChoice(delta=oa.Delta(content=delta.text), logprobs=logprobs),))
        parsed = self.tools.feed(delta.text)
        if not parsed and logprobs is None:
            return None
        return self._chunk(choices=(oa.ChunkChoice(delta=_delta_of(parsed.content, parsed.deltas()),
                                                   logprobs=logprobs),))

    def empty_chunk(self) -> oa.ChatCompletionChunk:
        return self._chunk(choices=(oa.ChunkChoice(delta=oa.Delta()),))

    def final_chunks(self, finished: Finished) -> tuple[oa.ChatCompletionChunk, ...]:
        if self.tools is None:
            return (self.finish_chunk(finished),)
        held = self.tools.flush()
        rest = (self._chunk(choices=(oa.ChunkChoice(delta=oa.Delta(content=held.content)),)),) if held else ()
        return (*rest, self.finish_chunk(finished))

    def finish_chunk(self, finished: Finished) -> oa.ChatCompletionChunk:
        reason = _finish_reason(finished, self.tools)
        return self._chunk(choices=(oa.ChunkChoice(delta=oa.Delta(), finish_reason=reason),))

    def usage_chunk(self, usage: oa.Usage) -> oa.ChatCompletionChunk:
        return self._chunk(usage=usage)


class CompletionStream(_Stream):
    """``text_completion`` events."""

    def _chunk(self, **fields: Any) -> oa.CompletionChunk:
        return oa.CompletionChunk(id=self.response_id, created=self.created, model=self.model, **fields)

    _offset = 0
    """Characters of the completion sent so far (``text_offset`` of the next token)."""

    def text_chunk(self, delta: TextDelta) -> oa.CompletionChunk:
        logprobs = None
        echoed = "" if delta.echo is None else delta.echo.text
        if self.tokenizer is not None:
            logprobs = completion_logprobs(self.tokenizer, delta.tokens, self._offset + len(echoed))
            if delta.echo is not None:
                logprobs = joined(echo_logprobs(self.tokenizer, delta.echo), logprobs)
        self._offset += len(echoed) + len(delta.text)
        return self._chunk(choices=(oa.CompletionChoice(text=echoed + delta.text, logprobs=logprobs),))

    def finish_chunk(self, finished: Finished) -> oa.CompletionChunk:
        return self._chunk(choices=(oa.CompletionChoice(text="", finish_reason=finished.finish_reason),))

    def usage_chunk(self, usage: oa.Usage) -> oa.CompletionChunk:
        return self._chunk(usage=usage)

