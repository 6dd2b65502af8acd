"""meshnet's native kernel for quantized products (services/node/model/quant/kernels/quant_mm.cpp).

Tolerance, stated once: against the exact product (float64 over the exactly
dequantized values) each output is within :func:`bound`, ``(K + 100) * 2^-24``
times ``sum_k |x_k| (|q_k - 8| s + |z|)`` (``|q_k| s + |z|`` for int8). The
AVX-512 and portable paths round each weight once and sum ``K`` float32
products (the classical ``K u`` bound of a dot product); the AMX path sums
each group's 96 exact products of the row's three bfloat16 pieces with the
integers, scales the sum and adds ``z`` times the row's group sum, then adds
``K/32`` group sums: under ``(96 + K/32 + 4) u`` of the same magnitudes. The
kernel computes every output of a row in one thread in an order that does not
depend on the batch, so on one path a row's result is the same bits whatever
rows ride with it and whatever the thread count.
"""

from __future__ import annotations

import fnmatch
import logging
import tomllib
from pathlib import Path
from unittest import mock

import pytest
import torch

from services.node.model.quant import quant_kernel
from services.node.model.quant.packed import (
    GROUP_SIZE,
    NATIVE_MAX_ROWS,
    NIBBLE_MID,
    QuantMatrix,
    _native_integers,
    groups_of,
)
from tests.requirements import needs

pytestmark = needs(quant_kernel.available(), "meshnet's native kernel did not build here (a C++ compiler: `make kernels`)")

UNIT = 2.0 ** -24
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
"""The default model's decoder-layer products: fused q/k/v, o, fused gate/up, down."""
LM_HEAD = (49152, 576)
ROWS = range(1, 21)


def _matrix(shape: tuple[int, int], fmt: str, seed: int = 0) -> QuantMatrix:
    weight = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    return QuantMatrix(groups_of(weight, fmt), "native")  # type: ignore[arg-type]


def bound(x: torch.Tensor, matrix: QuantMatrix) -> torch.Tensor:
    """The largest error each output of ``x @ W^T`` may carry (module doc)."""
    q = _native_integers(matrix.packed, matrix.bits).double() - (NIBBLE_MID if matrix.bits == 4 else 0)
    sz = matrix.scale_zeros.permute(0, 3, 1, 2).reshape(matrix.out_features, -1, 2).double()
    groups = q.view(matrix.out_features, -1, GROUP_SIZE).abs() * sz[..., :1].abs() + sz[..., 1:].abs()
    magnitude = groups.reshape(matrix.out_features, matrix.in_features)
    return (matrix.in_features + 100) * UNIT * (x.double().abs() @ magnitude.t())


def _isas() -> list[int]:
    best = int(torch.ops.meshnet_quant.best_isa())
    return [isa for isa in quant_kernel.ISA_NAMES if isa <= best]


def _check_rows(matrix: QuantMatrix, isa: int = 0) -> None:
    exact = matrix.dequantize(torch.float64)
    x = torch.randn(max(ROWS), matrix.in_features, generator=torch.Generator().manual_seed(7))
    limit = bound(x, matrix)
    for rows in ROWS:
        out = quant_kernel.mm(x[:rows], matrix.packed, matrix.scale_zeros, matrix.bits, isa)
        error = (out.double() - x[:rows].double() @ exact.t()).abs()
        assert bool((error <= limit[:rows]).all()), (rows, float(error.max()))


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_products_of_the_default_models_shapes_equal_the_exact_product_within_the_float32_bound(
        shape: tuple[int, int], fmt: str) -> None:
    _check_rows(_matrix(shape, fmt))


def test_the_lm_head_in_int8_equals_the_exact_product_within_the_float32_bound() -> None:
    _check_rows(_matrix(LM_HEAD, "int8"))


@pytest.mark.parametrize("isa", _isas() if quant_kernel.available() else [], ids=quant_kernel.ISA_NAMES.get)
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_every_instruction_set_path_of_this_cpu_keeps_the_bound(isa: int, fmt: str) -> None:
    _check_rows(_matrix((192, 96), fmt, seed=2), isa)


