"""Benchmark 2: time per token against context length on 2 nodes, beside the recompute baseline.

Prompts of about 30 to 2,048 tokens (:func:`~benchmarks.prompts.messages_of_length`)
go to a 2-node mesh of the default model (``--dtype auto``); the figure is
milliseconds per decoded token, prefill excluded (time to first token is kept
beside it). A KV-cached decode step attends over the context but runs one
token through the layers, so it should barely grow with the context.

Beside it, in one process:

- single-process ``generate`` with its KV cache, in the number format the
  nodes chose, the cost the mesh should match;
- the recompute baseline: the earlier mesh's way, every token re-runs the
  whole sequence without a KV cache. It runs in whichever of float32 and the
  nodes' format is faster for a whole-sequence forward on this CPU, in one
  process with nothing on the wire: a lower bound of the earlier mesh.

Issue 4's target: on 2 nodes, a token at a 1,500-token context costs at most
1.3 times one at a 30-token context.

Issue 38's goals, against llama.cpp on the same GGUF with every core (one greedy stream of the same prompt
ids, interleaved with the mesh's runs) at the long context: the mesh's decode at least 1.0x llama.cpp's, and
its time to first token at least 1.5x faster.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final, cast

from benchmarks import llama_cpp
from benchmarks.client import chat_once, describe_timing, warm_up
from benchmarks.harness import DEFAULT_MODEL, Harness, pick
from benchmarks.mesh import MeshSpec, num_layers_of, running_mesh
from benchmarks.plots import Lines, save_figure
from benchmarks.prompts import Message, messages_of_length, prompt_token_ids
from benchmarks.reference import DTYPES, DTypeName, SingleProcess
from benchmarks.results import Outcome, Row
from benchmarks.rounds import interleave
from benchmarks.stats import Spread, ratio, spread
from benchmarks.timing import StreamTiming
from services.node.model.model_source import resolve_model

TITLE: Final = "Time per token against context length: 2 nodes vs the recompute baseline"
CONTEXTS_FULL: Final = (30, 64, 128, 256, 512, 1024, 1500, 2048)
CONTEXTS_QUICK: Final = (30, 256, 1500)
SHORT_CONTEXT: Final = 30
LONG_CONTEXT: Final = 1500
LONG_CONTEXT_TARGET: Final = 1.3
"""Issue 4: ms/token at a 1,500-token context within this factor of that at a 30-token context."""
ISSUE_38_DECODE_TARGET: Final = 1.0
"""Issue 38: the mesh's ms/token at the long context at most llama.cpp's (its decode at least 1.0x)."""
ISSUE_38_TTFT_TARGET: Final = 1.5
"""Issue 38: the mesh's time to first token of the long prompt at least this many times faster than llama.cpp's."""
PROBE_TOKENS: Final = 512
"""Sequence length at which the recompute baseline's number format is chosen (the faster forward wins)."""


def run(harness: Harness) -> Outcome:
    log = harness.logger("context").info
    runs = pick(harness.quick, full=3, fast=2)
    max_tokens = pick(harness.quick, full=24, fast=12)
    recompute_steps = pick(harness.quick, full=2, fast=1)
    contexts = CONTEXTS_QUICK if harness.quick else CONTEXTS_FULL
    folder = harness.default_model

    float32 = SingleProcess(folder, "float32")
    prompts: dict[int, tuple[tuple[Message, ...], list[int]]] = {}
    for target in contexts:
        messages, _ = messages_of_length(float32.tokenizer, target)
        prompts[target] = (messages, prompt_token_ids(float32.tokenizer, messages))

    spec = MeshSpec(model=DEFAULT_MODEL, num_layers=num_layers_of(folder), nodes=2)
    log(f"starting a mesh of {spec.describe()}")
    with running_mesh(spec) as mesh:
        warm_up(mesh.url, mesh.model, prompts[contexts[0]][0])
        chosen = mesh.node_dtypes()
        formats = set(chosen)
        kv_dtype = cast(DTypeName, chosen[0]) if len(formats) == 1 and chosen[0] in DTYPES else "float32"
        kv_model = float32 if kv_dtype == "float32" else SingleProcess(folder, kv_dtype)
        recompute_model = _faster_full_forward(float32, kv_model, prompts[max(contexts)][1][:PROBE_TOKENS], log)
        mesh_timings: dict[int, list[StreamTiming]] = {}
        kv_timings: dict[int, list[StreamTiming]] = {}
        llama_timings: list[StreamTiming] = []
        recompute_ms: dict[int, list[float]] = {}
        gguf = resolve_model(DEFAULT_MODEL).gguf
        for target in contexts:
            messages, ids = prompts[target]
            mesh_label, kv_label = f"2 nodes, {len(ids)}-token context", f"single process {kv_dtype}, {len(ids)}"
            contenders = {
                mesh_label: functools.partial(chat_once, mesh.url, mesh.model, messages, max_tokens),
                kv_label: functools.partial(kv_model.generate, ids, max_tokens),
            }
            llama_label = f"llama.cpp, {len(ids)}"
            if target == LONG_CONTEXT and gguf is not None and llama_cpp.available():
                contenders[llama_label] = functools.partial(_llama_cpp_stream, gguf, ids, max_tokens)
            timings = interleave(contenders, runs, log=log, describe=describe_timing)
            mesh_timings[target], kv_timings[target] = timings[mesh_label], timings[kv_label]
            llama_timings += timings.get(llama_label, [])
            recompute_ms[target] = recompute_model.recompute(ids, recompute_steps)
            log(f"recompute baseline {recompute_model.dtype}, {len(ids)}-token context: "
                + ", ".join(f"{ms:.0f}" for ms in recompute_ms[target]) + " ms/token")
    outcome = _outcome(contexts, prompts, mesh_timings, kv_timings, recompute_ms, chosen, kv_dtype,
                       recompute_model.dtype, max_tokens)
    if not llama_timings:
        return outcome
    return _with_llama_cpp(outcome, mesh_timings[LONG_CONTEXT], llama_timings, len(prompts[LONG_CONTEXT][1]))


