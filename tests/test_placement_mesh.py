"""Nodes without ``--layers`` placed by the tracker, as real processes on the tiny model (float32).

A tiny-model layer is 147,968 bytes of weights and keeps 1,024 tokens x 256
bytes of KV room (the tracker's reserve), 410,112 bytes in all; the first
layer's holder adds the embedding, the last's the LM head (about 164 KB each).
:data:`HALF_BUDGET` holds two layers with either, not three: three such nodes
started together cover the four layers (two of them) and the third takes a
replica. :data:`TOO_SMALL` holds no layer at all.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Final

import httpx
import openai
import pytest
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from meshwire.auth import bearer_headers
from tests.procs import TEST_SECRET, Service, running, start_service, start_together
from tests.tiny_mesh import wait_until_servable

HALF_BUDGET: Final = "1100KB"
HALF_BUDGET_BYTES: Final = 1_100_000
TOO_SMALL: Final = "100KB"
logger = logging.getLogger(__name__)
HEARTBEAT_S: Final = "1"
READY_S: Final = 600.0
"""Bound on a service's start: importing torch alone took over 120 s at a load average of 24 on 2 cores."""
WAIT_S: Final = 240.0
"""Bound of every wait for a state (generous: the machine may be loaded; nothing waits for a time)."""
NODES: Final = ("placed-a", "placed-b", "placed-c")
PROMPT: Final = [{"role": "user", "content": "Where does the river run before it reaches the sea?"}]
MAX_TOKENS: Final = 24


def node_env(model_dir: Path, tracker: Service, node_id: str, budget: str) -> dict[str, str]:
    return {"MESHNET_MODEL": str(model_dir), "MESHNET_TRACKER": tracker.url, "MESHNET_NODE_ID": node_id,
            "MESHNET_MAX_MEMORY": budget, "MESHNET_DTYPE": "float32", "MESHNET_DEVICE": "cpu",
            "MESHNET_HEARTBEAT_S": HEARTBEAT_S}


def listed(tracker: Service) -> list[dict[str, Any]]:
    return list(httpx.get(f"{tracker.url}/v1/nodes").json()["nodes"])


def wait_for(condition: Callable[[], Any], what: str) -> Any:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if (value := condition()):
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@contextlib.contextmanager
def placement_tracker(env: Mapping[str, str] | None = None) -> Iterator[Service]:
    """A tracker heartbeating every :data:`HEARTBEAT_S` (plus ``env``), stopped on the way out."""
    with running(start_service("tracker", {"MESHNET_HEARTBEAT_S": HEARTBEAT_S, **(env or {})},
                               ready_timeout_s=READY_S)) as (service,):
        yield service


@contextlib.contextmanager
def placed_nodes(envs: Mapping[str, Mapping[str, str]]) -> Iterator[dict[str, Service]]:
    """One node per ``envs`` entry (its id: its environment), started at once so they load in parallel, each
    healthy within :data:`READY_S`; every one stopped on the way out (a test may have killed some)."""
    services = start_together([("node", env) for env in envs.values()], ready_timeout_s=READY_S)
    with running(*services):
        yield dict(zip(envs, services, strict=True))


@pytest.fixture(scope="module")
def tracker() -> Iterator[Service]:
    with placement_tracker() as service:
        yield service


@pytest.fixture(scope="module")
def placed_services(tracker: Service, tiny_model_dir: Path) -> Iterator[dict[str, Service]]:
    with placed_nodes({node_id: node_env(tiny_model_dir, tracker, node_id, HALF_BUDGET)
                       for node_id in NODES}) as nodes:
        yield nodes


@pytest.fixture(scope="module")
def placed_mesh(tracker: Service, placed_services: dict[str, Service]) -> list[dict[str, Any]]:
    return list(wait_for(lambda: (found := [n for n in listed(tracker) if n["node_id"] in NODES])
                         and len(found) == len(NODES) and found, "every placed node to register"))


def test_three_nodes_without_layers_cover_every_layer_within_their_budgets(placed_mesh: list[dict[str, Any]],
                                                                            tracker: Service) -> None:
    held = set()
    for node in placed_mesh:
        assert node["shard_end"] - node["shard_start"] + 1 == 2, node  # half the layers each
        assert 0 < node["weight_bytes"] <= HALF_BUDGET_BYTES
        held.update(range(node["shard_start"], node["shard_end"] + 1))
    assert held == {0, 1, 2, 3}
    coverage = httpx.get(f"{tracker.url}/v1/nodes").json()["models"][0]
    assert coverage["complete"] and coverage["missing"] == []


