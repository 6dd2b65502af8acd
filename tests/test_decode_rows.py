"""Decode rows of a quantized shard in one native call (kernels/decode_rows.cpp) against the layer-by-layer path.

The call must compute what :class:`~services.node.model.lean_decode.LeanDecoder` computes through torch one layer
at a time (to float32 rounding: its norms sum in another order), leave every cache as that path leaves it
(the same positions held, the same keys and values), and give a row the same bits whichever rows ride with
it on one product path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

import pytest
import torch

from services.node.model.kv_cache import GrowingLayer
from services.node.model.quant import quant_kernel
from services.node.model.shard import Shard, ShardCache
from services.node.model.shard_load import load_shard
from tests.requirements import needs

CPU: Final = torch.device("cpu")
PROMPT_LENGTHS: Final = (3, 9, 1, 17, 5)
STEPS: Final = 5
RTOL: Final = {"auto": 1e-5, "float16": 1e-3, "bfloat16": 8e-3}
"""Largest difference of the native call's rows from the torch path's, relative to the largest value, by the
cache's format: float32 rounding of the norms' sums carried through the layers; with a 16-bit cache those
differences can also round a cached key or value the other way (half a unit of float16, 2^-11, or of
bfloat16, 2^-8, at most)."""
KV_RTOL: Final = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
"""The same for the cached keys and values, in the cache's own format (one rounding of it apart at most)."""

pytestmark = [
    needs(quant_kernel.available(), "meshnet's native kernel did not build here (a C++ compiler: `make kernels`)"),
    pytest.mark.skipif(quant_kernel.available() and not quant_kernel.decode_rows_ready(),
                       reason="this CPU lacks AVX-512, which the native decode rows need"),
]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def _shard(folder: Path, kv_dtype: str = "auto", start: int = 0, end: int = 3) -> Shard:
    return load_shard(folder, start, end, torch.float32, CPU, weights="int4", kv_dtype=kv_dtype)


def _prefilled(shard: Shard, reserve: bool = False) -> list[ShardCache]:
    caches = []
    for s, n in enumerate(PROMPT_LENGTHS):
        ids = [(11 * s + 5 * i + 1) % shard.vocab_size for i in range(n)]
        cache = shard.new_cache(reserve_tokens=n if reserve else None)
        shard.run_layers(shard.embed(torch.tensor([ids])), cache, 0)
        caches.append(cache)
    return caches


def _step(shard: Shard, caches: list[ShardCache], tokens: list[int], fused: bool) -> torch.Tensor:
    assert shard.lean is not None
    shard.lean.fused = fused
    return shard.run_rows(shard.embed(torch.tensor([tokens])).transpose(0, 1), caches,
                          [cache.seq_len for cache in caches], from_layer=shard.start)


def _layers(cache: ShardCache, shard: Shard) -> list[GrowingLayer]:
    layers = [cache.kv.layers[index] for index in shard.layer_range]
    assert all(isinstance(layer, GrowingLayer) for layer in layers)
    return layers  # type: ignore[return-value]


def test_a_quantized_float32_shard_takes_the_native_call(tiny_model_dir: Path) -> None:
    shard = _shard(tiny_model_dir)
    assert shard.lean is not None and shard.lean.fused
    half = load_shard(tiny_model_dir, 0, 3, torch.bfloat16, CPU, weights="int4")
    assert half.lean is not None and not half.lean.fused  # bfloat16 norms: the torch path
    assert load_shard(tiny_model_dir, 0, 3, torch.float32, CPU).lean is not None
    assert not load_shard(tiny_model_dir, 0, 3, torch.float32, CPU).lean.fused  # type: ignore[union-attr]


