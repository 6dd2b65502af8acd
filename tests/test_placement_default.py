"""Placement and healing on the default model (SmolLM2-135M-Instruct, int4 from its GGUF), as real processes.

Slow: three nodes load the default model. Three nodes of ``--max-memory 80MB``
and no ``--layers`` cover its 30 layers, each within its budget (a layer is
about 2.1 MiB of int4 weights and 1.5 MiB of KV room; the embedding and the LM
head about 30 MiB each), and answer Paris. When the node holding layer 0 dies,
neither survivor has room for its layers as it is: the tracker re-cuts them
(with less KV room a layer) and the model is covered again. The tests wait for
states within generous bounds; the seconds healing took are printed, not asserted.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, Final

import httpx
import openai
import pytest

from tests.procs import Service
from tests.test_placement_mesh import HEARTBEAT_S, placed_nodes, placement_tracker, wait_for
from tests.test_placement_rebalance_mesh import streamed_chat
from tests.tiny_mesh import wait_until_servable

pytestmark = pytest.mark.slow

BUDGET: Final = "80MB"
BUDGET_BYTES: Final = 80_000_000
NODES: Final = ("smol-a", "smol-b", "smol-c")
NUM_LAYERS: Final = 30
QUESTION: Final = [{"role": "user", "content": "What is the capital of France?"}]


def default_model_env(tracker: Service, node_id: str) -> dict[str, str]:
    return {"MESHNET_MODEL": "default", "MESHNET_TRACKER": tracker.url, "MESHNET_MAX_MEMORY": BUDGET,
            "MESHNET_DEVICE": "cpu", "MESHNET_HEARTBEAT_S": HEARTBEAT_S, "MESHNET_NODE_ID": node_id}


@pytest.fixture(scope="module")
def tracker() -> Iterator[Service]:
    with placement_tracker() as service:
        yield service


@pytest.fixture(scope="module")
def services(tracker: Service) -> Iterator[dict[str, Service]]:
    with placed_nodes({node_id: default_model_env(tracker, node_id) for node_id in NODES}) as nodes:
        yield nodes


def view(tracker: Service) -> dict[str, Any]:
    return dict(httpx.get(f"{tracker.url}/v1/nodes").json())


def live(tracker: Service) -> dict[str, dict[str, Any]]:
    return {n["node_id"]: n for n in view(tracker)["nodes"] if n["routable"]}


def ask_paris(tracker: Service) -> str:
    model = wait_until_servable(tracker, "SmolLM2-135M-Instruct")
    client = openai.OpenAI(base_url=f"{tracker.url}/v1", api_key="unused", max_retries=0, timeout=300)
    answer = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, temperature=0)
    return str(answer.choices[0].message.content)


def test_three_nodes_of_80_mb_cover_the_default_model_and_heal_after_a_death(
        tracker: Service, services: dict[str, Service]) -> None:
    placed = wait_for(lambda: (nodes := live(tracker)) and len(nodes) == len(NODES) and nodes,
                      "every node to register")
    held = set()
    for node in placed.values():
        assert 0 < node["weight_bytes"] <= BUDGET_BYTES, node
        held.update(range(node["shard_start"], node["shard_end"] + 1))
    assert held == set(range(NUM_LAYERS)) and view(tracker)["models"][0]["complete"]
    assert "Paris" in ask_paris(tracker)
    head = next(node_id for node_id, node in placed.items() if node["shard_start"] == 0)
    services[head].kill()
    killed_at = time.monotonic()

    def covered() -> dict[str, dict[str, Any]] | None:
        nodes = live(tracker)
        return nodes if head not in nodes and view(tracker)["models"][0]["complete"] else None

    try:
        healed = wait_for(covered, "the two survivors to cover the model again")
    except AssertionError:
        for node_id, node in services.items():
            if node_id != head:
                print(f"--- {node_id}\n{node.log()[-4000:]}")
        print(f"--- tracker\n{tracker.log()[-6000:]}")
        raise
    print(f"covered again {time.monotonic() - killed_at:.1f} s after the death: "
          f"{ {k: (v['shard_start'], v['shard_end']) for k, v in healed.items()} }")
    for node in healed.values():
        assert node["weight_bytes"] <= BUDGET_BYTES, node
    assert "Paris" in ask_paris(tracker)


STREAM_NODES: Final = ("smol-kill-a", "smol-kill-b", "smol-kill-c")
STREAM_TOKENS: Final = 64
KILL_AFTER_CHUNKS: Final = 4


@pytest.fixture
def stream_mesh() -> Iterator[tuple[Service, dict[str, Service]]]:
    """A tracker of its own and three default-model nodes of 80 MB, apart from the module's mesh."""
    with placement_tracker() as tracker, \
            placed_nodes({node_id: default_model_env(tracker, node_id) for node_id in STREAM_NODES}) as nodes:
        yield tracker, nodes


def test_a_greedy_stream_outlives_the_death_of_its_tail_on_the_default_model(
        stream_mesh: tuple[Service, dict[str, Service]]) -> None:
    tracker, services = stream_mesh
    placed = wait_for(lambda: (nodes := {k: v for k, v in live(tracker).items() if k in STREAM_NODES})
                      and len(nodes) == len(STREAM_NODES) and view(tracker)["models"][0]["complete"] and nodes,
                      "every node to register")
    tail = next(node_id for node_id, node in placed.items() if node["shard_end"] == NUM_LAYERS - 1)
    model = wait_until_servable(tracker, "SmolLM2-135M-Instruct")
    whole, errors = streamed_chat(tracker, model, messages=QUESTION, max_tokens=STREAM_TOKENS)
    assert errors == [] and "Paris" in whole
    killed: list[float] = []

    def kill_the_tail(chunks: int) -> None:
        if not killed and chunks >= KILL_AFTER_CHUNKS:
            services[tail].kill()
            killed.append(time.monotonic())

    try:
        broken, errors = streamed_chat(tracker, model, kill_the_tail, messages=QUESTION, max_tokens=STREAM_TOKENS)
        assert killed and errors == [], errors
        assert broken == whole
        wait_for(lambda: view(tracker)["models"][0]["complete"] and tail not in live(tracker),
                 "the two survivors to cover the model again")
    except AssertionError:
        for node_id, node in services.items():
            if node_id != tail:
                print(f"--- {node_id}\n{node.log()[-4000:]}")
        print(f"--- tracker\n{tracker.log()[-6000:]}")
        raise
    print(f"stream finished and the model covered again {time.monotonic() - killed[0]:.1f} s after the death")
    again, errors = streamed_chat(tracker, model, messages=QUESTION, max_tokens=STREAM_TOKENS)
    assert errors == [] and again == whole
