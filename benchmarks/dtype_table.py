"""Which number format decodes fastest, per CPU class and per batch size: the table behind ``--dtype auto``.

    .venv/bin/python -m benchmarks.dtype_table                 # every class this machine can stand for
    .venv/bin/python -m benchmarks.dtype_table --rounds 5 --classes x86-avx2

writes ``benchmarks/results/dtype_table.json`` and prints one line per class
and row count. :data:`services.node.model.device.CPU_DTYPE_TABLE` copies its
winners, with the numbers, so that a node decides from what its CPU *is*
instead of timing formats at start (timings taken under load disagreed
between runs, and between the nodes of one machine).

What is timed: one decode step through the 30 decoder layers of the default
model (SmolLM2-135M-Instruct: hidden 576, intermediate 1536, 9 query heads
and 3 key/value heads of 64) for ``rows`` sessions at once, each with
:data:`CONTEXT_TOKENS` tokens already cached, on :data:`THREADS` threads,
with random weights of the model's shapes (speed does not depend on the
values). Two variants, both recorded:

* ``matmuls``: the layer's matrix products as the node's lean decode path
  runs them (:mod:`services.node.model.lean_decode`): fused q/k/v (576 -> 960),
  o (576 -> 576), fused gate/up (576 -> 3072) and down (1536 -> 576);
* ``step``: the whole layer the same way, generalised to ``rows`` sessions:
  RMS norms, rotary embedding, KV-cache append, attention over the cache
  (in float32 over a float32 cache for the half formats, as
  :mod:`services.node.model.chunk_precision` does), SiLU gate and residuals. The
  table is built from this one.

Each format runs its products in its own kernels (for float16 and bfloat16
at one row: torch's vectorised one-row kernels, not oneDNN). A half format
without native matrix kernels on that CPU
(:func:`services.node.model.device.chunk_compute_dtype` says float32) is timed at
more than one row a second way too, with float32 products on weights
converted for the call, as a shard's multi-token chunks run
(:class:`services.node.model.chunk_precision.Float32ChunkLinear`); the faster of the
two counts (``best``), and the choice from the own kernels alone is kept
beside it (``choice_own_kernels_only``).

CPU classes: this machine's own, and the x86 classes below it, emulated in a
child process by capping the instruction sets of oneDNN
(``ONEDNN_MAX_CPU_ISA``), and for the AVX2 class those of ATen's vectorised
kernels (``ATEN_CPU_CAPABILITY``) and MKL (``MKL_ENABLE_INSTRUCTIONS``). torch chooses its half-precision kernels from
oneDNN's effective instruction set (``torch.ops.mkldnn._is_mkldnn_fp16_supported``
and ``..._bf16_supported`` answer for the capped set; each class's answers are
recorded), so the child takes the kernels such a CPU would take. Memory,
caches and cores stay this machine's: the ratios between formats carry over,
the absolute times do not. Arm CPUs cannot be emulated here.

Every workload of a class is timed once per round, in a rotating order, for
:data:`ROUNDS` rounds; formats are compared by their fastest round
(:data:`FIGURE`: the cost on an otherwise idle machine, since load from
elsewhere only adds time), the median is kept beside it. The machine is
shared, so each class waits for quiet first, and is measured again if others
used more than :data:`OTHERS_BUSY_LIMIT` of the cores meanwhile. The whole
measurement is made :data:`PASSES` times; a half format enters the table at
a row count only if it ran a step at least :data:`HALF_MARGIN` times as fast
as float32 in every pass (:func:`decide`), else float32 does. Each class's
``bands`` lists where the choice changes, as the table in
``services/node/model/device.py`` writes it.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

RESULT_PATH: Final = Path(__file__).resolve().parent / "results" / "dtype_table.json"
COMMAND: Final = ".venv/bin/python -m benchmarks.dtype_table"

LAYERS: Final = 30
HIDDEN: Final = 576
INTERMEDIATE: Final = 1536
HEADS: Final = 9
KV_HEADS: Final = 3
HEAD_DIM: Final = 64
RMS_EPS: Final = 1e-5
"""SmolLM2-135M-Instruct's decoder: the default model's shapes."""

ROWS: Final = (1, 2, 4, 8, 16, 32)
"""Sessions per decode step: one stream, and batches up to twice the likely ``--max-batch`` default."""
CONTEXT_TOKENS: Final = 64
"""Tokens already in each session's KV cache: a short chat."""
THREADS: Final = 2
ROUNDS: Final = 15
PASSES: Final = 2
"""Whole passes over the classes: a half format enters the table only where every pass found it faster."""
WARMUP_STEPS: Final = 2
FORMATS: Final = ("float32", "bfloat16", "float16")
HALF_FORMATS: Final = ("bfloat16", "float16")
VARIANTS: Final = ("step", "matmuls")
OWN: Final = "own"
"""Products in the format's own kernels (torch's, or oneDNN's where it has them)."""
CONVERTED: Final = "float32"
"""Products in float32 on weights converted for the call, as
:class:`~services.node.model.chunk_precision.Float32ChunkLinear` computes a shard's chunks."""
CHOICE_VARIANT: Final = "step"
"""The variant the table's choices are made from: the whole layer, as a node runs it."""
QUIET_BUSY: Final = 0.2
"""Before each class, wait until the machine's cores are at most this busy (others' work): a shared
2-core machine under load stalls 2-thread kernels at random and garbles the comparison."""
QUIET_WAIT_S: Final = 1800.0
"""How long to wait for quiet before measuring anyway (the JSON records how busy the machine was)."""
OTHERS_BUSY_LIMIT: Final = 0.1
"""A class measured while others used more than this share of the cores is measured again ..."""
ATTEMPTS: Final = 3
"""... up to this many times; the quietest attempt is kept."""
FIGURE: Final = "min_ms"
"""What formats are compared by: a workload's fastest round, its cost on an otherwise idle machine (load
from elsewhere only ever adds time; the median is kept beside it)."""
HALF_MARGIN: Final = 1.10
"""A half format enters the table at a row count only if it ran a step at least this many times as fast as
float32 there, in every pass: near-ties keep float32, exact and native everywhere."""


