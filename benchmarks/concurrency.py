"""Benchmark 4: many streams at once on a 2-node mesh, batched steps on every node.

N clients each stream the same greedy chat at once, for N = 1, 2, 4, 8 and
16; the aggregate rate is all the tokens they received over the wall time
from the first request sent to the last stream's end (prefill included:
under load, waiting for the prefills of others is part of what a client
sees). Beside it: each stream's own decode rate, and the p50 and p95 time
between two tokens of a stream (over every gap of every stream of the level).

Two 2-node meshes run side by side, their rounds interleaved:

* as a user runs it: every node may use every core; co-located nodes share
  them as slots through their CPU lock (``services/node/engine/cpu_gate.py``);
* two machines simulated: each node pinned to a core of its own (every
  thread, ``sched_setaffinity``), one thread each, no shared CPU lock, so the
  nodes compute at the same time and the pipeline's overlap shows: while the
  tail runs one batch, the head runs the next.

Beside them, single-process transformers ``generate`` on a batch of 8 copies
of the prompt (float16, every core): how close the mesh comes to a
single-process server that batches its users.

A round is cut at :data:`ROUND_DEADLINE_S` (the tokens that arrived by then
count) and a level stops repeating once it has used :data:`LEVEL_BUDGET_S`
(it always runs once), so a mesh that collapses under load cannot blow the
time budget of ``make bench``; the row's run count says how many rounds it
got, and the notes name any round that was cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import httpx

from benchmarks import llama_cpp
from benchmarks.client import timed_chat, warm_up
from benchmarks.harness import DEFAULT_MODEL, Harness, pick
from benchmarks.mesh import Mesh, MeshSpec, num_layers_of, running_mesh
from benchmarks.plots import Bars, save_figure
from benchmarks.prompts import DECODE_MESSAGES, prompt_token_ids
from benchmarks.reference import SingleProcess
from benchmarks.results import Outcome, Row
from benchmarks.stats import Spread, spread
from services.node.model.model_source import resolve_model

TITLE: Final = "Many streams at once: aggregate tokens/s of 1 to 16 concurrent streams (2 nodes)"
STREAMS: Final = (1, 2, 4, 8, 16)
ISSUE_38_STREAMS: Final = 8
ISSUE_38_SCALING: Final = 2.5
"""Issue 38: eight streams' aggregate at least this multiple of one stream's (prompts included, as measured here)."""
ISSUE_38_VERSUS_LLAMA: Final = (8, 16)
ISSUE_38_VERSUS_LLAMA_TARGET: Final = 2.0
"""Issue 38: the mesh's aggregate at 8 and at 16 streams at least this multiple of llama.cpp's batched API's."""
NODES: Final = 2
SINGLE_PROCESS_BATCH: Final = 8
MAX_CONNECTIONS: Final = 64
"""Client connection pool: more than the most concurrent streams, so none waits for a connection."""
ROUND_DEADLINE_S: Final = 30.0
"""A round still running after this long is cut (see :func:`_round`)."""
LEVEL_BUDGET_S: Final = 40.0
"""Seconds one (mesh, streams) level may use before it stops repeating (it always runs once)."""
SHARED: Final = "as a user runs it"
PINNED: Final = "two machines simulated (a core and a thread per node)"


@dataclass(frozen=True)
class RoundResult:
    """One round: tokens received in ``wall_s``, each stream's decode rate and gaps, whether all streams ended."""

    tokens: int
    wall_s: float
    stream_rates: tuple[float, ...]
    gaps_ms: tuple[float, ...]
    complete: bool

    @property
    def aggregate(self) -> float:
        return self.tokens / self.wall_s


def percentile(samples: Sequence[float], fraction: float) -> float:
    """The ``fraction`` quantile of ``samples`` (nearest rank); 0 when there are none."""
    if not samples:
        return 0.0
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, round(fraction * (len(ordered) - 1))))]


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
    gaps = tuple(1000.0 * (b - a) for times in arrivals for a, b in itertools.pairwise(times))
    return RoundResult(tokens=sum(len(times) for times in arrivals), wall_s=wall, stream_rates=rates,
                       gaps_ms=gaps, complete=not pending)


