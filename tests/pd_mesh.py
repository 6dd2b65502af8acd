"""A prefill/decode mesh as real processes: bootstrap registry, tracker, prefill nodes and decode nodes.

Every node runs the tiny model in float32. Prefill nodes (``--role prefill``)
register in the bootstrap registry (``cache-layouts``) once the tracker gives
them their place in the prefill group; :func:`start_pd_mesh` returns when the
tracker lists every prefill node as registered there (``pd_rank``), so the
tracker hands prefill routes to heads from then on. With ``join_by_token``
every node joins by a join token of its own and holds a wrong mesh secret, so
nothing in that mesh, the KV handoff included, works by the shared secret.

Handoff calls are signed with a hop key (:mod:`services.node.pd.kv_auth`):
:func:`decode_route` signs a decode route with the test's route key (which the
prefill nodes pin) naming test-known hop keys, and :func:`signed` signs a call
as one of its nodes, so a test can play a decode node.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import httpx
from prometheus_client.parser import text_string_to_metric_families

from meshwire.hop_proof import sign_request
from meshwire.route_keys import SigningKey
from meshwire.routes import Route, RouteNode, issue_signed_route, plan_start_layers
from tests.procs import (
    TEST_ROUTE_KEY,
    TEST_SECRET,
    Service,
    node_hop_key,
    pinned_node_env,
    start_service,
    start_together,
    wait_healthy,
)

PD_MIN_PROMPT_TOKENS: Final = 40
"""Prompts at least this long are prefilled on the prefill nodes."""
PREFILL_CHUNK_TOKENS: Final = 16
"""The prefill head sends its prompt in frames of this many tokens, so a prompt spans several."""
DECODE_MAX_FRAME_BYTES: Final = 65536
"""Decode nodes pull KV in chunks of at most this many bytes: a long prompt's KV comes in several."""
SETTLE_TIMEOUT_S: Final = 60.0
AUTH: Final = {"Authorization": f"Bearer {TEST_SECRET}"}
ADMIN_KEY: Final = "pd-test-admin-key"
NODES_SECRET: Final = "a-secret-that-is-not-the-trackers"
"""The mesh secret nodes that join by token are given: useless, so they must work on tokens and keys."""
NUM_LAYERS: Final = 4


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


def decode_route(mesh: PdMesh, layers: Mapping[str, tuple[int, int]]) -> str:
    """A decode route through nodes called as ``layers`` says (they need not exist), signed with the test's route
    key and naming each node's test hop key (:func:`~tests.procs.node_hop_key`), as the tracker signs one."""
    nodes = plan_start_layers([RouteNode(node_id=name, endpoint=f"http://127.0.0.1:9/{name}", shard_start=start,
                                         shard_end=end, hop_key=node_hop_key(name).public_text)
                               for name, (start, end) in layers.items()])
    return issue_signed_route(Route(model=mesh.model, nodes=nodes, num_layers=NUM_LAYERS), TEST_ROUTE_KEY).token


def signed(headers: Mapping[str, str], signer: str, path: str, body: bytes = b"",
           key: SigningKey | None = None) -> dict[str, str]:
    """``headers`` and a proof that ``signer`` sent them (with its test hop key, or ``key``)."""
    proof = sign_request(node_hop_key(signer) if key is None else key, signer, path, headers, body)
    return {**headers, **proof}


def join_token(tracker: Service, node_id: str) -> str:
    """A join token for ``node_id``, made with the tracker's admin API."""
    made = httpx.post(f"{tracker.url}/v1/admin/tokens", json={"node_id": node_id},
                      headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30)
    assert made.status_code == 201, made.text
    return str(made.json()["token"])


def start_pd_mesh(model_dir: Any, prefill: Mapping[str, tuple[int, int]], decode: Mapping[str, tuple[int, int]],
                  node_env: Mapping[str, Mapping[str, str]] | None = None,
                  prefill_env: Mapping[str, str] | None = None, join_by_token: bool = False,
                  ports: Mapping[str, int] | None = None) -> PdMesh:
    """The registry, a tracker and the nodes (id -> inclusive layers), every prefill node registered.

    With ``join_by_token`` every node joins by a join token and holds a wrong mesh secret; decode nodes then
    pin the test's route key and hop key too (:func:`~tests.procs.pinned_node_env`). ``ports`` gives nodes
    a port chosen beforehand (a proxy in front of one must know it before the node registers).
    """
    bootstrap = start_service("bootstrap", {"MESHNET_REGISTRY": "cache-layouts"})
    tracker = start_service("tracker", {"MESHNET_HEARTBEAT_S": "1", "MESHNET_NODE_TTL_S": "6",
                                        "MESHNET_PD_MIN_PROMPT_TOKENS": str(PD_MIN_PROMPT_TOKENS),
                                        "MESHNET_FAILURE_BACKOFF_S": "3600", "MESHNET_FAILURE_BACKOFF_MAX_S": "3600",
                                        **({"MESHNET_ADMIN_KEY": ADMIN_KEY} if join_by_token else {})})
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
    if join_by_token:
        for name, spec in specs.items():
            spec.update({**pinned_node_env(name), "MESHNET_JOIN_TOKEN": join_token(tracker, name),
                         "MESHNET_SECRET": NODES_SECRET})
    for name, env in (node_env or {}).items():
        specs[name].update(env)
    try:
        started = start_together([("node", spec) for spec in specs.values()],
                                 [(ports or {}).get(name) for name in specs])
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