@dataclass(frozen=True)
class Emulation:
    """An x86 class and the caps that make this machine take that class's kernels."""

    cpu_class: str
    onednn_isa: str | None
    aten_capability: str | None
    mkl_instructions: str | None
    stands_for: str

    def caps(self) -> dict[str, str | None]:
        """The environment of the child process: oneDNN's, ATen's and MKL's instruction-set caps."""
        return {"ONEDNN_MAX_CPU_ISA": self.onednn_isa, "ATEN_CPU_CAPABILITY": self.aten_capability,
                "MKL_ENABLE_INSTRUCTIONS": self.mkl_instructions}


EMULATIONS: Final = (
    Emulation("x86-avx512fp16-amx", None, None, None,
              "Intel Sapphire/Emerald/Granite Rapids: AVX512-FP16 and AMX-BF16"),
    Emulation("x86-avx512fp16", "AVX512_CORE_FP16", None, None, "AVX512-FP16 and AVX512-BF16, no AMX"),
    Emulation("x86-avx512bf16", "AVX512_CORE_BF16", None, None,
              "AMD Zen 4/5 (EPYC 9004/9005), Intel Cooper Lake: AVX512-BF16, no AVX512-FP16, no AMX"),
    Emulation("x86-avx512", "AVX512_CORE", None, None,
              "Intel Skylake-SP to Ice Lake: AVX-512 without BF16 or FP16 instructions"),
    Emulation("x86-avx2", "AVX2", "avx2", "AVX2",
              "AVX2/FMA/F16C without AVX-512: Haswell and later desktops, AMD Zen 1-3"),
)
"""Most capable first; a machine measures its own class and every class after it."""


# ---------------------------------------------------------------- worker (runs in a child process)


