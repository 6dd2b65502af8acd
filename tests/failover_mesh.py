"""A tracker and node processes to kill mid-stream: the harness of the failover tests.

Every node runs the tiny model in float32 and registers with one tracker;
the head sends its prompt in chunks of :data:`HEAD_CHUNK_TOKENS`, so a
failover's replay spans several frames. Requests go to the tracker's front
door, as a client's do, and are read as raw server-sent events, so a test
sees every event, error events included.

Which replica serves a stream is read from the tracker: ``GET /v1/nodes``
counts, per node, the front-door requests in flight through it.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import httpx
import orjson
import pytest

from meshwire.sse import parse_sse_line
from meshwire.tool_calls import ToolCallAssembler
from tests.procs import Service, start_service, start_together, wait_healthy

HEAD_CHUNK_TOKENS: Final = 16
STREAM_TIMEOUT_S: Final = 120.0
"""Longest silence a test tolerates from a stream before it fails (a hang is a failure, not a wait)."""
SETTLE_TIMEOUT_S: Final = 30.0
LONG_PROMPT: Final = [{"role": "user", "content": "Tell me a long story about the river."}]
"""The tiny model does not end its answer to this within 400 tokens (greedy, and seeded at 0.8 with seed 1)."""
JSON_LIST_SCHEMA: Final = {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 12, "maxItems": 12}
"""A structured answer long enough to kill a node in (at least 36 tokens) that ends well within 200 tokens."""
STRUCTURED: Final = {"temperature": 0.8, "seed": 5, "response_format": {
    "type": "json_schema", "json_schema": {"name": "words", "schema": JSON_LIST_SCHEMA, "strict": True}}}
"""Seeded sampling constrained to :data:`JSON_LIST_SCHEMA`: the grammar's state must follow a failover."""
TRACKER_ENV: Final = {"MESHNET_NODE_TTL_S": "6", "MESHNET_HEARTBEAT_S": "1",
                      # A reported node's backoff outlasts any test (a revived node starts clean with its new
                      # lease), so what the tests read of it never depends on how fast a loaded machine runs.
                      "MESHNET_FAILURE_BACKOFF_S": "3600", "MESHNET_FAILURE_BACKOFF_MAX_S": "3600"}


@dataclass
class StreamResult:
    """What one streamed chat answered, and where it was when a node was killed."""

    text: str = ""
    content_chunks: int = 0
    finish_reason: str | None = None
    completion_tokens: int | None = None
    errors: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    """Whether ``data: [DONE]`` ended the stream."""
    events_after_done: int = 0
    killed: str | None = None
    chunks_before_kill: int = 0
    seconds_from_kill_to_end: float | None = None
    tool_calls: ToolCallAssembler = field(default_factory=ToolCallAssembler)
    """The stream's ``delta.tool_calls`` added up."""


