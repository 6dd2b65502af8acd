"""A tracker and two nodes splitting the tiny model (layers 0-1 and 2-3) in float32, as real processes."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Final

import httpx

from tests.procs import Launcher, Service, start_service, wait_healthy

HEARTBEAT_S: Final = "1"
MESH_READY_TIMEOUT_S: Final = 60.0


@contextlib.contextmanager
def tiny_mesh(model_dir: Path, store: str = "memory",
              node_ids: tuple[str, str] = ("front-node", "back-node"), *, env: Mapping[str, str] | None = None,
              launcher: Launcher = "uvicorn") -> Iterator[tuple[Service, str]]:
    """The tracker and the model's registered name, once servable; everything stopped afterwards.

    ``env`` is added to every service's environment (a certificate, say); ``launcher`` picks how they run.
    """
    services: list[Service] = []
    common = dict(env or {})
    try:
        tracker = start_service("tracker", {**common, "MESHNET_HEARTBEAT_S": HEARTBEAT_S, "MESHNET_STORE": store},
                                launcher=launcher)
        services.append(tracker)
        for node_id, layers in zip(node_ids, ("0-1", "2-3"), strict=True):
            services.append(start_service("node", {
                **common, "MESHNET_MODEL": str(model_dir), "MESHNET_LAYERS": layers, "MESHNET_TRACKER": tracker.url,
                "MESHNET_NODE_ID": node_id, "MESHNET_DTYPE": "float32", "MESHNET_DEVICE": "cpu",
                "MESHNET_HEARTBEAT_S": HEARTBEAT_S,
            }, wait_ready=False, launcher=launcher))  # both load at once
        for node in services[1:]:
            wait_healthy(node)
        keys = [key for key in common.get("MESHNET_API_KEYS", "").split(",") if key]
        yield tracker, wait_until_servable(tracker, model_dir.name,
                                           {"Authorization": f"Bearer {keys[0]}"} if keys else None)
    finally:
        for service in reversed(services):
            service.stop()


def wait_until_servable(tracker: Service, basename: str, headers: Mapping[str, str] | None = None) -> str:
    """Wait until ``/v1/models`` lists the model; answer the name its nodes registered it under.

    ``headers`` carry a client API key where the tracker requires one.
    """
    deadline = time.monotonic() + MESH_READY_TIMEOUT_S
    while time.monotonic() < deadline:
        listed = [card["id"] for card in httpx.get(f"{tracker.url}/v1/models", verify=tracker.verify, headers=headers).json()["data"]]
        if (found := [name for name in listed if Path(name).name == basename]):
            return found[0]
        time.sleep(0.2)
    nodes = httpx.get(f"{tracker.url}/v1/nodes", verify=tracker.verify).text
    raise AssertionError(f"the tracker never listed {basename}: {nodes}")
