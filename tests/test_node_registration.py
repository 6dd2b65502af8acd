"""A node joins the mesh by itself: it registers with the tracker, heartbeats, serves through it, and leaves.

One tracker and one node holding every layer of the tiny model, as real processes.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.procs import Service, start_service

HEARTBEAT_S = 0.5
KV_BUDGET = 5000
WAIT_S = 30.0
PROMPT = [{"role": "user", "content": "Where does the river run?"}]


@dataclass
class Joined:
    tracker: Service
    node: Service


@pytest.fixture(scope="module")
def joined(tiny_model_dir: Path) -> Iterator[Joined]:
    tracker = start_service("tracker", {"MESHNET_HEARTBEAT_S": str(HEARTBEAT_S)})
    try:
        node = start_service("node", {
            "MESHNET_MODEL": str(tiny_model_dir), "MESHNET_DTYPE": "float32", "MESHNET_DEVICE": "cpu",
            "MESHNET_TRACKER": tracker.url, "MESHNET_NODE_ID": "joiner", "MESHNET_HEARTBEAT_S": str(HEARTBEAT_S),
            "MESHNET_KV_BUDGET_TOKENS": str(KV_BUDGET),
        })
        try:
            yield Joined(tracker, node)
        finally:
            node.stop()
    finally:
        tracker.stop()


def listed(tracker: Service, node_id: str) -> dict[str, Any] | None:
    nodes = httpx.get(f"{tracker.url}/v1/nodes").json()["nodes"]
    return next((n for n in nodes if n["node_id"] == node_id), None)


def wait_for(condition: Callable[[], Any], what: str) -> Any:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if (value := condition()):
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_started_node_is_registered_with_its_layers_endpoint_and_load(joined: Joined) -> None:
    entry = wait_for(lambda: listed(joined.tracker, "joiner"), "the node to register")
    assert (entry["shard_start"], entry["shard_end"], entry["num_layers"]) == (0, 3, 4)
    assert entry["endpoint"] == joined.node.url
    assert entry["model"] == httpx.get(f"{joined.node.url}/health").json()["model"]
    assert entry["kv_capacity_tokens"] == KV_BUDGET and entry["kv_free_tokens"] == KV_BUDGET
    assert entry["decode_tokens_per_s"] > 0
    assert (entry["dtype"], entry["device"]) == ("float32", "cpu")


def test_the_node_keeps_heartbeating(joined: Joined) -> None:
    first = wait_for(lambda: listed(joined.tracker, "joiner"), "the node to register")["heartbeats"]
    wait_for(lambda: listed(joined.tracker, "joiner")["heartbeats"] >= first + 2, "two more heartbeats")
    assert listed(joined.tracker, "joiner")["state"] == "online"


def test_a_chat_through_the_tracker_reaches_the_node_and_matches_transformers(
        joined: Joined, tiny_model_dir: Path) -> None:
    wait_for(lambda: listed(joined.tracker, "joiner"), "the node to register")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    inputs = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, do_sample=False, max_new_tokens=16)
    expected = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    client = openai.OpenAI(base_url=f"{joined.tracker.url}/v1", api_key="unused", max_retries=0, timeout=60)
    answer = client.chat.completions.create(model=tiny_model_dir.name, messages=PROMPT, max_tokens=16, temperature=0)
    assert answer.choices[0].message.content == expected


def test_a_node_that_shuts_down_deregisters_at_once(joined: Joined) -> None:
    wait_for(lambda: listed(joined.tracker, "joiner"), "the node to register")
    joined.node.kill(signal.SIGTERM)
    assert not joined.node.alive()
    entry = listed(joined.tracker, "joiner")
    assert entry is None or entry["state"] == "offline"
