"""A head's answers collected whole: the chat completion, the completion, the Responses API response.

The collected text equals the streamed text: both are the concatenation of the same
:class:`~services.node.head.events.TextDelta` events (:mod:`services.node.api.streams`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from meshwire import openai as oa
from meshwire.responses_api import ResponseEvents, usage_of
from meshwire.tool_calls import ToolCallAssembler, ToolCallParser
from services.node.api.logprob_render import chat_logprobs, completion_logprobs, echo_logprobs, joined
from services.node.api.streams import finish_reason
from services.node.head.events import Echo, Finished, GenerationEvent, TokenInfo
from services.node.head.tokens import HeadTokenizer


async def first_event(events: AsyncIterator[GenerationEvent]) -> GenerationEvent:
    """The first event; on failure the generator is closed (which closes its session)."""
    try:
        return await anext(events)
    except BaseException:
        await events.aclose()  # type: ignore[attr-defined]
        raise


@dataclass(frozen=True)
class Answer:
    """A whole answer: its text, its tokens' log-probabilities (when asked for), how it finished, the prompt it
    echoes (a completion's ``echo``)."""

    text: str
    tokens: tuple[TokenInfo, ...]
    finished: Finished
    echo: Echo | None

    def usage(self) -> oa.Usage:
        return oa.Usage.of(self.finished.prompt_tokens, self.finished.completion_tokens)


async def collect(first: GenerationEvent, events: AsyncIterator[GenerationEvent]) -> Answer:
    """The whole answer, from its first event on; the generator is closed however collecting ends."""
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
    return Answer("".join(pieces), tuple(tokens), event, echo)


def chat_completion(response_id: str, model: str, answer: Answer, tokenizer: HeadTokenizer | None,
                    tools: ToolCallParser | None) -> oa.ChatCompletion:
    """A non-streamed chat answer (``tokenizer``: set when the request asked for log-probabilities)."""
    logprobs = None if tokenizer is None else chat_logprobs(tokenizer, answer.tokens)
    message, reason = _chat_message(answer.text, tools, answer.finished)
    return oa.ChatCompletion(id=response_id, created=oa.now_s(), model=model, usage=answer.usage(),
                             choices=(oa.ChatChoice(message=message, finish_reason=reason, logprobs=logprobs),))


def completion(response_id: str, model: str, answer: Answer, tokenizer: HeadTokenizer | None) -> oa.Completion:
    """A non-streamed completion, after the prompt it echoes (``echo``)."""
    echo = answer.echo
    text = answer.text
    start = 0 if echo is None else len(echo.text)
    legacy = None if tokenizer is None else completion_logprobs(tokenizer, answer.tokens, start)
    if echo is not None:
        text = echo.text + text
        if legacy is not None and tokenizer is not None:
            legacy = joined(echo_logprobs(tokenizer, echo), legacy)
    return oa.Completion(id=response_id, created=oa.now_s(), model=model, usage=answer.usage(),
                         choices=(oa.CompletionChoice(text=text, finish_reason=answer.finished.finish_reason,
                                                      logprobs=legacy),))


def response(builder: ResponseEvents, answer: Answer) -> dict[str, Any]:
    """A non-streamed Responses API response."""
    finished = answer.finished
    return builder.response("incomplete" if finished.finish_reason == "length" else "completed", answer.text,
                            usage_of(finished.prompt_tokens, finished.completion_tokens))


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
    return message, finish_reason(finished, tools)

