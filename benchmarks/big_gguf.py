"""Real model sizes from synthetic Q4_K_M GGUFs on several nodes, beside llama.cpp on the same file and threads.

The shared body of two ``make bench`` parts (issue 35's benchmark):

* ``gguf_8b`` (:mod:`benchmarks.gguf_8b`): Llama-3.1-8B's whole shape (32 layers, its 128,256-token vocabulary,
  4.9 GB as Q4_K_M) on 3 nodes, each holding a third of the layers (``--layers``);
* ``gguf_moe`` (:mod:`benchmarks.gguf_moe`): Qwen3-30B-A3B's layer shape (128 experts of 768, 8 routed) in 12
  of its 48 layers, its 151,936-token vocabulary, Q4_K_M, on 2 nodes.

The files are written once by :mod:`benchmarks.synthetic_gguf` (random weights in llama.cpp's Q4_K_M type mix)
into ``~/.cache/meshnet/bench``, so a rerun starts at once. Per mesh: each node's resident memory from
``/proc`` after a warm-up request (``VmRSS``, its anonymous and file-backed parts, and the peak ``VmHWM``)
against its share of the file (the bytes of the tensors it serves) plus :data:`RSS_ALLOWANCE_MIB`, each node's
load time (its own "ready in" log line) and the whole mesh's; then, round by round, one greedy stream a
contender of a :data:`PROMPT_TOKENS`-token prompt and ``tokens`` answer tokens, from which come the time to
first token (the prompt's prefill) and the decode rate (tokens after the first over their time): the mesh
through the tracker's OpenAI API and llama.cpp in this process (:mod:`benchmarks.llama_cpp`: the same prompt
ids, the same total threads as the nodes share, AMX repack off). When the machine's free memory cannot take
llama.cpp's mapping of the file beside the running nodes, the mesh's rounds run first and llama.cpp's after
it is stopped (the notes say which).
"""

from __future__ import annotations

import contextlib
import functools
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from benchmarks.harness import Harness, pick
from benchmarks.plots import Bars, save_figure
from benchmarks.results import Outcome, Row
from benchmarks.stats import ratio, spread
from benchmarks.synthetic_gguf import CACHE, SHAPES, BigShape, write_big_shape
from benchmarks.timing import StreamTiming

PROMPT_TOKENS: Final = 512
"""The prompt every timed stream sends (time to first token is its prefill)."""
RSS_ALLOWANCE_MIB: Final = 400
"""Issue 35's goal: each node's RSS within its share of the file plus this."""
DECODE_GOAL: Final = 0.9
"""Issue 35's goal for the dense shape: the mesh's decode at least this times llama.cpp's."""
MEMORY_MARGIN_BYTES: Final = 2 << 30
"""Free memory kept beyond the file's size before llama.cpp maps it beside a running mesh."""
READY_LINE: Final = re.compile(r"ready in ([0-9.]+) s")
"""A node's log line when its layers are loaded and it serves (:mod:`services.node.runtime`)."""
MIB: Final = 1 << 20
WARM_UP: Final = ({"role": "user", "content": "Tell me a long story about the river."},)
NODE_READY_S: Final = 1200.0
"""Longest a node may take to load its share: a third of the 8B file packed on two shared cores took minutes."""


@dataclass(frozen=True)
class Plan:
    """One part: which shape, on how many nodes, how many rounds of how many tokens."""

    benchmark: str
    shape: str
    nodes: int
    runs: int
    tokens: int
    quick_runs: int = 1
    quick_tokens: int = 8


def node_shares(gguf: Path, ranges: list[tuple[int, int]]) -> list[int]:
    """Bytes of the file each node serves: its layers' tensors, the embedding at the head, the final norm and
    LM head at the tail."""
    from services.node.model.quant.gguf_file import read_index

    tensors, _ = read_index(gguf)
    last = len(ranges) - 1
    shares = []
    for index, (start, end) in enumerate(ranges):
        wanted = {f"blk.{layer}." for layer in range(start, end + 1)}
        total = sum(t.nbytes for name, t in tensors.items()
                    if any(name.startswith(prefix) for prefix in wanted))
        if index == 0:
            total += tensors["token_embd.weight"].nbytes
        if index == last:
            total += tensors["output.weight"].nbytes + tensors["output_norm.weight"].nbytes
        shares.append(total)
    return shares


def process_memory(pid: int) -> dict[str, float]:
    """``VmRSS``, ``RssAnon``, ``RssFile`` and ``VmHWM`` of process ``pid``, MiB (``/proc/<pid>/status``)."""
    fields = ("VmRSS", "RssAnon", "RssFile", "VmHWM")
    found: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/status").read_text(encoding="ascii").splitlines():
        key, _, value = line.partition(":")
        if key in fields:
            found[key] = int(value.split()[0]) / 1024
    return found


def ready_seconds(log: str) -> float | None:
    """The load time a node logged ("ready in X s"), or ``None`` when its log lacks the line."""
    match = READY_LINE.search(log)
    return float(match.group(1)) if match else None


