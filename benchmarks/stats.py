"""Spread of a repeated measurement: median, minimum and maximum over the runs.

Every figure the benchmarks publish is a :class:`Spread`, never a single
sample: one run on a shared two-core machine says little, the median of
several with their range says how much to trust it.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

from pydantic import BaseModel, ConfigDict, Field


class Spread(BaseModel):
    """Median and range of ``n`` samples of one quantity (the samples are kept for the JSON)."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    median: float
    min: float
    max: float
    n: int = Field(ge=1)
    samples: tuple[float, ...]

    def map(self, fn: Callable[[float], float]) -> Spread:
        """The spread of ``fn`` applied to every sample (``fn`` monotonic keeps min/max meaningful)."""
        return spread([fn(sample) for sample in self.samples])

    def short(self, digits: int = 1) -> str:
        """``"41.2 (39.8–42.0, n=3)"``: the median, then the range and the number of runs."""
        return f"{self.median:.{digits}f} ({self.min:.{digits}f}–{self.max:.{digits}f}, n={self.n})"


def spread(samples: Sequence[float]) -> Spread:
    """The :class:`Spread` of ``samples``; refuses an empty sequence (a figure needs a measurement)."""
    if not samples:
        raise ValueError("a spread needs at least one sample")
    values = tuple(float(sample) for sample in samples)
    return Spread(median=statistics.median(values), min=min(values), max=max(values), n=len(values),
                  samples=values)


def ratio(numerators: Spread, denominator: float) -> Spread:
    """Each sample of ``numerators`` divided by ``denominator`` (e.g. runs of the mesh over a baseline median)."""
    if denominator <= 0:
        raise ValueError(f"cannot divide by a non-positive baseline {denominator}")
    return numerators.map(lambda value: value / denominator)
