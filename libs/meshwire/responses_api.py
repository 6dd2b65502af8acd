"""OpenAI's Responses API (``POST /v1/responses``), text in and text out, over the chat path.

A Responses request is turned into the chat request it means
(:meth:`ResponsesRequest.to_chat`: ``instructions`` become a system message,
``input`` the conversation) and served as a chat; the answer is rendered as a
``response`` object, or streamed as the Responses event sequence
(:class:`ResponseEvents`): ``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``, one
``response.output_text.delta`` per piece of text, then the ``.done`` events
and ``response.completed`` (``response.incomplete`` when ``max_output_tokens``
cut it; an ``error`` event when the mesh fails mid-answer). The official SDK's
``client.responses.create(...).output_text`` reads it.

Nothing is stored: ``previous_response_id`` is refused with a 400 that says so
(send the conversation in ``input`` instead). ``text.format`` (``json_object``,
``json_schema``) is chat's ``response_format``. Tools, reasoning and the like
are 400s naming them, as on the chat endpoint.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Final, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from meshwire import limits
from meshwire.fields import AsTuple
from meshwire.openai import (
    MAX_METADATA_ENTRIES,
    MAX_SCHEMA_CHARS,
    MAX_USER_CHARS,
    REQUEST_MODEL,
    SCHEMA_NAME_PATTERN,
    TOP_LEVEL_REQUEST,
    ChatCompletionRequest,
    JsonObjectFormat,
    NoReasoning,
    OneTier,
    TextFormat,
    TokenCount,
    refused,
)

RESPONSE_MEDIA_EVENTS: Final = "text/event-stream"
InputRole = Literal["user", "assistant", "system", "developer"]


class InputText(BaseModel):
    """A text part of an input message (``input_text``, or ``output_text`` in an assistant turn)."""

    model_config = REQUEST_MODEL

    type: Literal["input_text", "output_text", "text"]
    text: str = Field(max_length=limits.MAX_PROMPT_CHARS)


class InputMessage(BaseModel):
    """One message of ``input``: a role and text (a string or text parts)."""

    model_config = REQUEST_MODEL

    type: Literal["message"] = "message"
    role: InputRole
    content: str | Annotated[tuple[InputText, ...], AsTuple, Field(max_length=limits.MAX_CONTENT_PARTS)]

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        if isinstance(value, list):
            for index, part in enumerate(value):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in ("input_text", "output_text", "text"):
                    raise ValueError(f"content part {index} has type {str(kind)[:40]!r}; only text parts are "
                                     "supported")
        return value

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(part.text for part in self.content)


NoStoredResponses = refused("this mesh stores no responses; send the whole conversation in input")
_TOOLS_ON_CHAT: Final = "the Responses API here calls no tools; send tools to /v1/chat/completions"
NoResponseTools = refused(_TOOLS_ON_CHAT, allowed=((), []))
NoResponseToolChoice = refused(_TOOLS_ON_CHAT, allowed=("none", "auto"))
NoResponseParallel = refused(_TOOLS_ON_CHAT, allowed=(True, False))


class FlatJsonSchemaFormat(BaseModel):
    """``text.format`` of type ``json_schema``: the Responses API's flat form of chat's ``json_schema``."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid", populate_by_name=True)

    type: Literal["json_schema"]
    name: str = Field(pattern=SCHEMA_NAME_PATTERN)
    description: str | None = Field(default=None, max_length=MAX_SCHEMA_CHARS)
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseText(BaseModel):
    """``text``: the output's format (plain text, a JSON object, or JSON matching a schema)."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    format: Annotated[TextFormat | JsonObjectFormat | FlatJsonSchemaFormat, Field(discriminator="type")]

    def response_format(self) -> dict[str, Any] | None:
        """The chat ``response_format`` this means (``None``: plain text)."""
        fmt = self.format
        if isinstance(fmt, FlatJsonSchemaFormat):
            spec = {"name": fmt.name, "schema": fmt.json_schema, "strict": fmt.strict, "description": fmt.description}
            return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}
        return None if isinstance(fmt, TextFormat) else {"type": "json_object"}

NothingIncluded = refused("nothing extra can be included", allowed=((), []))
NoTruncation = refused("a prompt over the context is refused, never cut", allowed=("disabled",))
NoBackground = refused("responses are not run in the background", allowed=(False,))
NoResponseLogprobs = refused("use /v1/chat/completions for log-probabilities")


class ResponsesRequest(BaseModel):
    """Body of ``POST /v1/responses`` (the text subset; the rest is refused by name)."""

    model_config = TOP_LEVEL_REQUEST

    model: str = Field(min_length=1, max_length=limits.MAX_URL_CHARS)
    input: str | Annotated[tuple[InputMessage, ...], AsTuple, Field(min_length=1, max_length=limits.MAX_MESSAGES)]
    instructions: str | None = Field(default=None, max_length=limits.MAX_PROMPT_CHARS)
    max_output_tokens: TokenCount | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    stream: bool = False
    user: str | None = Field(default=None, max_length=MAX_USER_CHARS)
    store: bool | None = None
    """Accepted; nothing is ever stored, whatever it says (a later request cannot refer to this one)."""
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                        Field(max_length=MAX_METADATA_ENTRIES)] | None = None

    previous_response_id: NoStoredResponses = None
    tools: NoResponseTools = None
    tool_choice: NoResponseToolChoice = None
    parallel_tool_calls: NoResponseParallel = None
    text: ResponseText | None = None
    """Structured outputs, as chat's ``response_format`` (enforced at the tail by the same grammar engine)."""
    reasoning: NoReasoning = None
    include: NothingIncluded = None
    truncation: NoTruncation = None
    background: NoBackground = None
    service_tier: OneTier = None
    top_logprobs: NoResponseLogprobs = None

    @model_validator(mode="after")
    def _bounded_prompt(self) -> ResponsesRequest:
        total = len(self.instructions or "") + (len(self.input) if isinstance(self.input, str)
                                                else sum(len(message.text()) for message in self.input))
        if total > limits.MAX_PROMPT_CHARS:
            raise ValueError(f"instructions and input hold {total} characters, more than {limits.MAX_PROMPT_CHARS}")
        return self

    def to_chat(self) -> ChatCompletionRequest:
        """The chat request this response means (validated like any chat request)."""
        messages: list[dict[str, str]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        else:
            messages.extend({"role": message.role, "content": message.text()} for message in self.input)
        chat: dict[str, Any] = {"model": self.model, "messages": messages, "stream": self.stream}
        if self.text is not None and (response_format := self.text.response_format()) is not None:
            chat["response_format"] = response_format
        for name, value in (("max_completion_tokens", self.max_output_tokens), ("temperature", self.temperature),
                            ("top_p", self.top_p)):
            if value is not None:
                chat[name] = value
        return ChatCompletionRequest.model_validate_json(orjson.dumps(chat))


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def usage_of(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """The Responses API's usage object."""
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion_tokens}


class ResponseEvents:
    """Builds the ``response`` object and its stream events for one answer (one message of output text)."""

    def __init__(self, request: ResponsesRequest, model: str, created_at: int) -> None:
        self.request = request
        self.model = model
        self.created_at = created_at
        self.response_id = new_response_id()
        self.message_id = new_message_id()
        self._sequence = 0

    def response(self, status: Literal["in_progress", "completed", "incomplete", "failed"], text: str | None,
                 usage: dict[str, Any] | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        """The ``response`` object as it stands: ``text`` is the output so far (``None``: no output item yet)."""
        output = [] if text is None else [self.message(text, "completed" if status == "completed" else status)]
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at, "status": status,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": self.request.instructions, "max_output_tokens": self.request.max_output_tokens,
            "model": self.model, "output": output, "parallel_tool_calls": False, "previous_response_id": None,
            "reasoning": None, "store": False, "temperature": self.request.temperature,
            "text": self.request.text.model_dump(by_alias=True, exclude_none=True) if self.request.text is not None
            else {"format": {"type": "text"}}, "tool_choice": "none", "tools": [],
            "top_p": self.request.top_p, "truncation": "disabled", "usage": usage, "user": self.request.user,
            "metadata": dict(self.request.metadata or {}),
        }

    def message(self, text: str, status: str) -> dict[str, Any]:
        """The output message item holding ``text``."""
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant",
                "content": [] if status == "in_progress" and not text else [self.part(text)]}

    @staticmethod
    def part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": []}

    def event(self, kind: str, **fields: Any) -> bytes:
        """One server-sent event of the Responses stream (``event:`` and ``data:`` lines)."""
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"

    def opening(self) -> list[bytes]:
        """The events before any text."""
        return [
            self.event("response.created", response=self.response("in_progress", None)),
            self.event("response.in_progress", response=self.response("in_progress", None)),
            self.event("response.output_item.added", output_index=0,
                       item={"type": "message", "id": self.message_id, "status": "in_progress", "role": "assistant",
                             "content": []}),
            self.event("response.content_part.added", item_id=self.message_id, output_index=0, content_index=0,
                       part=self.part("")),
        ]

    def delta(self, text: str) -> bytes:
        return self.event("response.output_text.delta", item_id=self.message_id, output_index=0, content_index=0,
                          delta=text, logprobs=[])

    def closing(self, text: str, incomplete: bool, usage: dict[str, Any]) -> list[bytes]:
        """The events after the last text: the ``.done`` events and ``response.completed`` (or ``.incomplete``)."""
        status: Literal["completed", "incomplete"] = "incomplete" if incomplete else "completed"
        return [
            self.event("response.output_text.done", item_id=self.message_id, output_index=0, content_index=0,
                       text=text, logprobs=[]),
            self.event("response.content_part.done", item_id=self.message_id, output_index=0, content_index=0,
                       part=self.part(text)),
            self.event("response.output_item.done", output_index=0, item=self.message(text, "completed")),
            self.event(f"response.{status}", response=self.response(status, text, usage)),
        ]

    def failure(self, error: dict[str, Any]) -> bytes:
        """The ``error`` event of a stream the mesh could not finish (``error``: an OpenAI error object)."""
        return self.event("error", code=error.get("code"), message=error.get("message"), param=error.get("param"))
