"""The start probe's timing of decode rows (services/node/model/memory_budget.py), on a stand-in layer.

A node under a CPU quota (half a core: 50 ms of CPU a 100 ms period) runs a few rows at full
speed before the quota bites, so the probe times rows for at least PROBE_MIN_S together. The
clock here is a fake one that each row advances, so nothing depends on this machine's speed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from services.node.model import memory_budget
from services.node.model.memory_budget import PROBE_CACHE_TOKENS, PROBE_MIN_S, PROBE_TIMED_STEPS


@dataclass
class FakeCache:
    seq_len: int = 0


@dataclass
class FakeShard:
    """One layer whose decode rows take ``row_s`` of the fake clock each (prompts are free)."""

    clock: list[float]
    row_s: float
    start: int = 0
    hidden_size: int = 4
    dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    caches: int = 0

    def new_cache(self) -> FakeCache:
        self.caches += 1
        return FakeCache()

    def run_layers(self, states: torch.Tensor, cache: FakeCache, offset: int, from_layer: int) -> Any:
        tokens = states.shape[1]
        assert offset == cache.seq_len and from_layer == self.start
        cache.seq_len += tokens
        if tokens == 1:
            self.clock[0] += self.row_s
        return states


@pytest.mark.parametrize("row_s", [0.0003, 0.02, 1.0])
def test_rows_are_timed_for_at_least_half_a_second_and_at_least_a_few_rows(monkeypatch: pytest.MonkeyPatch,
                                                                          row_s: float) -> None:
    clock = [0.0]
    monkeypatch.setattr(memory_budget, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    shard = FakeShard(clock, row_s)
    seconds = memory_budget._time_decode_rows(shard)  # type: ignore[arg-type]
    assert seconds == pytest.approx(row_s)
    rows = round((clock[0] - row_s * memory_budget.PROBE_UNTIMED_STEPS) / row_s)
    assert rows >= PROBE_TIMED_STEPS and rows * row_s >= min(PROBE_MIN_S, memory_budget.PROBE_MAX_STEPS * row_s)
    if rows > PROBE_CACHE_TOKENS:
        assert shard.caches > 1  # long probes start fresh short contexts