def _llama_cpp_stream(gguf: Path, ids: list[int], max_tokens: int) -> StreamTiming:
    """One greedy stream of llama.cpp on ``gguf`` with every core, from the prompt's ids (prefill, then decode)."""
    run = llama_cpp.run_streams(gguf, ids, 1, max_tokens, llama_cpp.default_threads())
    return StreamTiming(tokens=max_tokens, first_s=run.first_s, last_s=run.wall_s, prompt_tokens=len(ids))


def _with_llama_cpp(outcome: Outcome, mesh: list[StreamTiming], llama: list[StreamTiming], length: int) -> Outcome:
    """Issue 38's rows at the long context: llama.cpp's figures and the mesh's ratios to them."""
    mesh_ms, llama_ms = spread([x.ms_per_token for x in mesh]), spread([x.ms_per_token for x in llama])
    mesh_ttft, llama_ttft = spread([x.ttft_s * 1000 for x in mesh]), spread([x.ttft_s * 1000 for x in llama])
    decode = llama_ms.map(lambda ms: ms / mesh_ms.median)
    ttft = llama_ttft.map(lambda ms: ms / mesh_ttft.median)
    label = f"llama.cpp Q4_1 GGUF, {llama_cpp.default_threads()} threads, {length}-token context"
    rows = (
        Row(label=label, value=llama_ms, unit="ms/token", note="same prompt ids, interleaved with the mesh"),
        Row(label=f"{label}: time to first token", value=llama_ttft, unit="ms"),
        Row(label=f"2 nodes / llama.cpp: decode at a {length}-token context", value=decode, unit="x",
            note=f"issue 38 goal ≥ {ISSUE_38_DECODE_TARGET}: "
                 f"{'met' if decode.median >= ISSUE_38_DECODE_TARGET else 'NOT met'}"),
        Row(label=f"llama.cpp / 2 nodes: time to first token of the {length}-token prompt", value=ttft, unit="x",
            note=f"issue 38 goal ≥ {ISSUE_38_TTFT_TARGET}: {'met' if ttft.median >= ISSUE_38_TTFT_TARGET else 'NOT met'}"),
    )
    series = {**outcome.series, "llama_cpp_long_context_ms_per_token": list(llama_ms.samples),
              "llama_cpp_long_context_ttft_ms": list(llama_ttft.samples)}
    return Outcome(rows=outcome.rows + rows, series=series, notes=outcome.notes)


def _faster_full_forward(first: SingleProcess, second: SingleProcess, ids: list[int],
                         log: Callable[[str], None]) -> SingleProcess:
    """Whichever model runs a whole-sequence forward of ``ids`` faster (the baseline's best case)."""
    if first is second:
        return first
    costs = {}
    for model in (first, second):
        model.recompute(ids, 1)  # warm-up at this length
        began = time.perf_counter()
        model.recompute(ids, 1)
        costs[model.dtype] = time.perf_counter() - began
    shown = ", ".join(f"{name} {seconds * 1000:.0f} ms" for name, seconds in costs.items())
    log(f"whole-sequence forward of {len(ids)} tokens: {shown}")
    return first if costs[first.dtype] <= costs[second.dtype] else second


