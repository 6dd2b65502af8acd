"""Healing that moves live nodes, as real processes on the tiny model (float32).

Three nodes of :data:`BUDGET` each, started without ``--layers``, are placed on
layers 0, 1-2 and 3 (a budget holds two bare layers with 1,024 tokens of KV
room each, or one beside the embedding or the LM head). When the node of layer
3 dies, neither survivor can take layer 3 as it is; the tracker re-cuts them
with 512 tokens of KV room a layer: the node of layer 0 grows to 0-1 first,
then the node of 1-2 shifts to 2-3 (it drops layer 1 only once the other holds
it). The tests wait for states, never for a time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

import httpx
import openai
import orjson
import pytest
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from meshwire.sse import parse_sse_line
from services.tracker.placement_rebalance import KV_RESERVE_LEVELS
from tests.procs import Service
from tests.test_placement_mesh import (
    MAX_TOKENS,
    PROMPT,
    greedy_reference,
    node_env,
    placed_nodes,
    placement_tracker,
    wait_for,
)
from tests.tiny_mesh import wait_until_servable

BUDGET: Final = "900KB"
BUDGET_BYTES: Final = 900_000
NODES: Final = ("cut-a", "cut-b", "cut-c")

NODE_TTL_S: Final = "20"
"""How long a silent node stays listed: longer than the tracker's 6 s default, so a live node whose heartbeats
a loaded machine delays is not taken for dead while the others are placed (that would change the layout)."""


@pytest.fixture(scope="module")
def tracker() -> Iterator[Service]:
    with placement_tracker({"MESHNET_NODE_TTL_S": NODE_TTL_S}) as service:
        yield service


@pytest.fixture(scope="module")
def services(tracker: Service, tiny_model_dir: Path) -> Iterator[dict[str, Service]]:
    with placed_nodes({node_id: node_env(tiny_model_dir, tracker, node_id, BUDGET) for node_id in NODES}) as nodes:
        yield nodes


def mesh(tracker: Service) -> dict[str, Any]:
    return dict(httpx.get(f"{tracker.url}/v1/nodes").json())


def ranges(tracker: Service) -> dict[str, tuple[int, int]]:
    return {n["node_id"]: (n["shard_start"], n["shard_end"]) for n in mesh(tracker)["nodes"]
            if n["routable"] and n["node_id"] in NODES}


def test_when_no_survivor_has_room_the_survivors_are_re_cut_and_chats_answer_again(
        tracker: Service, services: dict[str, Service], tiny_model_dir: Path, reference: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase) -> None:
    placed = wait_for(lambda: (found := ranges(tracker)) and len(found) == len(NODES) and found,
                      "every node to register")
    assert sorted(placed.values()) == [(0, 0), (1, 2), (3, 3)], placed
    by_range = {held: node_id for node_id, held in placed.items()}
    services[by_range[(3, 3)]].kill()

    def healed() -> dict[str, tuple[int, int]] | None:
        now = ranges(tracker)
        return now if mesh(tracker)["models"][0]["complete"] and by_range[(3, 3)] not in now else None

    try:
        after = wait_for(healed, "the survivors to cover every layer again")
        assert after == {by_range[(0, 0)]: (0, 1), by_range[(1, 2)]: (2, 3)}
        listed = {n["node_id"]: n for n in mesh(tracker)["nodes"]}
        for node_id in after:
            assert listed[node_id]["placement"] == "covering" and listed[node_id]["weight_bytes"] <= BUDGET_BYTES
        log = tracker.log()
        assert log.index(f"node {by_range[(0, 0)]} now holds layers 0-1") < log.index(
            f"node {by_range[(1, 2)]} (layers 1-2) is told to hold layers 2-3")  # the grower landed first
        assert f"({KV_RESERVE_LEVELS[1]} tokens of KV room a layer)" in log
    except (AssertionError, ValueError):  # what the survivors and the tracker said, for whoever reads the failure
        for node_id, node in services.items():
            if node_id != by_range[(3, 3)]:
                print(f"--- {node_id}\n{node.log()[-4000:]}")
        print(f"--- tracker\n{tracker.log()[-6000:]}")
        raise
    model = wait_until_servable(tracker, tiny_model_dir.name)
    client = openai.OpenAI(base_url=f"{tracker.url}/v1", api_key="unused", max_retries=0, timeout=120)
    answer = client.chat.completions.create(model=model, messages=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert answer.choices[0].message.content == greedy_reference(reference, tokenizer)


STREAM_NODES: Final = ("kill-a", "kill-b", "kill-c")
STREAM_TOKENS: Final = 200
"""Long enough that the stream is still running when its tail is killed a few chunks in."""
KILL_AFTER_CHUNKS: Final = 5
STREAM_TIMEOUT_S: Final = 600.0


CONTINUE_DEADLINE_S: Final = "600"
"""How long the tracker's own continuation of a stream may take: its head's death is seen only after the
node TTL, then the survivors load their new layers, on a machine that may be loaded (a bound, not a wait)."""


@pytest.fixture
def stream_mesh(tiny_model_dir: Path) -> Iterator[tuple[Service, dict[str, Service]]]:
    """A tracker of its own and three placed nodes (layers 0, 1-2 and 3), apart from the module's mesh."""
    with placement_tracker({"MESHNET_NODE_TTL_S": NODE_TTL_S,
                            "MESHNET_CONTINUE_DEADLINE_S": CONTINUE_DEADLINE_S}) as tracker, \
            placed_nodes({node_id: node_env(tiny_model_dir, tracker, node_id, BUDGET)
                          for node_id in STREAM_NODES}) as nodes:
        yield tracker, nodes


