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

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import httpx
import openai
import pytest
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from services.tracker.placement_rebalance import KV_RESERVE_LEVELS
from tests.procs import Service, start_service, wait_healthy
from tests.test_placement_mesh import (
    HEARTBEAT_S,
    MAX_TOKENS,
    PROMPT,
    READY_S,
    greedy_reference,
    node_env,
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
    service = start_service("tracker", {"MESHNET_HEARTBEAT_S": HEARTBEAT_S, "MESHNET_NODE_TTL_S": NODE_TTL_S},
                            ready_timeout_s=READY_S)
    try:
        yield service
    finally:
        service.stop()


@pytest.fixture(scope="module")
def services(tracker: Service, tiny_model_dir: Path) -> Iterator[dict[str, Service]]:
    nodes = {node_id: start_service("node", node_env(tiny_model_dir, tracker, node_id, BUDGET), wait_ready=False)
             for node_id in NODES}
    try:
        for node in nodes.values():
            wait_healthy(node, READY_S)
        yield nodes
    finally:
        for node in nodes.values():
            node.stop()


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
