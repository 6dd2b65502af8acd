"""Benchmark 7: the mesh across an emulated internet: decode tok/s and time to first token against RTT.

Every figure of the other benchmarks is on loopback, where a hop costs a few
milliseconds. Between machines a hop costs its round trip, every token, so a
route of N nodes cannot beat ``1000 / (N x RTT ms)`` tokens a second whatever
the hardware. Here every node sits behind a WAN proxy (:mod:`benchmarks.wan_proxy`:
each direction delayed by RTT/2, bandwidth capped at :data:`BANDWIDTH_MBIT`)
and advertises it, so every frame from one node to the next, and every
request the tracker passes to the head, crosses an emulated link; the client
and the tracker share a machine. The default model on 2 and 3 nodes, at
each RTT of :data:`RTTS_MS`: one mesh per node count, whose links are
reshaped between runs (the model loads once), and every (nodes, RTT) pair's
runs interleaved with the others'.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Final

from benchmarks.client import chat_once, describe_timing, warm_up
from benchmarks.harness import DEFAULT_MODEL, Harness, pick
from benchmarks.mesh import Mesh, MeshSpec, num_layers_of, running_mesh
from benchmarks.plots import Lines, save_figure
from benchmarks.prompts import DECODE_MESSAGES
from benchmarks.results import Outcome, Row
from benchmarks.rounds import interleave
from benchmarks.stats import spread
from benchmarks.timing import StreamTiming
from benchmarks.wan_proxy import LinkShape, mbit

TITLE: Final = "Across an emulated WAN: decode and time to first token against RTT (default model, 2-3 nodes)"
RTTS_MS: Final = (0.0, 10.0, 50.0, 100.0)
NODE_COUNTS: Final = (2, 3)
BANDWIDTH_MBIT: Final = 100.0
"""Every emulated link's bandwidth in each direction (a decode frame of the default model is 2.3 KB)."""


def link(rtt_ms: float) -> LinkShape:
    return LinkShape(rtt_ms=rtt_ms, bandwidth_bytes_s=mbit(BANDWIDTH_MBIT))


def label(nodes: int, rtt_ms: float) -> str:
    return f"{nodes} nodes, RTT {rtt_ms:g} ms"


def shaped(mesh: Mesh, shape: LinkShape, call: Callable[[], StreamTiming]) -> Callable[[], StreamTiming]:
    """``call`` run after the mesh's links are given ``shape``."""
    def go() -> StreamTiming:
        mesh.set_link(shape)
        return call()
    return go


def run(harness: Harness) -> Outcome:
    log = harness.logger("wan").info
    runs = pick(harness.quick, full=3, fast=1)
    max_tokens = pick(harness.quick, full=32, fast=12)
    folder = harness.default_model
    layers = num_layers_of(folder)
    with contextlib.ExitStack() as stack:
        contenders: dict[str, Callable[[], StreamTiming]] = {}
        for nodes in NODE_COUNTS:
            spec = MeshSpec(model=DEFAULT_MODEL, num_layers=layers, nodes=nodes, wan=link(0.0))
            log(f"starting a mesh of {spec.describe()}")
            mesh = stack.enter_context(running_mesh(spec))
            warm_up(mesh.url, mesh.model, DECODE_MESSAGES)
            for rtt in RTTS_MS:
                contenders[label(nodes, rtt)] = shaped(mesh, link(rtt), lambda mesh=mesh: chat_once(
                    mesh.url, mesh.model, DECODE_MESSAGES, max_tokens))
        timings = interleave(contenders, runs, log=log, describe=describe_timing)
    return outcome(timings, max_tokens)


def outcome(timings: dict[str, list[StreamTiming]], max_tokens: int) -> Outcome:
    rows: list[Row] = []
    series: dict[str, object] = {"max_tokens": max_tokens, "bandwidth_mbit": BANDWIDTH_MBIT, "rtts_ms": list(RTTS_MS)}
    for nodes in NODE_COUNTS:
        for rtt in RTTS_MS:
            runs = timings[label(nodes, rtt)]
            bound = f"; the round trips alone allow at most {1000 / (nodes * rtt):.1f} tok/s" if rtt else ""
            rows.append(Row(label=f"{label(nodes, rtt)}: decode", value=spread([t.tokens_per_s for t in runs]),
                            unit="tok/s", note=f"{BANDWIDTH_MBIT:g} Mbit/s links{bound}"))
            rows.append(Row(label=f"{label(nodes, rtt)}: time to first token",
                            value=spread([t.ttft_s * 1000 for t in runs]), unit="ms"))
            series[label(nodes, rtt)] = {"tokens_per_s": [t.tokens_per_s for t in runs],
                                         "ttft_ms": [t.ttft_s * 1000 for t in runs],
                                         "tokens": [t.tokens for t in runs]}
    return Outcome(rows=tuple(rows), series=series,
                   notes=(("every node behind a userspace WAN proxy (benchmarks/wan_proxy.py); the client and the "
                          "tracker on one machine, each node on its own emulated link"),))


def plot(outcome: Outcome, path: Path, caption: str) -> Path:
    series = outcome.series
    rtts = [float(r) for r in series["rtts_ms"]]
    decode = {f"{n} nodes": [(r, spread(series[label(n, r)]["tokens_per_s"])) for r in rtts] for n in NODE_COUNTS}
    ttft = {f"{n} nodes": [(r, spread(series[label(n, r)]["ttft_ms"])) for r in rtts] for n in NODE_COUNTS}
    return save_figure(path, TITLE, [
        Lines(title="decode tok/s against RTT", xlabel="RTT (ms)", ylabel="tok/s", lines=decode),
        Lines(title="time to first token against RTT", xlabel="RTT (ms)", ylabel="ms", lines=ttft),
    ], caption)
