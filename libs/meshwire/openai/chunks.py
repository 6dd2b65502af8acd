"""Streamed answers: ``chat.completion.chunk`` and the ``text_completion`` chunks of ``/v1/completions``.

Each goes out as one server-sent event (:mod:`meshwire.sse`). A delta leaves
its absent fields out of the JSON, as OpenAI's do; the usage chunk that ends a
stream with ``include_usage`` has no choices.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer

from meshwire.fields import STRICT_MODEL, AsTuple
from meshwire.openai.responses import AnswerEnvelope, ChatLogprobs, CompletionChoice, FinishReason


class SparseModel(BaseModel):
    """A model whose fields left ``None`` are left out of its JSON (a delta says only what it adds)."""

    model_config = STRICT_MODEL

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class FunctionDelta(SparseModel):
    """What a stream chunk adds to a tool call's function: its name (first chunk), more of its arguments."""

    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(SparseModel):
    """One ``delta.tool_calls`` entry: the call's ``index``; its id and type on its first chunk only."""

    index: int = Field(ge=0)
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta | None = None


class Delta(SparseModel):
    """What a stream chunk adds to the message; absent fields are left out of the JSON."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: Annotated[tuple[ToolCallDelta, ...], AsTuple] | None = None


class ChunkChoice(BaseModel):
    model_config = STRICT_MODEL

    index: int = Field(default=0, ge=0)
    delta: Delta
    finish_reason: FinishReason | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(AnswerEnvelope):
    """One streamed ``chat.completion.chunk``; the usage chunk has no choices."""

    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: Annotated[tuple[ChunkChoice, ...], AsTuple] = ()


class CompletionChunk(AnswerEnvelope):
    """One streamed ``/v1/completions`` chunk (OpenAI names it ``text_completion`` too)."""

    object: Literal["text_completion"] = "text_completion"
    choices: Annotated[tuple[CompletionChoice, ...], AsTuple] = ()