@pytest.mark.parametrize("kv_dtype", ["auto", "float16", "bfloat16"])
def test_native_rows_equal_the_layer_by_layer_path_and_leave_the_caches_alike(tiny_model_dir: Path,
                                                                               kv_dtype: str) -> None:
    shard = _shard(tiny_model_dir, kv_dtype)
    native, torch_path = _prefilled(shard, reserve=True), _prefilled(shard, reserve=True)  # the first row grows them
    tokens = [7, 8, 9, 10, 11]
    for _ in range(STEPS):
        fast = _step(shard, native, tokens, fused=True)
        slow = _step(shard, torch_path, tokens, fused=False)
        assert _relative(fast, slow) <= RTOL[kv_dtype]
        tokens = [int(t) for t in shard.logits_rows(slow).argmax(-1)]
    for one, other in zip(native, torch_path, strict=True):
        assert one.seq_len == other.seq_len
        for mine, theirs in zip(_layers(one, shard), _layers(other, shard), strict=True):
            assert mine.get_seq_length() == theirs.get_seq_length()
            assert mine.keys is not None and theirs.keys is not None
            assert mine.keys.dtype == theirs.keys.dtype and mine.keys.shape == theirs.keys.shape
            dtype = mine.keys.dtype
            assert _relative(mine.keys, theirs.keys) <= KV_RTOL[dtype]
            assert _relative(mine.values, theirs.values) <= KV_RTOL[dtype]  # type: ignore[arg-type]


def test_a_row_gives_the_same_bits_alone_or_beside_others(tiny_model_dir: Path) -> None:
    shard = _shard(tiny_model_dir)
    alone, together = _prefilled(shard), _prefilled(shard)
    tokens = [7, 8, 9, 10, 11]
    solo = torch.cat([_step(shard, [cache], [token], fused=True) for cache, token in zip(alone, tokens, strict=True)])
    batch = _step(shard, together, tokens, fused=True)
    assert torch.equal(solo, batch)


def test_rows_of_a_shard_entered_midway_take_hidden_states(tiny_model_dir: Path) -> None:
    head, tail = _shard(tiny_model_dir, end=1), _shard(tiny_model_dir, start=2)
    heads, native, torch_path = _prefilled(head), [], []
    for s, n in enumerate(PROMPT_LENGTHS):
        ids = [(11 * s + 5 * i + 1) % head.vocab_size for i in range(n)]
        hidden = head.run_layers(head.embed(torch.tensor([ids])), head.new_cache(), 0)
        for into in (native, torch_path):
            cache = tail.new_cache()
            tail.run_layers(hidden, cache, 0, from_layer=2)
            into.append(cache)
    rows = _step(head, heads, [7, 8, 9, 10, 11], fused=True)
    assert tail.lean is not None
    outs = []
    for caches, fused in ((native, True), (torch_path, False)):
        tail.lean.fused = fused
        outs.append(tail.run_rows(rows, caches, [cache.seq_len for cache in caches], from_layer=2))
    assert _relative(outs[0], outs[1]) <= RTOL["auto"]
    assert [cache.seq_len for cache in native] == [n + 1 for n in PROMPT_LENGTHS]


def test_a_cache_layer_without_its_prompt_falls_back_to_the_torch_path(tiny_model_dir: Path) -> None:
    """A row whose cache holds nothing yet (no buffers to write into) is not the native call's to take."""
    shard = _shard(tiny_model_dir)
    empty = shard.new_cache()
    out = _step(shard, [empty], [5], fused=True)
    assert out.shape == (1, 1, shard.hidden_size) and empty.seq_len == 1


def test_a_call_with_arguments_that_do_not_fit_is_refused_and_counts_nothing(tiny_model_dir: Path) -> None:
    shard = _shard(tiny_model_dir)
    [cache] = _prefilled(shard)[:1]
    layers = _layers(cache, shard)
    assert shard.lean is not None
    weights, bits, eps = shard.lean._fused_range(0, 3)
    keys = [layer.buffers[0] for layer in layers]  # type: ignore[index]
    values = [layer.buffers[1] for layer in layers]  # type: ignore[index]
    full = [layer.buffers[0].shape[2] for layer in layers]  # type: ignore[index]
    x = torch.zeros(1, shard.hidden_size)
    cos = sin = torch.zeros(1, shard.hidden_size // 4)
    with pytest.raises(RuntimeError, match="holds .* positions, the step needs"):
        quant_kernel.decode_rows(x, cos, sin, weights, bits, eps, keys, values, full, 1.0, 4, 2)
    with pytest.raises(RuntimeError, match="per layer"):
        quant_kernel.decode_rows(x, cos, sin, weights[:-1], bits, eps, keys, values, [3] * 4, 1.0, 4, 2)
    with pytest.raises(RuntimeError, match="query heads for"):
        quant_kernel.decode_rows(x, cos, sin, weights, bits, eps, keys, values, [3] * 4, 1.0, 3, 2)
    assert [layer.get_seq_length() for layer in layers] == [PROMPT_LENGTHS[0]] * 4
