"""Whether a benchmark ran on a quiet machine, and keeping a loaded run from silently replacing a quiet one.

Timings taken while other work shares the cores are worth less than quiet
ones, yet they still say something (ratios measured in one interleaved run
hold up better than absolute figures). The load average cannot tell: on a
2-core machine a benchmark's own meshes raise it past 2, and the next
benchmark starts under the last one's. So a run measures what *other* work
used: the cores busy machine-wide (``/proc/stat``) minus the CPU time of
this process and the children it reaped (its meshes, stopped by the end),
averaged over the run. Above :data:`QUIET_OTHER_CORES_MAX` the run is
*loaded*: its rows are marked as such in the README table, and it never
overwrites a quiet result of the same benchmark unless asked
(``--replace-quiet``); it is kept beside it as ``<name>.loaded.json``.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from benchmarks.results import Result, load_result, result_path, write_result

logger = logging.getLogger(__name__)

QUIET_OTHER_CORES_MAX: Final = 0.25
"""Most cores' worth of other work, averaged over a run, at which it still counts as quiet."""
QUIET_LOAD_MAX: Final = 1.0
"""For results written before other work was measured: the highest load average at their start."""
LOADED_SUFFIX: Final = ".loaded.json"
PROC_STAT: Final = Path("/proc/stat")
IDLE_FIELDS: Final = (3, 4)
"""``idle`` and ``iowait`` among the ``cpu`` line's fields: every other field is time a core was busy."""


def _busy_seconds() -> float | None:
    """Seconds every core was busy since boot, machine-wide; ``None`` where ``/proc/stat`` is not there."""
    try:
        fields = PROC_STAT.read_text(encoding="ascii").splitlines()[0].split()[1:]
    except (OSError, IndexError):
        return None
    ticks = sum(int(value) for index, value in enumerate(fields[:8]) if index not in IDLE_FIELDS)
    return ticks / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    """CPU seconds of this process and of the children it has reaped."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


@dataclass
class OtherWork:
    """Measures, over one run, the cores' worth of work done by processes outside it."""

    began: float
    busy: float | None
    own: float

    @classmethod
    def start(cls) -> OtherWork:
        return cls(began=time.monotonic(), busy=_busy_seconds(), own=_own_seconds())

    def cores(self) -> float | None:
        """Average cores other processes kept busy since :meth:`start`; ``None`` where it cannot be told."""
        busy = _busy_seconds()
        if busy is None or self.busy is None:
            return None
        return other_cores(busy - self.busy, _own_seconds() - self.own, time.monotonic() - self.began)


def other_cores(busy_s: float, own_s: float, elapsed_s: float) -> float | None:
    """Cores' worth of other work: the machine's busy core-seconds less this run's own, over the run's time."""
    if elapsed_s <= 0:
        return None
    return round(max(busy_s - own_s, 0.0) / elapsed_s, 2)


def is_quiet(result: Result) -> bool:
    if result.other_cores is not None:
        return result.other_cores <= QUIET_OTHER_CORES_MAX
    return result.machine.load_average_1m <= QUIET_LOAD_MAX


def loaded_note(result: Result) -> str:
    """What the README says beside a loaded run's rows; empty for a quiet run."""
    if is_quiet(result):
        return ""
    if result.other_cores is not None:
        return f"loaded machine (other work used {result.other_cores:.1f} cores on average)"
    return f"loaded machine (load average {result.machine.load_average_1m:.1f} at start)"


def describe_load(result: Result) -> str:
    """The run's load for the README's list of runs."""
    if result.other_cores is not None:
        return f"other work {result.other_cores:.2f} cores"
    return f"load average {result.machine.load_average_1m:.2f} at start"


def save_result(result: Result, directory: Path, *, replace_quiet: bool = False) -> Path:
    """Write ``result`` where the table reads it, unless it is loaded and would replace a quiet result
    of the same benchmark: then it goes beside it (``<name>.loaded.json``) and the quiet one stays, with a
    warning saying so. ``replace_quiet`` writes it over the quiet one anyway."""
    previous = load_result(result_path(result.benchmark, directory))
    if is_quiet(result) or replace_quiet or previous is None or not is_quiet(previous):
        return write_result(result, directory)
    aside = directory / f"{result.benchmark}{LOADED_SUFFIX}"
    aside.write_text(result.model_dump_json(indent=2) + "\n", encoding="utf-8")
    logger.warning("%s ran on a loaded machine (%s): kept the quiet result of %s in the table and wrote this "
                   "one to %s (pass --replace-quiet to replace it)", result.benchmark, describe_load(result),
                   previous.started_at, aside)
    return aside
