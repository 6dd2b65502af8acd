"""Interleaved repeats: every contender runs once per round, in a rotating order.

On a shared machine the load changes during a benchmark. Running all of one
contender's repeats, then all of the next one's, would credit that change to
the contenders; interleaving them spreads it over all of them, so a ratio
measured in the same run compares like with like.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeVar

T = TypeVar("T")


def interleave(contenders: Mapping[str, Callable[[], T]], runs: int, *, log: Callable[[str], None],
               describe: Callable[[T], str]) -> dict[str, list[T]]:
    """Call each contender ``runs`` times, round by round; each result is logged as ``describe`` says."""
    if runs < 1:
        raise ValueError(f"runs must be at least 1, got {runs}")
    names = list(contenders)
    results: dict[str, list[T]] = {name: [] for name in names}
    for round_index in range(runs):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            result = contenders[name]()
            results[name].append(result)
            log(f"{name} run {round_index + 1}/{runs}: {describe(result)}")
    return results
