"""A real mesh for a benchmark: tracker, N nodes (and a relay) as processes on 127.0.0.1.

Services are started exactly as a user starts them (``uvicorn
services.<kind>.app:app``, configured by ``MESHNET_*`` variables) through the
test suite's launcher, :mod:`tests.procs`. Nodes start one after another and
the mesh is ready when the tracker lists the model as servable. Each node may
use every core (``OMP_NUM_THREADS``): a single stream keeps one node busy at
a time, like the single-process run it is compared with.

A node "behind NAT" (``MeshSpec.relayed``) keeps its connection to the relay
and registers an endpoint where nothing listens, so the node before it in
the route cannot dial it and must go through the relay, as across a NAT.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

import httpx

from benchmarks.wan_proxy import LinkShape, ProxyThread
from tests.procs import Service, free_port, start_service

logger = logging.getLogger(__name__)

NodeDType = Literal["auto", "float32", "bfloat16", "float16"]
READY_TIMEOUT_S: Final = 180.0
"""Longest a mesh may take to start (nodes load and warm up their layers; the cores may be shared)."""
POLL_S: Final = 0.2
NODE_HEARTBEAT_S: Final = 2.0
"""Node heartbeat interval: well inside the tracker's default 6 s lease, even on busy cores."""
MAX_NODES: Final = 8
LOG_TAIL_CHARS: Final = 4000
"""Characters of each service's log quoted when a mesh fails to start."""


class MeshError(RuntimeError):
    """The mesh did not start or does not answer as the contract says."""


@dataclass(frozen=True)
class MeshSpec:
    """What to start: ``model`` (a folder or the default model's name) split over ``nodes`` nodes.

    ``relayed`` lists the indexes of nodes that are reached through a relay
    (node 0 is the head). ``node_env`` is added to every node's environment.
    """

    model: str
    num_layers: int
    nodes: int
    dtype: NodeDType = "auto"
    relayed: frozenset[int] = frozenset()
    node_env: Mapping[str, str] = field(default_factory=dict)
    node_cpus: tuple[int, ...] = ()
    """When given, node ``i`` (every thread of it) is pinned to core ``node_cpus[i]``: machines simulated."""
    ready_timeout_s: float = READY_TIMEOUT_S
    """Longest each service may take to become healthy, and the tracker to list the model after the last node
    (a model of several GB takes minutes to pack on shared cores)."""
    wan: LinkShape | None = None
    """When given, every node sits behind a WAN proxy (``benchmarks.wan_proxy``) of this shape and advertises
    it: every frame between nodes, and every request the tracker passes to a head, crosses an emulated link."""

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= min(MAX_NODES, self.num_layers):
            raise ValueError(f"{self.nodes} nodes for {self.num_layers} layers: need 1..{MAX_NODES} and one layer each")
        if self.node_cpus and len(self.node_cpus) != self.nodes:
            raise ValueError(f"node_cpus names {len(self.node_cpus)} cores for {self.nodes} nodes")
        if any(not 0 <= index < self.nodes for index in self.relayed):
            raise ValueError(f"relayed nodes {sorted(self.relayed)} are not among the {self.nodes} nodes")
        if self.wan is not None and self.relayed:
            raise ValueError("a mesh is either behind WAN proxies or behind a relay, not both")

    def describe(self) -> str:
        relayed = f", {len(self.relayed)} behind a relay" if self.relayed else ""
        wan = f", WAN {self.wan.describe()}" if self.wan is not None else ""
        return f"{self.nodes} node{'s' if self.nodes > 1 else ''} ({self.dtype}{relayed}{wan})"


def split_layers(num_layers: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous inclusive ranges covering ``0..num_layers-1``, sizes differing by at most one."""
    if not 1 <= parts <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {parts} parts")
    base, extra = divmod(num_layers, parts)
    ranges: list[tuple[int, int]] = []
    start = 0
    for index in range(parts):
        size = base + (1 if index < extra else 0)
        ranges.append((start, start + size - 1))
        start += size
    return ranges


def num_layers_of(folder: Path) -> int:
    """``num_hidden_layers`` from a model folder's ``config.json``."""
    return int(json.loads((folder / "config.json").read_text(encoding="utf-8"))["num_hidden_layers"])


@dataclass(frozen=True)
class Mesh:
    """A running mesh: its tracker, nodes and relay, the model name it serves, the secret its services share."""

    spec: MeshSpec
    secret: str
    tracker: Service
    nodes: tuple[Service, ...]
    relay: Service | None
    model: str
    wan: ProxyThread | None = None
    """The WAN proxies in front of the nodes (``spec.wan``), whose shape :meth:`set_link` changes."""

    def set_link(self, shape: LinkShape) -> None:
        """Give every link of the mesh ``shape`` from now on (a mesh started with ``spec.wan``)."""
        if self.wan is None:
            raise MeshError("this mesh was started without WAN proxies (MeshSpec.wan)")
        self.wan.set_shape(shape)

    @property
    def url(self) -> str:
        return self.tracker.url

    def registered_nodes(self) -> list[dict[str, Any]]:
        """The tracker's ``GET /v1/nodes`` list (each node's dtype, device, decode rate...)."""
        answer = httpx.get(f"{self.url}/v1/nodes", headers=self.auth(), timeout=10.0)
        answer.raise_for_status()
        return list(answer.json()["nodes"])

    def node_dtypes(self) -> list[str]:
        """The number format each node chose, in layer order (``--dtype auto`` measures and picks one)."""
        nodes = sorted(self.registered_nodes(), key=lambda node: int(node["shard_start"]))
        return [str(node.get("dtype")) for node in nodes]

    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.secret}"}

    def route(self) -> dict[str, Any]:
        """``GET /v1/route`` for the served model: the signed route a head expects."""
        answer = httpx.get(f"{self.url}/v1/route", params={"model": self.model}, timeout=10.0)
        answer.raise_for_status()
        return dict(answer.json())


