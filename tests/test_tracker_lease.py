"""A front-door request's route lease: the nodes of its route carry it as load while it runs, and never after.

The tracker is the real app, in process (httpx's ASGI transport runs each request to its very end, so the
load is read once the request is over, with no waiting). Its client to head nodes is swapped for one whose
transport plays the heads: each answers as the test says (a stream, an error, a refusal, a stream that
breaks) and writes down the load the tracker showed while it was asked. Every mode of the front door is
covered: streamed, assembled (not streamed), ``n > 1`` (raw choices) and relayed as it is (Responses).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Final

import httpx
import orjson
import pytest

from meshwire.resume import PROGRESS_KEY, RESUME_KEY
from services.tracker.app import create_app
from services.tracker.route_lease import RouteLease
from services.tracker.settings import TrackerSettings
from services.tracker.state import TrackerState
from tests.procs import TEST_SECRET

TRACKER: Final = "http://tracker.test"
MODEL: Final = "tiny"
MESH: Final = {"Authorization": f"Bearer {TEST_SECRET}"}
HEADS: Final = ("head-a", "head-b")
CHAT: Final = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
WORDS: Final = ("one", " two", " three")

Behaviour = Callable[[httpx.Request, dict[str, Any]], httpx.Response]
"""How a fake head answers a request (whose JSON body is given)."""


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def _chunk(content: str | None, ids: list[int], *, finish: str | None = None, role: bool = False) -> bytes:
    delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
    if content is not None:
        delta["content"] = content
    return _event({"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
                   PROGRESS_KEY: {"ids": ids, **({"seed": 7} if role else {})}})


def _stream_events(skip: int = 0) -> list[bytes]:
    """A chat stream of :data:`WORDS` (from word ``skip``), with progress, usage and ``[DONE]``."""
    events = [] if skip else [_chunk(None, [], role=True)]
    events += [_chunk(word, [index]) for index, word in enumerate(WORDS) if index >= skip]
    events.append(_chunk(None, [], finish="stop"))
    events.append(_event({"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
                          "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": len(WORDS),
                                                   "total_tokens": 3 + len(WORDS)}}))
    return [*events, b"data: [DONE]\n\n"]


class _Events(httpx.AsyncByteStream):
    """A response body of events, broken (a read error) after ``break_after`` of them when set."""

    def __init__(self, events: list[bytes], break_after: int | None = None) -> None:
        self._events = events
        self._break_after = break_after

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for index, event in enumerate(self._events):
            if self._break_after is not None and index == self._break_after:
                raise httpx.ReadError("connection reset by the fake head")
            yield event


def streams(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
    """A head that streams the whole answer (continuing after the ids it is given to resume from)."""
    skip = len(body.get(RESUME_KEY, {}).get("ids", ()))
    return httpx.Response(200, headers={"Content-Type": "text/event-stream"}, stream=_Events(_stream_events(skip)))


def breaks(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
    """A head that dies after its opening and first word."""
    return httpx.Response(200, headers={"Content-Type": "text/event-stream"},
                          stream=_Events(_stream_events(), break_after=2))


def refuses(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
    """A head whose KV budget is full (503: avoided, not reported)."""
    return httpx.Response(503, json={"error": {"message": "kv budget full", "type": "server_error",
                                               "code": "kv_budget"}})


def rejects(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
    """A head that finds the request itself wrong (400: the client's to read)."""
    return httpx.Response(400, json={"error": {"message": "max_tokens is too large", "type": "invalid_request_error",
                                               "code": "bad_max_tokens", "param": "max_tokens"}})


def answers_json(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
    """A head that answers one JSON document (a Responses answer)."""
    return httpx.Response(200, json={"id": "resp_fake", "object": "response", "output_text": "one two three"})


@dataclass
class FakeHeads:
    """The heads' behaviours by node id, and the load the tracker showed each time a head was asked."""

    state: TrackerState
    behaviours: dict[str, Behaviour] = field(default_factory=dict)
    asked: list[str] = field(default_factory=list)
    load_seen: list[dict[str, int]] = field(default_factory=list)

    def handle(self, request: httpx.Request) -> httpx.Response:
        node_id = request.url.host.removesuffix(".test")
        self.asked.append(node_id)
        self.load_seen.append(inflight(self.state))
        return self.behaviours[node_id](request, orjson.loads(request.content))


def inflight(state: TrackerState) -> dict[str, int]:
    return {node.node_id: node.inflight_requests for node in state.registry.snapshot(state.now())}


@pytest.fixture
async def mesh() -> AsyncIterator[tuple[httpx.AsyncClient, FakeHeads]]:
    """The tracker (its lifespan running) with two heads that each hold the whole model."""
    app = create_app(TrackerSettings(secret=TEST_SECRET))
    state: TrackerState = app.state.tracker
    heads = FakeHeads(state, behaviours=dict.fromkeys(HEADS, streams))
    async with app.router.lifespan_context(app):
        real = state.client
        async with httpx.AsyncClient(transport=httpx.MockTransport(heads.handle)) as fake:
            state.client = fake
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=TRACKER) as client:
                for node_id in HEADS:
                    body = {"node_id": node_id, "model": MODEL, "endpoint": f"http://{node_id}.test:8100",
                            "shard_start": 0, "shard_end": 3, "num_layers": 4}
                    assert (await client.post("/v1/nodes", json=body, headers=MESH)).status_code == 200
                yield client, heads
            state.client = real


def idle() -> dict[str, int]:
    return dict.fromkeys(HEADS, 0)


def text_of(stream: str) -> str:
    pieces = []
    for line in stream.splitlines():
        if line.startswith("data: {"):
            for choice in orjson.loads(line[6:]).get("choices", ()):
                pieces.append(choice.get("delta", {}).get("content") or "")
    return "".join(pieces)


async def test_a_streamed_chat_counts_on_its_route_while_it_runs_and_not_after(
        mesh: tuple[httpx.AsyncClient, FakeHeads]) -> None:
    client, heads = mesh
    answer = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert answer.status_code == 200 and text_of(answer.text) == "".join(WORDS)
    assert heads.load_seen == [{**idle(), heads.asked[0]: 1}]
    assert inflight(heads.state) == idle()


async def test_an_assembled_chat_counts_on_its_route_while_it_runs_and_not_after(
        mesh: tuple[httpx.AsyncClient, FakeHeads]) -> None:
    client, heads = mesh
    answer = await client.post("/v1/chat/completions", json=CHAT)
    assert answer.status_code == 200
    assert answer.json()["choices"][0]["message"]["content"] == "".join(WORDS)
    assert heads.load_seen == [{**idle(), heads.asked[0]: 1}]
    assert inflight(heads.state) == idle()


@pytest.mark.parametrize("stream", [False, True], ids=["assembled", "streamed"])
async def test_each_choice_of_n_counts_on_the_shared_route_and_none_after(
        mesh: tuple[httpx.AsyncClient, FakeHeads], stream: bool) -> None:
    client, heads = mesh
    answer = await client.post("/v1/chat/completions", json={**CHAT, "n": 2, "stream": stream})
    assert answer.status_code == 200
    assert len(heads.asked) == 2 and heads.asked[0] == heads.asked[1], "both choices share one route"
    assert inflight(heads.state) == idle()


async def test_a_relayed_answer_counts_on_its_route_while_it_runs_and_not_after(
        mesh: tuple[httpx.AsyncClient, FakeHeads]) -> None:
    client, heads = mesh
    heads.behaviours = dict.fromkeys(HEADS, answers_json)
    answer = await client.post("/v1/responses", json={"model": MODEL, "input": "hi"})
    assert answer.status_code == 200 and answer.json()["id"] == "resp_fake"
    assert heads.load_seen == [{**idle(), heads.asked[0]: 1}]
    assert inflight(heads.state) == idle()


@pytest.mark.parametrize("stream", [False, True], ids=["assembled", "streamed"])
async def test_a_heads_own_error_ends_the_lease(mesh: tuple[httpx.AsyncClient, FakeHeads], stream: bool) -> None:
    client, heads = mesh
    heads.behaviours = dict.fromkeys(HEADS, rejects)
    answer = await client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "bad_max_tokens"
    assert inflight(heads.state) == idle()


@pytest.mark.parametrize("stream", [False, True], ids=["assembled", "streamed"])
async def test_a_refusing_head_hands_the_lease_to_the_next_route(mesh: tuple[httpx.AsyncClient, FakeHeads],
                                                                 stream: bool) -> None:
    client, heads = mesh
    heads.behaviours = {HEADS[0]: refuses, HEADS[1]: refuses}
    first = (await client.get("/v1/route", params={"model": MODEL})).json()["nodes"][0]["node_id"]
    heads.behaviours[next(h for h in HEADS if h != first)] = streams
    answer = await client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
    assert answer.status_code == 200
    assert heads.asked == [first, next(h for h in HEADS if h != first)]
    assert heads.load_seen[1] == {**idle(), heads.asked[1]: 1}, "the refused route's load went with it"
    assert inflight(heads.state) == idle()


async def test_when_every_head_refuses_no_load_is_left_behind(mesh: tuple[httpx.AsyncClient, FakeHeads]) -> None:
    client, heads = mesh
    heads.behaviours = dict.fromkeys(HEADS, refuses)
    answer = await client.post("/v1/chat/completions", json=CHAT)
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "kv_budget"
    assert inflight(heads.state) == idle()


@pytest.mark.parametrize("stream", [False, True], ids=["assembled", "streamed"])
async def test_a_stream_continued_on_another_head_moves_its_load_there_and_ends_it(
        mesh: tuple[httpx.AsyncClient, FakeHeads], stream: bool) -> None:
    client, heads = mesh
    first = (await client.get("/v1/route", params={"model": MODEL})).json()["nodes"][0]["node_id"]
    second = next(h for h in HEADS if h != first)
    heads.behaviours = {first: breaks, second: streams}
    answer = await client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
    assert answer.status_code == 200
    text = text_of(answer.text) if stream else answer.json()["choices"][0]["message"]["content"]
    assert text == "".join(WORDS)
    assert heads.asked == [first, second]
    assert heads.load_seen[1] == {**idle(), second: 1}, "the load followed the stream to its new head"
    assert inflight(heads.state) == idle()


# --- the lease itself ---------------------------------------------------------------------------------------


class CountingRegistry:
    """Counts begin/end per node, as the registry's in-flight figures do."""

    def __init__(self) -> None:
        self.load: dict[str, int] = {}

    def begin_request(self, node_ids: tuple[str, ...]) -> None:
        for node_id in node_ids:
            self.load[node_id] = self.load.get(node_id, 0) + 1

    def end_request(self, node_ids: tuple[str, ...]) -> None:
        for node_id in node_ids:
            self.load[node_id] -= 1


def signed_route(*node_ids: str) -> Any:
    """Enough of a signed route for a lease: its hops' ids."""
    return SimpleNamespace(nodes=[SimpleNamespace(node_id=node_id) for node_id in node_ids])


async def test_a_lease_ends_once_and_a_route_held_after_its_end_carries_nothing() -> None:
    registry = CountingRegistry()
    ended: list[str] = []
    async with RouteLease(registry) as lease:  # type: ignore[arg-type]
        lease.hold(signed_route("a", "b"))
        lease.at_end(lambda: ended.append("counted"))
        assert registry.load == {"a": 1, "b": 1}
        lease.hold(signed_route("c"))
        assert registry.load == {"a": 0, "b": 0, "c": 1}
    await lease.end()
    lease.hold(signed_route("d"))  # a continuation racing the end: nothing is begun
    assert registry.load == {"a": 0, "b": 0, "c": 0} and ended == ["counted"]


async def test_a_handed_over_lease_outlives_its_block_unless_the_block_failed() -> None:
    registry = CountingRegistry()
    async with RouteLease(registry) as lease:  # type: ignore[arg-type]
        lease.hold(signed_route("a"))
        handed = lease.hand_over()
    assert registry.load == {"a": 1}, "the taker ends it"
    await handed.end()
    assert registry.load == {"a": 0}
    with pytest.raises(RuntimeError):
        async with RouteLease(registry) as failed:  # type: ignore[arg-type]
            failed.hold(signed_route("a"))
            failed.hand_over()
            raise RuntimeError("the response could not be built")
    assert registry.load == {"a": 0}
