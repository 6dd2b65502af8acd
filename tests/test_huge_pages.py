"""A quantized shard's packed matrices live in one huge-page mapping and compute exactly what they did."""

from __future__ import annotations

from pathlib import Path
from typing import Final

import pytest
import torch

from services.node.model import shard_load as shard_module
from services.node.model.quant.huge_pages import HUGE_PAGE_BYTES, gather
from services.node.model.quant.packed import QuantMatrix
from services.node.model.shard_load import load_shard

CPU: Final = torch.device("cpu")
PROMPT: Final = [5, 6, 7, 8, 9]


def _matrices(shard: object) -> list[QuantMatrix]:
    return [m for m in shard.modules.modules() if isinstance(m, QuantMatrix)]  # type: ignore[attr-defined]


def test_every_packed_matrix_of_a_quantized_shard_lives_in_its_region(tiny_model_dir: Path) -> None:
    shard = load_shard(tiny_model_dir, 0, 3, torch.float32, CPU, weights="int4")
    region = shard.huge_region
    assert region is not None and region.matrices == len(_matrices(shard)) > 0
    start = torch.frombuffer(region.region, dtype=torch.uint8).data_ptr()
    first = min(m.packed.data_ptr() for m in _matrices(shard))
    assert first % HUGE_PAGE_BYTES == 0  # the region's matrices start on a huge page
    for matrix in _matrices(shard):
        for tensor in (matrix.packed, matrix.scale_zeros):
            assert start <= tensor.data_ptr() < start + len(region.region)
            assert tensor.is_contiguous()
    assert load_shard(tiny_model_dir, 0, 3, torch.float32, CPU).huge_region is None  # float shards keep theirs


def test_a_shard_in_huge_pages_computes_what_it_computed_before(tiny_model_dir: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    moved = load_shard(tiny_model_dir, 0, 3, torch.float32, CPU, weights="int4")
    monkeypatch.setattr(shard_module, "gather", lambda modules: None)  # a shard whose matrices stay where they were
    kept = load_shard(tiny_model_dir, 0, 3, torch.float32, CPU, weights="int4")
    assert kept.huge_region is None and moved.huge_region is not None
    assert all(torch.equal(a.packed, b.packed) and torch.equal(a.scale_zeros, b.scale_zeros)
               for a, b in zip(_matrices(moved), _matrices(kept), strict=True))
    outs = []
    for shard in (moved, kept):
        cache = shard.new_cache()
        hidden = shard.run_layers(shard.embed(torch.tensor([PROMPT])), cache, 0)
        rows = [shard.logits_last(hidden)]
        for token in (3, 4, 5):
            rows.append(shard.logits_last(shard.run_layers(shard.embed(torch.tensor([[token]])), cache, cache.seq_len)))
        outs.append(torch.stack(rows))
    assert torch.equal(outs[0], outs[1])


def test_a_module_without_packed_matrices_has_no_region() -> None:
    assert gather(torch.nn.Linear(4, 4)) is None
