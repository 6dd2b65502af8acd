"""Whether a benchmark ran on a quiet machine, and keeping a loaded run from silently replacing a quiet one.

Timings taken while other work shares the cores are worth less than quiet
ones, yet they still say something (ratios measured in one interleaved run
hold up better than absolute figures). A run whose 1-minute load average
went above :data:`QUIET_LOAD_MAX` at its start or end is *loaded*: its rows
are marked as such in the README table, and it never overwrites a quiet
result of the same benchmark unless asked (``--replace-quiet``); it is kept
beside it as ``<name>.loaded.json`` instead.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Final

from benchmarks.results import Result, load_result, result_path, write_result

logger = logging.getLogger(__name__)

QUIET_LOAD_MAX: Final = 1.0
"""The highest 1-minute load average at which a run still counts as quiet on the machine it ran on."""
LOADED_SUFFIX: Final = ".loaded.json"


def peak_load(load_at_start: float) -> float:
    """The worst of the load average at the start and the 1- and 5-minute averages now (the run's end)."""
    now_1m, now_5m, _ = os.getloadavg()
    return round(max(load_at_start, now_1m, now_5m), 2)


def run_load(result: Result) -> float:
    """The load a result ran under: its peak when recorded, else the load at its start (older results)."""
    return result.peak_load_1m if result.peak_load_1m is not None else result.machine.load_average_1m


def is_quiet(result: Result) -> bool:
    return run_load(result) <= QUIET_LOAD_MAX


def loaded_note(result: Result) -> str:
    """What the README says beside a loaded run's rows; empty for a quiet run."""
    return "" if is_quiet(result) else f"loaded machine (load average up to {run_load(result):.1f})"


def save_result(result: Result, directory: Path, *, replace_quiet: bool = False) -> Path:
    """Write ``result`` where the table reads it, unless it is loaded and would replace a quiet result
    of the same benchmark: then it goes beside it (``<name>.loaded.json``) and the quiet one stays, with a
    warning saying so. ``replace_quiet`` writes it over the quiet one anyway."""
    previous = load_result(result_path(result.benchmark, directory))
    if is_quiet(result) or replace_quiet or previous is None or not is_quiet(previous):
        return write_result(result, directory)
    aside = directory / f"{result.benchmark}{LOADED_SUFFIX}"
    aside.write_text(result.model_dump_json(indent=2) + "\n", encoding="utf-8")
    logger.warning("%s ran on a loaded machine (load average up to %.1f): kept the quiet result of %s in the "
                   "table and wrote this one to %s (pass --replace-quiet to replace it)", result.benchmark,
                   run_load(result), previous.started_at, aside)
    return aside
