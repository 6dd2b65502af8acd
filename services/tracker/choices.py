"""``n > 1``: several choices for one request, each its own stream on the mesh, assembled here.

The tracker sends each choice to a head as a request of its own (``n`` 1,
streamed, with usage): choice ``i`` samples with
:func:`meshwire.openai.choice_seed` (``seed + i``), so a seeded request is
reproducible choice by choice, and choice ``i`` equals the same request with
``n=1`` and ``seed + i``. Each choice is a stream that outlives its head
(:mod:`.continuation`), exactly as a one-choice request is.

The choices go along one route, marked as one group (``meshwire.fork``): the
head prefills the prompt once and the other choices fork its KV, which
changes no token of any choice.

Streamed, the clients sees one stream: every event under one id, each
choice's chunks with their ``index`` as they arrive, one usage chunk at the
end when ``stream_options.include_usage`` asks for it (the prompt counted
once, the completions summed), then one ``[DONE]``. An error event from any
choice ends the whole stream (the other choices are closed). Not streamed,
the answer has ``n`` choices in index order and the same usage.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final

import orjson
from fastapi.responses import Response, StreamingResponse

from meshwire import openai as oa
from meshwire.sse import DONE, MEDIA_TYPE, sse_event

from .collect import collect

logger = logging.getLogger(__name__)

STREAM_HEADERS: Final = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(frozen=True)
class ChoicePayloads:
    """One choice's stream as parsed events (``None``: its ``[DONE]``), and how to let it go."""

    events: AsyncIterator[dict[str, Any] | None]
    close: Callable[[], Awaitable[None]]


OpenChoice = Callable[[bytes, int], Awaitable[ChoicePayloads]]
"""Send choice ``index``'s body along a route: its events (raises the OpenAI error when no head takes it)."""


def choice_body(body: bytes, index: int) -> bytes:
    """The request for choice ``index`` of ``body``: one choice, streamed with usage, seed ``seed + index``."""
    payload = orjson.loads(body)
    payload.pop("n", None)
    if payload.get("seed") is not None:
        payload["seed"] = oa.choice_seed(int(payload["seed"]), index)
    payload["stream"] = True
    payload["stream_options"] = {"include_usage": True}
    return orjson.dumps(payload)


async def several_choices(open_choice: OpenChoice, body: bytes, parsed: oa.SamplingRequest, *,
                          chat: bool) -> Response:
    """The answer to ``parsed`` (``n > 1``): its choices opened at once, streamed or assembled."""
    opened = await _open_all(open_choice, body, parsed.choices)
    if not parsed.stream:
        try:
            answers = await asyncio.gather(*(collect(choice.events, chat=chat) for choice in opened))
        finally:
            await asyncio.gather(*(choice.close() for choice in opened), return_exceptions=True)
        return Response(_merged_answer([orjson.loads(answer) for answer in answers]),
                        media_type="application/json")
    merged = _merged_stream(opened, chat=chat, include_usage=parsed.include_usage)
    return StreamingResponse(merged, media_type=MEDIA_TYPE, headers=STREAM_HEADERS)


async def _open_all(open_choice: OpenChoice, body: bytes, n: int) -> list[ChoicePayloads]:
    """Every choice's stream, or none: when one cannot be opened, those that were are closed."""
    results = await asyncio.gather(*(open_choice(choice_body(body, index), index) for index in range(n)),
                                   return_exceptions=True)
    failure = next((result for result in results if isinstance(result, BaseException)), None)
    if failure is None:
        return [result for result in results if isinstance(result, ChoicePayloads)]
    await asyncio.gather(*(result.close() for result in results if isinstance(result, ChoicePayloads)),
                         return_exceptions=True)
    raise failure


def _merged_answer(answers: list[dict[str, Any]]) -> bytes:
    """One non-streamed answer holding each answer's single choice, with its index, and the summed usage."""
    first = answers[0]
    choices = []
    for index, answer in enumerate(answers):
        choice = dict(answer["choices"][0])
        choice["index"] = index
        choices.append(choice)
    usage = _summed([answer.get("usage") for answer in answers])
    return orjson.dumps({**first, "choices": choices, "usage": usage})


def _summed(usages: list[dict[str, Any] | None]) -> dict[str, int] | None:
    """The usage of several choices of one prompt: the prompt once, every completion."""
    if not usages or any(usage is None for usage in usages):
        return None
    prompt = int(usages[0]["prompt_tokens"])  # type: ignore[index]
    completion = sum(int(usage["completion_tokens"]) for usage in usages)  # type: ignore[index]
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _merged_stream(opened: list[ChoicePayloads], *, chat: bool,
                         include_usage: bool) -> AsyncIterator[bytes]:
    """The choices' events as one stream, each choice's under its index, as they arrive."""
    queue: asyncio.Queue[tuple[int, dict[str, Any] | None | BaseException]] = asyncio.Queue()
    response_id = oa.new_id("chatcmpl" if chat else "cmpl")

    async def pump(index: int, choice: ChoicePayloads) -> None:
        try:
            async for event in choice.events:
                if event is not None:
                    await queue.put((index, event))
        except Exception as exc:  # noqa: BLE001 - reported to the merged stream as its error
            await queue.put((index, exc))
        finally:
            await queue.put((index, None))

    pumps = [asyncio.create_task(pump(index, choice)) for index, choice in enumerate(opened)]
    usages: list[dict[str, Any] | None] = [None] * len(opened)
    template: dict[str, Any] = {}
    running = len(opened)
    try:
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
                continue
            if isinstance(item, BaseException):
                logger.warning("choice %d of stream %s failed: %s", index, response_id, item)
                yield sse_event(orjson.dumps({"error": {"message": f"choice {index} failed: {item}",
                                                        "type": "server_error", "code": "choice_failed"}}))
                return
            if isinstance(item.get("error"), dict):
                yield sse_event(orjson.dumps(item))
                return
            if isinstance(item.get("usage"), dict) and not item.get("choices"):
                usages[index] = item["usage"]
                template = template or item
                continue
            event = {**item, "id": response_id}
            event.pop("usage", None)
            event["choices"] = [{**choice, "index": index} for choice in item.get("choices") or ()]
            template = template or item
            yield sse_event(orjson.dumps(event))
        if include_usage:
            yield sse_event(orjson.dumps({**template, "id": response_id, "choices": [], "usage": _summed(usages)}))
        yield DONE
    finally:
        for task in pumps:
            task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*pumps, return_exceptions=True)
        await asyncio.gather(*(choice.close() for choice in opened), return_exceptions=True)
