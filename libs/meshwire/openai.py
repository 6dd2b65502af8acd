"""OpenAI-compatible request, response and stream-chunk schemas, in one place.

Requests follow what the OpenAI API accepts, and nothing is silently
ignored: every top-level parameter of a request is honoured, refused with a
400 that names it and says why (:data:`REFUSED`: tools, structured outputs,
penalties, ...), or one of the few OpenAI itself documents as having no effect
on the answer (:data:`NO_EFFECT`: ``user``, ``store``, ``metadata``); an
unknown parameter is a 400 too, as OpenAI answers it. An integer is accepted
where a number is expected (``"temperature": 1`` is an integer in JSON), and
everything else is strictly typed and bounded. A bad request becomes one
sentence naming the field via :func:`validation_error_message`, which
services put in a 400 error body.

Responses are built by the services and serialised with ``model_dump_json``;
stream chunks go out as server-sent events (:mod:`meshwire.sse`).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from typing import Annotated, Any, Final, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    SerializerFunctionWrapHandler,
    Tag,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from meshwire import limits
from meshwire.fields import STRICT_MODEL, AsTuple
from meshwire.sampling_params import MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_ENTRIES, MAX_TOP_LOGPROBS

REQUEST_MODEL: Final = ConfigDict(frozen=True, strict=True, extra="ignore")
"""Parts of requests (messages, options): immutable and strictly typed; keys of other OpenAI features ignored."""
TOP_LEVEL_REQUEST: Final = ConfigDict(frozen=True, strict=True, extra="forbid")
"""A request body: an unknown parameter is refused (OpenAI: "Unrecognized request argument supplied")."""

Role = Literal["system", "user", "assistant", "developer", "tool"]
FinishReason = Literal["stop", "length", "tool_calls"]
PART_SEPARATOR: Final = "\n"
"""How the text parts of one message are joined into its text."""
MAX_NAME_CHARS: Final = 256
MAX_USER_CHARS: Final = 256
SEED_MIN: Final = -(1 << 63)
SEED_MAX: Final = (1 << 64) - 1
DEFAULT_COMPLETION_MAX_TOKENS: Final = 16
MAX_COMPLETION_LOGPROBS: Final = 5
"""OpenAI's bound on ``logprobs`` of ``/v1/completions``."""
"""OpenAI's default ``max_tokens`` for ``/v1/completions``."""

MAX_CHOICES: Final = 16
"""Largest ``n``: each choice is a session of its own on the mesh (KV cache on every hop)."""


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index`` of a request with ``seed``: ``seed + index`` (``None``: random, per choice).

    Choice 0 is the request with ``n=1``; choice ``i`` equals ``n=1`` with ``seed + i``. A sum past
    :data:`SEED_MAX` wraps round 2**64, as torch wraps a seed it is given.
    """
    if seed is None:
        return None
    out = seed + index
    return out - (1 << 64) if out > SEED_MAX else out


StopSequence = Annotated[str, Field(min_length=1, max_length=limits.MAX_STOP_CHARS)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]
TokenCount = Annotated[int, Field(ge=1, le=limits.MAX_TOKENS_LIMIT)]


class TextPart(BaseModel):
    """A ``{"type": "text", "text": ...}`` content part (the only kind this server reads)."""

    model_config = REQUEST_MODEL

    type: Literal["text"]
    text: str = Field(max_length=limits.MAX_PROMPT_CHARS)


MAX_TOOL_CALL_ID_CHARS: Final = 256
MAX_ARGUMENTS_CHARS: Final = 64 * 1024
"""Longest ``arguments`` string of a tool call in the conversation history."""
MAX_HISTORY_TOOL_CALLS: Final = 128
"""Most tool calls one assistant message of the history may carry."""


class FunctionCallIn(BaseModel):
    """``function`` of a tool call in the history: the function's name and its arguments as a JSON string."""

    model_config = REQUEST_MODEL

    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    arguments: str = Field(max_length=MAX_ARGUMENTS_CHARS)

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, value: str) -> str:
        try:
            parsed = json.loads(value)
        except ValueError:
            raise ValueError("must be a JSON object (as a string)") from None
        if not isinstance(parsed, dict):
            raise ValueError("must be a JSON object (as a string)")  # noqa: TRY004 (pydantic reports ValueError)
        return value


