"""The result of one benchmark: rows for the README table, series for the plot, written as JSON.

``benchmarks/results/<name>.json`` holds one :class:`Result`; the README
table is rebuilt from every such file, so running a subset (``--only``) keeps
the other benchmarks' latest rows.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from benchmarks.machine import Machine
from benchmarks.stats import Spread

logger = logging.getLogger(__name__)

BenchmarkName = Literal["decode", "context", "hops", "concurrency", "relay", "control_plane", "wan", "wan_spec",
                        "gguf_8b", "gguf_moe"]
BENCHMARK_ORDER: Final[tuple[BenchmarkName, ...]] = ("decode", "context", "hops", "concurrency", "relay",
                                                     "control_plane", "wan", "wan_spec", "gguf_8b", "gguf_moe")
"""The order benchmarks run in and appear in the README."""
Unit = Literal["tok/s", "ms/token", "x", "ms", "lookups/s", "s", "MiB"]

RESULTS_DIR: Final = Path(__file__).resolve().parent / "results"
_FROZEN: Final = ConfigDict(frozen=True, strict=True, extra="forbid")


class Row(BaseModel):
    """One line of the README table: a measured quantity, its spread, and how to reproduce it."""

    model_config = _FROZEN

    label: str = Field(min_length=1)
    value: Spread
    unit: Unit
    note: str = ""
    """Why the row matters, e.g. a target from an issue and whether it was met."""


class Outcome(BaseModel):
    """What a benchmark module measured; the runner adds the when, where and how."""

    model_config = _FROZEN

    rows: tuple[Row, ...]
    series: dict[str, Any] = Field(default_factory=dict)
    """Everything the plot draws (and more), JSON-ready."""
    notes: tuple[str, ...] = ()


class Result(BaseModel):
    """One benchmark run as written to ``results/<benchmark>.json``."""

    model_config = _FROZEN

    benchmark: BenchmarkName
    title: str
    command: str
    """The command that reproduces every row of this benchmark."""
    quick: bool
    started_at: str
    elapsed_s: float
    machine: Machine
    outcome: Outcome
    other_cores: float | None = None
    """Cores' worth of work other processes did during the run, on average (:mod:`benchmarks.quiet`); ``None``
    in results written before it was measured."""


def result_path(name: BenchmarkName, directory: Path = RESULTS_DIR) -> Path:
    return directory / f"{name}.json"


def plot_path(name: BenchmarkName, directory: Path = RESULTS_DIR) -> Path:
    return directory / f"{name}.png"


def write_result(result: Result, directory: Path = RESULTS_DIR) -> Path:
    """Write ``result`` as indented JSON; the path written."""
    directory.mkdir(parents=True, exist_ok=True)
    path = result_path(result.benchmark, directory)
    path.write_text(result.model_dump_json(indent=2) + "\n", encoding="utf-8")
    return path


def load_result(path: Path) -> Result | None:
    """The result at ``path``; ``None`` when there is none or it cannot be read (logged)."""
    if not path.is_file():
        return None
    try:
        return Result.model_validate_json(path.read_text(encoding="utf-8"))
    except (OSError, ValidationError) as exc:
        logger.warning("skipping %s: %s", path, exc)
        return None


def load_results(directory: Path = RESULTS_DIR) -> list[Result]:
    """Every readable result in ``directory``, in :data:`BENCHMARK_ORDER`; unreadable files are skipped."""
    found = (load_result(result_path(name, directory)) for name in BENCHMARK_ORDER)
    return [result for result in found if result is not None]
