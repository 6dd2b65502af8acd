"""Benchmark 4: aggregate tokens/s with 1, 4 and 8 concurrent streams on a 2-node mesh.

N clients each stream the same greedy chat at once; the aggregate rate is
all the tokens they received over the wall time from the first request sent
to the last stream's end (prefill included: under load, waiting for the
prefills of others is part of what a client sees). Each stream's own decode
rate is kept beside it.

Two 2-node meshes run side by side, their rounds interleaved: one as a user
gets it (every node may use every core; co-located nodes share them as
slots through their CPU lock, ``services/node/cpu_gate.py``), and one with
the cores divided between the nodes once and for all (``MESHNET_THREADS`` =
cores / nodes). The second shows what the sharing is worth under load.

A round is cut at :data:`ROUND_DEADLINE_S` (the tokens that arrived by then
count) and a level stops repeating once it has used :data:`LEVEL_BUDGET_S`
(it always runs once), so a mesh that collapses under load cannot blow the
time budget of ``make bench``; the row's run count says how many rounds it
got, and the notes name any round that was cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import httpx

from benchmarks.client import timed_chat, warm_up
from benchmarks.harness import DEFAULT_MODEL, Harness, pick
from benchmarks.mesh import Mesh, MeshSpec, num_layers_of, running_mesh
from benchmarks.plots import Bars, save_figure
from benchmarks.prompts import DECODE_MESSAGES
from benchmarks.results import Outcome, Row
from benchmarks.stats import Spread, spread

TITLE: Final = "Aggregate tokens/s with 1, 4 and 8 concurrent streams (2 nodes)"
STREAMS: Final = (1, 4, 8)
NODES: Final = 2
MAX_CONNECTIONS: Final = 32
"""Client connection pool: more than the most concurrent streams, so none waits for a connection."""
ROUND_DEADLINE_S: Final = 20.0
"""A round still running after this long is cut (see :func:`_round`)."""
LEVEL_BUDGET_S: Final = 30.0
"""Seconds one (mesh, streams) level may use before it stops repeating (it always runs once)."""


@dataclass(frozen=True)
class RoundResult:
    """One round: tokens received in ``wall_s``, each stream's decode rate, and whether all streams ended."""

    tokens: int
    wall_s: float
    stream_rates: tuple[float, ...]
    complete: bool

    @property
    def aggregate(self) -> float:
        return self.tokens / self.wall_s