class ToolCallIn(BaseModel):
    """One entry of an assistant message's ``tool_calls`` in the history."""

    model_config = REQUEST_MODEL

    id: str = Field(min_length=1, max_length=MAX_TOOL_CALL_ID_CHARS)
    type: Literal["function"]
    function: FunctionCallIn

    def template_dict(self) -> dict[str, Any]:
        """The call as chat templates read it: ``arguments`` as an object (transformers' convention)."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name, "arguments": json.loads(self.function.arguments)}}


class ChatMessage(BaseModel):
    """One chat message. ``content`` is a string or a list of text parts.

    An assistant message may carry the ``tool_calls`` it made (its content may then be ``null``);
    a ``tool`` message answers one of them and names it in ``tool_call_id``.
    """

    model_config = REQUEST_MODEL

    role: Role
    content: str | Annotated[tuple[TextPart, ...], Field(max_length=limits.MAX_CONTENT_PARTS)] | None = None
    name: str | None = Field(default=None, max_length=MAX_NAME_CHARS)
    tool_calls: Annotated[tuple[ToolCallIn, ...], AsTuple, Field(max_length=MAX_HISTORY_TOOL_CALLS)] | None = None
    tool_call_id: str | None = Field(default=None, min_length=1, max_length=MAX_TOOL_CALL_ID_CHARS)

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        """Give a clear message for non-text parts instead of a union error."""
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list | tuple):
            raise ValueError("content must be a string or a list of text parts")  # noqa: TRY004 (pydantic reports ValueError)
        if len(value) > limits.MAX_CONTENT_PARTS:
            raise ValueError(f"content has more than {limits.MAX_CONTENT_PARTS} parts")
        parts: list[Any] = []
        for i, part in enumerate(value):
            if isinstance(part, TextPart):
                parts.append(part)
                continue
            if not isinstance(part, Mapping):
                raise ValueError(f"content part {i} must be an object")  # noqa: TRY004 (pydantic reports ValueError)
            if part.get("type") != "text":
                raise ValueError(f"content part {i} has type {str(part.get('type'))[:40]!r}; "
                                 "only 'text' parts are supported")
            parts.append(TextPart.model_validate(part))
        return tuple(parts)

    @model_validator(mode="after")
    def _content_present(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"a {self.role} message cannot carry tool_calls (only an assistant's does)")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs tool_call_id (the id of the call it answers)")
        return self

    def text(self) -> str:
        """The message content as plain text (text parts joined by :data:`PART_SEPARATOR`)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return PART_SEPARATOR.join(part.text for part in self.content)

    def template_dict(self) -> dict[str, Any]:
        """``{"role", "content"}`` with text content, as chat templates expect; with ``tool_calls`` (arguments
        as objects) and ``tool_call_id`` where the message has them."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [call.template_dict() for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


MAX_SCHEMA_CHARS: Final = 8 * 1024
"""Longest ``response_format`` JSON schema (as compact JSON): its grammar travels to the tail in a header."""
SCHEMA_NAME_PATTERN: Final = r"^[A-Za-z0-9_-]{1,64}$"
"""OpenAI's rule for ``json_schema.name``."""