def mem_available() -> int:
    """Bytes the kernel says could be given to a new process without swapping (``MemAvailable``)."""
    for line in Path("/proc/meminfo").read_text(encoding="ascii").splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def measure(harness: Harness, plan: Plan) -> Outcome:
    """One part's mesh and llama.cpp, round by round (module doc)."""
    from benchmarks import llama_cpp
    from benchmarks.client import chat_once, describe_timing, warm_up
    from benchmarks.mesh import MeshSpec, running_mesh, split_layers
    from benchmarks.prompts import messages_of_length, prompt_token_ids
    from benchmarks.rounds import interleave
    from tests.tiny_model import _build_tokenizer

    log = harness.logger(plan.benchmark).info
    shape: BigShape = SHAPES[plan.shape]
    runs = pick(harness.quick, plan.runs, plan.quick_runs)
    tokens = pick(harness.quick, plan.tokens, plan.quick_tokens)
    began = time.perf_counter()
    path = write_big_shape(shape, CACHE, progress=log)
    log(f"{path.name}: {path.stat().st_size / MIB:,.0f} MiB, ready in {time.perf_counter() - began:.0f} s")
    tokenizer = _build_tokenizer()  # the file's tokenizer is it, padded with unreachable tokens
    messages, prompt_length = messages_of_length(tokenizer, PROMPT_TOKENS)
    prompt_ids = prompt_token_ids(tokenizer, messages)
    threads = llama_cpp.default_threads()
    ranges = split_layers(shape.layers, plan.nodes)
    shares = node_shares(path, ranges)
    notes: list[str] = []
    nodes_info: list[dict[str, object]] = []
    timings: dict[str, list[StreamTiming]] = {}
    mesh_label, llama_label = f"{plan.nodes} nodes", f"llama.cpp, {threads} threads"
    have_llama = llama_cpp.available()
    if not have_llama:
        notes.append(f"llama.cpp not measured: {llama_cpp.INSTALL_HINT}")
    llama_loads: list[float] = []

    def llama_stream() -> StreamTiming:
        run = llama_cpp.run_streams(path, prompt_ids, 1, tokens, threads)
        llama_loads.append(run.load_s)
        return StreamTiming(tokens=tokens, first_s=run.first_s, last_s=run.wall_s, prompt_tokens=len(prompt_ids))

    with contextlib.ExitStack() as stack:
        spec = MeshSpec(model=str(path), num_layers=shape.layers, nodes=plan.nodes, ready_timeout_s=NODE_READY_S,
                        node_env={"MESHNET_SPECULATE": "off"})  # drafts of a random model are never accepted
        log(f"starting {spec.describe()} on {path.name}: layers {', '.join(f'{a}-{b}' for a, b in ranges)}")
        up = time.perf_counter()
        mesh = stack.enter_context(running_mesh(spec))
        mesh_up_s = time.perf_counter() - up
        warm_up(mesh.url, mesh.model, WARM_UP)  # short: connections and first calls, not a second prefill
        for index, (node, share) in enumerate(zip(mesh.nodes, shares, strict=True)):
            memory = process_memory(node.proc.pid)
            info = {"layers": f"{ranges[index][0]}-{ranges[index][1]}", "share_mib": round(share / MIB, 1),
                    "load_s": ready_seconds(node.log()), **{k: round(v, 1) for k, v in memory.items()}}
            nodes_info.append(info)
            log(f"node {index} ({info['layers']}): RSS {memory.get('VmRSS', 0):,.0f} MiB (anon "
                f"{memory.get('RssAnon', 0):,.0f}, file {memory.get('RssFile', 0):,.0f}, peak "
                f"{memory.get('VmHWM', 0):,.0f}) for a share of {share / MIB:,.0f} MiB; loaded in {info['load_s']} s")
        contenders: dict[str, Callable[[], StreamTiming]] = {
            mesh_label: functools.partial(chat_once, mesh.url, mesh.model, messages, tokens)}
        beside = have_llama and mem_available() >= path.stat().st_size + MEMORY_MARGIN_BYTES
        if beside:
            contenders[llama_label] = llama_stream
        elif have_llama:
            notes.append("llama.cpp ran after the mesh was stopped (too little free memory to map the file beside it)")
        timings.update(interleave(contenders, runs, log=log, describe=describe_timing))
        for info, node in zip(nodes_info, mesh.nodes, strict=True):  # serving: a 512-token prompt's KV was held
            info["rss_after_rounds_mib"] = round(process_memory(node.proc.pid).get("VmRSS", 0.0), 1)
    if have_llama and not beside:
        timings.update(interleave({llama_label: llama_stream}, runs, log=log, describe=describe_timing))
    if timings[mesh_label] and timings[mesh_label][0].prompt_tokens not in (None, prompt_length):
        notes.append(f"the mesh counted {timings[mesh_label][0].prompt_tokens} prompt tokens, llama.cpp "
                     f"{prompt_length}")
    return _outcome(plan, shape, path, mesh_label, llama_label, timings, nodes_info, mesh_up_s, llama_loads,
                    prompt_length, tokens, threads, tuple(notes))


