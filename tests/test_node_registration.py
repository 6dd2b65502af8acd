"""A node joins the mesh by itself: it registers with the tracker, heartbeats, serves through it, and leaves.

One tracker and one node holding every layer of the tiny model, as real
processes; then the node's :class:`~services.node.hop.registration.Registrar`
against the real tracker app served in process, where its lease is the point:
kept from the first answer, carried on every heartbeat and on the way out,
and replaced when a restarted tracker registers the node afresh.
"""

from __future__ import annotations

import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from meshwire.registry import NodeRegistration
from services.node.hop.registration import Registrar
from services.tracker.app import create_app
from services.tracker.settings import TrackerSettings
from tests.procs import TEST_SECRET, Service, start_service

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


# --- the registrar and its lease, against the tracker app in process -----------------------------------------

TRACKER = "http://tracker.test"
AUTH = {"Authorization": f"Bearer {TEST_SECRET}"}


class SwitchableTracker(httpx.AsyncBaseTransport):
    """The tracker app behind an ASGI transport; :meth:`restart` swaps in a fresh one (it forgets every node)."""

    def __init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        self._transport = httpx.ASGITransport(app=create_app(TrackerSettings(secret=TEST_SECRET)))

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self._transport.handle_async_request(request)


def body(node_id: str = "leased", port: int = 9100) -> NodeRegistration:
    return NodeRegistration(node_id=node_id, model="tiny", endpoint=f"http://127.0.0.1:{port}", shard_start=0,
                            shard_end=3, num_layers=4)


@pytest.fixture
def tracker_app() -> SwitchableTracker:
    return SwitchableTracker()


@pytest.fixture
async def http(tracker_app: SwitchableTracker) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=tracker_app) as client:
        yield client


async def listing(http: httpx.AsyncClient) -> dict[str, Any]:
    return {n["node_id"]: n for n in (await http.get(f"{TRACKER}/v1/nodes", headers=AUTH)).json()["nodes"]}


async def test_the_registrar_keeps_its_lease_and_carries_it_on_every_heartbeat(http: httpx.AsyncClient) -> None:
    registrar = Registrar(http, TRACKER, TEST_SECRET, body, heartbeat_s=1.0)
    assert await registrar.beat() and registrar.lease is not None
    lease = registrar.lease
    for _ in range(3):
        assert await registrar.beat()
    assert registrar.lease == lease
    assert (await listing(http))["leased"]["heartbeats"] == 3


async def test_a_second_registrar_under_a_live_id_is_refused_until_the_first_leaves(
        http: httpx.AsyncClient) -> None:
    first = Registrar(http, TRACKER, TEST_SECRET, body, heartbeat_s=1.0)
    assert await first.beat()
    restarted = Registrar(http, TRACKER, TEST_SECRET, body, heartbeat_s=1.0)  # same id, same endpoint, no lease
    assert not await restarted.beat() and restarted.lease is None
    assert await first.beat()
    await first.deregister()
    assert (await listing(http))["leased"]["state"] == "offline"
    assert await restarted.beat() and restarted.lease not in (None, first.lease)


async def test_the_registrar_leaves_with_its_lease(http: httpx.AsyncClient) -> None:
    registrar = Registrar(http, TRACKER, TEST_SECRET, body, heartbeat_s=1.0)
    assert await registrar.beat()
    await registrar.deregister()
    assert (await listing(http))["leased"]["state"] == "offline"


async def test_after_a_tracker_restart_the_registrar_registers_afresh_with_a_new_lease(
        http: httpx.AsyncClient, tracker_app: SwitchableTracker) -> None:
    registrar = Registrar(http, TRACKER, TEST_SECRET, body, heartbeat_s=1.0)
    assert await registrar.beat()
    old = registrar.lease
    tracker_app.restart()
    assert await registrar.beat()
    assert registrar.lease not in (None, old)
    assert (await listing(http))["leased"]["state"] == "joining"
    assert await registrar.beat() and (await listing(http))["leased"]["heartbeats"] == 1
    await registrar.deregister()
    assert (await listing(http))["leased"]["state"] == "offline"
