"""Issue 34 with two trackers on one real Redis: they agree on how fast a node is and on whose word backs it off.

Trackers A and B share a ``redis-server``; an honest node holds every layer of
the tiny model; members joined by their own tokens register what the tests
need (a slow fake head, tests/fake_head.py, that claims 1e300 tok/s; a
reporter and a victim). Ratings and the failure gate used to live in each
tracker's memory: a node measured slow through A kept heading B's routes on its
claim, and a lone reporter got one backoff from each tracker it asked.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import httpx
import pytest

from tests.procs import REPO_ROOT, Service, free_port, service_env, start_service, wait_for, wait_healthy
from tests.redis_server import RedisServer, require_redis_server
from tests.tiny_mesh import wait_until_servable

ADMIN: Final = "admin-key-for-the-shared-judgement-tests"
NUM_LAYERS: Final = 4
WAIT_S: Final = 120.0



@dataclass
class Mesh:
    a: Service
    b: Service
    model: str
    fake_url: str


@pytest.fixture(scope="module")
def mesh(tiny_model_dir: Path) -> Iterator[Mesh]:
    redis = RedisServer(require_redis_server()).start()
    port = free_port()
    fake = subprocess.Popen([sys.executable, "-m", "uvicorn", "tests.fake_head:app", "--host", "127.0.0.1",
                             "--port", str(port), "--log-level", "warning"], cwd=REPO_ROOT,
                            env={**service_env(), "FAKE_HEAD_DELAY_S": "0.5"})
    common = {"MESHNET_STORE": redis.url, "MESHNET_ADMIN_KEY": ADMIN, "MESHNET_HEARTBEAT_S": "1",
              "MESHNET_NODE_TTL_S": "120"}
    services: list[Service] = []
    try:
        a = start_service("tracker", common)
        services.append(a)
        b = start_service("tracker", common)
        services.append(b)
        node = start_service("node", {"MESHNET_MODEL": str(tiny_model_dir), "MESHNET_DTYPE": "float32",
                                      "MESHNET_DEVICE": "cpu", "MESHNET_LAYERS": f"0-{NUM_LAYERS - 1}",
                                      "MESHNET_NODE_ID": "honest", "MESHNET_TRACKER": a.url,
                                      "MESHNET_HEARTBEAT_S": "1"}, wait_ready=False)
        services.append(node)
        wait_healthy(node)
        model = wait_until_servable(b, tiny_model_dir.name)
        wait_for(lambda: httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200, "the fake head")
        yield Mesh(a, b, model, f"http://127.0.0.1:{port}")
    finally:
        for service in reversed(services):
            service.stop()
        fake.terminate()
        fake.wait(10)
        redis.stop()



def join(tracker: Service, model: str, node_id: str, endpoint: str, layers: tuple[int, int],
         **extra: Any) -> str:
    made = httpx.post(f"{tracker.url}/v1/admin/tokens", json={"node_id": node_id},
                      headers={"Authorization": f"Bearer {ADMIN}"})
    assert made.status_code == 201, made.text
    token = str(made.json()["token"])
    registered = httpx.post(f"{tracker.url}/v1/nodes", headers={"Authorization": f"Bearer {token}"},
                            json={"node_id": node_id, "model": model, "endpoint": endpoint, "shard_start": layers[0],
                                  "shard_end": layers[1], "num_layers": NUM_LAYERS, **extra})
    assert registered.status_code == 200, registered.text
    return token


def listed(tracker: Service) -> dict[str, dict[str, Any]]:
    return {node["node_id"]: node for node in httpx.get(f"{tracker.url}/v1/nodes").json()["nodes"]}


def head_of(tracker: Service, model: str) -> str:
    answer = httpx.get(f"{tracker.url}/v1/route", params={"model": model})
    assert answer.status_code == 200, answer.text
    return str(answer.json()["nodes"][0]["node_id"])


def test_a_node_measured_slow_through_one_tracker_loses_its_routes_on_the_other(mesh: Mesh) -> None:
    join(mesh.a, mesh.model, "slow", mesh.fake_url, (0, NUM_LAYERS - 1), decode_tokens_per_s=1e300)
    assert head_of(mesh.b, mesh.model) == "slow"  # not measured yet: its claim seeds it on both trackers
    answer = httpx.post(f"{mesh.a.url}/v1/chat/completions", timeout=WAIT_S,
                        json={"model": mesh.model, "messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 3, "temperature": 0})
    assert answer.status_code == 200, answer.text
    wait_for(lambda: listed(mesh.b)["slow"]["measured_streams"] == 1, "B to hold A's measurement of the slow node")
    assert listed(mesh.b)["slow"]["measured_tokens_per_s"] == listed(mesh.a)["slow"]["measured_tokens_per_s"]
    assert head_of(mesh.b, mesh.model) == "honest"


def test_a_lone_reporter_gets_one_backoff_from_all_trackers_together(mesh: Mesh) -> None:
    unused = f"http://127.0.0.1:{free_port()}"
    reporter = join(mesh.a, mesh.model, "reporter", unused, (0, 1))
    join(mesh.a, mesh.model, "victim", unused, (2, NUM_LAYERS - 1))
    route = httpx.get(f"{mesh.a.url}/v1/route", params={"model": mesh.model, "exclude": "honest,slow"}).json()
    assert [hop["node_id"] for hop in route["nodes"]] == ["reporter", "victim"]
    sent = {"reason": "it failed, trust me", "route": route["token"]}
    auth = {"Authorization": f"Bearer {reporter}"}
    first = httpx.post(f"{mesh.a.url}/v1/nodes/victim/failures", json=sent, headers=auth)
    assert first.status_code == 200 and first.json()["applied"], first.text
    again = httpx.post(f"{mesh.b.url}/v1/nodes/victim/failures", json=sent, headers=auth)
    assert again.status_code == 200, again.text
    assert not again.json()["applied"], "tracker B gave the lone reporter a second backoff of the same node"
