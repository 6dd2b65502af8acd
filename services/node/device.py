"""Where a node's layers run and in which number format (``--device`` and ``--dtype``).

``auto`` device: the first CUDA device torch sees, else the CPU. ``auto``
dtype: on CUDA bfloat16 where the GPU supports it, else float16. On a CPU the
formats' speeds depend on the instruction set (DESIGN.md section 8: on an AMD
EPYC float16 decodes 2.6x faster than float32, bfloat16 1.5x; on a Xeon
float32 decoded fastest), so they are measured at start, and a fixed rule
with wide margins turns the measurements into a choice:

* a half format is eligible if it decodes at least
  :data:`DECODE_SPEEDUP_REQUIRED` times as fast as float32 and processes
  prompts at least :data:`PROMPT_SPEED_REQUIRED` times as fast;
* of the eligible, float16 is chosen unless bfloat16 decodes at least
  :data:`PREFERENCE_MARGIN` times as fast as it; with none eligible, float32.

The margins are wide so that noise (a busy machine, another node starting
next to this one) cannot flip the choice between runs or between the nodes of
one machine: a flip would change a mesh's answers. The measurement is
interleaved over several rounds and keeps each format's best time, and the
choice is made once per process. It is logged in one line with its reason.

A half format whose matrix kernels this CPU lacks (float16 without
AVX512-FP16 or AMX-FP16: torch then runs a slow generic GEMM, ten times slower
than bfloat16 on prompts) still decodes fast, because decoding one token
streams each weight once and half the bytes is what counts. Its multi-token
chunks (prompts, replays) are computed in float32 instead
(:func:`chunk_compute_dtype`; the shard converts each weight as it uses it),
and the prompt measurement times exactly that path.
"""

from __future__ import annotations

import functools
import logging
import math
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final, Literal

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

DTypeName = Literal["float32", "bfloat16", "float16"]
WorkloadKind = Literal["decode", "prompt"]
DTYPES: Final[dict[DTypeName, torch.dtype]] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
BASELINE: Final[DTypeName] = "float32"
"""The CPU choice unless a half format is clearly faster: the format the exactness tests pin."""
HALF_CANDIDATES: Final[tuple[DTypeName, ...]] = ("float16", "bfloat16")
"""Half formats in order of preference: float16 first, its 10-bit mantissa keeps answers closer to float32's."""

DECODE_SPEEDUP_REQUIRED: Final = 1.5
"""A half format must decode at least this many times as fast as float32 to be chosen."""
PROMPT_SPEED_REQUIRED: Final = 0.5
"""A half format must process prompts at least this fraction as fast as float32: float16 through
float32 chunks runs at about 0.95x; a format whose native kernels are slow, at 0.1x to 0.25x."""
PREFERENCE_MARGIN: Final = 1.25
"""A half format later in :data:`HALF_CANDIDATES` is preferred to an earlier one only if it decodes
at least this many times as fast: near-ties go to the earlier one."""

BENCH_N: Final = 2048
"""Side of the decode measurement's square weight matrices."""
BENCH_PROMPT_N: Final = 1024
"""Side of the prompt measurement's weight matrix (arithmetic-bound: cache size does not matter)."""
BENCH_DECODE_BYTES: Final = 128 << 20
"""Weights streamed per decode measurement: more than any CPU cache, as a real model's are."""
BENCH_FILL_BYTE: Final = 0x3C
"""Byte pattern of the benchmark weights: a normal number in float16, bfloat16 and float32 alike."""
BENCH_PROMPT_ROWS: Final = 64
"""Tokens of the prompt-shaped measurement."""
BENCH_ROUNDS: Final = 7
"""Rounds of measurement; each times every format once, and each format keeps its best round."""

_CUDA_PATTERN: Final = re.compile(r"cuda(:\d+)?")


class DeviceError(ValueError):
    """The requested device or dtype does not exist here."""


@dataclass(frozen=True)
class FormatCost:
    """What one number format costs on this CPU, in seconds per weight."""

    decode: float
    """One token (a decode step) through one weight; ``inf`` where the format has no kernels."""
    prompt: float
    """One prompt token through one weight, on the path a shard takes for multi-token chunks."""


@dataclass(frozen=True)
class DtypeChoice:
    """The format ``auto`` chose on a CPU, and why, in words for the log."""

    name: DTypeName
    reason: str

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.name]