def _variants() -> dict[str, tuple[dict[str, str], tuple[int, ...]]]:
    """Each mesh to compare: its nodes' extra environment and their pinned cores (none: not pinned)."""
    variants: dict[str, tuple[dict[str, str], tuple[int, ...]]] = {SHARED: ({}, ())}
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= NODES:
        variants[PINNED] = ({"OMP_NUM_THREADS": "1", "MESHNET_THREADS": "1", "MESHNET_CPU_LOCK": "off"},
                            tuple(cores[:NODES]))
    return variants


def _llama_cpp_levels(prompt: list[int], max_tokens: int, rounds: int,
                      log: Callable[[str], None]) -> dict[int, list[float]]:
    """llama.cpp's aggregate tokens/s at every level of :data:`STREAMS` on the same GGUF, through its batched
    API (:mod:`benchmarks.llama_cpp`); empty when llama-cpp-python is not installed."""
    gguf = resolve_model(DEFAULT_MODEL).gguf
    if not llama_cpp.available() or gguf is None:
        log(llama_cpp.INSTALL_HINT + ": no llama.cpp rows")
        return {}
    levels: dict[int, list[float]] = {}
    for streams in STREAMS:
        for _ in range(rounds):
            run = llama_cpp.run_streams(gguf, prompt, streams, max_tokens, llama_cpp.default_threads())
            levels.setdefault(streams, []).append(run.aggregate)
        log(f"llama.cpp, {streams} streams: {statistics.median(levels[streams]):.1f} tok/s aggregate")
    return levels


