"""A non-streamed answer assembled from a stream, so that it too outlives its head.

The tracker serves a non-streamed chat or completion by asking the head for
the streamed answer (with progress, see :mod:`.continuation`) and assembling
the events into the one JSON answer the client asked for: the text in order,
the tool calls (their ``delta.tool_calls`` added up), the finish reason, the
usage, the log-probabilities. A head that dies midway
is replaced exactly as for a stream, and the client gets one whole answer.
A stream that ends in an error event becomes that error's HTTP answer.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Final

import orjson

from meshwire import errors
from meshwire import openai as oa
from meshwire.tool_calls import ToolCallAssembler

from .responses import HTTPError

STREAMED_FOR_COLLECTION: Final = {"stream": True, "stream_options": {"include_usage": True}}
"""What the tracker adds to a non-streamed request before sending it to a head."""


def as_streamed(body: bytes) -> bytes:
    """``body`` (a validated non-streamed request) asking for the streamed answer with usage."""
    return orjson.dumps({**orjson.loads(body), **STREAMED_FOR_COLLECTION})


@dataclass
class _Answer:
    response_id: str = ""
    created: int = 0
    model: str = ""
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    chat_logprobs: list[Any] = field(default_factory=list)
    legacy: dict[str, list[Any]] = field(default_factory=lambda: {"tokens": [], "token_logprobs": [],
                                                                  "top_logprobs": [], "text_offset": []})
    has_logprobs: bool = False
    error: dict[str, Any] | None = None
    tool_calls: ToolCallAssembler = field(default_factory=ToolCallAssembler)


async def collect(events: AsyncIterator[dict[str, Any] | None], *, chat: bool) -> bytes:
    """The JSON answer (``chat.completion`` or ``text_completion``) the stream's parsed ``events`` spell out
    (``None`` is its ``[DONE]``, as :meth:`.continuation.ContinuedStream.payloads` yields them).

    Raises :class:`HTTPError` with the stream's error when it ended in one.
    """
    answer = _Answer()
    async for event in events:
        if event is not None:
            _take(answer, event, chat)
    if answer.error is not None:
        status = 503 if answer.error.get("code") in ("no_route", "head_failed", "kv_budget") else 502
        raise HTTPError(status, str(answer.error.get("message", "the mesh failed mid-answer")),
                        str(answer.error.get("type", errors.SERVER_ERROR)), answer.error.get("code"),
                        answer.error.get("param"))
    usage = oa.Usage.model_validate(answer.usage) if answer.usage else None
    finish = answer.finish_reason if answer.finish_reason in ("stop", "length", "tool_calls") else None
    text = "".join(answer.text)
    if chat:
        logprobs = oa.ChatLogprobs(content=tuple(answer.chat_logprobs)) if answer.has_logprobs else None
        calls = answer.tool_calls.result()
        message = oa.AssistantMessage(content=text or (None if calls else ""),
                                      tool_calls=None if calls is None else
                                      tuple(oa.ToolCall.model_validate(call) for call in calls))
        body: Any = oa.ChatCompletion(
            id=answer.response_id, created=answer.created, model=answer.model, usage=usage,
            choices=(oa.ChatChoice(message=message, finish_reason=finish,  # type: ignore[arg-type]
                                   logprobs=logprobs),))
    else:
        legacy = oa.CompletionLogprobs.model_validate(answer.legacy) if answer.has_logprobs else None
        body = oa.Completion(id=answer.response_id, created=answer.created, model=answer.model, usage=usage,
                             choices=(oa.CompletionChoice(text=text, finish_reason=finish,  # type: ignore[arg-type]
                                                          logprobs=legacy),))
    return body.model_dump_json().encode()


def _take(answer: _Answer, event: dict[str, Any], chat: bool) -> None:
    if isinstance(event.get("error"), dict):
        answer.error = event["error"]
        return
    answer.response_id = answer.response_id or str(event.get("id", ""))
    answer.created = answer.created or int(event.get("created", 0) or 0)
    answer.model = answer.model or str(event.get("model", ""))
    if isinstance(event.get("usage"), dict):
        answer.usage = event["usage"]
    for choice in event.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
        if isinstance(piece, str):
            answer.text.append(piece)
        if chat:
            answer.tool_calls.add((choice.get("delta") or {}).get("tool_calls"))
        if choice.get("finish_reason"):
            answer.finish_reason = choice["finish_reason"]
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict):
            answer.has_logprobs = True
            if chat:
                answer.chat_logprobs.extend(logprobs.get("content") or ())
            else:
                for key, values in answer.legacy.items():
                    values.extend(logprobs.get(key) or ())