def _outcome(plan: Plan, shape: BigShape, path: Path, mesh_label: str, llama_label: str,
             timings: dict[str, list[StreamTiming]], nodes_info: list[dict[str, object]], mesh_up_s: float,
             llama_loads: list[float], prompt_tokens: int, tokens: int, threads: int,
             notes: tuple[str, ...]) -> Outcome:
    what = f"{shape.name} Q4_K_M ({path.stat().st_size / 1e9:.1f} GB)"
    decode = {name: spread([t.tokens_per_s for t in runs]) for name, runs in timings.items()}
    ttft = {name: spread([t.ttft_s * 1000 for t in runs]) for name, runs in timings.items()}
    rows: list[Row] = []
    for name in timings:
        rows.append(Row(label=f"{what}, {name}: decode after a {prompt_tokens}-token prompt", value=decode[name],
                        unit="tok/s"))
    if llama_label in timings:
        goal = DECODE_GOAL if not shape.moe else None
        met = decode[mesh_label].median >= DECODE_GOAL * decode[llama_label].median
        rows.append(Row(label=f"{what}, {mesh_label} / llama.cpp: decode",
                        value=ratio(decode[mesh_label], decode[llama_label].median), unit="x",
                        note=(f"issue 35 goal ≥ {goal}: {'met' if met else 'NOT met'}" if goal else "")))
    for name in timings:
        rows.append(Row(label=f"{what}, {name}: time to first token, {prompt_tokens}-token prompt",
                        value=ttft[name], unit="ms"))
    if llama_label in timings:
        rows.append(Row(label=f"{what}, llama.cpp / {mesh_label}: time to first token",
                        value=ratio(ttft[llama_label], ttft[mesh_label].median), unit="x"))
    for index, info in enumerate(nodes_info):
        share = float(info["share_mib"])  # type: ignore[arg-type]
        rss = float(info.get("VmRSS", 0.0))  # type: ignore[arg-type]
        after = info.get("rss_after_rounds_mib")
        worst = max(rss, float(after)) if after is not None else rss  # type: ignore[arg-type]
        within = worst <= share + RSS_ALLOWANCE_MIB
        rows.append(Row(label=f"{what}, node {index} (layers {info['layers']}): RSS after warm-up",
                        value=spread([rss]), unit="MiB",
                        note=(f"its share of the file {share:,.0f} MiB + {RSS_ALLOWANCE_MIB}: "
                              f"{'within' if within else 'NOT within'} (issue 35 goal); anon "
                              f"{info.get('RssAnon')}, file {info.get('RssFile')}, peak while loading "
                              f"{info.get('VmHWM')} MiB" + (f"; {after} MiB after the rounds" if after else ""))))
        if info.get("load_s") is not None:
            rows.append(Row(label=f"{what}, node {index}: load time", value=spread([float(info['load_s'])]),  # type: ignore[arg-type]
                            unit="s"))
    rows.append(Row(label=f"{what}, {mesh_label}: mesh up (tracker and nodes, one after another)",
                    value=spread([mesh_up_s]), unit="s"))
    if llama_loads:
        rows.append(Row(label=f"{what}, llama.cpp: model load (mmap, file in the page cache)",
                        value=spread(llama_loads), unit="s"))
    series = {"shape": shape.name, "file": path.name, "file_bytes": path.stat().st_size, "nodes": plan.nodes,
              "threads": threads, "prompt_tokens": prompt_tokens, "tokens": tokens, "nodes_info": nodes_info,
              "decode_tok_s": {n: list(s.samples) for n, s in decode.items()},
              "ttft_ms": {n: list(s.samples) for n, s in ttft.items()},
              "completion_tokens": {n: [t.tokens for t in runs] for n, runs in timings.items()},
              "mesh_up_s": mesh_up_s, "llama_load_s": llama_loads}
    return Outcome(rows=tuple(rows), series=series, notes=notes)


def plot(title: str, outcome: Outcome, path: Path, caption: str) -> Path:
    decode = {name: spread(samples) for name, samples in outcome.series["decode_tok_s"].items()}
    ttft = {name: spread(samples) for name, samples in outcome.series["ttft_ms"].items()}
    memory = [(f"node {i}", spread([float(info.get("VmRSS", 0.0))]))
              for i, info in enumerate(outcome.series["nodes_info"])]
    shares = {f"node {i} share + {RSS_ALLOWANCE_MIB}": float(info["share_mib"]) + RSS_ALLOWANCE_MIB
              for i, info in enumerate(outcome.series["nodes_info"])}
    return save_figure(path, title, [
        Bars(title="decode tok/s", ylabel="tok/s", bars=list(decode.items())),
        Bars(title=f"time to first token, {outcome.series['prompt_tokens']}-token prompt", ylabel="ms",
             bars=list(ttft.items())),
        Bars(title="RSS a node (MiB)", ylabel="MiB", bars=memory,
             references=dict(list(shares.items())[:1]) if len(set(shares.values())) == 1 else {}),
    ], caption)