@contextlib.contextmanager
def running_mesh(spec: MeshSpec) -> Iterator[Mesh]:
    """Start the mesh ``spec`` describes, wait until the tracker can route its model, stop it at the end.

    Nodes start one after another: ``--dtype auto`` times the number formats
    when a node starts, and nodes starting together would time each other's
    load instead of the CPU.
    """
    began = time.perf_counter()
    secret = secrets.token_urlsafe(24)
    common = {"MESHNET_SECRET": secret}
    started: list[Service] = []
    proxies = ProxyThread() if spec.wan is not None else None
    try:
        tracker = start_service("tracker", common, ready_timeout_s=spec.ready_timeout_s)
        started.append(tracker)
        relay = None
        if spec.relayed:
            relay = start_service("relay", common, ready_timeout_s=spec.ready_timeout_s)
            started.append(relay)
        for index in range(spec.nodes):
            env = {**common, **_node_env(spec, index, tracker, relay)}
            port = free_port()
            if proxies is not None and spec.wan is not None:
                env["MESHNET_ADVERTISE"] = proxies.proxy(port, spec.wan).url  # others reach it through the proxy
            started.append(start_service("node", env, port, ready_timeout_s=spec.ready_timeout_s))
        model = _wait_servable(tracker, started, spec.ready_timeout_s)
        for node, cpu in zip(started[-spec.nodes:], spec.node_cpus, strict=False):
            pin_process(node.proc.pid, cpu)
        mesh = Mesh(spec=spec, secret=secret, tracker=tracker, nodes=tuple(started[-spec.nodes:]), relay=relay,
                    model=model, wan=proxies)
        logger.info("mesh of %s up in %.1f s, serving %s", spec.describe(), time.perf_counter() - began, model)
        yield mesh
    finally:
        for service in reversed(started):
            service.stop()
            with contextlib.suppress(OSError):
                service.log_path.unlink()
        if proxies is not None:
            proxies.close()


def pin_process(pid: int, cpu: int) -> None:
    """Pin every thread of process ``pid`` (and the threads it starts later) to core ``cpu``."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(ProcessLookupError, FileNotFoundError):
            os.sched_setaffinity(int(task.name), {cpu})


def _node_env(spec: MeshSpec, index: int, tracker: Service, relay: Service | None) -> dict[str, str]:
    start, end = split_layers(spec.num_layers, spec.nodes)[index]
    threads = str(os.cpu_count() or 1)
    env = {
        "MESHNET_MODEL": spec.model,
        "MESHNET_LAYERS": f"{start}-{end}",
        "MESHNET_TRACKER": tracker.url,
        "MESHNET_DTYPE": spec.dtype,
        "MESHNET_DEVICE": "cpu",
        "MESHNET_HEARTBEAT_S": str(NODE_HEARTBEAT_S),
        "MESHNET_NODE_ID": f"bench-node-{index}",
        "OMP_NUM_THREADS": threads,
        "MESHNET_SPECULATE": "auto",  # the node's default (the test launcher pins it off)
        "MESHNET_ACTIVATIONS": "auto",  # the node's default (the test launcher pins float32)
        **spec.node_env,
    }
    if relay is not None and index in spec.relayed:
        env["MESHNET_RELAY"] = f"ws://{relay.host}:{relay.port}"
        env["MESHNET_ADVERTISE"] = f"http://127.0.0.1:{free_port()}"  # nothing listens: as if behind NAT
    return env


def _wait_servable(tracker: Service, services: list[Service], timeout_s: float = READY_TIMEOUT_S) -> str:
    """Poll ``GET /v1/models`` until the tracker has a complete route; the served model's name."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for service in services:
            if not service.alive():
                raise MeshError(f"{service.kind} on port {service.port} exited:\n{_logs(services)}")
        with contextlib.suppress(httpx.HTTPError, ValueError):
            models = httpx.get(f"{tracker.url}/v1/models", timeout=5.0).json().get("data") or []
            if models:
                return str(models[0]["id"])
        time.sleep(POLL_S)
    raise MeshError(f"the tracker listed no servable model after {timeout_s:.0f} s:\n{_logs(services)}")


def _logs(services: list[Service]) -> str:
    """The tail of every service's log, for an error message."""
    return "\n".join(f"--- {s.kind} :{s.port}\n{s.log()[-LOG_TAIL_CHARS:]}" for s in services)
