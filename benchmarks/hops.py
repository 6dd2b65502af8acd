"""Benchmark 3: what each hop adds to a token, on loopback with the tiny model, 1 to 4 nodes.

The test suite's tiny model (4 layers, hidden size 64) costs almost nothing to
compute, so its time per token on a mesh is almost all overhead: HTTP, frame
encoding, the event loops, the tracker's relay of the stream. Splitting its 4
layers over 1, 2, 3 and 4 nodes and timing a greedy stream on each gives the
cost of one more hop: per run, (ms/token on N nodes − median ms/token on 1
node) / (N − 1). The four meshes are up at once and their runs interleaved.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Final

from benchmarks.client import chat_once, describe_timing, warm_up
from benchmarks.harness import Harness, pick
from benchmarks.mesh import MeshSpec, num_layers_of, running_mesh
from benchmarks.plots import Bars, Lines, save_figure
from benchmarks.prompts import DECODE_MESSAGES
from benchmarks.results import Outcome, Row
from benchmarks.rounds import interleave
from benchmarks.stats import spread
from benchmarks.timing import StreamTiming

TITLE: Final = "Per-hop overhead per token on loopback (tiny model, 1-4 nodes)"
MAX_NODES: Final = 4


def run(harness: Harness) -> Outcome:
    log = harness.logger("hops").info
    runs = pick(harness.quick, full=5, fast=2)
    max_tokens = pick(harness.quick, full=64, fast=24)
    folder = harness.tiny_model
    layers = num_layers_of(folder)
    with contextlib.ExitStack() as stack:
        contenders: dict[str, Callable[[], StreamTiming]] = {}
        for nodes in range(1, min(MAX_NODES, layers) + 1):
            spec = MeshSpec(model=str(folder), num_layers=layers, nodes=nodes)
            log(f"starting a mesh of {spec.describe()} with the tiny model")
            mesh = stack.enter_context(running_mesh(spec))
            warm_up(mesh.url, mesh.model, DECODE_MESSAGES)
            contenders[_label(nodes)] = functools.partial(chat_once, mesh.url, mesh.model, DECODE_MESSAGES,
                                                          max_tokens)
        timings = interleave(contenders, runs, log=log, describe=describe_timing)
    return _outcome({nodes: timings[_label(nodes)] for nodes in range(1, len(contenders) + 1)}, max_tokens)


def _label(nodes: int) -> str:
    return f"tiny model, {nodes} node{'s' if nodes > 1 else ''}"


def _outcome(timings: dict[int, list[StreamTiming]], max_tokens: int) -> Outcome:
    per_token = {nodes: spread([t.ms_per_token for t in runs]) for nodes, runs in timings.items()}
    alone = per_token[1].median
    per_hop = spread([(t.ms_per_token - alone) / (nodes - 1) for nodes, runs in timings.items() if nodes > 1
                      for t in runs])
    rows = [Row(label=_label(nodes), value=value, unit="ms/token")
            for nodes, value in per_token.items()]
    rows.append(Row(label="added by each hop", value=per_hop, unit="ms",
                    note="per token per extra node: (N-node − 1-node) / (N − 1), over every run of 2-4 nodes"))
    series = {"max_tokens": max_tokens, "nodes": list(per_token),
              "ms_per_token": [list(per_token[n].samples) for n in per_token],
              "ttft_ms": [[t.ttft_s * 1000 for t in timings[n]] for n in per_token],
              "tokens": [[t.tokens for t in timings[n]] for n in per_token]}
    return Outcome(rows=tuple(rows), series=series)


def plot(outcome: Outcome, path: Path, caption: str) -> Path:
    nodes = [float(n) for n in outcome.series["nodes"]]
    points = [(n, spread(samples)) for n, samples in zip(nodes, outcome.series["ms_per_token"], strict=True)]
    per_hop = next(row.value for row in outcome.rows if row.unit == "ms")
    return save_figure(path, TITLE, [
        Lines(title="ms per token against nodes on the route", xlabel="nodes", ylabel="ms/token",
              lines={"tiny model, loopback": points}),
        Bars(title="added by each hop (ms per token)", ylabel="ms", bars=[("per hop", per_hop)]),
    ], caption)
