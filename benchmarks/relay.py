"""Benchmark 5: a hop through the relay against a direct hop (tiny model, 2 nodes, loopback).

Two meshes of the tiny model split over 2 nodes run side by side: in one the
head reaches the tail directly; in the other the tail is "behind NAT" (it
keeps a WebSocket to the relay and registers an endpoint nobody can dial),
so every frame to it goes head → relay → tail and back. Their runs are
interleaved; the difference in ms/token is what a relayed hop costs a token.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Final

import httpx

from benchmarks.client import chat_once, describe_timing, warm_up
from benchmarks.harness import Harness, pick
from benchmarks.mesh import Mesh, MeshSpec, num_layers_of, running_mesh
from benchmarks.plots import Bars, save_figure
from benchmarks.prompts import DECODE_MESSAGES
from benchmarks.results import Outcome, Row
from benchmarks.rounds import interleave
from benchmarks.stats import spread
from benchmarks.timing import StreamTiming

TITLE: Final = "A hop through the relay against a direct hop (tiny model, 2 nodes)"
DIRECT: Final = "direct hop"
RELAYED: Final = "hop through the relay"
RELAY_REQUESTS_METRIC: Final = "meshnet_relay_requests_total"
"""The relay's counter of requests relayed (every frame a relayed hop receives is one)."""
TAIL: Final = 1
"""Index of the node put behind the relay: the tail, which only the head dials."""


def run(harness: Harness) -> Outcome:
    log = harness.logger("relay").info
    runs = pick(harness.quick, full=7, fast=2)
    max_tokens = pick(harness.quick, full=64, fast=24)
    folder = harness.tiny_model
    layers = num_layers_of(folder)
    with contextlib.ExitStack() as stack:
        contenders: dict[str, Callable[[], StreamTiming]] = {}
        relayed_mesh: Mesh | None = None
        for name, relayed in ((DIRECT, frozenset[int]()), (RELAYED, frozenset({TAIL}))):
            spec = MeshSpec(model=str(folder), num_layers=layers, nodes=2, relayed=relayed)
            log(f"starting a mesh of {spec.describe()} with the tiny model")
            mesh = stack.enter_context(running_mesh(spec))
            if relayed and not all(node.get("relay_addr") for node in mesh.registered_nodes()
                                   if int(node["shard_start"]) > 0):
                raise RuntimeError("the tail registered no relay_addr: the node does not use MESHNET_RELAY")
            warm_up(mesh.url, mesh.model, DECODE_MESSAGES)
            contenders[name] = functools.partial(chat_once, mesh.url, mesh.model, DECODE_MESSAGES, max_tokens)
            if relayed:
                relayed_mesh = mesh
        timings = interleave(contenders, runs, log=log, describe=describe_timing)
        assert relayed_mesh is not None
        through_relay = _relayed_requests(relayed_mesh)
        tokens = sum(t.tokens for t in timings[RELAYED])
        if through_relay < tokens:
            raise RuntimeError(f"the relay carried {through_relay} requests for {tokens} relayed tokens: "
                               "frames to the tail did not all go through it")
        log(f"the relay carried {through_relay:.0f} requests for {tokens} tokens")
    direct = spread([t.ms_per_token for t in timings[DIRECT]])
    relayed_ms = spread([t.ms_per_token for t in timings[RELAYED]])
    added = relayed_ms.map(lambda ms: ms - direct.median)
    rows = (
        Row(label="2 nodes, direct hop", value=direct, unit="ms/token"),
        Row(label="2 nodes, the tail behind the relay", value=relayed_ms, unit="ms/token"),
        Row(label="added by the relay", value=added, unit="ms", note="per token: relayed runs − direct median"),
    )
    series = {"max_tokens": max_tokens, "relayed_requests": through_relay, "direct_ms_per_token": list(direct.samples),
              "relayed_ms_per_token": list(relayed_ms.samples), "added_ms": list(added.samples)}
    return Outcome(rows=rows, series=series)


def _relayed_requests(mesh: Mesh) -> float:
    """Requests the mesh's relay has carried, from its Prometheus ``/metrics``."""
    assert mesh.relay is not None
    text = httpx.get(f"{mesh.relay.url}/metrics", timeout=10.0).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(RELAY_REQUESTS_METRIC))


def plot(outcome: Outcome, path: Path, caption: str) -> Path:
    series = outcome.series
    return save_figure(path, TITLE, [
        Bars(title="ms per token (tiny model, loopback)", ylabel="ms/token",
             bars=[(DIRECT, spread(series["direct_ms_per_token"])),
                   (RELAYED, spread(series["relayed_ms_per_token"]))]),
        Bars(title="added by the relay, per token", ylabel="ms", bars=[("relay", spread(series["added_ms"]))]),
    ], caption)
