"""A prefill/decode mesh as real processes: bootstrap registry, tracker, prefill nodes and decode nodes.

Every node runs the tiny model in float32. Prefill nodes (``--role prefill``)
register in the bootstrap registry (``cache-layouts``) once the tracker gives
them their place in the prefill group; :func:`start_pd_mesh` returns when the
tracker lists every prefill node as registered there (``pd_rank``), so the
tracker hands prefill routes to heads from then on.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.procs import TEST_SECRET, Service, pinned_node_env, start_service, start_together, wait_healthy

PD_MIN_PROMPT_TOKENS: Final = 40
"""Prompts at least this long are prefilled on the prefill nodes."""
PREFILL_CHUNK_TOKENS: Final = 16
"""The prefill head sends its prompt in frames of this many tokens, so a prompt spans several."""
DECODE_MAX_FRAME_BYTES: Final = 65536
"""Decode nodes pull KV in chunks of at most this many bytes: a long prompt's KV comes in several."""
SETTLE_TIMEOUT_S: Final = 60.0
AUTH: Final = {"Authorization": f"Bearer {TEST_SECRET}"}


@dataclass
class PdMesh:
    bootstrap: Service
    tracker: Service
    nodes: dict[str, Service]
    model: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def url(self, name: str) -> str:
        return self.nodes[name].url

    def node_view(self) -> dict[str, dict[str, Any]]:
        return {n["node_id"]: n for n in httpx.get(f"{self.tracker.url}/v1/nodes", headers=AUTH).json()["nodes"]}

    def metric(self, name: str, sample: str, **labels: str) -> float:
        """The value of one sample of node ``name``'s metrics, summed over the samples that match (0 if none)."""
        total = 0.0
        for family in text_string_to_metric_families(httpx.get(f"{self.url(name)}/metrics").text):
            for s in family.samples:
                if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                    total += float(s.value)
        return total

    def stop(self) -> None:
        for service in [*self.nodes.values(), self.tracker, self.bootstrap]:
            service.stop()


def wait_for(condition: Any, what: str, timeout_s: float = SETTLE_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def start_pd_mesh(model_dir: Any, prefill: Mapping[str, tuple[int, int]], decode: Mapping[str, tuple[int, int]],
                  node_env: Mapping[str, Mapping[str, str]] | None = None,
                  prefill_env: Mapping[str, str] | None = None) -> PdMesh:
    """The registry, a tracker and the nodes (id -> inclusive layers), every prefill node registered."""
    bootstrap = start_service("bootstrap", {"MESHNET_REGISTRY": "cache-layouts"})
    tracker = start_service("tracker", {"MESHNET_HEARTBEAT_S": "1", "MESHNET_NODE_TTL_S": "6",
                                        "MESHNET_PD_MIN_PROMPT_TOKENS": str(PD_MIN_PROMPT_TOKENS),
                                        "MESHNET_FAILURE_BACKOFF_S": "3600", "MESHNET_FAILURE_BACKOFF_MAX_S": "3600"})
    common = {"MESHNET_MODEL": str(model_dir), "MESHNET_DTYPE": "float32", "MESHNET_DEVICE": "cpu",
              "MESHNET_TRACKER": tracker.url, "MESHNET_THREADS": "1", "MESHNET_HEARTBEAT_S": "1",
              "MESHNET_BOOTSTRAP": bootstrap.url}
    specs: dict[str, dict[str, str]] = {}
    for name, (start, end) in prefill.items():
        # pinned: the tests also sign prefill routes of their own with the test key, naming the nodes' hop keys
        specs[name] = {**common, **pinned_node_env(name), "MESHNET_NODE_ID": name, "MESHNET_LAYERS": f"{start}-{end}",
                       "MESHNET_ROLE": "prefill",
                       "MESHNET_PREFILL_CHUNK_TOKENS": str(PREFILL_CHUNK_TOKENS), **(prefill_env or {})}
    for name, (start, end) in decode.items():
        specs[name] = {**common, "MESHNET_NODE_ID": name, "MESHNET_LAYERS": f"{start}-{end}", "MESHNET_ROLE": "decode",
                       "MESHNET_MAX_FRAME_BYTES": str(DECODE_MAX_FRAME_BYTES)}
    for name, env in (node_env or {}).items():
        specs[name].update(env)
    try:
        started = start_together([("node", spec) for spec in specs.values()])
    except Exception:
        tracker.stop()
        bootstrap.stop()
        raise
    mesh = PdMesh(bootstrap=bootstrap, tracker=tracker, nodes=dict(zip(specs, started, strict=True)))
    try:
        for service in mesh.nodes.values():
            wait_healthy(service)
        wait_for(lambda: set(mesh.node_view()) == set(mesh.nodes), "every node to register")
        wait_for(lambda: all(mesh.node_view()[name]["pd_rank"] is not None for name in prefill),
                 "every prefill node to register in the bootstrap registry")
        mesh.model = next(iter(mesh.node_view().values()))["model"]
    except Exception:
        mesh.stop()
        raise
    return mesh
