"""Where a node's layers run and in which number format (``--device`` and ``--dtype``).

``auto`` device: the first CUDA device torch sees, else the CPU.

``auto`` dtype is decided from what the hardware *is*, never from timings
taken at start: timings taken while the machine was busy made two nodes of
one machine, or two runs of one test, choose differently, and a flip changes
a mesh's answers. The rule is a pure function of its inputs, so the same
machine always gets the same format:

* CUDA: from the device's compute capability (:func:`choose_cuda_dtype`):
  bfloat16 from capability 8.0 (Ampere) on, else float16.
* CPU: from the CPU's features (the ``flags`` / ``Features`` line of
  ``/proc/cpuinfo``, capped by the kernels torch itself runs,
  :func:`torch.backends.cpu.get_cpu_capability`) a :class:`CpuClass`, then
  from :data:`CPU_DTYPE_TABLE` the format measured fastest for that class at
  the number of rows a decode step carries (:func:`choose_cpu_dtype`). The
  row count matters: on an Intel Xeon with AMX float16 decodes one session
  fastest (1.2x float32), while bfloat16 is fastest from four rows on (1.3x
  to 1.6x float32, AMX kernels); on CPUs without native half-precision
  matrix kernels float16 wins one row and float32 wins batches. The table's
  numbers come from ``benchmarks/dtype_table.py`` (results in
  ``benchmarks/results/dtype_table.json``): this machine's class measured
  natively, the lesser x86 classes by capping torch's kernels to theirs.
  Classes that could not be measured (Arm, x86 without AVX2) get float32,
  the format every CPU runs with native kernels and the one the exactness
  tests pin.

The choice is logged in one line with its reason.

A half format whose matrix kernels this CPU lacks (float16 without
AVX512-FP16 or AMX-FP16: torch then runs a generic GEMM, slow for many rows)
still decodes one row fast, through torch's vectorised one-row kernel:
decoding one token streams each weight once and half the bytes is what
counts. Its prompts and replays are computed in float32 instead
(:func:`chunk_compute_dtype`; the shard converts each weight as it uses it).
The table's measurements time such a format's batched steps both ways, its
own kernels and float32 products, and count the faster; the choices come out
the same either way.
"""

from __future__ import annotations

import functools
import logging
import platform
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Final, Literal

import torch

logger = logging.getLogger(__name__)

DTypeName = Literal["float32", "bfloat16", "float16"]
DTYPES: Final[dict[DTypeName, torch.dtype]] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
BASELINE: Final[DTypeName] = "float32"
"""The CPU choice where nothing was measured: native everywhere, and the format the exactness tests pin."""

CUDA_BFLOAT16_CAPABILITY: Final = (8, 0)
"""From this CUDA compute capability on (Ampere and later), ``auto`` takes bfloat16; below it, float16."""

CPUINFO: Final = Path("/proc/cpuinfo")
BENCHMARK: Final = "benchmarks/dtype_table.py"
"""Where the table's numbers come from; rerun it on a CPU of an unmeasured class to add a row."""

_CUDA_PATTERN: Final = re.compile(r"cuda(:\d+)?")

CpuClassName = Literal[
    "x86-avx512fp16-amx",
    "x86-avx512fp16",
    "x86-avx512bf16",
    "x86-avx512",
    "x86-avx2",
    "x86",
    "arm-bf16",
    "arm-fp16",
    "arm",
    "other",
]

X86_MACHINES: Final = frozenset({"x86_64", "amd64", "i386", "i686", "x86"})
ARM_MACHINES: Final = frozenset({"aarch64", "arm64", "armv8l", "armv8b"})
AVX512_CORE: Final = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})
"""oneDNN's ``avx512_core`` and torch's ``AVX512`` kernels need all four."""
AVX2_CORE: Final = frozenset({"avx2", "fma", "f16c"})
"""torch's ``AVX2`` kernels, with F16C for its half-precision conversions."""
AMX_BF16: Final = frozenset({"amx_bf16", "amx_tile"})


