"""Decode rows of several sessions as one batch (Shard.run_rows): each row is its session's own step."""

from __future__ import annotations

from pathlib import Path
from typing import Final

import pytest
import torch

from services.node.model.shard import Shard, ShardCache
from services.node.model.shard_load import load_shard

CPU: Final = torch.device("cpu")
PROMPT_LENGTHS: Final = (3, 9, 1, 17, 5)
"""Sessions of different lengths, so every row attends over a cache of its own size."""
STEPS: Final = 6
TOLERANCE: Final = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 4e-2}
"""Largest difference of a batched row from its solo step, relative to the largest value: the rounding
of a B-row product (a few units in the last place of the format)."""


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def prompts(shard: Shard) -> list[list[int]]:
    return [[(11 * s + 5 * i + 1) % shard.vocab_size for i in range(n)] for s, n in enumerate(PROMPT_LENGTHS)]


def prefilled(shard: Shard) -> list[ShardCache]:
    caches = []
    for ids in prompts(shard):
        cache = shard.new_cache()
        shard.run_layers(shard.embed(torch.tensor([ids])), cache, 0)
        caches.append(cache)
    return caches


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_batched_rows_equal_each_sessions_solo_steps(tiny_model_dir: Path, dtype: torch.dtype) -> None:
    shard = load_shard(tiny_model_dir, 0, 3, dtype, CPU)
    assert shard.batches_rows
    batched, solo = prefilled(shard), prefilled(shard)
    tokens = [ids[-1] for ids in prompts(shard)]
    for _ in range(STEPS):
        rows = shard.run_rows(shard.embed(torch.tensor([tokens])).transpose(0, 1), batched,
                              [c.seq_len for c in batched], from_layer=0)
        alone = torch.cat([shard.run_layers(shard.embed(torch.tensor([[t]])), cache, cache.seq_len)
                           for t, cache in zip(tokens, solo, strict=True)])
        assert rows.shape == alone.shape == (len(tokens), 1, shard.hidden_size)
        assert relative_difference(rows, alone) <= TOLERANCE[dtype]
        logits = shard.logits_rows(rows)
        for row, expected in enumerate(alone):
            assert relative_difference(logits[row], shard.logits_last(expected.unsqueeze(0))) <= TOLERANCE[dtype]
        tokens = [int(t) for t in shard.logits_rows(alone).argmax(-1)]
    assert [c.seq_len for c in batched] == [c.seq_len for c in solo] == [n + STEPS for n in PROMPT_LENGTHS]


def test_a_batch_of_one_row_is_the_lone_step_exactly(tiny_model_dir: Path) -> None:
    shard = load_shard(tiny_model_dir, 0, 3, torch.float32, CPU)
    [batched], [solo] = prefilled(shard)[:1], prefilled(shard)[:1]
    token = torch.tensor([[7]])
    row = shard.run_rows(shard.embed(token), [batched], [batched.seq_len], from_layer=0)
    assert relative_difference(row, shard.run_layers(shard.embed(token), solo, solo.seq_len)) <= TOLERANCE[torch.float32]


def test_a_failed_batch_leaves_every_cache_as_it_was(tiny_model_dir: Path) -> None:
    shard = load_shard(tiny_model_dir, 0, 3, torch.float32, CPU)
    caches = prefilled(shard)
    before = [c.seq_len for c in caches]
    assert shard.lean is not None
    layer = shard.lean._layers[2]
    broken = layer.__class__(**{**layer.__dict__, "down": layer.down[:, :3]})  # a product that cannot run
    shard.lean._layers[2] = broken
    try:
        with pytest.raises(RuntimeError):
            shard.run_rows(torch.zeros(len(caches), 1, shard.hidden_size), caches, [c.seq_len for c in caches],
                           from_layer=0)
    finally:
        shard.lean._layers[2] = layer
    assert [c.seq_len for c in caches] == before


def test_rows_of_a_shard_entered_midway(tiny_model_dir: Path) -> None:
    shard = load_shard(tiny_model_dir, 2, 3, torch.float32, CPU)
    hidden = torch.randn(3, 4, shard.hidden_size, generator=torch.Generator().manual_seed(3))
    caches = [shard.new_cache() for _ in range(3)]
    for i, cache in enumerate(caches):
        shard.run_layers(hidden[i:i + 1], cache, 0, from_layer=3)
    rows = shard.run_rows(hidden[:, :1], caches, [4, 4, 4], from_layer=3)
    assert rows.shape == (3, 1, shard.hidden_size) and [c.seq_len for c in caches] == [5, 5, 5]
    with pytest.raises(ValueError, match="entered this shard at layer 3"):
        shard.run_rows(hidden[:, :1], caches, [5, 5, 5], from_layer=2)
    with pytest.raises(ValueError, match="does not follow the 5 tokens"):
        shard.run_rows(hidden[:, :1], caches, [5, 4, 5], from_layer=3)