def test_nodes_list_why_they_hold_their_layers(placed_mesh: list[dict[str, Any]]) -> None:
    reasons = sorted(node["placement"] for node in placed_mesh)
    assert reasons == ["covering", "covering", "replica"]


def test_a_chat_through_the_placed_mesh_answers_what_transformers_answers(
        placed_mesh: list[dict[str, Any]], tracker: Service, tiny_model_dir: Path,
        reference: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    inputs = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = reference.generate(**inputs, do_sample=False, max_new_tokens=MAX_TOKENS)
    expected = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    model = wait_until_servable(tracker, tiny_model_dir.name)
    client = openai.OpenAI(base_url=f"{tracker.url}/v1", api_key="unused", max_retries=0, timeout=120)
    answer = client.chat.completions.create(model=model, messages=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert answer.choices[0].message.content == expected


def greedy_reference(reference: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> str:
    inputs = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = reference.generate(**inputs, do_sample=False, max_new_tokens=MAX_TOKENS)
    return str(tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))


def test_when_the_last_holder_of_layers_dies_a_survivor_moves_onto_them_and_chats_answer_again(
        placed_mesh: list[dict[str, Any]], placed_services: dict[str, Service], tracker: Service,
        tiny_model_dir: Path, reference: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Two nodes hold one range (the one placed as its replica and the one it copies): either may be the one
    the tracker moves, whichever heartbeats first once the gap is seen, so the test waits for the state (the
    dead node's range held again by a survivor, every layer covered), not for a particular node."""
    replica = next(n for n in placed_mesh if n["placement"] == "replica")
    lone = next(n for n in placed_mesh if n["placement"] == "covering"
                and (n["shard_start"], n["shard_end"]) != (replica["shard_start"], replica["shard_end"]))
    placed_services[lone["node_id"]].kill()
    lost = (lone["shard_start"], lone["shard_end"])

    def healed() -> dict[str, Any] | None:
        answer = httpx.get(f"{tracker.url}/v1/nodes").json()
        movers = [n for n in answer["nodes"] if n["node_id"] != lone["node_id"] and n["routable"]
                  and (n["shard_start"], n["shard_end"]) == lost]
        return movers[0] if movers and answer["models"][0]["complete"] else None

    try:
        moved = wait_for(healed, "a survivor to take the dead node's layers")
    except AssertionError:  # what the survivors and the tracker said, for whoever reads the failure
        for node_id, node in placed_services.items():
            if node_id != lone["node_id"]:
                logger.error("survivor %s log:\n%s", node_id, node.log()[-4000:])
        logger.error("tracker log:\n%s", tracker.log()[-4000:])
        raise
    assert moved["placement"] == "covering"
    assert moved["weight_bytes"] <= HALF_BUDGET_BYTES
    model = wait_until_servable(tracker, tiny_model_dir.name)
    client = openai.OpenAI(base_url=f"{tracker.url}/v1", api_key="unused", max_retries=0, timeout=120)
    answer = client.chat.completions.create(model=model, messages=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert answer.choices[0].message.content == greedy_reference(reference, tokenizer)


def test_a_node_whose_budget_cannot_hold_one_layer_refuses_to_start_naming_the_budget(
        tracker: Service, tiny_model_dir: Path) -> None:
    node = start_service("node", node_env(tiny_model_dir, tracker, "too-small", TOO_SMALL), wait_ready=False)
    try:
        assert node.proc.wait(timeout=READY_S) != 0
        log = node.log()
        assert "cannot hold one layer" in log and "97.7 KiB" in log and "one layer needs 400.5 KiB" in log, log
    finally:
        node.stop()
    assert all(n["node_id"] != "too-small" for n in listed(tracker))


def test_the_placement_endpoint_needs_the_mesh_credential(tracker: Service) -> None:
    body = {"node_id": "x", "model": "m", "num_layers": 4, "max_memory_bytes": 1, "layer_bytes": 1,
            "kv_bytes_per_token": 1, "seconds_per_layer": 0.1}
    assert httpx.post(f"{tracker.url}/v1/placement", json=body).status_code == 401
    assert httpx.post(f"{tracker.url}/v1/placement", json=body, headers=bearer_headers("wrong")).status_code == 403
    refused = httpx.post(f"{tracker.url}/v1/placement", json={**body, "num_layers": 0},
                         headers=bearer_headers(TEST_SECRET))
    assert refused.status_code == 400 and "num_layers" in refused.json()["error"]["message"]