class JsonSchemaSpec(BaseModel):
    """``response_format.json_schema``: the schema every answer must match.

    ``strict`` is accepted either way: the schema is always enforced as OpenAI's
    ``strict: true`` enforces it, and a schema the engine cannot enforce is a 400.
    """

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid", populate_by_name=True)

    name: str = Field(pattern=SCHEMA_NAME_PATTERN)
    description: str | None = Field(default=None, max_length=MAX_SCHEMA_CHARS)
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @field_validator("json_schema")
    @classmethod
    def _bounded(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and len(json.dumps(value, separators=(",", ":"))) > MAX_SCHEMA_CHARS:
            raise ValueError(f"the schema is longer than {MAX_SCHEMA_CHARS} characters as compact JSON")
        return value


MAX_TOOLS: Final = 128
"""Most tools one request may declare (OpenAI's bound)."""


class FunctionSpec(BaseModel):
    """A function a model may call: its name, what it does, its arguments' JSON schema."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    name: str = Field(pattern=SCHEMA_NAME_PATTERN)
    description: str | None = Field(default=None, max_length=MAX_SCHEMA_CHARS)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _bounded(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and len(json.dumps(value, separators=(",", ":"))) > MAX_SCHEMA_CHARS:
            raise ValueError(f"the parameters schema is longer than {MAX_SCHEMA_CHARS} characters as compact JSON")
        if value is not None and value.get("type", "object") != "object":
            raise ValueError("must be the JSON schema of an object (a call's arguments are a JSON object)")
        return value


class ToolSpec(BaseModel):
    """One entry of ``tools``: ``{"type": "function", "function": {...}}``."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    type: Literal["function"]
    function: FunctionSpec


class FunctionName(BaseModel):
    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    name: str = Field(pattern=SCHEMA_NAME_PATTERN)


class NamedToolChoice(BaseModel):
    """``tool_choice`` naming the function the model must call."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class TextFormat(BaseModel):
    """``{"type": "text"}``: free text (the default)."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    type: Literal["text"]


class JsonObjectFormat(BaseModel):
    """``{"type": "json_object"}``: the answer is one JSON object."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    type: Literal["json_object"]


class JsonSchemaFormat(BaseModel):
    """``{"type": "json_schema", "json_schema": {...}}``: the answer is JSON matching the schema."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


def _format_type(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, Mapping) else getattr(value, "type", None)
    return f"[{kind}]" if kind in ("text", "json_object", "json_schema") else None


ResponseFormat = Annotated[
    Annotated[TextFormat, Tag("[text]")] | Annotated[JsonObjectFormat, Tag("[json_object]")]
    | Annotated[JsonSchemaFormat, Tag("[json_schema]")],
    Discriminator(_format_type, custom_error_type="invalid_response_format",
                  custom_error_message="type must be 'text', 'json_object' or 'json_schema'")]
"""``response_format``, chosen by its ``type`` (the tags are bracketed so an error's location skips them)."""


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a final chunk carrying usage."""

    model_config = REQUEST_MODEL

    include_usage: bool = False


NO_EFFECT: Final = ("user", "store", "metadata")
"""Accepted and without effect on the answer, by design (as at OpenAI: end-user ids, storage, tags)."""
MAX_METADATA_ENTRIES: Final = 16
"""OpenAI's bound on ``metadata``: 16 pairs, keys up to 64 characters, values up to 512."""


def refused(reason: str, *, allowed: tuple[Any, ...] = ()) -> Any:
    """The type of a parameter this server does not implement: absent, ``null`` or one of ``allowed`` (the
    values that ask for what it does anyway, e.g. ``{"type": "text"}``) passes; anything else is a 400
    naming the parameter and saying ``reason``."""
    def check(value: Any) -> Any:
        if value is not None and value not in allowed:
            raise ValueError(f"not supported: {reason}")
        return value
    return Annotated[Any, BeforeValidator(check)]


NoFunctions = refused("the deprecated functions API is not served; send tools and tool_choice instead")
OneTier = refused("a mesh has one tier")
TextModalityOnly = refused("this mesh answers text only", allowed=(["text"],))
TextOnly = refused("this mesh answers text only")
NoPrediction = refused("predicted outputs are not implemented")
NoReasoning = refused("the served model has no reasoning settings")
NoWebSearch = refused("this mesh has no web search")
NoSuffix = refused("insertion (a suffix after the completion) is not implemented")


class SamplingRequest(BaseModel):
    """The generation and sampling fields ``/v1/chat/completions`` and ``/v1/completions`` share.

    ``top_k`` is an extension (0 or absent: off). ``logit_bias`` is applied by
    the tail to the model's logits before anything else. Penalties are
    accepted only at 0 (their default): the tail does not see the tokens a
    replayed session generated, so it could not apply them faithfully.
    """

    model_config = TOP_LEVEL_REQUEST

    model: str = Field(min_length=1, max_length=limits.MAX_URL_CHARS)
    max_tokens: TokenCount | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=0, le=limits.MAX_TOP_K)
    n: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    """Choices to generate, each its own session; choice ``i`` is sampled with :func:`choice_seed` (``seed``, ``i``)."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    """Only read when ``stream`` is true."""
    stop: str | Annotated[tuple[StopSequence, ...], AsTuple,
                          Field(max_length=limits.MAX_STOP_SEQUENCES)] | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    user: str | None = Field(default=None, max_length=MAX_USER_CHARS)
    store: bool | None = None
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                        Field(max_length=MAX_METADATA_ENTRIES)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS,
                                                           allow_inf_nan=False)]],
                          Field(max_length=MAX_LOGIT_BIAS_ENTRIES)] | None = None
    """Token id (as a string, as OpenAI takes it) to a bias in -100..100 added to its logit."""

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float | None) -> float | None:
        if value:
            raise ValueError("penalties are not supported (only 0, the default): the tail of a route does not "
                             "see which tokens a session generated once a failover replays it")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not key.isdigit() or len(key) > 10:
                raise ValueError(f"keys must be token ids (non-negative integers as strings), got {key[:20]!r}")
        return value

    @property
    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as ``(token id, bias)`` pairs, in token order."""
        return tuple(sorted((int(key), float(bias)) for key, bias in (self.logit_bias or {}).items()))

    @property
    def top_logprobs_wanted(self) -> int | None:
        """``None``: no log-probabilities; else how many alternatives per token (subclasses read their fields)."""
        return None

    response_format: ResponseFormat | None = None
    """Structured outputs: the tail constrains every token to a grammar compiled from it."""
    tools: Annotated[tuple[ToolSpec, ...], AsTuple, Field(max_length=MAX_TOOLS)] | None = None
    """Functions the model may call. Served only where the model's chat template renders tools (the head
    answers a 400 saying so otherwise); with ``tool_choice: "none"`` they are not offered and the answer is text."""
    tool_choice: ToolChoice | None = None
    """``auto`` (the default with tools): text or tool calls; ``required``: at least one call; a named
    function: exactly one call of it; ``none``: text, as if no tools were given."""
    parallel_tool_calls: bool | None = None
    """``false``: at most one tool call per answer (default: several may follow each other)."""

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> SamplingRequest:
        names = [tool.function.name for tool in self.tools or ()]
        if len(set(names)) != len(names):
            twice = next(name for name in names if names.count(name) > 1)
            raise ValueError(f"tools declare the function {twice!r} more than once")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names the function {self.tool_choice.function.name!r}, which is not "
                             "among the tools")
        if self.tool_choice in ("auto", "required") and not names:
            raise ValueError(f"tool_choice {self.tool_choice!r} needs tools")
        if self.wants_tools and self.response_format is not None and not isinstance(self.response_format,
                                                                                    TextFormat):
            raise ValueError("response_format cannot be combined with tools on this mesh (tool call arguments "
                             "follow their function's parameters schema); send one or the other, or "
                             "tool_choice 'none'")
        return self

    @property
    def wants_tools(self) -> bool:
        """True when the answer may (or must) be a tool call: tools given, and ``tool_choice`` is not ``none``."""
        return bool(self.tools) and self.tool_choice != "none"
    functions: NoFunctions = None
    function_call: NoFunctions = None
    service_tier: OneTier = None

    @field_validator("temperature")
    @classmethod
    def _temperature_floor(cls, value: float | None) -> float | None:
        if value is not None and 0.0 < value < limits.MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or at least {limits.MIN_TEMPERATURE}, got {value!r}")
        return value

    @property
    def choices(self) -> int:
        """How many choices the request asks for (``n``, 1 when absent)."""
        return self.n or 1

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, value: Any) -> Any:
        if isinstance(value, list | tuple):
            if len(value) > limits.MAX_STOP_SEQUENCES:
                raise ValueError(f"at most {limits.MAX_STOP_SEQUENCES} stop sequences are allowed")
            if not all(isinstance(item, str) for item in value):
                raise ValueError("stop must be a string or a list of strings")
            return tuple(value)
        if value is not None and not isinstance(value, str):
            raise ValueError("stop must be a string or a list of strings")
        if isinstance(value, str) and len(value) > limits.MAX_STOP_CHARS:
            raise ValueError(f"a stop sequence may be at most {limits.MAX_STOP_CHARS} characters")
        return value

    @property
    def stop_sequences(self) -> tuple[str, ...]:
        """``stop`` as a tuple (empty when absent; an empty string is no stop)."""
        if self.stop is None:
            return ()
        if isinstance(self.stop, str):
            return (self.stop,) if self.stop else ()
        return self.stop

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    def token_budget(self, default: int) -> int:
        """How many tokens to generate at most: the request's limit, else ``default``."""
        return self.max_tokens if self.max_tokens is not None else default


