"""int8 activations: meshnet's product of int8-quantized rows with packed weights (kernels/q8_mm.cpp).

Tolerance, stated once: the reference is the float64 product of the same
int8 rows (``xq * d``, the kernel's own quantization, checked separately)
with the exactly dequantized weights. The kernel's integer dot products are
exact; per group it rounds ``float(idot) * d``, one fused multiply-add by
``s``, ``zx = d * sumq`` and one fused multiply-add by ``z``: each output is
within ``(2 K/G + 4) * 2^-24 * sum_k |xq_k d| (|s (q_k - c)| + |z|)`` (c = 8
for int4, 0 otherwise) of the reference. Every instruction-set path (generic,
AVX2, AVX512-VNNI, AMX-INT8: forced by ``mm8``'s ``isa``) computes the same
integers and the same float steps, so their results are the same bits.
"""

from __future__ import annotations

import logging

import pytest
import torch

from services.node.model.quant import quant_kernel
from services.node.model.quant.packed import (
    NIBBLE_MID,
    QuantMatrix,
    _native_integers,
    groups_of,
    int8_signed_groups,
)
from tests.requirements import needs

pytestmark = needs(quant_kernel.available(), "meshnet's native kernel did not build here (a C++ compiler: `make kernels`)")

UNIT = 2.0 ** -24
ROWS = (1, 8, 64, 300)
FORMATS = ("int4", "int8", "int8/16", "int5")
"""Q4_0/Q4_1/Q4_K (4 bits, groups of 32), Q8_0 (8 bits), Q6_K (8 bits, groups of 16), Q5_0/Q5_1/Q5_K (5 bits)."""


def _isas() -> list[int]:
    if not quant_kernel.available():
        return []
    return [isa for isa in quant_kernel.Q8_ISA_NAMES if isa <= int(torch.ops.meshnet_quant.q8_best_isa())]