def streamed_chat(tracker: Service, model: str, on_chunk: Callable[[int], None] = lambda _: None, *,
                  messages: list[dict[str, str]] = PROMPT, max_tokens: int = STREAM_TOKENS) -> tuple[str, list[Any]]:
    """A greedy streamed chat through the tracker's OpenAI API: its text and any error events;
    ``on_chunk`` hears the count of content chunks after each one."""
    text, errors, chunks = "", [], 0
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{tracker.url}/v1/chat/completions", json=body, timeout=STREAM_TIMEOUT_S) as response:
        assert response.status_code == 200, response.read().decode()
        for line in response.iter_lines():
            data = parse_sse_line(line)
            if data is None or data == "[DONE]":
                continue
            event = orjson.loads(data)
            if "error" in event:
                errors.append(event["error"])
            for choice in event.get("choices") or []:
                if content := choice.get("delta", {}).get("content"):
                    text += content
                    chunks += 1
                    on_chunk(chunks)
    return text, errors


@contextlib.contextmanager
def survivors_logged_on_failure(tracker: Service, services: dict[str, Service], dead: str) -> Iterator[None]:
    """On a failed assertion, print what the survivors and the tracker said, for whoever reads the failure."""
    try:
        yield
    except (AssertionError, ValueError):
        for node_id, node in services.items():
            if node_id != dead:
                print(f"--- {node_id}\n{node.log()[-6000:]}")
        print(f"--- tracker\n{tracker.log()[-8000:]}")
        raise


def stream_through_a_kill(tracker: Service, services: dict[str, Service], model_dir: Path,
                          victim_holds: tuple[int, int]) -> tuple[str, str]:
    """The three stream nodes placed on 0, 1-2 and 3; a greedy stream run whole, then again with the node holding
    ``victim_holds`` SIGKILLed a few chunks in: it must finish with no error and the same text. Returns the
    killed node's id and the text."""
    placed = wait_for(lambda: (found := {n["node_id"]: (n["shard_start"], n["shard_end"]) for n in mesh(tracker)["nodes"]
                                         if n["routable"] and n["node_id"] in STREAM_NODES})
                      and len(found) == len(STREAM_NODES) and found, "every node to register")
    assert sorted(placed.values()) == [(0, 0), (1, 2), (3, 3)], placed
    victim = next(node_id for node_id, held in placed.items() if held == victim_holds)
    model = wait_until_servable(tracker, model_dir.name)
    whole, errors = streamed_chat(tracker, model)
    assert errors == [] and len(whole) > 0

    killed: list[int] = []

    def kill_the_victim(chunks: int) -> None:
        if not killed and chunks >= KILL_AFTER_CHUNKS:
            services[victim].kill()
            killed.append(chunks)

    with survivors_logged_on_failure(tracker, services, victim):
        broken, errors = streamed_chat(tracker, model, kill_the_victim)
        assert killed, "the stream ended before the kill"
        assert errors == [], errors
        assert broken == whole
    return victim, whole


def test_a_greedy_stream_outlives_the_death_of_its_tail_while_the_survivors_are_re_cut(
        stream_mesh: tuple[Service, dict[str, Service]], tiny_model_dir: Path) -> None:
    """Issue 36, what must hold: one of three placed nodes killed while a greedy stream runs through it; the two
    left cover the model again, the stream finishes identical to its uninterrupted run, and new chats answer."""
    tracker, services = stream_mesh
    tail, whole = stream_through_a_kill(tracker, services, tiny_model_dir, (3, 3))
    with survivors_logged_on_failure(tracker, services, tail):
        wait_for(lambda: mesh(tracker)["models"][0]["complete"] and tail not in {
            n["node_id"] for n in mesh(tracker)["nodes"] if n["routable"]}, "the survivors to cover every layer again")
    again, errors = streamed_chat(tracker, wait_until_servable(tracker, tiny_model_dir.name))
    assert errors == [] and again == whole


def test_a_greedy_stream_the_tracker_relays_outlives_the_death_of_its_head_while_the_survivors_are_re_cut(
        stream_mesh: tuple[Service, dict[str, Service]], tiny_model_dir: Path) -> None:
    """The head (layer 0) killed mid-stream: no route avoids it until the survivors are re-cut, and the
    tracker's continuation (services/tracker/continuation.py) waits for that, as it says ``healing``, instead
    of ending the stream; it then finishes identical to its uninterrupted run on the new head."""
    tracker, services = stream_mesh
    head, _ = stream_through_a_kill(tracker, services, tiny_model_dir, (0, 0))
    with survivors_logged_on_failure(tracker, services, head):
        assert "the tracker is healing the gap" in tracker.log()
        healed = {n["node_id"]: (n["shard_start"], n["shard_end"]) for n in mesh(tracker)["nodes"]
                  if n["routable"] and n["node_id"] in STREAM_NODES}
        assert head not in healed and sorted(healed.values()) == [(0, 1), (2, 3)], healed