def _worker(cpu_class: str, rounds: int, threads: int, rows_list: tuple[int, ...]) -> dict[str, Any]:
    import torch  # imported here: the parent sets the instruction-set caps before the child loads torch
    import torch.nn.functional as F

    from services.node.model.device import chunk_compute_dtype

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + RMS_EPS)
        return weight * h.to(x.dtype)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def layer_weights(dtype: torch.dtype) -> dict[str, torch.Tensor]:
        def matrix(out: int, inp: int) -> torch.Tensor:
            return (torch.randn(out, inp) * 0.02).to(dtype)
        return {
            "qkv": matrix((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
            "o": matrix(HIDDEN, HEADS * HEAD_DIM),
            "gate_up": matrix(2 * INTERMEDIATE, HIDDEN),
            "down": matrix(HIDDEN, INTERMEDIATE),
            "in_norm": torch.ones(HIDDEN, dtype=dtype),
            "post_norm": torch.ones(HIDDEN, dtype=dtype),
        }

    def converted(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), w.float()).to(x.dtype)

    linears: dict[str, Callable[..., torch.Tensor]] = {OWN: F.linear, CONVERTED: converted}
    workloads: list[tuple[str, Callable[[], object]]] = []
    native: dict[str, bool] = {}
    for name, dtype in dtypes.items():
        layers = [layer_weights(dtype) for _ in range(LAYERS)]
        native[name] = chunk_compute_dtype(dtype, cpu) == dtype
        for rows in rows_list:
            # float32 caches for every format: half-precision CPU shards keep their KV cache in float32
            caches = [(torch.randn(rows, KV_HEADS, CONTEXT_TOKENS, HEAD_DIM),
                       torch.randn(rows, KV_HEADS, CONTEXT_TOKENS, HEAD_DIM)) for _ in layers]
            x0 = torch.randn(rows, 1, HIDDEN).to(dtype)
            cos = torch.randn(1, 1, 1, HEAD_DIM).to(dtype)
            sin = torch.randn(1, 1, 1, HEAD_DIM).to(dtype)
            inputs = {key: torch.randn(rows, 1, width).to(dtype) for key, width in
                      (("qkv", HIDDEN), ("o", HEADS * HEAD_DIM), ("gate_up", HIDDEN), ("down", INTERMEDIATE))}

            def step(linear: Callable[..., torch.Tensor], layers: list[dict[str, torch.Tensor]] = layers,
                     caches: list[Any] = caches, x0: torch.Tensor = x0, cos: torch.Tensor = cos,
                     sin: torch.Tensor = sin, rows: int = rows) -> torch.Tensor:
                x = x0
                for w, (keys, values) in zip(layers, caches, strict=True):
                    qkv = linear(rms(x, w["in_norm"]), w["qkv"])
                    q, k, v = qkv.view(rows, 1, HEADS + 2 * KV_HEADS, HEAD_DIM).transpose(1, 2).split(
                        [HEADS, KV_HEADS, KV_HEADS], 1)
                    q = q * cos + rotate(q) * sin
                    k = k * cos + rotate(k) * sin
                    keys[:, :, -1:].copy_(k)
                    values[:, :, -1:].copy_(v)
                    attended = F.scaled_dot_product_attention(q.to(keys.dtype), keys, values, enable_gqa=True)
                    x = x + linear(attended.to(x.dtype).transpose(1, 2).reshape(rows, 1, HEADS * HEAD_DIM),
                                   w["o"])
                    gate, up = linear(rms(x, w["post_norm"]), w["gate_up"]).split(
                        [INTERMEDIATE, INTERMEDIATE], -1)
                    x = x + linear(F.silu(gate) * up, w["down"])
                return x

            def matmuls(linear: Callable[..., torch.Tensor], layers: list[dict[str, torch.Tensor]] = layers,
                        inputs: dict[str, torch.Tensor] = inputs) -> None:
                for w in layers:
                    for key, x in inputs.items():
                        linear(x, w[key])

            # a half format without native kernels here: multi-row products also as a shard's chunks run
            paths = (OWN,) if native[name] or rows == 1 else (OWN, CONVERTED)
            for path in paths:
                for variant, run in (("step", step), ("matmuls", matmuls)):
                    workloads.append((f"{variant} {name} {rows} {path}",
                                      functools.partial(run, linears[path])))

    for _, run in workloads:
        for _ in range(WARMUP_STEPS):
            run()
    samples: dict[str, list[float]] = {key: [] for key, _ in workloads}
    for round_index in range(rounds):
        shift = round_index * 7 % len(workloads)  # a rotating order: no workload always follows the same one
        for key, run in workloads[shift:] + workloads[:shift]:
            began = time.perf_counter()
            run()
            samples[key].append(round((time.perf_counter() - began) * 1e3, 3))
        print(f"[{cpu_class}] round {round_index + 1}/{rounds}", file=sys.stderr, flush=True)

    return {
        "cpu_class": cpu_class,
        "torch": torch.__version__,
        "aten_capability": torch.backends.cpu.get_cpu_capability(),
        "onednn_fp16_kernels": bool(torch.ops.mkldnn._is_mkldnn_fp16_supported()),
        "onednn_bf16_kernels": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
        "native_matrix_kernels": native,
        "samples_ms": samples,
    }


# ---------------------------------------------------------------- parent


def _run_class(emulation: Emulation, rounds: int, threads: int, rows: tuple[int, ...]) -> dict[str, Any]:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": str(threads), "OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000"})
    for key, value in emulation.caps().items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    command = [sys.executable, "-m", "benchmarks.dtype_table", "--worker", emulation.cpu_class,
               "--rounds", str(rounds), "--threads", str(threads), "--rows", ",".join(map(str, rows))]
    done = subprocess.run(command, env=env, check=True, stdout=subprocess.PIPE, text=True,
                          cwd=Path(__file__).resolve().parent.parent)
    measured: dict[str, Any] = json.loads(done.stdout)
    measured["emulated"] = emulation.caps()
    measured["stands_for"] = emulation.stands_for
    return measured


def _cpu_jiffies() -> tuple[int, int]:
    """(busy, total) clock ticks of every core since boot, from ``/proc/stat``; (0, 0) where unreadable."""
    try:
        fields = [int(part) for part in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return 0, 0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def _busy_fraction(seconds: float) -> float:
    """How busy the cores are over the next ``seconds`` (this process sleeping meanwhile)."""
    busy0, total0 = _cpu_jiffies()
    time.sleep(seconds)
    busy1, total1 = _cpu_jiffies()
    return (busy1 - busy0) / (total1 - total0) if total1 > total0 else 0.0


def _wait_for_quiet(limit_s: float) -> tuple[float, float]:
    """Wait until others use at most :data:`QUIET_BUSY` of the cores; (busy fraction, seconds waited)."""
    began = time.monotonic()
    busy = _busy_fraction(2.0)
    while busy > QUIET_BUSY and time.monotonic() - began < limit_s:
        print(f"waiting for quiet: cores {busy:.0%} busy", file=sys.stderr, flush=True)
        time.sleep(10.0)
        busy = _busy_fraction(2.0)
    return busy, time.monotonic() - began


def _measure_class(emulation: Emulation, args: argparse.Namespace, rows: tuple[int, ...]) -> dict[str, Any]:
    """One pass over a class: measured again while others kept the cores busy, the quietest attempt kept."""
    attempts = []
    for attempt in range(ATTEMPTS):
        attempts.append(_measure_quietly(emulation, args, rows))
        others = attempts[-1]["others_busy_fraction_during"]
        if others <= OTHERS_BUSY_LIMIT:
            break
        print(f"{emulation.cpu_class}: others used {others:.0%} of the cores during attempt {attempt + 1}",
              file=sys.stderr, flush=True)
    measured = min(attempts, key=lambda attempt: attempt["others_busy_fraction_during"])
    measured["attempts"] = len(attempts)
    return measured


def _measure_quietly(emulation: Emulation, args: argparse.Namespace, rows: tuple[int, ...]) -> dict[str, Any]:
    """One class measured after waiting for quiet, with how busy others kept the cores meanwhile."""
    busy_before, waited_s = _wait_for_quiet(args.quiet_wait_s)
    busy0, total0 = _cpu_jiffies()
    own0 = _children_cpu_s()
    measured = _run_class(emulation, args.rounds, args.threads, rows)
    busy1, total1 = _cpu_jiffies()
    ticks = os.sysconf("SC_CLK_TCK")
    others = max(0.0, (busy1 - busy0) / ticks - (_children_cpu_s() - own0))
    measured["machine_busy_before"] = round(busy_before, 3)
    measured["waited_for_quiet_s"] = round(waited_s, 1)
    measured["others_busy_fraction_during"] = round(others / ((total1 - total0) / ticks), 3) \
        if total1 > total0 else 0.0
    return measured


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _summarise(measured: dict[str, Any], rows_list: tuple[int, ...]) -> None:
    """Add to one pass's ``measured``: figures per workload, per format its faster path, and the speedups.

    ``stats`` is keyed ``"<variant> <format> <rows> <path>"``; ``best`` is keyed
    ``"<variant> <format> <rows>"`` and holds the faster path's figures (a
    shard can take either path: see the module docstring). ``speedup`` is, per
    row count, how many times as fast as float32 each half format's best path
    runs a whole step; ``speedup_own_kernels`` the same from the own kernels alone.
    """
    stats = {key: {"median_ms": round(statistics.median(values), 3), "min_ms": round(min(values), 3)}
             for key, values in measured["samples_ms"].items()}
    best: dict[str, dict[str, Any]] = {}
    for key, figures in stats.items():
        workload, path = key.rsplit(" ", 1)
        if workload not in best or figures[FIGURE] < best[workload][FIGURE]:
            best[workload] = {**figures, "path": path}
    own = {key.rsplit(" ", 1)[0]: figures for key, figures in stats.items() if key.endswith(f" {OWN}")}
    fastest: dict[str, dict[str, Any]] = {}
    for variant in VARIANTS:
        for rows in rows_list:
            def figure(name: str, variant: str = variant, rows: int = rows) -> float:
                return float(best[f"{variant} {name} {rows}"][FIGURE])

            ranked = sorted(FORMATS, key=figure)
            margin = round(figure(ranked[1]) / figure(ranked[0]), 3)
            fastest[f"{variant} {rows}"] = {"format": ranked[0], "next": ranked[1],
                                            "margin_over_next": margin}
    measured.update(stats=stats, best=best, fastest=fastest, speedup=_speedups(best, rows_list),
                    speedup_own_kernels=_speedups(own, rows_list))


def _speedups(figures: dict[str, dict[str, Any]], rows_list: tuple[int, ...]) -> dict[str, dict[str, float]]:
    def cost(name: str, rows: int) -> float:
        return float(figures[f"{CHOICE_VARIANT} {name} {rows}"][FIGURE])

    return {str(rows): {half: round(cost("float32", rows) / cost(half, rows), 3) for half in HALF_FORMATS}
            for rows in rows_list}


def decide(passes: list[dict[str, Any]], rows_list: tuple[int, ...], key: str = "speedup") -> dict[str, str]:
    """The table's format per row count, from every pass's ``key`` speedups.

    A half format's speedup over float32 counts as its *smallest* over the
    passes: it must be reproduced. The half format with the larger such
    speedup is chosen if that is at least :data:`HALF_MARGIN`, else float32.
    """
    choices: dict[str, str] = {}
    for rows in map(str, rows_list):
        worst = {half: min(one[key][rows][half] for one in passes) for half in HALF_FORMATS}
        half = max(HALF_FORMATS, key=lambda name: worst[name])
        choices[rows] = half if worst[half] >= HALF_MARGIN else "float32"
    return choices


def _bands(choices: dict[str, str]) -> list[list[Any]]:
    """Where the choice changes, as ``[from rows, format]`` pairs: the table's rows for this class."""
    bands: list[list[Any]] = []
    for rows, name in choices.items():
        if not bands or bands[-1][1] != name:
            bands.append([int(rows), name])
    return bands


def to_json(result: dict[str, Any]) -> str:
    """``result`` as indented JSON, each innermost list or object on one line (the samples are many)."""
    text = json.dumps(result, indent=1)
    innermost = re.compile(r"[\[{]\n[^\[\]{}]*?\n\s*[\]}]")  # JSON strings hold no raw newlines
    return innermost.sub(lambda match: re.sub(r"\n\s*", " ", match.group(0)).replace("[ ", "[")
                         .replace("{ ", "{").replace(" ]", "]").replace(" }", "}"), text) + "\n"


def _native_class() -> str | None:
    from services.node.model.device import cpu_class  # the rule's own classification of this machine

    return cpu_class().name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--threads", type=int, default=THREADS)
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--classes", default="",
                        help="comma-separated subset of the classes this machine covers")
    parser.add_argument("--output", type=Path, default=RESULT_PATH)
    parser.add_argument("--quiet-wait-s", type=float, default=QUIET_WAIT_S,
                        help="how long to wait for the machine to be quiet before each class (0: don't)")
    parser.add_argument("--passes", type=int, default=PASSES)
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    rows = tuple(int(part) for part in args.rows.split(","))

    if args.worker:
        json.dump(_worker(args.worker, args.rounds, args.threads, rows), sys.stdout)
        return 0

    native = _native_class()
    names = [emulation.cpu_class for emulation in EMULATIONS]
    if native not in names:
        print(f"this machine's class {native!r} cannot be measured by this script", file=sys.stderr)
        return 1
    covered = EMULATIONS[names.index(native):]
    wanted = {part for part in args.classes.split(",") if part}
    chosen = [emulation for emulation in covered if not wanted or emulation.cpu_class in wanted]
    began = time.monotonic()
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    load = os.getloadavg()[0]
    classes: dict[str, Any] = {emulation.cpu_class: {"stands_for": emulation.stands_for,
                                                     "emulated": emulation.caps(), "passes": []}
                               for emulation in chosen}
    for pass_index in range(args.passes):
        for emulation in chosen:
            measured = _measure_class(emulation, args, rows)
            _summarise(measured, rows)
            classes[emulation.cpu_class]["passes"].append(measured)
            print(f"pass {pass_index + 1}: {emulation.cpu_class} (others used "
                  f"{measured['others_busy_fraction_during']:.0%} of the cores meanwhile)", flush=True)
            for count in rows:
                print(f"  rows {count:2d}: " + "  ".join(
                    f"{name} {measured['best'][f'step {name} {count}'][FIGURE]:7.2f}"
                    + ("*" if measured["best"][f"step {name} {count}"]["path"] == CONVERTED else " ")
                    for name in FORMATS) + " ms/step", flush=True)
    print("(* products in float32 on converted weights, the faster path there)")
    for name, measured in classes.items():
        measured["choice"] = decide(measured["passes"], rows)
        measured["choice_own_kernels_only"] = decide(measured["passes"], rows, "speedup_own_kernels")
        measured["bands"] = _bands(measured["choice"])
        bands = ", ".join(f"from {start} rows {dtype}" for start, dtype in measured["bands"])
        print(f"{name:20s} table: {bands}")

    from benchmarks.machine import describe_machine

    result = {
        "benchmark": "dtype_table",
        "command": COMMAND + ("" if argv is None and len(sys.argv) == 1 else " " + " ".join(sys.argv[1:])),
        "started_at": started_at,
        "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "elapsed_s": round(time.monotonic() - began, 1),
        "machine": describe_machine().model_dump(),
        "load_average_1m_at_start": round(load, 2),
        "load_average_1m_at_end": round(os.getloadavg()[0], 2),
        "native_class": native,
        "settings": {"layers": LAYERS, "hidden": HIDDEN, "intermediate": INTERMEDIATE, "heads": HEADS,
                     "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "context_tokens": CONTEXT_TOKENS,
                     "threads": args.threads, "rounds": args.rounds, "rows": list(rows),
                     "compared_by": FIGURE, "choice_variant": CHOICE_VARIANT, "half_margin": HALF_MARGIN,
                     "others_busy_limit": OTHERS_BUSY_LIMIT, "passes": args.passes},
        "classes": classes,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(to_json(result), encoding="utf-8")
    print(f"wrote {args.output} in {result['elapsed_s']} s", file=sys.stderr)
    return 0 if all(math.isfinite(figures["median_ms"]) for measured in classes.values()
                    for one in measured["passes"] for figures in one["stats"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
