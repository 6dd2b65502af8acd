"""Issue 34, blame on evidence, with real processes: a hop cannot put an honest node after it in backoff.

A tracker, a real head (layers 0-1) and a real tail (3-3), and between them a
dishonest member (``tests/fake_liar.py``, joined by its own token, layers 2-2)
that answers every frame with a 502 naming the honest tail as the node that
failed. The head used to take that name on the liar's word and report the tail
to the tracker, which put it in backoff. Now a downstream claim needs the
signed word of the hop before the named node (here the liar itself could sign
only as itself, and did not): the head blames the hop that answered it.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import httpx
import pytest

from tests.procs import REPO_ROOT, Service, free_port, service_env, start_service, wait_healthy
from tests.tiny_mesh import wait_until_servable

ADMIN: Final = "admin-key-for-the-blame-tests"
WAIT_S: Final = 120.0


def nodes(tracker: Service) -> dict[str, dict[str, Any]]:
    return {node["node_id"]: node for node in httpx.get(f"{tracker.url}/v1/nodes").json()["nodes"]}


@pytest.fixture(scope="module")
def mesh(tiny_model_dir: Path) -> Iterator[tuple[Service, str]]:
    port = free_port()
    liar = subprocess.Popen([sys.executable, "-m", "uvicorn", "tests.fake_liar:app", "--host", "127.0.0.1",
                             "--port", str(port), "--log-level", "warning"], cwd=REPO_ROOT,
                            env={**service_env(), "FAKE_LIAR_BLAMES": "tail"})
    tracker = start_service("tracker", {"MESHNET_ADMIN_KEY": ADMIN, "MESHNET_NODE_TTL_S": "120",
                                        "MESHNET_HEARTBEAT_S": "1"})
    common = {"MESHNET_MODEL": str(tiny_model_dir), "MESHNET_TRACKER": tracker.url, "MESHNET_DTYPE": "float32",
              "MESHNET_DEVICE": "cpu", "MESHNET_HEARTBEAT_S": "1"}
    real = [start_service("node", {**common, "MESHNET_LAYERS": layers, "MESHNET_NODE_ID": name}, wait_ready=False)
            for name, layers in (("head", "0-1"), ("tail", "3-3"))]
    try:
        for node in real:
            wait_healthy(node)
        made = httpx.post(f"{tracker.url}/v1/admin/tokens", json={"node_id": "liar"},
                          headers={"Authorization": f"Bearer {ADMIN}"})
        assert made.status_code == 201, made.text
        registered = httpx.post(f"{tracker.url}/v1/nodes", headers={"Authorization": f"Bearer {made.json()['token']}"},
                                json={"node_id": "liar", "model": tiny_model_dir.name, "num_layers": 4,
                                      "endpoint": f"http://127.0.0.1:{port}", "shard_start": 2, "shard_end": 2})
        assert registered.status_code == 200, registered.text
        model = wait_until_servable(tracker, tiny_model_dir.name)
        yield tracker, model
    finally:
        for node in real:
            node.stop()
        tracker.stop()
        liar.terminate()
        liar.wait(10)


def test_a_hop_naming_an_honest_node_after_it_as_failed_gets_itself_blamed(mesh: tuple[Service, str]) -> None:
    tracker, model = mesh
    route = httpx.get(f"{tracker.url}/v1/route", params={"model": model}).json()
    assert [hop["node_id"] for hop in route["nodes"]] == ["head", "liar", "tail"]
    answer = httpx.post(f"{tracker.url}/v1/chat/completions", timeout=WAIT_S,
                        json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                              "temperature": 0})
    assert answer.status_code != 200, "the route through the liar cannot answer"
    deadline = time.monotonic() + WAIT_S
    while nodes(tracker)["liar"]["failures"] == 0 and nodes(tracker)["tail"]["failures"] == 0:
        assert time.monotonic() < deadline, f"the head reported nobody: {nodes(tracker)}"
        time.sleep(0.2)
    listed = nodes(tracker)
    assert listed["tail"]["failures"] == 0, f"the honest tail was blamed on the liar's word: {listed['tail']}"
    assert listed["liar"]["failures"] >= 1