def run(harness: Harness) -> Outcome:
    log = harness.logger("concurrency").info
    rounds = pick(harness.quick, full=3, fast=2)
    max_tokens = pick(harness.quick, full=32, fast=12)
    folder = harness.default_model
    variants = _variants()
    aggregate: dict[tuple[str, int], list[float]] = {}
    per_stream: dict[tuple[str, int], list[float]] = {}
    gaps: dict[tuple[str, int], list[float]] = {}
    cut_rounds: list[str] = []
    with contextlib.ExitStack() as stack:
        meshes: dict[str, Mesh] = {}
        for name, (env, cpus) in variants.items():
            spec = MeshSpec(model=DEFAULT_MODEL, num_layers=num_layers_of(folder), nodes=NODES, node_env=env,
                            node_cpus=cpus)
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
                    gaps.setdefault((name, streams), []).extend(result.gaps_ms)
                    cut = "" if result.complete else f" (cut at the {ROUND_DEADLINE_S:.0f} s deadline)"
                    if not result.complete:
                        cut_rounds.append(f"{name}, {streams} streams, round {index}")
                    log(f"{name}, {streams} streams, round {index}/{rounds}: {result.tokens} tokens in "
                        f"{result.wall_s:.1f} s = {result.aggregate:.1f} tok/s aggregate{cut}")
    single = SingleProcess(folder, "float16")
    try:
        prompt = prompt_token_ids(single.tokenizer, DECODE_MESSAGES)
        batched = [single.generate_batch(prompt, SINGLE_PROCESS_BATCH, max_tokens) for _ in range(rounds)]
        alone = [single.generate_batch(prompt, 1, max_tokens) for _ in range(rounds)]
    finally:
        single.close()
    log(f"single process float16: batch of {SINGLE_PROCESS_BATCH} {statistics.median(batched):.1f} tok/s, "
        f"one sequence {statistics.median(alone):.1f} tok/s")
    llama = _llama_cpp_levels(prompt, max_tokens, rounds, log)
    rows: list[Row] = []
    for name in variants:
        for streams in STREAMS:
            plural = "s" if streams > 1 else ""
            key = (name, streams)
            rows.append(Row(label=f"{streams} stream{plural}, {name} ({dtypes[name]}): aggregate",
                            value=spread(aggregate[key]), unit="tok/s", note="all tokens / wall time"))
            rows.append(Row(label=f"{streams} stream{plural}, {name}: each stream's decode rate",
                            value=spread(per_stream[key]), unit="tok/s"))
            rows.append(Row(label=f"{streams} stream{plural}, {name}: time between tokens p50 / p95",
                            value=spread([percentile(gaps[key], 0.5)]), unit="ms",
                            note=f"p95 {percentile(gaps[key], 0.95):.1f} ms over {len(gaps[key])} gaps"))
        one = statistics.median(aggregate[name, 1])
        for streams in STREAMS[1:]:
            versus_one = spread([a / one for a in aggregate[name, streams]])
            goal = (f"issue 38 goal ≥ {ISSUE_38_SCALING}: {'met' if versus_one.median >= ISSUE_38_SCALING else 'NOT met'}"
                    if streams == ISSUE_38_STREAMS else "")
            rows.append(Row(label=f"{streams} streams / 1 stream, {name}: aggregate", value=versus_one, unit="x",
                            note=goal))
        for streams in ISSUE_38_VERSUS_LLAMA:
            if streams in llama and (name, streams) in aggregate:
                versus = spread([a / statistics.median(llama[streams]) for a in aggregate[name, streams]])
                met = "met" if versus.median >= ISSUE_38_VERSUS_LLAMA_TARGET else "NOT met"
                rows.append(Row(label=f"{streams} streams, {name} / llama.cpp's batched API: aggregate", value=versus,
                                unit="x", note=f"issue 38 goal ≥ {ISSUE_38_VERSUS_LLAMA_TARGET}: {met}"))
    rows.append(Row(label=f"single-process transformers float16, batch of {SINGLE_PROCESS_BATCH}: aggregate",
                    value=spread(batched), unit="tok/s", note="generate on 8 copies of the prompt, every core"))
    rows.append(Row(label="single-process transformers float16, one sequence", value=spread(alone), unit="tok/s",
                    note="the same call with a batch of 1"))
    for streams, rates in llama.items():
        plural = "s" if streams > 1 else ""
        rows.append(Row(label=f"llama.cpp Q4_1 GGUF, batched API, {streams} stream{plural}: aggregate",
                        value=spread(rates), unit="tok/s",
                        note=f"{llama_cpp.default_threads()} threads, llama-cpp-python {llama_cpp.VERSION}"))
    if llama:
        one = statistics.median(llama[1])
        for streams in STREAMS[1:]:
            rows.append(Row(label=f"llama.cpp {streams} streams / 1 stream: aggregate",
                            value=spread([a / one for a in llama[streams]]), unit="x"))
    series = {"max_tokens": max_tokens, "node_dtypes": dtypes, "streams": list(STREAMS), "variants": list(variants),
              "aggregate_tokens_per_s": {name: [aggregate[name, s] for s in STREAMS] for name in variants},
              "per_stream_tokens_per_s": {name: [per_stream[name, s] for s in STREAMS] for name in variants},
              "gap_p50_ms": {name: [percentile(gaps[name, s], 0.5) for s in STREAMS] for name in variants},
              "gap_p95_ms": {name: [percentile(gaps[name, s], 0.95) for s in STREAMS] for name in variants},
              "single_process_batch": SINGLE_PROCESS_BATCH, "single_process_batched_tokens_per_s": batched,
              "single_process_alone_tokens_per_s": alone,
              "llama_cpp_aggregate_tokens_per_s": {str(streams): rates for streams, rates in llama.items()}}
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

    single = [(f"single process, batch of {series['single_process_batch']}",
               spread(series["single_process_batched_tokens_per_s"]))]
    return save_figure(path, TITLE, [
        Bars(title="aggregate tokens/s", ylabel="tokens/s", bars=bars("aggregate_tokens_per_s") + single,
             horizontal=True),
        Bars(title="decode tokens/s of each stream", ylabel="tokens/s", bars=bars("per_stream_tokens_per_s"),
             horizontal=True),
    ], caption)
