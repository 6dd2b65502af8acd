"""Background work (a decode node's KV pulls) runs on threads below the node's CPU priority."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Final

import pytest
import torch

from services.node.engine.background import MAX_NICE, BackgroundPool
from services.node.model.shard_load import load_shard
from services.node.pd.kv_pull import _PullJob, _Stopped
from services.node.pd.kv_transfer import held_positions

CPU: Final = torch.device("cpu")


def _own_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_work_runs_on_a_thread_whose_priority_is_lowered_by_nice_steps_and_the_caller_keeps_its_own() -> None:
    base = _own_nice()
    pool = BackgroundPool("test-bg", workers=1, nice=5)
    try:
        assert pool.submit(_own_nice).result(timeout=30) == min(MAX_NICE, base + 5)
    finally:
        pool.shutdown()
    assert _own_nice() == base


def test_nice_zero_keeps_the_node_priority_and_out_of_range_values_are_refused() -> None:
    base = _own_nice()
    pool = BackgroundPool("test-bg", workers=1, nice=0)
    try:
        assert pool.submit(_own_nice).result(timeout=30) == base
    finally:
        pool.shutdown()
    for bad in (-1, MAX_NICE + 1):
        with pytest.raises(ValueError, match="nice must be"):
            BackgroundPool("test-bg", workers=1, nice=bad)


def test_a_stopped_pull_never_writes_to_its_cache_again(tiny_model_dir: Path) -> None:
    """Once the waiting request stops a pull (its timeout, or the client gone), the pull thread's next
    chunk is dropped: the session may already be prefilled afresh or freed."""
    shard = load_shard(tiny_model_dir, 0, 1, torch.float32, CPU)
    cache = shard.new_cache()
    job = _PullJob(cache, CPU)
    heads = int(shard.config.num_key_value_heads)
    dim = int(shard.config.hidden_size // shard.config.num_attention_heads)
    job.append(0, torch.ones(4, heads, 16, dim))
    assert held_positions(cache, 0, 1) == {16}
    job.stop()
    with pytest.raises(_Stopped):
        job.append(0, torch.ones(4, heads, 16, dim))
    assert held_positions(cache, 0, 1) == {16} and job.stopped
