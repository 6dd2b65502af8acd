"""Benchmark ``gguf_8b``: Llama-3.1-8B's whole shape as a Q4_K_M GGUF (4.9 GB) on 3 nodes, beside llama.cpp.

Each node holds a third of the 32 layers; measured: each node's RSS against its share of the file plus 400 MB,
load times, decode tok/s and time to first token of a 512-token prompt, llama.cpp on the same file with the
same total threads (:mod:`benchmarks.big_gguf`). Issue 35's goals: decode ≥ 0.9x llama.cpp's, each node's RSS
within its share + 400 MB.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

from benchmarks import big_gguf
from benchmarks.harness import Harness
from benchmarks.results import Outcome

TITLE: Final = "Llama-3.1-8B shape, Q4_K_M GGUF (4.9 GB), 3 nodes beside llama.cpp"
PLAN: Final = big_gguf.Plan(benchmark="gguf_8b", shape="llama-8b", nodes=3, runs=3, tokens=32)


def run(harness: Harness) -> Outcome:
    return big_gguf.measure(harness, PLAN)


def plot(outcome: Outcome, path: Path, caption: str) -> Path:
    return big_gguf.plot(TITLE, outcome, path, caption)
