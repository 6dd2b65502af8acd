"""A request to a head's OpenAI endpoints made ready to generate: validated, tokenised, routed, bounded.

Requests are validated with :mod:`meshwire.openai` (400 naming the field). The tracker proxies client
requests here with the signed route in ``X-Meshnet-Route`` (:mod:`services.node.api.request_route`); only
the mesh may continue a stream whose head died (``meshwire.resume``) or name an ``n > 1`` choice group.
Every size is bounded here: the prompt by the mesh's limit and the model's context, ``max_tokens`` by what
the context leaves, a grammar by what travels along a route.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import orjson
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from meshwire import headers as h
from meshwire import openai as oa
from meshwire.fork import ChoiceGroup
from meshwire.limits import MAX_HEADER_VALUE_CHARS
from meshwire.responses_api import ResponsesRequest
from meshwire.resume import RESUME_KEY, Resume, take_resume
from meshwire.sampling_params import SamplingParams
from meshwire.tool_calls import ToolCallParser
from services.node.api.answer_grammar import check_tools_supported, response_grammar, tools_grammar
from services.node.api.api_error import ApiError
from services.node.api.caller import Caller
from services.node.api.head_node import HeadNode
from services.node.api.json_body import read_json_body
from services.node.api.request_route import prefill_plan_of, route_of
from services.node.head.answer_text import sent_text
from services.node.head.events import GenerationRequest, pick_seed
from services.node.head.tokens import HeadTokenizer, TemplateError
from services.node.hop.routing import RoutedHop

DEFAULT_CHAT_MAX_TOKENS: Final = 1024
"""``max_tokens`` of a chat request that gives none (bounded so a session's KV reservation is too)."""


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


class RequestPreparer:
    """Prepares the requests of one head node (:class:`HeadNode`)."""

    def __init__(self, node: HeadNode) -> None:
        self._node = node

    async def prepare(self, request: Request, schema: type[oa.SamplingRequest], *, chat: bool,
                      caller: Caller) -> Prepared:
        """A chat or completions request, ready to generate."""
        self.check_head()
        body = caller.body if caller.body is not None else await self._body(request)
        resume = None
        if caller.from_mesh:  # only the tracker continues a stream whose head died (meshwire.resume)
            try:
                body, resume = take_resume(body)
            except ValueError as exc:
                raise ApiError(400, f"{RESUME_KEY} is not a stream to continue: {str(exc)[:200]}",
                               "invalid_request", RESUME_KEY) from None
        parsed = self._validate(body, schema)
        assert isinstance(parsed, oa.SamplingRequest)
        return await self._prepare_parsed(request, parsed, chat=chat, resume=resume, from_mesh=caller.from_mesh)

    async def prepare_response(self, request: Request, caller: Caller) -> tuple[ResponsesRequest, Prepared]:
        """A Responses API request and the chat it means (:mod:`meshwire.responses_api`), ready to generate."""
        self.check_head()
        body = caller.body if caller.body is not None else await self._body(request)
        parsed = self._validate(body, ResponsesRequest)
        assert isinstance(parsed, ResponsesRequest)
        try:
            chat = parsed.to_chat()
        except ValidationError as exc:
            raise ApiError(400, oa.validation_error_message(exc), "invalid_request",
                           oa.validation_error_param(exc)) from None
        return parsed, await self._prepare_parsed(request, chat, chat=True)

    def check_head(self) -> None:
        """Refuse a request this node cannot serve now: 503 while it is not ready, 409 if it is not a head."""
        node = self._node
        shard = node.shard
        if shard is None or node.state != "ready":
            raise ApiError(503, f"this node is {node.state}", "not_ready", retry_after="2")
        if node.generator is None:
            raise ApiError(409, f"this node holds layers {shard.start}-{shard.end}, not layer 0: it is not a head; "
                                "send chat requests to the tracker", "not_head")

    async def _body(self, request: Request) -> bytes:
        return await read_json_body(request, self._node.settings.max_body_bytes)

    @staticmethod
    def _validate(body: bytes, schema: type[BaseModel]) -> BaseModel:
        try:
            return schema.model_validate_json(body)
        except ValidationError as exc:
            raise ApiError(400, oa.validation_error_message(exc), "invalid_request",
                           oa.validation_error_param(exc)) from None

    async def _prepare_parsed(self, request: Request, parsed: oa.SamplingRequest, *, chat: bool,
                              resume: Resume | None = None, from_mesh: bool = False) -> Prepared:
        node = self._node
        generator = node.generator
        assert generator is not None
        if request.headers.get(h.ROUTE) is None:  # with a route, the tracker has matched the name already
            self._check_model_name(parsed.model)
        tools = isinstance(parsed, oa.ChatCompletionRequest) and parsed.wants_tools
        if tools:
            check_tools_supported(generator.tokenizer, node.model_id)
        if parsed.choices > 1:
            raise ApiError(400, f"n={parsed.choices}: a head serves one choice a request; the tracker's front door "
                                "serves n > 1, as one session per choice", "invalid_request", "n")
        hop = await route_of(request, node)
        prompt = await self._prompt(parsed, generator.tokenizer, tools=tools)
        if tools:
            assert isinstance(parsed, oa.ChatCompletionRequest)
            grammar = await tools_grammar(node.grammar, parsed)
        else:
            grammar = await response_grammar(node.grammar, parsed.response_format)
        generation = self._generation_request(parsed, prompt, chat=chat, resume=resume, grammar=grammar)
        generation = self._with_mesh_headers(request, generation, from_mesh=from_mesh)
        sent = "" if not (tools and generation.resume) else await asyncio.to_thread(
            sent_text, generator.tokenizer, generation.stop, generation.resume)
        return Prepared(generation=generation, hop=hop, stream=parsed.stream, include_usage=parsed.include_usage,
                        tools=tools, sent=sent)

    @staticmethod
    async def _prompt(parsed: oa.SamplingRequest, tokenizer: HeadTokenizer, *, tools: bool) -> list[int]:
        """The prompt's token ids: chat messages (and the tools offered) through the chat template, or a raw
        completion prompt."""
        try:
            if isinstance(parsed, oa.ChatCompletionRequest):
                messages = [m.template_dict() for m in parsed.messages]
                shown = [tool.model_dump(exclude_none=True, exclude={"function": {"strict"}})
                         for tool in parsed.tools or ()] if tools else None
                return await asyncio.to_thread(tokenizer.encode_chat, messages, shown)
            assert isinstance(parsed, oa.CompletionRequest)
            return await asyncio.to_thread(tokenizer.encode_text, parsed.prompt)
        except TemplateError as exc:
            raise ApiError(400, str(exc), "invalid_request", "messages") from None

    def _with_mesh_headers(self, request: Request, generation: GenerationRequest, *,
                           from_mesh: bool) -> GenerationRequest:
        """``generation`` with what the tracker's headers add: a prefill route, an ``n > 1`` choice group."""
        plan = prefill_plan_of(request, self._node, len(generation.prompt_ids))
        if plan is not None:
            generation = dataclasses.replace(generation, prefill=plan)
        group = request.headers.get(h.CHOICE_GROUP) if from_mesh else None
        if group is not None:
            try:
                generation = dataclasses.replace(generation, group=ChoiceGroup.parse(group))
            except ValueError as exc:
                raise ApiError(400, str(exc), "bad_header") from None
        return generation

    def _check_model_name(self, model: str) -> None:
        node = self._node
        if model not in (node.model_id, node.settings.model, Path(node.settings.model).name):
            raise ApiError(404, f"model {model!r} is not served here; this node serves {node.model_id!r}",
                           "model_not_found", "model")

    def _generation_request(self, parsed: oa.SamplingRequest, prompt: list[int], *, chat: bool,
                            resume: Resume | None = None, grammar: str | None = None) -> GenerationRequest:
        """What to generate, every size within bounds (400 naming what is not)."""
        max_tokens = self._max_tokens(parsed, prompt, chat=chat)
        sampling = self._sampling(parsed, resume, grammar)
        resumed = self._resumed(resume, max_tokens)
        echo = parsed.prompt if isinstance(parsed, oa.CompletionRequest) and parsed.echo else None
        return GenerationRequest(prompt_ids=tuple(prompt), max_tokens=max_tokens, stop=parsed.stop_sequences,
                                 sampling=sampling, resume=resumed, echo=echo)

    def _max_tokens(self, parsed: oa.SamplingRequest, prompt: list[int], *, chat: bool) -> int:
        """The answer's token budget: what the request asks, within what the model's context leaves after a
        prompt that is not empty and within the mesh's limit."""
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
        return wanted if context is None else max(1, min(wanted, context - len(prompt)))

    def _sampling(self, parsed: oa.SamplingRequest, resume: Resume | None, grammar: str | None) -> SamplingParams:
        """The request's sampling over the model's recommended defaults, with a definite seed (a continued
        stream's own); small enough to travel along the route in a header."""
        node = self._node
        assert node.shard is not None
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
        return sampling

    def _resumed(self, resume: Resume | None, max_tokens: int) -> tuple[int, ...]:
        """The tokens a continued stream already sent (``meshwire.resume``): in the vocabulary, fewer than the
        answer's budget."""
        node = self._node
        assert node.shard is not None
        resumed = () if resume is None else resume.ids
        if any(token >= node.shard.vocab_size for token in resumed):
            raise ApiError(400, f"{RESUME_KEY} names a token outside this model's vocabulary", "invalid_request",
                           RESUME_KEY)
        if len(resumed) >= max_tokens:
            raise ApiError(400, f"{RESUME_KEY} holds {len(resumed)} tokens: the answer is already complete",
                           "invalid_request", RESUME_KEY)
        return tuple(resumed)