class DeviceError(ValueError):
    """The requested device or dtype does not exist here."""


@dataclass(frozen=True)
class DtypeChoice:
    """The format ``auto`` chose, and why, in words for the log."""

    name: DTypeName
    reason: str

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.name]


@dataclass(frozen=True)
class CpuClass:
    """A kind of CPU, as far as the speed of the number formats goes, and the features that make it one."""

    name: CpuClassName
    features: tuple[str, ...]
    """The features that put it in the class (for the log)."""


@dataclass(frozen=True)
class RowBand:
    """From ``min_rows`` rows a decode step on (up to the next band's), ``dtype`` is the class's choice."""

    min_rows: int
    dtype: DTypeName
    evidence: str
    """The measurement (ms per 30-layer step of SmolLM2-135M, 2 threads) or the reasoning behind it."""


def _band(min_rows: int, dtype: DTypeName, evidence: str) -> RowBand:
    return RowBand(min_rows=min_rows, dtype=dtype, evidence=evidence)


_MEASURED: Final = "measured on an Intel Xeon of this class (AMX-BF16, AVX512-FP16)"
_EMULATED: Final = "measured on that Xeon with torch's kernels capped to this class"
_UNMEASURED: Final = ("not measured (no such CPU, and no way to emulate one, here): float32, which every CPU "
                      "runs with native kernels, and which the exactness tests pin")

# The measurements behind the table: `.venv/bin/python -m benchmarks.dtype_table` (results in
# benchmarks/results/dtype_table.json), torch 2.13 CPU, 2 threads. One decode step through the 30
# decoder layers of SmolLM2-135M (hidden 576, intermediate 1536, 9/3 heads) for `rows` sessions of 64
# cached tokens, as the lean decode path runs it (fused q/k/v and gate/up products, float32 attention
# over a float32 cache for the half formats). Milliseconds a step, fastest of 15 rounds, in each of
# two passes; * = a half format's products in float32 on converted weights, its faster path there.
# A half format is in the table at a row count only if it ran at least 1.1x as fast as float32 in
# both passes (benchmarks.dtype_table.HALF_MARGIN); near-ties keep float32.
#
# x86-avx512fp16-amx: this machine
#   rows  float32        bfloat16        float16
#      1  34.8/36.4       38.5/52.7       29.3/28.1
#      2  38.0/38.4       36.9/42.1       49.8/63.8
#      4  51.3/63.4       39.0/41.7       49.4/66.3
#      8  63.4/74.3       45.5/45.8       56.4/75.8
#     16  87.3/100.9      51.2/62.4       84.1/80.4
#     32  121.7/129.3     61.5/80.3       105.8/119.8
# x86-avx512fp16: emulated, ONEDNN_MAX_CPU_ISA=AVX512_CORE_FP16
#      1  41.3/36.8       52.7/51.7       35.5/38.3
#      2  42.3/42.1       51.7/47.9       63.4/66.9
#      4  60.8/65.8       55.8/58.7       57.0/75.7
#      8  75.4/74.7       73.3/80.1       69.1/84.5
#     16  105.2/110.1     94.1/94.9       86.8/95.9
#     32  135.2/139.1     142.4/147.2     119.2/119.5
# x86-avx512bf16: emulated, ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16
#      1  40.9/38.1       38.2/43.9       28.9/32.0
#      2  44.0/40.0       45.8/50.9       44.4/43.3
#      4  57.8/59.3       47.3/52.4       68.9/74.7
#      8  75.6/76.2       60.6/72.4       78.0*/98.3*
#     16  100.5/103.5     87.1/100.7      115.2*/132.2*
#     32  129.6/136.0     143.2/141.0     164.0*/165.9*
# x86-avx512: emulated, ONEDNN_MAX_CPU_ISA=AVX512_CORE
#      1  33.4/39.1       29.5/33.9       26.3/32.0
#      2  33.2/38.6       46.9/65.1       34.0/42.0
#      4  51.7/64.8       73.9/88.7       60.5/73.3
#      8  63.3/77.4       89.5/118.8      91.4*/113.0*
#     16  94.2/99.2       139.3/157.6     119.1*/144.4*
#     32  109.4/133.6     213.6/253.3     135.3*/159.5*
# x86-avx2: emulated, ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2
#      1  28.5/34.7       24.6/32.3       25.2/29.3
#      2  43.3/57.5       36.1/40.2       35.1/45.4
#      4  48.0/62.4       56.9/70.9       54.8/72.8
#      8  59.8/78.5       78.7*/101.8*    75.6*/97.4*
#     16  75.6/97.7       102.3*/129.6*   95.6*/118.7*
#     32  121.3/153.8     124.5*/181.8*   126.1*/164.1*
#
# How to read them. One row: every x86 class runs the same kernels (torch's own vectorised one-row
# kernels for float16 and bfloat16, MKL's for float32), and reading half the bytes wins; on the
# AMD EPYC of DESIGN.md section 8 (class x86-avx512bf16) the whole model decoded in float16 at 2.6x
# float32's speed, more than the 1.1-1.4x here, where float32 steps also get the lean path and the
# memory is fast. The emulated x86-avx512fp16 class ran those same kernels and its second pass found
# float16 at only 0.96x: the spread between processes, which the both-passes rule turns into float32.
# Several rows: only oneDNN's AMX bfloat16 kernels keep their cost nearly flat (8 rows cost 1.2x one
# row); without AMX, bfloat16 leads float32 by 1.25x at most, reproducibly only at 4 rows; float16
# without AVX512-FP16 and bfloat16 without AVX512-BF16 lose to float32 from 2 or 4 rows, their
# products being converted or generic.
# Emulation caps the kernels, not the machine: memory, caches and cores stay this Xeon's.

