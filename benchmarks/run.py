"""``make bench``: run the benchmarks, write JSON and PNG results, and rebuild the README table.

Usage::

    python -m benchmarks.run                       # everything (under 15 minutes on 2 cores, then gguf_8b and
                                                   # gguf_moe: about 25 more, writing two 4.9 GB files the first time)
    python -m benchmarks.run --only decode,context # a subset
    python -m benchmarks.run --quick               # fewer runs and shorter lengths, for a check

Each benchmark writes ``benchmarks/results/<name>.json`` and ``<name>.png``;
the table between the markers in ``benchmarks/README.md`` is then rebuilt
from every result present. Progress goes to stderr as it happens, e.g.
``[  61.2s decode] 2 nodes auto run 2/5: 41.2 tok/s``. A benchmark that
fails is reported and the others still run; the exit status is 1 then.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import logging
import os
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Final, cast, get_args

from benchmarks.harness import Harness
from benchmarks.machine import describe_machine
from benchmarks.quiet import QUIET_OTHER_CORES_MAX, OtherWork, save_result
from benchmarks.report import update_readme
from benchmarks.results import (
    BENCHMARK_ORDER,
    RESULTS_DIR,
    BenchmarkName,
    Result,
    load_results,
    plot_path,
)

logger = logging.getLogger("benchmarks.run")

ENTRY: Final = ".venv/bin/python -m benchmarks.run"
BUDGET_S: Final = 15 * 60
"""`make bench` must finish within this on the 2-core development machine; a longer run says so."""
NOISY_LOGGERS: Final = ("httpx", "httpcore", "transformers", "filelock", "urllib3", "matplotlib")


class _Progress(logging.Formatter):
    """``[  12.3s decode] message``: seconds since the run began and the benchmark's name."""

    def __init__(self, began: float) -> None:
        super().__init__()
        self._began = began

    def format(self, record: logging.LogRecord) -> str:
        name = record.name.removeprefix("benchmarks.")
        level = "" if record.levelno == logging.INFO else f"{record.levelname}: "
        return f"[{record.created - self._began:7.1f}s {name}] {level}{record.getMessage()}" + (
            "\n" + self.formatException(record.exc_info) if record.exc_info else "")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=ENTRY, description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--only", type=_names, default=BENCHMARK_ORDER, metavar="NAMES",
                        help=f"comma-separated subset of: {', '.join(BENCHMARK_ORDER)}")
    parser.add_argument("--quick", action="store_true", help="fewer runs and shorter lengths (a smoke check)")
    parser.add_argument("--results", type=Path, default=RESULTS_DIR,
                        help="where JSON and PNG results go (elsewhere than the default: the README is left alone)")
    parser.add_argument("--no-readme", action="store_true", help="do not rebuild the table in benchmarks/README.md")
    parser.add_argument("--replace-quiet", action="store_true",
                        help=f"let a run on a loaded machine (other work above {QUIET_OTHER_CORES_MAX:g} cores on "
                             "average) replace a quiet result; without it the loaded one is kept beside it as <name>.loaded.json")
    return parser.parse_args(argv)


def _names(text: str) -> tuple[BenchmarkName, ...]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in get_args(BenchmarkName)]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown benchmark {', '.join(unknown) or '(none given)'}; "
                                         f"choose from {', '.join(BENCHMARK_ORDER)}")
    return tuple(name for name in BENCHMARK_ORDER if name in names)  # always in the documented order


def command_for(name: BenchmarkName, quick: bool) -> str:
    """The command line that reproduces one benchmark's rows."""
    return f"{ENTRY} --only {name}" + (" --quick" if quick else "")


def _stop_on_sigterm() -> None:
    """Turn SIGTERM (``kill``, ``timeout``) into KeyboardInterrupt, so every mesh's context manager stops its
    processes on the way out instead of leaving a tracker and nodes running with no parent."""

    def interrupt(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    _stop_on_sigterm()
    began = time.time()
    _setup_logging(began)
    machine = describe_machine()
    logger.info("machine: %s; load average %.2f", machine.one_line(), machine.load_average_1m)
    if machine.load_average_1m > machine.logical_cores / 2:
        logger.warning("the machine is already busy (load average %.2f on %d cores): figures will be noisy",
                       machine.load_average_1m, machine.logical_cores)
    failed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="meshnet-bench-") as scratch:
        harness = Harness(quick=args.quick, scratch=Path(scratch))
        for name in cast(tuple[BenchmarkName, ...], args.only):
            if not _run_one(name, harness, args.results, replace_quiet=args.replace_quiet):
                failed.append(name)
    if args.no_readme or args.results.resolve() != RESULTS_DIR:
        logger.info("README left as it is (its table shows %s only)", RESULTS_DIR)
    else:
        update_readme(load_results(args.results))
        logger.info("README table rebuilt from %s", args.results)
    elapsed = time.time() - began
    over = f" (over the {BUDGET_S // 60}-minute budget)" if elapsed > BUDGET_S and not args.quick else ""
    logger.info("total elapsed %.0f s (%.1f min)%s%s", elapsed, elapsed / 60, over,
                f"; failed: {', '.join(failed)}" if failed else "")
    return 1 if failed else 0


def _run_one(name: BenchmarkName, harness: Harness, results: Path, *, replace_quiet: bool = False) -> bool:
    """Run, save and plot one benchmark; False (logged, not raised) when it failed."""
    module: ModuleType = importlib.import_module(f"benchmarks.{name}")
    log = harness.logger(name)
    started = dt.datetime.now(dt.UTC)
    began = time.perf_counter()
    log.info("starting: %s%s", module.TITLE, " (quick)" if harness.quick else "")
    machine = describe_machine()
    others = OtherWork.start()
    try:
        outcome = module.run(harness)
    except Exception:
        log.exception("failed")
        return False
    result = Result(benchmark=name, title=module.TITLE, command=command_for(name, harness.quick),
                    quick=harness.quick, started_at=started.isoformat(timespec="seconds"),
                    elapsed_s=round(time.perf_counter() - began, 1), machine=machine, outcome=outcome,
                    other_cores=others.cores())
    path = save_result(result, results, replace_quiet=replace_quiet)
    png = module.plot(outcome, plot_path(name, results), caption=f"{machine.one_line()}; {result.command}")
    for row in outcome.rows:
        log.info("%s: %s %s%s", row.label, row.value.short(2 if row.unit == "x" else 1), row.unit,
                 f"  [{row.note}]" if row.note else "")
    log.info("done in %.0f s: %s, %s", result.elapsed_s, path, png)
    return True


def _setup_logging(began: float) -> None:
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # progress is ours to report, one line per step
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Progress(began))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


if __name__ == "__main__":
    sys.exit(main())