class ChatCompletionRequest(SamplingRequest):
    """Body of ``POST /v1/chat/completions``."""

    messages: Annotated[tuple[ChatMessage, ...], AsTuple,
                        Field(min_length=1, max_length=limits.MAX_MESSAGES)]
    max_completion_tokens: TokenCount | None = None
    """OpenAI's newer name for ``max_tokens``; wins when both are given."""
    logprobs: bool | None = None
    """Return each output token's log-probability."""
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    """With ``logprobs``: also the most likely alternatives at each position (0-20)."""
    modalities: TextModalityOnly = None
    audio: TextOnly = None
    prediction: NoPrediction = None
    reasoning_effort: NoReasoning = None
    web_search_options: NoWebSearch = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self

    @property
    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @model_validator(mode="after")
    def _bounded_prompt(self) -> ChatCompletionRequest:
        total = sum(len(message.text()) for message in self.messages)
        if total > limits.MAX_PROMPT_CHARS:
            raise ValueError(f"messages hold {total} characters, more than {limits.MAX_PROMPT_CHARS}")
        return self

    def token_budget(self, default: int) -> int:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return super().token_budget(default)


class CompletionRequest(SamplingRequest):
    """Body of ``POST /v1/completions``: one prompt string (or a list holding one)."""

    prompt: str = Field(max_length=limits.MAX_PROMPT_CHARS)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    """Return each output token's log-probability and this many likeliest alternatives (0-5)."""
    echo: bool = False
    """Give the prompt back before the completion; with ``logprobs``, with each prompt token's log-probability
    (the first has none: ``null``), computed by the tail from the prompt's own logits."""
    best_of: int | None = None
    suffix: NoSuffix = None

    @model_validator(mode="after")
    def _no_tools(self) -> CompletionRequest:
        for name in ("tools", "tool_choice", "parallel_tool_calls"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name} is a parameter of /v1/chat/completions; a raw completion has no tools")
        return self

    @field_validator("best_of")
    @classmethod
    def _one_best(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise ValueError(f"only best_of=1 is supported, got {value}")
        return value

    @property
    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_string(cls, value: Any) -> Any:
        if isinstance(value, list | tuple):
            if len(value) != 1 or not isinstance(value[0], str):
                raise ValueError("prompt must be a string or a list of exactly one string")
            return value[0]
        return value

    def token_budget(self, default: int = DEFAULT_COMPLETION_MAX_TOKENS) -> int:
        return super().token_budget(default)


# --- responses ---------------------------------------------------------------------


class Usage(BaseModel):
    """Token counts of one request."""

    model_config = STRICT_MODEL

    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0)

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        """Usage with ``total_tokens`` filled in."""
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class FunctionCall(BaseModel):
    """The function a tool call calls: its name and its arguments as a JSON string."""

    model_config = STRICT_MODEL

    name: str
    arguments: str