CPU_DTYPE_TABLE: Final[Mapping[CpuClassName, tuple[RowBand, ...]]] = MappingProxyType({
    "x86-avx512fp16-amx": (
        _band(1, "float16", f"{_MEASURED}: one row 1.19x float32's speed (29.3 against 34.8 ms a step)"),
        _band(2, "float32", f"{_MEASURED}: two rows, bfloat16 only 0.91-1.03x float32's speed, "
                            "float16 0.60-0.76x"),
        _band(4, "bfloat16", f"{_MEASURED}: 4 to 32 rows 1.32x to 1.62x float32's speed, AMX kernels "
                             "(16 rows: 51.2 against 87.3 ms a step; float16 84.1)"),
    ),
    "x86-avx512fp16": (
        _band(1, "float32", f"{_EMULATED}: 1 to 8 rows, no half format 1.1x faster than float32 in both "
                            "passes (one row: float16 1.16x, then 0.96x)"),
        _band(16, "float16", f"{_EMULATED}: 16 and 32 rows, float16 1.13x to 1.21x float32's speed"),
    ),
    "x86-avx512bf16": (
        _band(1, "float16", f"{_EMULATED}: one row 1.19x float32's speed (AMD EPYC, DESIGN.md section 8: "
                            "whole model 2.6x)"),
        _band(2, "float32", f"{_EMULATED}: two rows, float16 0.92-0.99x float32's speed, "
                            "bfloat16 0.79-0.96x"),
        _band(4, "bfloat16", f"{_EMULATED}: four rows 1.13x-1.22x float32's speed"),
        _band(8, "float32", f"{_EMULATED}: 8 to 32 rows, bfloat16 0.91x to 1.25x float32's speed, "
                            "not 1.1x in both passes; float16 0.78x to 0.97x"),
    ),
    "x86-avx512": (
        _band(1, "float16", f"{_EMULATED}: one row 1.22x float32's speed"),
        _band(2, "float32", f"{_EMULATED}: 2 to 32 rows, float16 0.69x to 0.98x float32's speed, "
                            "bfloat16 0.51x to 0.73x (no native half kernels)"),
    ),
    "x86-avx2": (
        _band(1, "float16", f"{_EMULATED}: one and two rows 1.13x to 1.27x float32's speed"),
        _band(4, "float32", f"{_EMULATED}: 4 to 32 rows, float16 0.79x to 0.96x float32's speed, "
                            "bfloat16 0.74x to 0.97x (no native half kernels)"),
    ),
    "x86": (_band(1, "float32", f"{_UNMEASURED}; without AVX2 and F16C torch has no fast half path"),),
    "arm-bf16": (_band(1, "float32", _UNMEASURED),),
    "arm-fp16": (_band(1, "float32", _UNMEASURED),),
    "arm": (_band(1, "float32", f"{_UNMEASURED}; without FP16 arithmetic (asimdhp) halves are converted"),),
    "other": (_band(1, "float32", _UNMEASURED),),
})
"""The fastest format per CPU class, by rows per decode step: bands ascending, the first from 1 row.

A band holds from its ``min_rows`` up to the next band's; the last one for
every larger batch (the widest measured was 32 rows). Its ``evidence``
cites the measurement above. Classes that could not be measured (Arm, x86
without AVX2, other architectures) get float32: the choice that is never
slow for want of kernels and never changes an answer. A measurement there
(``benchmarks/dtype_table.py`` covers the machine's own class) replaces it.
"""


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


