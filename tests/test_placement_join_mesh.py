"""A node joining a covered mesh takes a replica of its slowest stage, as the tracker rates the stages.

Real processes on the tiny model (float32). Three nodes of the half budget of
:mod:`tests.test_placement_mesh` cover the four layers (two stages of two
layers) and one replica; a few chats let the tracker measure the nodes
(:mod:`services.tracker.ratings`). ``GET /v1/nodes`` then shows each stage's
seconds a token from the tracker's own figures; a fourth node started without
``--layers`` is placed on the slowest, and the slowest stage gets faster.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import httpx
import openai
import pytest

from tests.procs import Service, start_service, wait_healthy
from tests.test_placement_mesh import (
    HALF_BUDGET,
    MAX_TOKENS,
    PROMPT,
    READY_S,
    node_env,
    placed_nodes,
    placement_tracker,
    wait_for,
)
from tests.tiny_mesh import wait_until_servable

NODES: Final = ("join-a", "join-b", "join-c")
JOINER: Final = "join-d"
CHATS: Final = 4

NODE_TTL_S: Final = "20"
"""How long a silent node stays listed: longer than the tracker's 6 s default, so a live node whose heartbeats
a loaded machine delays is not taken for dead while the others are placed (that would change the layout)."""


@pytest.fixture(scope="module")
def tracker() -> Iterator[Service]:
    with placement_tracker({"MESHNET_NODE_TTL_S": NODE_TTL_S}) as service:
        yield service


@pytest.fixture(scope="module")
def services(tracker: Service, tiny_model_dir: Path) -> Iterator[dict[str, Service]]:
    with placed_nodes({node_id: node_env(tiny_model_dir, tracker, node_id, HALF_BUDGET)
                       for node_id in NODES}) as nodes:
        yield nodes


def model_view(tracker: Service) -> dict[str, Any]:
    return dict(httpx.get(f"{tracker.url}/v1/nodes").json()["models"][0])


def routable(tracker: Service) -> dict[str, dict[str, Any]]:
    return {n["node_id"]: n for n in httpx.get(f"{tracker.url}/v1/nodes").json()["nodes"] if n["routable"]}


def test_a_fourth_node_takes_a_replica_of_the_slowest_stage_by_the_trackers_figures(
        tracker: Service, services: dict[str, Service], tiny_model_dir: Path) -> None:
    wait_for(lambda: len(routable(tracker)) == len(NODES), "the three nodes to register")
    model = wait_until_servable(tracker, tiny_model_dir.name)
    client = openai.OpenAI(base_url=f"{tracker.url}/v1", api_key="unused", max_retries=0, timeout=120)
    for _ in range(CHATS):  # streamed: each stream the tracker relays to its end is a measurement of its route
        for _chunk in client.chat.completions.create(model=model, messages=PROMPT, max_tokens=MAX_TOKENS,
                                                     temperature=0, stream=True):
            pass
    wait_for(lambda: any(n["measured_streams"] > 0 for n in routable(tracker).values()),
             "the tracker to measure the routes it relayed")
    before = model_view(tracker)["stages"]
    slowest = next(stage for stage in before if stage["slowest"])
    assert max(stage["seconds_per_token"] for stage in before) == slowest["seconds_per_token"]
    joiner = start_service("node", node_env(tiny_model_dir, tracker, JOINER, HALF_BUDGET), wait_ready=False)
    try:
        wait_healthy(joiner, READY_S)
        joined = wait_for(lambda: routable(tracker).get(JOINER), "the fourth node to register")
        assert (joined["shard_start"], joined["shard_end"]) == (slowest["shard_start"], slowest["shard_end"])
        assert joined["placement"] == "replica"
        after = {(s["shard_start"], s["shard_end"]): s for s in model_view(tracker)["stages"]}
        replicated = after[(slowest["shard_start"], slowest["shard_end"])]
        assert JOINER in replicated["holders"]
        assert replicated["seconds_per_token"] < slowest["seconds_per_token"]
    finally:
        joiner.stop()