@dataclass
class FailoverMesh:
    """A running tracker and named nodes, each restartable on its own port."""

    tracker: Service
    nodes: dict[str, Service]
    specs: dict[str, dict[str, str]]
    model: str

    # --- views of the tracker ---------------------------------------------------------------------------

    def node_view(self) -> dict[str, dict[str, Any]]:
        """``GET /v1/nodes``, by node id."""
        listed = httpx.get(f"{self.tracker.url}/v1/nodes", timeout=10).json()["nodes"]
        return {node["node_id"]: node for node in listed}

    def route(self, exclude: tuple[str, ...] = ()) -> httpx.Response:
        params = {"model": self.model, **({"exclude": ",".join(exclude)} if exclude else {})}
        return httpx.get(f"{self.tracker.url}/v1/route", params=params, timeout=10)

    def serving(self, candidates: tuple[str, ...]) -> str:
        """The one node of ``candidates`` that a front-door request in flight goes through."""
        view = self.node_view()
        busy = [name for name in candidates if view.get(name, {}).get("inflight_requests", 0) > 0]
        assert len(busy) == 1, f"expected exactly one of {candidates} in use, the tracker says {busy}"
        return busy[0]

    # --- life and death ---------------------------------------------------------------------------------

    def kill(self, name: str) -> None:
        """SIGKILL ``name``: a crash, no deregistration."""
        self.nodes[name].kill(signal.SIGKILL)

    def revive(self, name: str) -> None:
        """Start ``name`` again on its old port and wait until the tracker routes through it."""
        old = self.nodes[name]
        if old.alive():
            return
        self.nodes[name] = start_service("node", self.specs[name], port=old.port)
        wait_for(lambda: self.node_view().get(name, {}).get("state") == "online", f"{name} to be online again")

    def revive_all(self) -> None:
        for name in self.nodes:
            self.revive(name)
        wait_for(self.idle, "every session of earlier requests to be closed")

    def idle(self) -> bool:
        """No running node holds a session and the tracker has no request in flight."""
        view = self.node_view()
        if any(node["inflight_requests"] for node in view.values()):
            return False
        return all(httpx.get(f"{s.url}/health", timeout=10).json()["sessions"] == 0
                   for s in self.nodes.values() if s.alive())

    def stop(self) -> None:
        for service in [*self.nodes.values(), self.tracker]:
            service.stop()

    # --- requests ---------------------------------------------------------------------------------------

    def body(self, max_tokens: int, sampling: Mapping[str, Any] | None, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "messages": LONG_PROMPT, "max_tokens": max_tokens,
                                "stream": stream, **(sampling or {"temperature": 0})}
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    def chat(self, max_tokens: int, sampling: Mapping[str, Any] | None = None) -> httpx.Response:
        """A non-streamed chat through the tracker's front door."""
        return httpx.post(f"{self.tracker.url}/v1/chat/completions", json=self.body(max_tokens, sampling, False),
                          timeout=STREAM_TIMEOUT_S)

    def stream(self, max_tokens: int, sampling: Mapping[str, Any] | None = None, *,
               kill_one_of: tuple[str, ...] = (), kill_after_chunks: int = 0,
               on_chunk: Callable[[int], None] | None = None) -> StreamResult:
        """A streamed chat through the tracker; with ``kill_one_of``, SIGKILL the one serving it mid-stream.

        ``on_chunk`` hears the count of content chunks received so far, after each event.
        """
        result = StreamResult()
        killed_at: float | None = None
        with httpx.stream("POST", f"{self.tracker.url}/v1/chat/completions",
                          json=self.body(max_tokens, sampling, True), timeout=STREAM_TIMEOUT_S) as response:
            assert response.status_code == 200, response.read().decode()
            for line in response.iter_lines():
                data = parse_sse_line(line)
                if data is None:
                    continue
                if result.done:
                    result.events_after_done += 1
                    continue
                if data == "[DONE]":
                    result.done = True
                    continue
                _take_event(result, orjson.loads(data))
                if on_chunk is not None:
                    on_chunk(result.content_chunks)
                if kill_one_of and result.killed is None and result.content_chunks >= kill_after_chunks:
                    result.killed = self.serving(kill_one_of)
                    result.chunks_before_kill = result.content_chunks
                    self.kill(result.killed)
                    killed_at = time.monotonic()
        if killed_at is not None:
            result.seconds_from_kill_to_end = time.monotonic() - killed_at
        return result


    def streams_with_a_kill(self, streams: int, max_tokens: int, candidates: tuple[str, ...],
                            kill_after_chunks: int, timeout_s: float = SETTLE_TIMEOUT_S) -> tuple[list[StreamResult], str]:
        """``streams`` streamed chats at once; once each has ``kill_after_chunks`` chunks, SIGKILL whichever of
        ``candidates`` carries the most of them. Every stream's result, and the node killed."""
        progress = [0] * streams

        def follow(index: int) -> StreamResult:
            return self.stream(max_tokens, on_chunk=lambda chunks: progress.__setitem__(index, chunks))

        with ThreadPoolExecutor(streams) as pool:
            running = [pool.submit(follow, index) for index in range(streams)]
            wait_for(lambda: min(progress) >= kill_after_chunks, "every stream to be under way", timeout_s)
            view = self.node_view()
            victim = max(candidates, key=lambda name: view[name]["inflight_requests"])
            assert view[victim]["inflight_requests"] > 0, f"none of {candidates} carries a stream"
            self.kill(victim)
            return [future.result() for future in running], victim