def pick_dtype(requested: str, device: torch.device, *, rows: int = 1) -> torch.dtype:
    """The number format for ``--dtype`` (``auto``, ``float32``, ``bfloat16``, ``float16``) on ``device``.

    ``rows``: how many rows (sessions) the node's decode steps are expected
    to carry, e.g. its ``--max-batch``; it only matters to ``auto`` on a CPU.
    """
    choice = requested.strip().lower()
    if choice in DTYPES:
        return DTYPES[choice]  # type: ignore[index]
    if choice != "auto":
        raise DeviceError(f"unknown dtype {requested!r}: use auto, float32, bfloat16 or float16")
    decided = auto_dtype(device, rows=rows)
    logger.info("dtype auto: %s", decided.reason)
    return decided.dtype


def auto_dtype(device: torch.device, *, rows: int = 1) -> DtypeChoice:
    """What ``--dtype auto`` means on ``device`` for decode steps of ``rows`` rows, with the reason."""
    if device.type == "cuda":
        index = 0 if device.index is None else device.index
        return choose_cuda_dtype(torch.cuda.get_device_capability(index), torch.cuda.get_device_name(index))
    if device.type == "cpu":
        return choose_cpu_dtype(cpu_class(), rows)
    return DtypeChoice(BASELINE, f"{BASELINE} on {device} (no rule for this kind of device)")


def choose_cuda_dtype(capability: tuple[int, int], name: str = "this GPU") -> DtypeChoice:
    """bfloat16 from compute capability :data:`CUDA_BFLOAT16_CAPABILITY` on, float16 below it.

    From 8.0 (Ampere) on, tensor cores multiply bfloat16 at the same rate as
    float16, and both read half float32's bytes, which is what a decode step
    of a few rows is bound by, so the row count does not separate them; and
    bfloat16 keeps float32's exponent range, so activations that would
    overflow float16 (and turn an answer into NaNs) stay finite. Below 8.0
    there are no bfloat16 tensor-core instructions, so bfloat16 products
    run the slow way (``torch.cuda.is_bf16_supported()`` answers yes there
    all the same, counting emulation), while float16 runs natively (on
    tensor cores from 7.0) and still halves the bytes read. No GPU was at
    hand to measure this; it rests on those documented facts.
    """
    major, minor = capability
    shown = f"compute capability {major}.{minor}"
    threshold = ".".join(map(str, CUDA_BFLOAT16_CAPABILITY))
    if (major, minor) >= CUDA_BFLOAT16_CAPABILITY:
        return DtypeChoice("bfloat16", f"bfloat16 on {name} ({shown} >= {threshold}: bfloat16 tensor cores, "
                                       "as fast as float16 with float32's exponent range)")
    return DtypeChoice("float16", f"float16 on {name} ({shown} < {threshold}: no bfloat16 tensor cores, "
                                  "bfloat16 would be emulated)")


