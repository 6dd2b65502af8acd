"""The `ha` deployment: its compose profile, and its HAProxy config in front of two real trackers on Redis.

The compose file is checked as written (the engine itself runs in
``make compose-smoke``): the `ha` services are only in the `ha` profile, their
images build FROM the project's ``BASE_IMAGE``, and the default services are
unchanged. Then ``deploy/haproxy.cfg`` runs for real, under the local
``haproxy`` (``make setup`` installs it beside ``redis-server``), in front of
two trackers on a real Redis: one address keeps answering when a tracker is
SIGKILLed.
"""

from __future__ import annotations

import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.procs import TEST_SECRET, Service, free_port, start_service
from tests.redis_server import RedisServer, require_program, require_redis_server

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
HA_SERVICES = {"redis", "tracker-b", "gateway"}
AUTH = {"Authorization": f"Bearer {TEST_SECRET}"}
WAIT_S = 60.0


def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    return loaded


def test_the_ha_services_are_only_in_the_ha_profile_and_the_default_mesh_is_unchanged() -> None:
    services = compose()["services"]
    for name, service in services.items():
        assert service.get("profiles", []) == (["ha"] if name in HA_SERVICES else []), name
    assert services["tracker"]["environment"]["MESHNET_STORE"] == "${MESHNET_STORE:-memory}"
    for node in ("node-0", "node-1"):
        assert services[node]["environment"]["MESHNET_TRACKER"] == "${MESHNET_NODE_TRACKERS:-http://tracker:8000}"
    assert services["tracker-b"]["environment"]["MESHNET_STORE"].startswith("${MESHNET_STORE:-redis://redis:")


@pytest.mark.parametrize("service, dockerfile", [("redis", "redis.Dockerfile"), ("gateway", "haproxy.Dockerfile")])
def test_the_ha_images_build_from_the_projects_base_image(service: str, dockerfile: str) -> None:
    build = compose()["services"][service]["build"]
    assert build["dockerfile"] == dockerfile and build["args"]["BASE_IMAGE"] == "${BASE_IMAGE:-python:3.11-slim}"
    text = (DEPLOY / dockerfile).read_text()
    assert "ARG BASE_IMAGE" in text and "FROM ${BASE_IMAGE}" in text
    assert "apt-get install" in text


def test_the_gateway_sends_to_both_trackers_and_checks_their_health() -> None:
    environment = compose()["services"]["gateway"]["environment"]
    assert (environment["MESHNET_TRACKER_A"], environment["MESHNET_TRACKER_B"]) == ("tracker:8000", "tracker-b:8000")
    config = (DEPLOY / "haproxy.cfg").read_text()
    assert "option httpchk GET /health" in config and "retry-on conn-failure" in config


# --- HAProxy for real, in front of two trackers on one Redis ------------------------------------------------


def require_haproxy() -> str:
    return require_program("haproxy", "the gateway test")


@pytest.fixture(scope="module")
def gateway() -> Iterator[tuple[str, Service, Service]]:
    """HAProxy (deploy/haproxy.cfg) on a free port in front of trackers A and B on one Redis."""
    haproxy = require_haproxy()
    redis = RedisServer(require_redis_server()).start()
    env = {"MESHNET_STORE": redis.url, "MESHNET_NODE_TTL_S": "60", "MESHNET_HEARTBEAT_S": "1"}
    trackers = [start_service("tracker", env), start_service("tracker", env)]
    port = free_port()
    with tempfile.NamedTemporaryFile(prefix="meshnet-haproxy-", suffix=".log", delete=False) as log:
        proc = subprocess.Popen(
            [haproxy, "-db", "-f", str(DEPLOY / "haproxy.cfg")], stdout=log, stderr=subprocess.STDOUT,
            env={"MESHNET_GATEWAY_BIND": f"127.0.0.1:{port}", "MESHNET_TRACKER_A": f"127.0.0.1:{trackers[0].port}",
                 "MESHNET_TRACKER_B": f"127.0.0.1:{trackers[1].port}", "PATH": "/usr/sbin:/usr/bin"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200, "HAProxy to answer")
        yield url, trackers[0], trackers[1]
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        for tracker in trackers:
            tracker.stop()
        redis.stop()
        print(Path(log.name).read_text(errors="replace")[-2000:])


def wait_for(condition: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for: {what}")


def test_one_address_keeps_answering_when_a_tracker_is_killed(gateway: tuple[str, Service, Service]) -> None:
    url, a, _ = gateway
    model = f"/models/gw-{uuid.uuid4().hex[:8]}"
    body = {"node_id": f"n-{uuid.uuid4().hex[:6]}", "model": model, "endpoint": "http://127.0.0.1:9",
            "shard_start": 0, "shard_end": 3, "num_layers": 4}
    assert httpx.post(f"{url}/v1/nodes", json=body, headers=AUTH, timeout=10).status_code == 200
    for _ in range(4):  # round robin: both trackers answer the same route
        assert httpx.get(f"{url}/v1/route", params={"model": model}, timeout=10).status_code == 200
    a.kill()  # SIGKILL
    for _ in range(10):  # a refused connection is retried on the other tracker: no request fails
        answer = httpx.get(f"{url}/v1/route", params={"model": model}, timeout=30)
        assert answer.status_code == 200, answer.text
    assert httpx.get(f"{url}/v1/nodes", timeout=10).json()["nodes"][0]["node_id"] == body["node_id"]