class ToolCall(BaseModel):
    """One entry of ``message.tool_calls``."""

    model_config = STRICT_MODEL

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    """The message of a non-streamed chat choice: text, or (``content`` ``null`` when none) tool calls."""

    model_config = STRICT_MODEL

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: Annotated[tuple[ToolCall, ...], AsTuple] | None = None

    @model_serializer(mode="wrap")
    def _no_empty_tool_calls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out = handler(self)
        if out.get("tool_calls") is None:
            out.pop("tool_calls", None)
        return out


class TopLogprob(BaseModel):
    """One alternative at a position of a chat answer: the token's text, its UTF-8 bytes, its log-probability."""

    model_config = STRICT_MODEL

    token: str
    logprob: float
    bytes: Annotated[tuple[int, ...], AsTuple] | None = None


class TokenLogprob(TopLogprob):
    """One output token of a chat answer with its log-probability and the likeliest alternatives."""

    top_logprobs: Annotated[tuple[TopLogprob, ...], AsTuple] = ()


class ChatLogprobs(BaseModel):
    """``choices[].logprobs`` of a chat answer (or of one stream chunk: the tokens that chunk completes)."""

    model_config = STRICT_MODEL

    content: Annotated[tuple[TokenLogprob, ...], AsTuple] | None = None
    refusal: None = None


class CompletionLogprobs(BaseModel):
    """``choices[].logprobs`` of a ``/v1/completions`` answer (the legacy parallel-lists form)."""

    model_config = STRICT_MODEL

    tokens: Annotated[tuple[str, ...], AsTuple] = ()
    token_logprobs: Annotated[tuple[float | None, ...], AsTuple] = ()
    """``None`` for an echoed prompt's first token (nothing precedes it)."""
    top_logprobs: Annotated[tuple[dict[str, float] | None, ...], AsTuple] = ()
    text_offset: Annotated[tuple[int, ...], AsTuple] = ()


class ChatChoice(BaseModel):
    model_config = STRICT_MODEL

    index: int = Field(default=0, ge=0)
    message: AssistantMessage
    finish_reason: FinishReason | None
    logprobs: ChatLogprobs | None = None


