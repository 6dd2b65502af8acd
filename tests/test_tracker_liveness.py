"""Nodes dying under a real tracker: routes forget them, requests go around them.

Two nodes each hold the whole tiny model, so either can serve alone. Each test
kills the node the tracker currently routes through (SIGKILL: no goodbye).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.procs import Service, start_service, wait_healthy

NODE_TTL_S = "5"
HEARTBEAT_S = "2"
"""Slow heartbeats keep the replicas' load figures still between choosing a head and killing it."""
READY_TIMEOUT_S = 60.0
EXPIRY_WAIT_S = 60.0
"""How long to wait for a killed node to leave (generous; the rule itself is unit-tested with a hand clock)."""


@pytest.fixture(scope="module")
def mesh(tiny_model_dir: Path) -> Iterator[tuple[Service, dict[str, Service]]]:
    """A tracker and two full replicas of the tiny model."""
    tracker = start_service("tracker", {"MESHNET_NODE_TTL_S": NODE_TTL_S, "MESHNET_HEARTBEAT_S": HEARTBEAT_S})
    nodes: dict[str, Service] = {}
    try:
        for node_id in ("replica-1", "replica-2"):
            nodes[node_id] = start_service("node", {
                "MESHNET_MODEL": str(tiny_model_dir), "MESHNET_TRACKER": tracker.url, "MESHNET_NODE_ID": node_id,
                "MESHNET_DTYPE": "float32", "MESHNET_DEVICE": "cpu", "MESHNET_HEARTBEAT_S": HEARTBEAT_S,
            }, wait_ready=False)  # both load at once
        for node in nodes.values():
            wait_healthy(node)
        wait_for(lambda: {n["node_id"] for n in routable(tracker)} == set(nodes), READY_TIMEOUT_S,
                 "both replicas registered")
        yield tracker, nodes
    finally:
        for service in [*nodes.values(), tracker]:
            service.stop()


def routable(tracker: Service) -> list[dict]:
    return [n for n in httpx.get(f"{tracker.url}/v1/nodes").json()["nodes"] if n["routable"]]


def node_info(tracker: Service, node_id: str) -> dict:
    return next(n for n in httpx.get(f"{tracker.url}/v1/nodes").json()["nodes"] if n["node_id"] == node_id)


def route_head(tracker: Service, model: str) -> str:
    answer = httpx.get(f"{tracker.url}/v1/route", params={"model": model})
    assert answer.status_code == 200, answer.text
    return answer.json()["nodes"][0]["node_id"]


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for: {what}")


def test_a_head_that_died_before_answering_is_reported_and_the_request_takes_another_route(
        mesh: tuple[Service, dict[str, Service]], tiny_model_dir: Path) -> None:
    tracker, nodes = mesh
    model = str(tiny_model_dir)
    dead = route_head(tracker, model)
    nodes[dead].kill()
    client = openai.OpenAI(base_url=f"{tracker.url}/v1", api_key="unused", max_retries=0, timeout=120)
    answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello"}],
                                            max_tokens=4, temperature=0)
    assert answer.choices[0].message.content is not None
    assert node_info(tracker, dead)["failures"] == 1
    assert route_head(tracker, model) != dead


def test_a_killed_node_leaves_the_routes_within_the_ttl(mesh: tuple[Service, dict[str, Service]],
                                                        tiny_model_dir: Path) -> None:
    tracker, nodes = mesh
    model = str(tiny_model_dir)
    victim = route_head(tracker, model)
    nodes[victim].kill()

    def gone() -> bool:
        answer = httpx.get(f"{tracker.url}/v1/route", params={"model": model})
        return answer.status_code == 503 or victim not in {n["node_id"] for n in answer.json()["nodes"]}

    wait_for(gone, EXPIRY_WAIT_S, f"{victim} to leave /v1/route")
    wait_for(lambda: node_info(tracker, victim)["state"] == "offline", EXPIRY_WAIT_S, f"{victim} offline")
    assert node_info(tracker, victim)["last_heartbeat_age_s"] > float(NODE_TTL_S)