@pytest.mark.parametrize("isa", _isas() if quant_kernel.available() else [], ids=quant_kernel.ISA_NAMES.get)
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_on_one_path_a_rows_result_is_the_same_bits_alone_in_any_batch_and_on_any_thread_count(
        isa: int, fmt: str) -> None:
    matrix = _matrix((576, 1536), fmt, seed=4)
    x = torch.randn(20, 1536, generator=torch.Generator().manual_seed(5))

    def product(rows: torch.Tensor) -> torch.Tensor:
        return quant_kernel.mm(rows, matrix.packed, matrix.scale_zeros, matrix.bits, isa)
    alone = torch.cat([product(x[i:i + 1]) for i in range(20)])
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for rows in (2, 3, 8, 16, 17, 20):
                assert torch.equal(product(x[:rows]), alone[:rows])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_a_prompts_many_rows_keep_the_bound_and_each_rows_bits(fmt: str) -> None:
    """Many rows (a prompt chunk) pass over each weight tile in sets that stay in L2 (AMX: ``block_amx_rows``):
    each row still computes what it computes in a pass of 16, within the float32 bound of the exact product."""
    matrix = _matrix((576, 1536), fmt, seed=8)  # K = 1536: 300 rows span several sets of rows
    x = torch.randn(300, 1536, generator=torch.Generator().manual_seed(9))
    exact = matrix.dequantize(torch.float64)
    many = quant_kernel.mm(x, matrix.packed, matrix.scale_zeros, matrix.bits)
    assert bool(((many.double() - x.double() @ exact.t()).abs() <= bound(x, matrix)).all())
    passes = torch.cat([quant_kernel.mm(x[i:i + 16], matrix.packed, matrix.scale_zeros, matrix.bits)
                        for i in range(0, 288, 16)])
    assert torch.equal(many[:288], passes)  # full passes of 16 (from 8 rows a pass takes AMX too)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_the_native_layout_holds_the_same_values_as_torchs_layout_in_no_more_bytes(fmt: str) -> None:
    groups = groups_of(torch.randn(192, 96, generator=torch.Generator().manual_seed(3)), fmt)  # type: ignore[arg-type]
    native, aten = QuantMatrix(groups, "native"), QuantMatrix(groups, "aten")
    assert torch.equal(native.dequantize(), aten.dequantize())
    assert torch.equal(native.unpacked(), aten.unpacked())
    index = torch.tensor([0, 5, 15, 16, 63, 64, 100, 191, 5])
    assert torch.equal(native.rows(index, torch.float32), aten.rows(index, torch.float32))

    def size(m: QuantMatrix) -> int:
        return sum(b.numel() * b.element_size() for b in m.buffers())
    assert size(native) <= size(aten)


def test_products_above_the_kernels_rows_dequantize_and_agree() -> None:
    matrix = _matrix((192, 96), "int4", seed=6)
    x = torch.randn(NATIVE_MAX_ROWS + 1, 96, generator=torch.Generator().manual_seed(1))
    exact = matrix.dequantize(torch.float64)
    assert bool(((matrix.matmul(x).double() - x.double() @ exact.t()).abs() <= bound(x, matrix)).all())


def test_without_the_kernel_matrices_take_torchs_layout_and_the_log_says_why(
        caplog: pytest.LogCaptureFixture) -> None:
    quant_kernel.available.cache_clear()
    try:
        with (mock.patch.object(quant_kernel, "build", side_effect=RuntimeError("no C++ compiler")),
              caplog.at_level(logging.WARNING, logger="services.node.model.quant.quant_kernel")):
            assert not quant_kernel.available()
            matrix = QuantMatrix(groups_of(torch.randn(64, 64), "int4"))
        assert matrix.layout == "aten"
        assert any("no C++ compiler" in r.message for r in caplog.records)
    finally:
        quant_kernel.available.cache_clear()
    assert quant_kernel.available()


def test_a_build_that_failed_is_not_retried_at_every_start_and_says_why(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(quant_kernel.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a compiler that fails at once
    with pytest.raises(RuntimeError, match="did not compile"):
        quant_kernel.build()
    monkeypatch.setenv("CXX", "/nonexistent/c++")  # not even tried again
    with pytest.raises(RuntimeError, match="did not compile .*delete .* to try again"):
        quant_kernel.build()


def test_a_failed_build_reports_the_compilers_error_lines_not_the_headers_warnings() -> None:
    warning = ("torch/include/c10/core/AutogradState.h:89:33: warning: default member initializers for "
               "bit-fields only available with -std=c++20 [-Wc++20-extensions]\n")
    stderr = ("In file included from kernels/quant_mm.cpp:20:\n" + warning * 3
              + "kernels/quant_mm.cpp:382: Error: bad register name `%tmmX'\n"
              + "kernels/decode_rows.cpp:10:5: error: 'x' was not declared in this scope\n" + warning * 200)
    said = quant_kernel.complaint(stderr)
    assert "quant_mm.cpp:382: Error: bad register name" in said
    assert "decode_rows.cpp:10:5: error: 'x' was not declared" in said
    assert "warning" not in said
    many = quant_kernel.complaint("a.cpp:1: error: one\n" * (quant_kernel.COMPLAINT_LINES + 5))
    assert many.count("error: one") == quant_kernel.COMPLAINT_LINES and "and 5 more error lines" in many
    assert quant_kernel.complaint("ld: cannot open output\n") == "ld: cannot open output"  # no error line: the end


def test_every_kernel_source_and_header_ships_with_the_package() -> None:
    """A non-editable install (the container image's ``pip install .``) must carry what the kernel build reads."""
    root = Path(__file__).resolve().parents[1]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["services.node.model.quant"]
    package = root / "services" / "node" / "model" / "quant"
    for path in (*quant_kernel.SOURCES, *quant_kernel.HEADERS):
        relative = path.relative_to(package).as_posix()
        assert any(fnmatch.fnmatch(relative, pattern) for pattern in globs), relative