def pick_device(requested: str) -> torch.device:
    """The device for ``--device`` (``auto``, ``cpu``, ``cuda``, ``cuda:N``); ``auto`` takes the first CUDA device if any."""
    choice = requested.strip().lower()
    if choice == "auto":
        if torch.cuda.is_available():
            device = torch.device("cuda", 0)
            logger.info("device auto: using %s (%s)", device, torch.cuda.get_device_name(device))
        else:
            device = torch.device("cpu")
            logger.info("device auto: no CUDA device visible to torch, using the CPU")
        return device
    if choice == "cpu":
        return torch.device("cpu")
    if _CUDA_PATTERN.fullmatch(choice):
        if not torch.cuda.is_available():
            raise DeviceError(f"device {requested!r} asked for, but torch sees no CUDA device here")
        device = torch.device(choice)
        index = 0 if device.index is None else device.index
        if index >= torch.cuda.device_count():
            raise DeviceError(
                f"device {requested!r} asked for, but only {torch.cuda.device_count()} CUDA devices exist"
            )
        return torch.device("cuda", index)
    raise DeviceError(f"unknown device {requested!r}: use auto, cpu, cuda or cuda:N")


def pick_dtype(requested: str, device: torch.device) -> torch.dtype:
    """The number format for ``--dtype`` (``auto``, ``float32``, ``bfloat16``, ``float16``) on ``device``."""
    choice = requested.strip().lower()
    if choice in DTYPES:
        return DTYPES[choice]  # type: ignore[index]
    if choice != "auto":
        raise DeviceError(f"unknown dtype {requested!r}: use auto, float32, bfloat16 or float16")
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            logger.info("dtype auto: bfloat16 (supported by %s)", device)
            return torch.bfloat16
        logger.info("dtype auto: float16 (%s has no bfloat16)", device)
        return torch.float16
    if device.type != "cpu":
        logger.info("dtype auto: float32 on %s (no measured preference)", device)
        return torch.float32
    decided = _cpu_choice()
    logger.info("dtype auto: %s", decided.reason)
    return decided.dtype