def _outcome(contexts: tuple[int, ...], prompts: dict[int, tuple[tuple[Message, ...], list[int]]],
             mesh: dict[int, list[StreamTiming]], kv: dict[int, list[StreamTiming]],
             recompute: dict[int, list[float]], chosen: list[str], kv_dtype: str, recompute_dtype: str,
             max_tokens: int) -> Outcome:
    length = {target: len(prompts[target][1]) for target in contexts}
    mesh_ms = {t: spread([x.ms_per_token for x in mesh[t]]) for t in contexts}
    kv_ms = {t: spread([x.ms_per_token for x in kv[t]]) for t in contexts}
    recompute_spread = {t: spread(recompute[t]) for t in contexts}
    rows = [Row(label=f"2 nodes ({'/'.join(chosen)}), {length[t]}-token context", value=mesh_ms[t],
                unit="ms/token") for t in contexts]
    short, long_, longest = SHORT_CONTEXT, LONG_CONTEXT, max(contexts)
    if short in contexts and long_ in contexts:
        versus = ratio(mesh_ms[long_], mesh_ms[short].median)
        met = "met" if versus.median <= LONG_CONTEXT_TARGET else "NOT met"
        rows.append(Row(label=f"2 nodes: ms/token at {length[long_]} / at {length[short]} tokens", value=versus,
                        unit="x", note=f"issue 4 target ≤ {LONG_CONTEXT_TARGET}: {met}"))
    rows += [
        Row(label=f"2 nodes: time to first token, {length[longest]}-token prompt",
            value=spread([x.ttft_s * 1000 for x in mesh[longest]]), unit="ms", note="prefill, for scale"),
        Row(label=f"single process {kv_dtype} with KV cache, {length[short if short in contexts else longest]}"
                  f"-token context", value=kv_ms[short if short in contexts else longest], unit="ms/token"),
        Row(label=f"single process {kv_dtype} with KV cache, {length[longest]}-token context",
            value=kv_ms[longest], unit="ms/token"),
        Row(label=f"recompute baseline ({recompute_dtype}), {length[longest]}-token context",
            value=recompute_spread[longest], unit="ms/token", note="the earlier mesh's way, lower bound"),
        Row(label=f"recompute baseline / 2 nodes, {length[longest]}-token context",
            value=recompute_spread[longest].map(lambda ms: ms / mesh_ms[longest].median), unit="x"),
    ]
    series = {
        "max_tokens": max_tokens, "node_dtypes": chosen, "kv_dtype": kv_dtype, "recompute_dtype": recompute_dtype,
        "contexts": [length[t] for t in contexts],
        "mesh_ms_per_token": [list(mesh_ms[t].samples) for t in contexts],
        "mesh_ttft_ms": [[x.ttft_s * 1000 for x in mesh[t]] for t in contexts],
        "mesh_tokens": [[x.tokens for x in mesh[t]] for t in contexts],
        "mesh_prompt_tokens": [[x.prompt_tokens for x in mesh[t]] for t in contexts],
        "single_process_ms_per_token": [list(kv_ms[t].samples) for t in contexts],
        "recompute_ms_per_token": [recompute[t] for t in contexts],
    }
    notes = tuple(f"the mesh counted {sorted({x.prompt_tokens for x in mesh[t]})} prompt tokens where the "
                  f"benchmark's tokenizer counted {length[t]}" for t in contexts
                  if {x.prompt_tokens for x in mesh[t]} != {length[t]})
    return Outcome(rows=tuple(rows), series=series, notes=notes)


def plot(outcome: Outcome, path: Path, caption: str) -> Path:
    series = outcome.series
    contexts = [float(c) for c in series["contexts"]]

    def line(key: str) -> list[tuple[float, Spread]]:
        return [(c, spread(samples)) for c, samples in zip(contexts, series[key], strict=True)]

    lines = {
        f"mesh, 2 nodes ({'/'.join(series['node_dtypes'])})": line("mesh_ms_per_token"),
        f"single process with KV cache ({series['kv_dtype']})": line("single_process_ms_per_token"),
        f"recompute baseline ({series['recompute_dtype']})": line("recompute_ms_per_token"),
    }
    kv_only = {name: points for name, points in lines.items() if not name.startswith("recompute")}
    return save_figure(path, TITLE, [
        Lines(title="ms per decoded token (log scale)", xlabel="context (prompt tokens)", ylabel="ms/token",
              lines=lines, log_y=True, log_x=True),
        Lines(title="KV-cached only (linear scale)", xlabel="context (prompt tokens)", ylabel="ms/token",
              lines=kv_only, log_x=True),
    ], caption)