class ChatCompletion(BaseModel):
    """A non-streamed ``/v1/chat/completions`` answer."""

    model_config = STRICT_MODEL

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: Annotated[tuple[ChatChoice, ...], AsTuple]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class FunctionDelta(BaseModel):
    """What a stream chunk adds to a tool call's function: its name (first chunk), more of its arguments."""

    model_config = STRICT_MODEL

    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class ToolCallDelta(BaseModel):
    """One ``delta.tool_calls`` entry: the call's ``index``; its id and type on its first chunk only."""

    model_config = STRICT_MODEL

    index: int = Field(ge=0)
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class Delta(BaseModel):
    """What a stream chunk adds to the message; absent fields are left out of the JSON."""

    model_config = STRICT_MODEL

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: Annotated[tuple[ToolCallDelta, ...], AsTuple] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class ChunkChoice(BaseModel):
    model_config = STRICT_MODEL

    index: int = Field(default=0, ge=0)
    delta: Delta
    finish_reason: FinishReason | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    """One streamed ``chat.completion.chunk``; the usage chunk has no choices."""

    model_config = STRICT_MODEL

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: Annotated[tuple[ChunkChoice, ...], AsTuple] = ()
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionChoice(BaseModel):
    model_config = STRICT_MODEL

    index: int = Field(default=0, ge=0)
    text: str
    finish_reason: FinishReason | None = None
    logprobs: CompletionLogprobs | None = None


class Completion(BaseModel):
    """A non-streamed ``/v1/completions`` answer."""

    model_config = STRICT_MODEL

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: Annotated[tuple[CompletionChoice, ...], AsTuple]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionChunk(BaseModel):
    """One streamed ``/v1/completions`` chunk (OpenAI names it ``text_completion`` too)."""

    model_config = STRICT_MODEL

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: Annotated[tuple[CompletionChoice, ...], AsTuple] = ()
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    """One entry of ``GET /v1/models``."""

    model_config = STRICT_MODEL

    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "meshnet"


class ModelList(BaseModel):
    """``GET /v1/models``."""

    model_config = STRICT_MODEL

    object: Literal["list"] = "list"
    data: Annotated[tuple[ModelCard, ...], AsTuple] = ()


class ErrorDetail(BaseModel):
    """The ``error`` object; extra keys (``failed_node``) are kept."""

    model_config = ConfigDict(frozen=True, strict=True, extra="allow")

    message: str
    type: str
    code: str | None = None
    param: str | None = None


class ErrorResponse(BaseModel):
    """``{"error": {...}}``, the shape :func:`meshwire.errors.error_body` builds."""

    model_config = STRICT_MODEL

    error: ErrorDetail


# --- helpers ---------------------------------------------------------------------


def new_id(prefix: Literal["chatcmpl", "cmpl"]) -> str:
    """A fresh response id such as ``chatcmpl-3f2a...``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    """The ``created`` timestamp: whole unix seconds."""
    return int(time.time())


_UNION_MARKERS: Final = frozenset({"str", "int", "float", "bool", "none", "dict", "list", "tuple"})


def _location(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part in _UNION_MARKERS:
            continue  # pydantic's union-branch markers (``str``, ``tuple[...]``): not field names
        else:
            out += f".{part}" if out else part
    return out


def validation_error_param(exc: ValidationError) -> str | None:
    """The field the first error is about (``messages[0].role``), for the error's ``param``."""
    errors = exc.errors(include_url=False)
    if not errors:
        return None
    return _location(tuple(errors[0]["loc"])) or None


def validation_error_message(exc: ValidationError) -> str:
    """One sentence naming the offending field and what is wrong with it."""
    errors = exc.errors(include_url=False)
    if not errors:
        return "invalid request body"
    first = errors[0]
    field = _location(tuple(first["loc"]))
    message = str(first["msg"]).removeprefix("Value error, ").removeprefix("Assertion failed, ")
    if first["type"] == "extra_forbidden":
        sentence = f"unrecognized request argument supplied: {field}"
    elif first["type"] == "missing":
        sentence = f"missing required field '{field}'"
    elif first["type"] == "json_invalid":
        sentence = f"request body is not valid JSON ({message})"
    elif first["type"] in ("model_type", "model_attributes_type", "dict_type") and not field:
        sentence = "request body must be a JSON object"
    elif field:
        sentence = f"invalid value for '{field}': {message[0].lower() + message[1:] if message else message}"
    else:
        sentence = message[0].lower() + message[1:] if message else "invalid request body"
    more = len(errors) - 1
    suffix = f" (and {more} more problem{'s' if more > 1 else ''})" if more else ""
    return f"{sentence}{suffix}"