def chunk_compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The format the matrix products of a multi-token chunk run in, for weights stored as ``dtype``.

    ``dtype`` itself, unless it is a half format for which this CPU has no
    native matrix kernels (torch's own test: oneDNN usable for it): then
    float32, which holds half-precision weights exactly and, with the weights
    converted on the fly, runs prompts about as fast as a float32 model. A one-token decode
    step always runs in ``dtype``: it is bound by memory, not arithmetic.
    """
    if device.type != "cpu" or dtype == torch.float32:
        return dtype
    return dtype if _cpu_has_native_kernels(dtype) else torch.float32


def _cpu_has_native_kernels(dtype: torch.dtype) -> bool:
    """Whether torch runs ``dtype`` matrix products on this CPU with oneDNN (hardware or fast emulation)."""
    checks = {
        torch.float16: "_is_mkldnn_fp16_supported",
        torch.bfloat16: "_is_mkldnn_bf16_supported",
    }
    check = getattr(torch.ops.mkldnn, checks[dtype], None) if dtype in checks else None
    if check is None:
        return False
    try:
        return bool(check())
    except RuntimeError:  # a torch built without oneDNN
        return False


def choose_cpu_dtype(costs: Mapping[DTypeName, FormatCost]) -> DtypeChoice:
    """Apply this module's rule to measured ``costs`` (one for every format of :data:`DTYPES`).

    Speeds are compared as ratios, so the rule holds on a fast and a slow CPU
    alike. Every threshold is a wide margin: two formats of similar speed
    never take turns at winning as the measurement wobbles.
    """
    base = costs[BASELINE]
    eligible = [
        name
        for name in HALF_CANDIDATES
        if _speedup(base.decode, costs[name].decode) >= DECODE_SPEEDUP_REQUIRED
        and _speedup(base.prompt, costs[name].prompt) >= PROMPT_SPEED_REQUIRED
    ]
    choice: DTypeName = BASELINE
    for name in eligible:  # in order of preference
        if choice == BASELINE or _speedup(costs[choice].decode, costs[name].decode) >= PREFERENCE_MARGIN:
            choice = name
    measured = ", ".join(
        f"{name} decodes {_speedup(base.decode, costs[name].decode):.2f}x and prompts "
        f"{_speedup(base.prompt, costs[name].prompt):.2f}x as fast"
        for name in HALF_CANDIDATES
    )
    reason = (
        f"{choice} on this CPU; against float32 {measured} (one core, best of {BENCH_ROUNDS} rounds); "
        f"rule: a half format must decode >= {DECODE_SPEEDUP_REQUIRED}x and prompt >= "
        f"{PROMPT_SPEED_REQUIRED}x as fast as float32, and bfloat16 must decode >= {PREFERENCE_MARGIN}x "
        "as fast as float16 to be preferred to it"
    )
    return DtypeChoice(name=choice, reason=reason)


def _speedup(reference_s: float, candidate_s: float) -> float:
    """How many times faster ``candidate_s`` is than ``reference_s``; 0 for a format that cannot run here."""
    if not candidate_s < math.inf:
        return 0.0
    return reference_s / candidate_s


@functools.cache
def _cpu_choice() -> DtypeChoice:
    """The CPU choice of this process, measured once: every shard of a process gets the same format."""
    return choose_cpu_dtype(measure_cpu_costs())


def measure_cpu_costs() -> dict[DTypeName, FormatCost]:
    """Time a decode-shaped and a prompt-shaped workload in each format, on one core.

    Decoding one token streams every weight from memory once, so its speed is
    set by bytes per weight and the kernels' handling of a single row; prompt
    processing multiplies many rows by each weight and is bound by arithmetic.
    The formats are timed in turn, round after round, and each keeps its best
    time: a burst of load from elsewhere slows one round of every format
    rather than every round of one. One core is measured: on a busy machine
    multi-threaded kernels stall at random, while one core's ranking holds for
    several.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        weights = torch.full((BENCH_DECODE_BYTES,), BENCH_FILL_BYTE, dtype=torch.uint8)
        workloads = [
            workload
            for name in DTYPES
            for workload in (_decode_workload(name, weights), _prompt_workload(name))
            if workload is not None
        ]
        best: dict[tuple[DTypeName, WorkloadKind], float] = {}
        for _ in range(BENCH_ROUNDS):
            for workload in workloads:
                seconds = workload.time_once() / workload.products
                key = (workload.name, workload.kind)
                best[key] = min(best.get(key, seconds), seconds)
        del workloads, weights
    finally:
        torch.set_num_threads(threads)
    return {
        name: FormatCost(
            decode=best.get((name, "decode"), math.inf), prompt=best.get((name, "prompt"), math.inf)
        )
        for name in DTYPES
    }


@dataclass(frozen=True)
class _Workload:
    """One timed piece of work in one format, and the weight-by-token products it performs."""

    name: DTypeName
    kind: WorkloadKind
    run: Callable[[], object]
    products: int

    def time_once(self) -> float:
        began = time.perf_counter()
        self.run()
        return time.perf_counter() - began


def _decode_workload(name: DTypeName, raw: torch.Tensor) -> _Workload | None:
    """One token through ``raw`` viewed as ``[k, N, N]`` matrices of the format."""
    dtype = DTYPES[name]
    matrices = raw.view(dtype).view(-1, BENCH_N, BENCH_N)
    x = torch.full((1, 1, BENCH_N), 0.01, dtype=dtype)
    return _warmed(_Workload(name, "decode", lambda: [F.linear(x, w) for w in matrices], matrices.numel()))


def _prompt_workload(name: DTypeName) -> _Workload | None:
    """:data:`BENCH_PROMPT_ROWS` tokens through one square matrix, the way a shard runs a chunk."""
    dtype = DTYPES[name]
    x = torch.full((1, BENCH_PROMPT_ROWS, BENCH_PROMPT_N), 0.01, dtype=dtype)
    w = torch.full((BENCH_PROMPT_N, BENCH_PROMPT_N), 0.01, dtype=dtype)
    compute = chunk_compute_dtype(dtype, torch.device("cpu"))
    products = BENCH_PROMPT_ROWS * w.numel()
    if compute == dtype:
        return _warmed(_Workload(name, "prompt", lambda: F.linear(x, w), products))
    return _warmed(
        _Workload(name, "prompt", lambda: F.linear(x.to(compute), w.to(compute)).to(dtype), products)
    )


def _warmed(workload: _Workload) -> _Workload | None:
    """``workload`` after one untimed run (kernel selection, page faults), or ``None`` if it cannot run here."""
    try:
        workload.run()
    except RuntimeError as exc:  # a CPU build without kernels for this format
        logger.debug("dtype auto: %s %s unsupported here: %s", workload.name, workload.kind, exc)
        return None
    return workload