def _matrix(fmt: str, shape: tuple[int, int], seed: int = 0) -> QuantMatrix:
    gen = torch.Generator().manual_seed(seed)
    rows, cols = shape
    if fmt == "int4":
        return QuantMatrix(groups_of(torch.randn(rows, cols, generator=gen), "int4"), "native")
    bits, group = {"int8": (8, 32), "int8/16": (8, 16), "int5": (5, 32)}[fmt]
    low, high = (-128, 127) if bits == 8 else (-16, 15)
    q = torch.randint(low, high + 1, (rows, cols), generator=gen, dtype=torch.int8)
    scale = torch.rand(rows, cols // group, generator=gen) * 0.02 + 0.001
    zero = torch.randn(rows, cols // group, generator=gen) * 0.01
    return QuantMatrix(int8_signed_groups(q, scale, zero, group=group, bits=bits), "native")


def _group(matrix: QuantMatrix) -> int:
    return matrix.in_features // int(matrix.scale_zeros.shape[1])


def _int8_rows(x: torch.Tensor, group: int) -> torch.Tensor:
    """The rows as the kernel quantizes them, dequantized exactly (float64 ``xq * d``)."""
    xq, d = torch.ops.meshnet_quant.q8_rows(x, group)
    return (xq.double().view(x.shape[0], -1, group) * d.double().unsqueeze(-1)).view(x.shape)


def reference_and_bound(x: torch.Tensor, matrix: QuantMatrix) -> tuple[torch.Tensor, torch.Tensor]:
    group = _group(matrix)
    rows = _int8_rows(x, group)
    q = _native_integers(matrix.packed, matrix.bits).double() - (NIBBLE_MID if matrix.bits == 4 else 0)
    sz = matrix.scale_zeros.permute(0, 3, 1, 2).reshape(matrix.out_features, -1, 2).double()
    magnitude = (q.view(matrix.out_features, -1, group).abs() * sz[..., :1].abs() + sz[..., 1:].abs())
    limit = (2 * matrix.in_features // group + 4) * UNIT * (rows.abs() @ magnitude.reshape(q.shape).t())
    return rows @ matrix.dequantize(torch.float64).t(), limit


def test_rows_are_quantized_per_group_with_one_scale_as_llama_cpps_q8() -> None:
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(1)) * torch.tensor([1e-3, 1.0, 30.0]).repeat(32)
    x[2, 32:64] = 0.0  # an all-zero group: scale 0, integers 0, no division by zero
    for group in (32, 16):
        xq, d = torch.ops.meshnet_quant.q8_rows(x, group)
        grouped = x.view(5, -1, group)
        amax = grouped.abs().amax(-1)
        assert torch.equal(d, amax / 127)
        inverse = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
        expected = torch.round(grouped * inverse.unsqueeze(-1)).clamp(-127, 127).to(torch.int8).view(5, 96)
        assert torch.equal(xq, expected)
    half_step = x.view(5, 3, 32).abs().amax(-1).repeat_interleave(32, 1).double() / 254
    assert bool(((_int8_rows(x, 32) - x.double()).abs() <= half_step * (1 + 1e-5)).all())  # x * id rounds too


@pytest.mark.parametrize("isa", _isas(), ids=quant_kernel.Q8_ISA_NAMES.get)
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_path_equals_the_float64_product_of_the_same_int8_rows_within_the_float32_bound(
        isa: int, fmt: str) -> None:
    for shape in ((64, 96), (192, 160)):  # odd shapes: 3 and 5 groups of inputs, 4 and 12 blocks of outputs
        matrix = _matrix(fmt, shape, seed=shape[1])
        x = torch.randn(max(ROWS), shape[1], generator=torch.Generator().manual_seed(7))
        exact, limit = reference_and_bound(x, matrix)
        for rows in ROWS:
            out = quant_kernel.mm8(x[:rows], matrix.packed, matrix.scale_zeros, matrix.bits, isa)
            error = (out.double() - exact[:rows]).abs()
            assert bool((error <= limit[:rows]).all()), (shape, rows, float((error - limit[:rows]).max()))


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_path_gives_the_same_bits_and_a_rows_result_does_not_depend_on_its_batch(fmt: str) -> None:
    matrix = _matrix(fmt, (576, 1536) if fmt != "int5" else (192, 1536), seed=4)
    x = torch.randn(40, 1536, generator=torch.Generator().manual_seed(5))
    first = quant_kernel.mm8(x, matrix.packed, matrix.scale_zeros, matrix.bits, 1)
    for isa in _isas():
        assert torch.equal(quant_kernel.mm8(x, matrix.packed, matrix.scale_zeros, matrix.bits, isa), first), isa
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for rows in (1, 3, 8, 16, 17, 40):  # VNNI below 16 rows, AMX from 16 where the CPU has it
                assert torch.equal(quant_kernel.mm8(x[:rows], matrix.packed, matrix.scale_zeros, matrix.bits),
                                   first[:rows])
    finally:
        torch.set_num_threads(threads)


def test_the_processs_mode_routes_mm_and_float32_stays_todays_product(caplog: pytest.LogCaptureFixture) -> None:
    matrix = _matrix("int4", (192, 576), seed=3)
    x = torch.randn(4, 576, generator=torch.Generator().manual_seed(4))
    float_rows = torch.ops.meshnet_quant.mm(x, matrix.packed, matrix.scale_zeros, 4, 0, 0)
    int8_rows = quant_kernel.mm8(x, matrix.packed, matrix.scale_zeros, 4)
    assert not torch.equal(float_rows, int8_rows)
    assert quant_kernel.activations() == "float32"  # until a node chooses
    try:
        with caplog.at_level(logging.INFO, logger=quant_kernel.__name__):
            assert quant_kernel.choose_activations("int8") == "int8"
        assert "int8 activations (asked for)" in caplog.text
        assert torch.equal(quant_kernel.mm(x, matrix.packed, matrix.scale_zeros, 4), int8_rows)
        assert torch.equal(matrix.matmul(x), int8_rows)
        assert quant_kernel.choose_activations("float32") == "float32"
        assert torch.equal(matrix.matmul(x), float_rows)
        vnni = int(torch.ops.meshnet_quant.q8_best_isa()) >= quant_kernel.VNNI
        assert quant_kernel.choose_activations("auto") == ("int8" if vnni else "float32")
    finally:
        quant_kernel.choose_activations("float32")
    with pytest.raises(ValueError, match="auto, float32 or int8"):
        quant_kernel.choose_activations("int4")


def test_a_path_the_cpu_lacks_is_refused_by_name() -> None:
    matrix = _matrix("int8", (64, 96))
    best = int(torch.ops.meshnet_quant.q8_best_isa())
    if best == max(quant_kernel.Q8_ISA_NAMES):
        pytest.skip("this CPU has every path")
    with pytest.raises(RuntimeError, match="not available here"):
        quant_kernel.mm8(torch.ones(1, 96), matrix.packed, matrix.scale_zeros, 8, best + 1)
