"""Benchmark ``gguf_moe``: Qwen3-30B-A3B's layer shape (128 experts, 8 routed) in 12 layers, Q4_K_M, on 2 nodes.

Each node holds 6 of the 12 layers (the real model has 48; fewer so the file, about 4.5 GB, fits a shared
machine); measured as :mod:`benchmarks.gguf_8b` is, beside llama.cpp on the same file and threads
(:mod:`benchmarks.big_gguf`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

from benchmarks import big_gguf
from benchmarks.harness import Harness
from benchmarks.results import Outcome

TITLE: Final = "Qwen3-30B-A3B layer shape (MoE, 12 of 48 layers), Q4_K_M GGUF, 2 nodes beside llama.cpp"
PLAN: Final = big_gguf.Plan(benchmark="gguf_moe", shape="qwen3moe-30b-a3b", nodes=2, runs=3, tokens=32)


def run(harness: Harness) -> Outcome:
    return big_gguf.measure(harness, PLAN)


def plot(outcome: Outcome, path: Path, caption: str) -> Path:
    return big_gguf.plot(TITLE, outcome, path, caption)
