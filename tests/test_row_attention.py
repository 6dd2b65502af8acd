"""meshnet's decode-row attention kernel (``kernels/row_attention.cpp``) against attention in float64.

The vector path (AVX-512, head dims that are multiples of 16, up to 128) and
the portable loops (any other head dim) both run here: every tail of 16 keys,
every tile of query heads, keys read from a cache's slice (strided heads).
"""

from __future__ import annotations

import pytest
import torch

from services.node.model.quant import quant_kernel
from tests.requirements import needs

pytestmark = needs(quant_kernel.available(), "meshnet's native kernel did not build here (a C++ compiler: `make kernels`)")

FLOAT32_BOUND = 2e-6
"""Largest difference from float64 attention allowed (values of order one, softmax weights summing to one)."""


def _reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    scores = torch.matmul(q.double(), keys.double().transpose(-1, -2)) * scale
    return torch.matmul(scores.softmax(-1), values.double())


@pytest.mark.parametrize("cached", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dim", [64, 128, 16, 24])
@pytest.mark.parametrize("group", [1, 3, 5, 8])
@pytest.mark.parametrize("length", [1, 15, 16, 17, 300])
def test_a_groups_attention_equals_float64_attention_within_the_float32_bound(dim: int, group: int, length: int,
                                                                               cached: torch.dtype) -> None:
    """Keys and values kept in 16 bits are widened exactly: the bound is float32's, against attention over
    the same 16-bit values."""
    gen = torch.Generator().manual_seed(dim * 1000 + group * 100 + length)
    heads, capacity = 3, length + 40
    q = torch.randn(heads, group, dim, generator=gen)
    cache_k = torch.randn(1, heads, capacity, dim, generator=gen).to(cached)
    cache_v = torch.randn(1, heads, capacity, dim, generator=gen).to(cached)
    keys, values = cache_k[0, :, :length], cache_v[0, :, :length]  # a cache's first positions: strided heads
    scale = dim ** -0.5
    out = quant_kernel.row_attention(q, keys, values, scale)
    assert out.shape == (heads, group, dim) and out.dtype == torch.float32
    assert (out.double() - _reference(q, keys, values, scale)).abs().max().item() <= FLOAT32_BOUND


def test_a_rows_result_does_not_depend_on_the_thread_count() -> None:
    gen = torch.Generator().manual_seed(7)
    q, keys, values = (torch.randn(3, 3, 64, generator=gen), torch.randn(3, 500, 64, generator=gen),
                       torch.randn(3, 500, 64, generator=gen))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = quant_kernel.row_attention(q, keys, values, 0.125)
        torch.set_num_threads(2)
        two = quant_kernel.row_attention(q, keys, values, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@pytest.mark.parametrize("bad", ["dtype", "mixed", "heads", "dim", "lengths", "stride", "empty"])
def test_shapes_it_cannot_take_are_refused_with_what_was_wrong(bad: str) -> None:
    q, keys, values = torch.randn(3, 3, 64), torch.randn(3, 20, 64), torch.randn(3, 20, 64)
    if bad == "dtype":
        keys, values = keys.double(), values.double()
    elif bad == "mixed":
        keys = keys.half()
    elif bad == "heads":
        keys = torch.randn(2, 20, 64)
    elif bad == "dim":
        values = torch.randn(3, 20, 32)
    elif bad == "lengths":
        values = torch.randn(3, 19, 64)
    elif bad == "stride":
        keys = torch.randn(3, 64, 20).transpose(1, 2)
    else:
        keys, values = torch.randn(3, 0, 64), torch.randn(3, 0, 64)
    with pytest.raises(RuntimeError, match="row_attention"):
        quant_kernel.row_attention(q, keys, values, 0.125)
