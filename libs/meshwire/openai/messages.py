"""The parts of a chat request: messages, their text parts, and the tool calls an assistant made.

A message's ``content`` is a string or a list of text parts (the only kind this
server reads; another kind is a 400 naming it). The history may hold an
assistant's tool calls and the ``tool`` messages answering them; chat templates
read them through :meth:`ChatMessage.template_dict`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from meshwire import limits
from meshwire.fields import AsTuple

REQUEST_MODEL: Final = ConfigDict(frozen=True, strict=True, extra="ignore")
"""Parts of requests (messages, options): immutable and strictly typed; keys of other OpenAI features ignored."""

Role = Literal["system", "user", "assistant", "developer", "tool"]
PART_SEPARATOR: Final = "\n"
"""How the text parts of one message are joined into its text."""
MAX_NAME_CHARS: Final = 256


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