async def _round(url: str, model: str, streams: int, max_tokens: int, deadline_s: float) -> RoundResult:
    """Start ``streams`` chats at once and count their tokens as they arrive.

    A round that outlasts ``deadline_s`` is cut there: the streams are closed
    and the tokens that arrived by then count (one content chunk is one token),
    so a mesh that has collapsed under load is measured without waiting for it.
    """
    limits = httpx.Limits(max_connections=MAX_CONNECTIONS, max_keepalive_connections=MAX_CONNECTIONS)
    arrivals: list[list[float]] = [[] for _ in range(streams)]
    async with httpx.AsyncClient(limits=limits) as client:
        began = time.perf_counter()
        tasks = [asyncio.create_task(timed_chat(client, url, model, DECODE_MESSAGES, max_tokens,
                                                on_content=arrivals[index].append))
                 for index in range(streams)]
        done, pending = await asyncio.wait(tasks, timeout=deadline_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        wall = min(time.perf_counter() - began, deadline_s) if pending else time.perf_counter() - began
        for task in done:
            task.result()  # a stream that failed fails the round
    rates = tuple((len(times) - 1) / (times[-1] - times[0]) for times in arrivals
                  if len(times) > 1 and times[-1] > times[0])
    return RoundResult(tokens=sum(len(times) for times in arrivals), wall_s=wall, stream_rates=rates,
                       complete=not pending)


def run(harness: Harness) -> Outcome:
    log = harness.logger("concurrency").info
    rounds = pick(harness.quick, full=3, fast=2)
    max_tokens = pick(harness.quick, full=24, fast=12)
    folder = harness.default_model
    cores = os.cpu_count() or 1
    divided = max(1, cores // NODES)
    variants = {"all cores per node": {},
                f"{divided} thread{'s' if divided > 1 else ''} per node": {"OMP_NUM_THREADS": str(divided),
                                                                         "MESHNET_THREADS": str(divided)}}
    aggregate: dict[tuple[str, int], list[float]] = {}
    per_stream: dict[tuple[str, int], list[float]] = {}
    cut_rounds: list[str] = []
    with contextlib.ExitStack() as stack:
        meshes: dict[str, Mesh] = {}
        for name, env in variants.items():
            spec = MeshSpec(model=DEFAULT_MODEL, num_layers=num_layers_of(folder), nodes=NODES, node_env=env)
            log(f"starting a mesh of {spec.describe()}, {name}")
            meshes[name] = stack.enter_context(running_mesh(spec))
            warm_up(meshes[name].url, meshes[name].model, DECODE_MESSAGES)
        dtypes = {name: "/".join(mesh.node_dtypes()) for name, mesh in meshes.items()}
        for streams in STREAMS:
            spent = dict.fromkeys(meshes, 0.0)
            for index in range(1, rounds + 1):
                for name, mesh in meshes.items():
                    if spent[name] > LEVEL_BUDGET_S:
                        continue
                    result = asyncio.run(_round(mesh.url, mesh.model, streams, max_tokens, ROUND_DEADLINE_S))
                    spent[name] += result.wall_s
                    aggregate.setdefault((name, streams), []).append(result.aggregate)
                    per_stream.setdefault((name, streams), []).extend(result.stream_rates)
                    cut = "" if result.complete else f" (cut at the {ROUND_DEADLINE_S:.0f} s deadline)"
                    if not result.complete:
                        cut_rounds.append(f"{name}, {streams} streams, round {index}")
                    log(f"{name}, {streams} streams, round {index}/{rounds}: {result.tokens} tokens in "
                        f"{result.wall_s:.1f} s = {result.aggregate:.1f} tok/s aggregate{cut}")
    rows: list[Row] = []
    for name in variants:
        for streams in STREAMS:
            plural = "s" if streams > 1 else ""
            rows.append(Row(label=f"{streams} stream{plural}, {name} ({dtypes[name]}): aggregate",
                            value=spread(aggregate[name, streams]), unit="tok/s", note="all tokens / wall time"))
            rows.append(Row(label=f"{streams} stream{plural}, {name}: each stream's decode rate",
                            value=spread(per_stream[name, streams]), unit="tok/s"))
    series = {"max_tokens": max_tokens, "node_dtypes": dtypes, "streams": list(STREAMS), "variants": list(variants),
              "aggregate_tokens_per_s": {name: [aggregate[name, s] for s in STREAMS] for name in variants},
              "per_stream_tokens_per_s": {name: [per_stream[name, s] for s in STREAMS] for name in variants}}
    notes = (f"rounds cut at the {ROUND_DEADLINE_S:.0f} s deadline (tokens that arrived by then counted): "
             + "; ".join(cut_rounds),) if cut_rounds else ()
    return Outcome(rows=tuple(rows), series=series, notes=notes)


def plot(outcome: Outcome, path: Path, caption: str) -> Path:
    series = outcome.series
    streams = series["streams"]

    def bars(key: str) -> list[tuple[str, Spread]]:
        return [(f"{s} stream{'s' if s > 1 else ''}, {name}", spread(samples))
                for name in series["variants"]
                for s, samples in zip(streams, series[key][name], strict=True)]

    return save_figure(path, TITLE, [
        Bars(title="aggregate tokens/s", ylabel="tokens/s", bars=bars("aggregate_tokens_per_s"), horizontal=True),
        Bars(title="decode tokens/s of each stream", ylabel="tokens/s", bars=bars("per_stream_tokens_per_s"),
             horizontal=True),
    ], caption)
