"""Where a node's layers run and in which number format (``--device`` and ``--dtype``).

``auto`` device: the first CUDA device torch sees, else the CPU. ``auto``
dtype: on CUDA bfloat16 where the GPU supports it, else float16; on a CPU the
cheapest of float16, bfloat16 and float32 on this very CPU, measured at start
with a short benchmark of one decode-shaped and one prompt-shaped linear layer.
Which one wins depends on the CPU's instruction set (DESIGN.md section 8
measured float16 decode at 21 ms a token against float32 at 55 ms on an AMD
EPYC, whose float16 prompt processing is however ten times slower than
bfloat16's; on a Xeon float32 decoded fastest), so it is measured rather than
guessed. Every choice is logged with its reason.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from typing import Final

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

DTYPES: Final[dict[str, torch.dtype]] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
CPU_CANDIDATES: Final = ("float16", "bfloat16", "float32")
"""Formats the CPU benchmark compares, in order of preference on a tie."""

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
PROMPT_TOKENS_PER_DECODED: Final = 2.0
"""Weight of prompt cost against decode cost: a chat turn (system prompt, history) reads more than it writes."""
BENCH_BUDGET_S: Final = 0.03
"""Time spent timing each measurement after its warm-up (the whole choice takes about half a second)."""
BENCH_MIN_REPEATS: Final = 3
"""Timed runs per measurement at the least, however slow."""
FASTER_BY: Final = 0.9
"""A lower-precision format must cost at most this fraction of float32 to be chosen."""

_CUDA_PATTERN: Final = re.compile(r"cuda(:\d+)?")


class DeviceError(ValueError):
    """The requested device or dtype does not exist here."""


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
        return DTYPES[choice]
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
    return _fastest_cpu_dtype()


def _fastest_cpu_dtype() -> torch.dtype:
    """Time a decode-shaped and a prompt-shaped workload in each format and pick the cheapest overall.

    Decoding one token streams every weight from memory once, so its speed is
    set by bytes per weight and the kernels' handling of a single row; prompt
    processing multiplies many rows by each weight and is bound by arithmetic.
    The two can disagree: on an AMD EPYC here float16 decodes fastest but runs
    prompts about ten times slower than bfloat16. The score is the cost of one
    decoded token plus :data:`PROMPT_TOKENS_PER_DECODED` prompt tokens, per
    weight. One core is measured: on a busy machine multi-threaded kernels
    stall at random, while one core's ranking holds for several.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        weights = torch.full((BENCH_DECODE_BYTES,), BENCH_FILL_BYTE, dtype=torch.uint8)
        costs = {
            name: (_decode_s_per_weight(weights, DTYPES[name]), _prompt_s_per_weight(DTYPES[name]))
            for name in CPU_CANDIDATES
        }
        del weights
    finally:
        torch.set_num_threads(threads)
    scores = {name: decode + PROMPT_TOKENS_PER_DECODED * prompt for name, (decode, prompt) in costs.items()}
    fastest = min(CPU_CANDIDATES, key=lambda name: scores[name])
    if fastest != "float32" and scores[fastest] > scores["float32"] * FASTER_BY:
        fastest = "float32"
    shown = ", ".join(
        f"{name} {decode * 1e12:.0f}+{prompt * 1e12:.0f}" for name, (decode, prompt) in costs.items()
    )
    logger.info(
        "dtype auto: %s, the cheapest on this CPU (one core, ps per weight for a decoded+a prompt token: %s)",
        fastest,
        shown,
    )
    return DTYPES[fastest]


def _decode_s_per_weight(raw: torch.Tensor, dtype: torch.dtype) -> float:
    """Seconds per weight of one token through ``raw`` viewed as ``[k, N, N]`` matrices of ``dtype``."""
    try:
        matrices = raw.view(dtype).view(-1, BENCH_N, BENCH_N)
        x = torch.full((1, 1, BENCH_N), 0.01, dtype=dtype)
        best = _best_time(lambda: [F.linear(x, w) for w in matrices])
    except RuntimeError as exc:  # a CPU build without kernels for this format
        logger.debug("dtype auto: %s linear unsupported here: %s", dtype, exc)
        return float("inf")
    return best / matrices.numel()


def _prompt_s_per_weight(dtype: torch.dtype) -> float:
    """Seconds per weight and token of :data:`BENCH_PROMPT_ROWS` tokens through one square matrix."""
    try:
        x = torch.full((1, BENCH_PROMPT_ROWS, BENCH_PROMPT_N), 0.01, dtype=dtype)
        w = torch.full((BENCH_PROMPT_N, BENCH_PROMPT_N), 0.01, dtype=dtype)
        best = _best_time(lambda: F.linear(x, w))
    except RuntimeError as exc:
        logger.debug("dtype auto: %s linear unsupported here: %s", dtype, exc)
        return float("inf")
    return best / (BENCH_PROMPT_ROWS * w.numel())


def _best_time(work: Callable[[], object]) -> float:
    """Fastest of several timed runs of ``work`` after one warm-up run (the minimum shrugs off interruptions)."""
    work()  # warm-up: first calls pay for kernel selection and page faults
    samples: list[float] = []
    deadline = time.perf_counter() + BENCH_BUDGET_S
    while len(samples) < BENCH_MIN_REPEATS or time.perf_counter() < deadline:
        began = time.perf_counter()
        work()
        samples.append(time.perf_counter() - began)
    return min(samples)
