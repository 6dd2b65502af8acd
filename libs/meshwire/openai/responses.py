"""What the services answer: non-streamed completions, their choices and log-probabilities, usage, models, errors.

Built by the services and serialised with ``model_dump_json``; the streamed
forms are in :mod:`meshwire.openai.chunks`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from meshwire.fields import STRICT_MODEL, AsTuple

FinishReason = Literal["stop", "length", "tool_calls"]


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


class AnswerEnvelope(BaseModel):
    """What every answer and stream chunk carries, in OpenAI's order of keys.

    Each kind fixes ``object`` and types ``choices`` by declaring them again (a field declared again keeps
    its place in the JSON).
    """

    model_config = STRICT_MODEL

    id: str
    object: str
    created: int
    model: str
    choices: tuple[Any, ...]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ChatChoice(BaseModel):
    model_config = STRICT_MODEL

    index: int = Field(default=0, ge=0)
    message: AssistantMessage
    finish_reason: FinishReason | None
    logprobs: ChatLogprobs | None = None


class ChatCompletion(AnswerEnvelope):
    """A non-streamed ``/v1/chat/completions`` answer."""

    object: Literal["chat.completion"] = "chat.completion"
    choices: Annotated[tuple[ChatChoice, ...], AsTuple]


class CompletionChoice(BaseModel):
    model_config = STRICT_MODEL

    index: int = Field(default=0, ge=0)
    text: str
    finish_reason: FinishReason | None = None
    logprobs: CompletionLogprobs | None = None


class Completion(AnswerEnvelope):
    """A non-streamed ``/v1/completions`` answer."""

    object: Literal["text_completion"] = "text_completion"
    choices: Annotated[tuple[CompletionChoice, ...], AsTuple]


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