def _take_event(result: StreamResult, event: dict[str, Any]) -> None:
    if "error" in event:
        result.errors.append(event["error"])
        return
    for choice in event.get("choices") or []:
        content = choice.get("delta", {}).get("content")
        if content:
            result.text += content
            result.content_chunks += 1
        if calls := choice.get("delta", {}).get("tool_calls"):  # a tool call's piece counts as a chunk too
            result.tool_calls.add(calls)
            result.content_chunks += 0 if content else 1
        if choice.get("finish_reason"):
            result.finish_reason = choice["finish_reason"]
    if event.get("usage"):
        result.completion_tokens = event["usage"]["completion_tokens"]


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = SETTLE_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def start_mesh(model_dir: Path, layers: Mapping[str, tuple[int, int]],
               node_env: Mapping[str, str] | None = None,
               tracker_env: Mapping[str, str] | None = None) -> FailoverMesh:
    """A tracker and one node per entry of ``layers`` (node id -> inclusive layer range), all registered;
    ``tracker_env`` is added to the tracker's :data:`TRACKER_ENV`."""
    tracker = start_service("tracker", {**TRACKER_ENV, **(tracker_env or {})})
    common = {"MESHNET_MODEL": str(model_dir), "MESHNET_DTYPE": "float32", "MESHNET_DEVICE": "cpu",
              "MESHNET_TRACKER": tracker.url, "MESHNET_THREADS": "1", **(node_env or {})}
    specs = {name: {**common, "MESHNET_NODE_ID": name, "MESHNET_LAYERS": f"{start}-{end}",
                    **({"MESHNET_PREFILL_CHUNK_TOKENS": str(HEAD_CHUNK_TOKENS)} if start == 0 else {})}
             for name, (start, end) in layers.items()}
    try:
        started = start_together([("node", spec) for spec in specs.values()])
    except Exception:
        tracker.stop()
        raise
    nodes = dict(zip(specs, started, strict=True))
    mesh = FailoverMesh(tracker=tracker, nodes=nodes, specs=specs, model="")
    try:
        for service in nodes.values():
            wait_healthy(service)
        wait_for(lambda: set(mesh.node_view()) == set(nodes), "every node to register")
        mesh.model = next(iter(mesh.node_view().values()))["model"]
    except Exception:
        mesh.stop()
        raise
    return mesh


def mesh_fixtures(layers: Mapping[str, tuple[int, int]],
                  node_env: Mapping[str, str] | None = None) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The two fixtures a failover test module needs, for a mesh of ``layers``.

    ``mesh`` (module scope) runs the tracker and nodes; ``whole`` (autouse)
    revives every node before each test, so a test's kill never leaks into
    the next. A module binds them by name: ``mesh, whole = mesh_fixtures(LAYERS)``.
    """

    @pytest.fixture(scope="module", name="mesh")
    def mesh(tiny_model_dir: Path) -> Iterator[FailoverMesh]:
        running = start_mesh(tiny_model_dir, layers, node_env)
        try:
            yield running
        finally:
            running.stop()

    @pytest.fixture(autouse=True, name="whole")
    def whole(mesh: FailoverMesh) -> FailoverMesh:
        """Every test starts with every node up and no session open."""
        mesh.revive_all()
        return mesh

    return mesh, whole