def choose_cpu_dtype(cpu: CpuClass, rows: int = 1) -> DtypeChoice:
    """The format :data:`CPU_DTYPE_TABLE` gives ``cpu`` for decode steps of ``rows`` rows."""
    if rows < 1:
        raise DeviceError(f"rows must be at least 1, not {rows}")
    bands = CPU_DTYPE_TABLE[cpu.name]
    band = next(band for band in reversed(bands) if band.min_rows <= rows)
    features = ", ".join(cpu.features) or "none of note"
    return DtypeChoice(
        band.dtype,
        f"{band.dtype} for decode steps of {rows} row{'s' if rows != 1 else ''} on this CPU "
        f"(class {cpu.name}: {features}); {band.evidence} [{BENCHMARK}]",
    )


@functools.cache
def cpu_class() -> CpuClass:
    """This machine's :class:`CpuClass`, read once: every shard of a process gets the same answer."""
    return classify_cpu(cpu_features(), platform.machine(), torch.backends.cpu.get_cpu_capability())


@functools.cache
def cpu_features() -> frozenset[str]:
    """The CPU's feature flags (``flags`` / ``Features`` of ``/proc/cpuinfo``); none if unreadable."""
    try:
        text = CPUINFO.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return frozenset()
    return parse_cpu_features(text)


def parse_cpu_features(cpuinfo: str) -> frozenset[str]:
    """The features of the first processor listed in ``cpuinfo`` (the text of ``/proc/cpuinfo``)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            return frozenset(value.lower().split())
    return frozenset()


def classify_cpu(features: Iterable[str], machine: str, aten_capability: str) -> CpuClass:
    """The :class:`CpuClass` of a CPU with ``features``, of architecture ``machine`` (``platform.machine()``).

    ``aten_capability`` (:func:`torch.backends.cpu.get_cpu_capability`, e.g.
    ``AVX512``, ``AVX2``, ``DEFAULT``) caps the class at the vectorised
    kernels torch actually runs: a CPU with AVX-512 under a torch limited to
    AVX2 (``ATEN_CPU_CAPABILITY=avx2``) behaves as an AVX2 CPU.
    """
    flags = frozenset(features)
    arch = machine.strip().lower()
    capability = aten_capability.strip().upper()
    if arch in X86_MACHINES:
        if AVX512_CORE <= flags and capability.startswith("AVX512"):
            if {"avx512_fp16", "avx512_bf16"} | AMX_BF16 <= flags:
                return CpuClass("x86-avx512fp16-amx", ("avx512_fp16", "amx_bf16"))
            if {"avx512_fp16", "avx512_bf16"} <= flags:
                return CpuClass("x86-avx512fp16", ("avx512_fp16", "avx512_bf16"))
            if "avx512_bf16" in flags:
                return CpuClass("x86-avx512bf16", ("avx512_bf16", "no avx512_fp16", "no amx"))
            return CpuClass("x86-avx512", ("avx512f", "no avx512_bf16"))
        if AVX2_CORE <= flags and capability.startswith("AVX"):
            return CpuClass("x86-avx2", ("avx2", "f16c", "no avx512"))
        return CpuClass("x86", ("no avx2",))
    if arch in ARM_MACHINES:
        if {"bf16", "asimdhp"} <= flags:
            return CpuClass("arm-bf16", ("bf16", "asimdhp"))
        if "asimdhp" in flags:
            return CpuClass("arm-fp16", ("asimdhp", "no bf16"))
        return CpuClass("arm", ("no asimdhp",))
    return CpuClass("other", (arch or "unknown architecture",))


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
