"""A head's answers streamed as server-sent events: chat chunks, completion chunks, Responses API events.

A stream opens (the chat's first chunk carries the role), sends one chunk per piece of text as tokens are
produced, then a final chunk with ``finish_reason``, a usage chunk when ``stream_options.include_usage``,
then ``data: [DONE]``. A failure after the stream began (failover gave up) ends it with an error event,
then ``data: [DONE]``. With tools, the text is read by a :class:`ToolCallParser`: content and
``delta.tool_calls`` go out, never the call markup. When the tracker asks for progress
(``meshwire.resume``), every event carries its token ids (and the first, the seed).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any, Final

import orjson
from pydantic import BaseModel

from meshwire import openai as oa
from meshwire import sse
from meshwire.responses_api import ResponseEvents, usage_of
from meshwire.resume import Progress, with_progress
from meshwire.tool_calls import ToolCallParser
from services.node.api.api_error import from_failure
from services.node.api.logprob_render import chat_logprobs, completion_logprobs, echo_logprobs, joined
from services.node.head.events import Finished, GenerationEvent, TextDelta
from services.node.head.failures import GenerationFailed
from services.node.head.tokens import HeadTokenizer

logger = logging.getLogger(__name__)

SSE_HEADERS: Final = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
"""Headers of every stream: no caching, no proxy buffering (each event goes out as it is made)."""


def finish_reason(finished: Finished, tools: ToolCallParser | None) -> oa.FinishReason:
    """``tool_calls`` for an answer that ended by itself after calling tools, else the generator's reason."""
    if tools is not None and tools.called and finished.finish_reason == "stop":
        return "tool_calls"
    return finished.finish_reason


def _delta_of(content: str, tool_calls: list[dict[str, Any]]) -> oa.Delta:
    """A chunk's delta: content text, tool call entries, or both."""
    return oa.Delta(content=content or None,
                    tool_calls=tuple(oa.ToolCallDelta.model_validate(call) for call in tool_calls) or None)


async def response_events(builder: ResponseEvents, first: GenerationEvent,
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
        yield builder.failure(from_failure(exc).body()["error"])
    finally:
        await rest.aclose()  # type: ignore[attr-defined]


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
            yield sse.sse_error(orjson.dumps(from_failure(exc).body()))
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
        reason = finish_reason(finished, self.tools)
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

