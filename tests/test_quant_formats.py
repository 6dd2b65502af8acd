"""GGUF's block formats held packed: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K against the GGUF spec.

The reference is this file's own float64 reading of the blocks, written from ggml's
``dequantize_row_*`` (ggml-quants.c) one block at a time, independent of gguf-py's
reader and of :func:`services.node.model.quant.packed.gguf_groups`. Blocks come from
gguf-py's quantizers where it has them (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), from llama.cpp's
``ggml_quantize_chunk`` for the K-quants when llama-cpp-python is installed (``make
llama-cpp``), and as random bytes with finite scales for every format (any such bytes are
a valid block), so the formats are checked without llama.cpp too.

Bound, stated once. A held weight is ``(q - c) s' + z'`` with the file's integer ``q``
(``c`` = 8 for int4, 0 for int8) and ``s'``, ``z'`` the exact scale and zero rounded to
bfloat16 (relative error at most 2^-9 each; K-quants' ``z = c s - dmin m`` is first formed
in float32, off by at most 2^-24 (16 s + |z|)). So a held weight is within ``2^-8 M`` of the
spec's, where ``M = (|q - c| + 1) |s'| + |z'|`` (the 1 absorbs the float32 term). The native
kernel adds float32 arithmetic, ``(K + 100) 2^-24 |x| M`` (tests/test_quant_kernel.py); so
each output of ``x W^T`` is within ``(2^-8 + (K + 100) 2^-24) |x| . M`` of ``x . W_spec``.
torch's kernel (the fallback) also rounds the rows and the result to bfloat16 and feeds an int8
matrix twice (a Q6_K matrix spread to groups of 32: four times the inputs): within ``(2^-8 +
2^-9 * 1.01 + (4 K + 100) 2^-24) |x| . M + 2^-9 * 1.01 |x . W_spec|``.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize as gguf_quantize

from services.node.model.quant import quant_kernel
from services.node.model.quant.packed import (
    GGUF_BITS,
    GGUF_BLOCK_BYTES,
    GGUF_FORMAT,
    Groups,
    QuantMatrix,
    gguf_groups,
    stack,
)
from services.node.model.quant.quant_load import packed_from_gguf, resolve_format

UNIT = 2.0 ** -24
HELD = 2.0 ** -8
"""A held weight's largest error against the spec's, in units of its magnitude ``M`` (module doc)."""
BF16 = 2.0 ** -9 * 1.01
ROWS, COLS = 64, 512
FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
GGUF_PY = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
"""The formats gguf-py's quantizers write."""
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
PRODUCT_ROWS = (1, 2, 3, 8, 16, 17, 40)
"""Lone and batched decode rows (AVX-512; AMX from 8 where the CPU has it) and prompt chunks (many rows)."""
HAS_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None


# --- the spec, in float64, a block at a time (ggml-quants.c's dequantize_row_*) -----------------------------


def _f16(block: np.ndarray, at: int) -> float:
    return float(block[at:at + 2].view(np.float16)[0])


def _scale_min_k4(j: int, q: np.ndarray) -> tuple[int, int]:
    if j < 4:
        return int(q[j]) & 63, int(q[j + 4]) & 63
    return (int(q[j + 4]) & 0xF) | ((int(q[j - 4]) >> 6) << 4), (int(q[j + 4]) >> 4) | ((int(q[j]) >> 6) << 4)


def _spec_block(kind: str, b: np.ndarray) -> np.ndarray:
    """One block's weights in float64, as ggml computes them."""
    y = np.zeros(256 if kind.endswith("_K") else 32)
    if kind in ("Q4_0", "Q4_1"):
        d, m, qs = _f16(b, 0), (_f16(b, 2) if kind == "Q4_1" else 0.0), b[4 if kind == "Q4_1" else 2:]
        for j in range(16):
            lo, hi = int(qs[j]) & 0xF, int(qs[j]) >> 4
            y[j], y[j + 16] = ((lo - 8) * d, (hi - 8) * d) if kind == "Q4_0" else (lo * d + m, hi * d + m)
    elif kind in ("Q5_0", "Q5_1"):
        d = _f16(b, 0)
        m = _f16(b, 2) if kind == "Q5_1" else 0.0
        at = 4 if kind == "Q5_1" else 2
        qh = int.from_bytes(bytes(b[at:at + 4]), "little")
        qs = b[at + 4:]
        for j in range(16):
            x0 = (int(qs[j]) & 0x0F) | (((qh >> j) << 4) & 0x10)
            x1 = (int(qs[j]) >> 4) | ((qh >> (j + 12)) & 0x10)
            y[j], y[j + 16] = ((x0 - 16) * d, (x1 - 16) * d) if kind == "Q5_0" else (x0 * d + m, x1 * d + m)
    elif kind == "Q8_0":
        y[:] = b[2:34].view(np.int8).astype(np.float64) * _f16(b, 0)
    elif kind in ("Q4_K", "Q5_K"):
        d, dmin, scales = _f16(b, 0), _f16(b, 2), b[4:16]
        qh, ql = (b[16:48], b[48:176]) if kind == "Q5_K" else (None, b[16:144])
        at, u1, u2 = 0, 1, 2
        for chunk in range(4):
            sc, m = _scale_min_k4(2 * chunk, scales)
            d1, m1 = d * sc, dmin * m
            sc, m = _scale_min_k4(2 * chunk + 1, scales)
            d2, m2 = d * sc, dmin * m
            q = ql[32 * chunk:32 * chunk + 32]
            for l in range(32):
                lo, hi = int(q[l]) & 0xF, int(q[l]) >> 4
                if qh is not None:
                    lo += 16 if int(qh[l]) & u1 else 0
                    hi += 16 if int(qh[l]) & u2 else 0
                y[at + l], y[at + 32 + l] = d1 * lo - m1, d2 * hi - m2
            at, u1, u2 = at + 64, u1 << 2, u2 << 2
    elif kind == "Q6_K":
        d, sc = _f16(b, 208), b[192:208].view(np.int8)
        for half in range(2):
            ql, qh, s = b[64 * half:64 * half + 64], b[128 + 32 * half:128 + 32 * half + 32], sc[8 * half:]
            for l in range(32):
                i = l // 16
                q1 = ((int(ql[l]) & 0xF) | (((int(qh[l]) >> 0) & 3) << 4)) - 32
                q2 = ((int(ql[l + 32]) & 0xF) | (((int(qh[l]) >> 2) & 3) << 4)) - 32
                q3 = ((int(ql[l]) >> 4) | (((int(qh[l]) >> 4) & 3) << 4)) - 32
                q4 = ((int(ql[l + 32]) >> 4) | (((int(qh[l]) >> 6) & 3) << 4)) - 32
                base = 128 * half
                y[base + l] = d * int(s[i]) * q1
                y[base + l + 32] = d * int(s[i + 2]) * q2
                y[base + l + 64] = d * int(s[i + 4]) * q3
                y[base + l + 96] = d * int(s[i + 6]) * q4
    else:
        raise AssertionError(kind)
    return y


def spec_matrix(kind: str, raw: np.ndarray, rows: int, cols: int) -> torch.Tensor:
    """The float64 ``[rows, cols]`` matrix of a GGUF tensor's bytes, block by block from the spec."""
    size = GGUF_BLOCK_BYTES[kind]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, size)
    return torch.from_numpy(np.concatenate([_spec_block(kind, b) for b in blocks]).reshape(rows, cols))


# --- blocks: gguf-py's, llama.cpp's, random ---------------------------------------------------------------


def _weight(seed: int, rows: int = ROWS, cols: int = COLS) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 0.2, (rows, 1))).astype(np.float32)


def _random_blocks(kind: str, seed: int, rows: int = ROWS, cols: int = COLS) -> np.ndarray:
    """Random bytes in ``kind``'s blocks with finite float16 scales (every such block is valid)."""
    rng = np.random.default_rng(seed)
    size, per = GGUF_BLOCK_BYTES[kind], (256 if kind.endswith("_K") else 32)
    raw = rng.integers(0, 256, (rows * cols // per, size), dtype=np.uint8)
    halves = {"Q6_K": [208], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q4_1": [0, 2], "Q5_1": [0, 2]}.get(kind, [0])
    for at in halves:
        signs = rng.choice([-1.0, 1.0], len(raw)) if at == 2 else 1.0  # m may be negative; d and dmin are not
        raw[:, at:at + 2] = (signs * rng.uniform(1e-4, 0.05, len(raw))).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def _llama_cpp_blocks(kind: str, weight: np.ndarray) -> np.ndarray:
    """``weight`` quantized by llama.cpp's own ``ggml_quantize_chunk`` (the library llama-cpp-python ships)."""
    import llama_cpp

    lib_dir = Path(os.environ.get("LLAMA_CPP_LIB_PATH") or Path(llama_cpp.__file__).parent / "lib")  # its own override
    names = sorted(lib_dir.glob("libggml-base.*")) or sorted(lib_dir.glob("libggml.*"))
    ggml = ctypes.CDLL(str(names[0]))
    ggml.ggml_quantize_chunk.restype = ctypes.c_size_t
    ggml.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                         ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    rows, cols = weight.shape
    src = np.ascontiguousarray(weight, dtype=np.float32)
    out = np.zeros((rows, cols // 256 * GGUF_BLOCK_BYTES[kind]), dtype=np.uint8)
    written = ggml.ggml_quantize_chunk(int(GGMLQuantizationType[kind]), src.ctypes.data, out.ctypes.data, 0, rows,
                                       cols, None)
    assert written == out.size
    return out


def _sources() -> list[tuple[str, str]]:
    cases = [(kind, "random") for kind in FORMATS] + [(kind, "gguf-py") for kind in GGUF_PY]
    return cases + [(kind, "llama.cpp") for kind in K_QUANTS]


def _blocks(kind: str, source: str, seed: int = 0) -> np.ndarray:
    if source == "random":
        return _random_blocks(kind, seed)
    if source == "gguf-py":
        return gguf_quantize(_weight(seed), GGMLQuantizationType[kind])
    if not HAS_LLAMA_CPP:
        pytest.skip("llama-cpp-python is not installed (make llama-cpp)")
    return _llama_cpp_blocks(kind, _weight(seed))


def magnitude(groups: Groups) -> torch.Tensor:
    """``M = (|q - c| + 1) |s'| + |z'|`` of each held weight, float64 ``[N, K]`` (module doc)."""
    rows, cols = groups.q.shape
    centred = groups.q.double() - (8 if groups.bits == 4 else 0)
    m = (centred.abs() + 1).view(rows, -1, groups.group) * groups.scale.double().abs().unsqueeze(-1)
    return (m + groups.zero.double().abs().unsqueeze(-1)).reshape(rows, cols)


# --- the held values ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "source"), _sources(), ids=[f"{k}-{s}" for k, s in _sources()])
def test_held_weights_are_the_specs_within_the_bfloat16_rounding_of_their_scales(kind: str, source: str) -> None:
    raw = _blocks(kind, source)
    groups = gguf_groups(kind, raw, ROWS, COLS)
    assert groups.bits == GGUF_BITS[kind] == (5 if kind.startswith("Q5") else {"int4": 4, "int8": 8}[GGUF_FORMAT[kind]])
    assert groups.group == (16 if kind == "Q6_K" else 32)
    held = QuantMatrix(groups).dequantize(torch.float64)
    exact = spec_matrix(kind, raw, ROWS, COLS)
    assert bool(((held - exact).abs() <= HELD * magnitude(groups)).all())


def test_the_references_agree_with_gguf_py_where_it_reads_the_format() -> None:
    """A check of this file's spec reading itself: gguf-py's dequantizer reads the same values."""
    from gguf.quants import dequantize

    for kind in FORMATS:
        raw = _random_blocks(kind, 5)
        theirs = np.asarray(dequantize(raw, GGMLQuantizationType[kind]), dtype=np.float64).reshape(ROWS, COLS)
        assert np.allclose(spec_matrix(kind, raw, ROWS, COLS).numpy(), theirs, rtol=1e-6, atol=1e-12), kind


# --- products ------------------------------------------------------------------------------------------------


def _isas() -> list[int]:
    if not quant_kernel.available():
        return []
    best = int(torch.ops.meshnet_quant.best_isa())
    return [isa for isa in quant_kernel.ISA_NAMES if isa <= best]


@pytest.mark.skipif(not quant_kernel.available(), reason="the native kernel did not build here")
@pytest.mark.parametrize("isa", _isas(), ids=quant_kernel.ISA_NAMES.get)
@pytest.mark.parametrize(("kind", "source"), _sources(), ids=[f"{k}-{s}" for k, s in _sources()])
def test_native_products_equal_the_specs_product_within_the_bound(kind: str, source: str, isa: int) -> None:
    raw = _blocks(kind, source, seed=1)
    groups = gguf_groups(kind, raw, ROWS, COLS)
    matrix = QuantMatrix(groups, "native")
    exact = spec_matrix(kind, raw, ROWS, COLS)
    x = torch.randn(max(PRODUCT_ROWS), COLS, generator=torch.Generator().manual_seed(2))
    limit = (HELD + (COLS + 100) * UNIT) * (x.double().abs() @ magnitude(groups).t())
    for rows in PRODUCT_ROWS:
        out = quant_kernel.mm(x[:rows], matrix.packed, matrix.scale_zeros, matrix.bits, isa)
        error = (out.double() - x[:rows].double() @ exact.t()).abs()
        assert bool((error <= limit[:rows]).all()), (rows, float((error / limit[:rows]).max()))


@pytest.mark.parametrize(("kind", "source"), _sources(), ids=[f"{k}-{s}" for k, s in _sources()])
def test_torchs_fallback_products_equal_the_specs_product_within_the_bound(kind: str, source: str) -> None:
    raw = _blocks(kind, source, seed=3)
    groups = gguf_groups(kind, raw, ROWS, COLS)
    matrix = QuantMatrix(groups, "aten")
    exact = spec_matrix(kind, raw, ROWS, COLS)
    x = torch.randn(max(PRODUCT_ROWS), COLS, generator=torch.Generator().manual_seed(4))
    product = x.double() @ exact.t()
    limit = ((HELD + BF16 + (4 * COLS + 100) * UNIT) * (x.double().abs() @ magnitude(groups).t())
             + BF16 * product.abs())
    for rows in PRODUCT_ROWS:
        error = (matrix.matmul(x[:rows]).double() - product[:rows]).abs()
        assert bool((error <= limit[:rows]).all()), (rows, float((error / limit[:rows]).max()))


@pytest.mark.parametrize("kind", FORMATS)
def test_both_layouts_hold_the_same_values_and_read_the_same_embedding_rows(kind: str) -> None:
    if not quant_kernel.available():
        pytest.skip("the native kernel did not build here")
    groups = gguf_groups(kind, _random_blocks(kind, 6), ROWS, COLS)
    native, aten = QuantMatrix(groups, "native"), QuantMatrix(groups, "aten")
    assert torch.equal(native.dequantize(torch.float64), aten.dequantize(torch.float64))
    index = torch.tensor([0, 5, 15, 16, 31, 32, 63, 5])
    assert torch.equal(native.rows(index, torch.float32), aten.rows(index, torch.float32))
    assert torch.equal(native.rows(index, torch.float32), native.dequantize()[index])


def test_a_fused_matrix_of_mixed_formats_holds_each_parts_values_exactly() -> None:
    """A Q4_K_M file mixes types inside one layer (q/k Q5_0, v Q6_K or Q8_0, others Q4_K): fused, each part
    keeps its values (int4 widened to int8, groups of 32 split into 16, both exact)."""
    parts = [gguf_groups(kind, _random_blocks(kind, 7 + i), ROWS, COLS)
             for i, kind in enumerate(("Q5_0", "Q4_K", "Q6_K", "Q4_0"))]
    fused = stack(parts)
    assert (fused.bits, fused.group) == (8, 16)
    expected = torch.cat([QuantMatrix(p, "aten").dequantize(torch.float64) for p in parts])
    for layout in ("native", "aten") if quant_kernel.available() else ("aten",):
        assert torch.equal(QuantMatrix(fused, layout).dequantize(torch.float64), expected)  # type: ignore[arg-type]


# --- which file serves what ---------------------------------------------------------------------------------


def _gguf_with(tmp_path: Path, kinds: list[str]) -> Path:
    path = tmp_path / f"{'-'.join(kinds)}.gguf"
    writer = GGUFWriter(str(path), "llama")
    for index, kind in enumerate(kinds):
        raw = _random_blocks(kind, index) if kind in GGUF_BLOCK_BYTES else None
        if raw is None:  # a type this module does not read: the right number of bytes is enough here
            raw = np.zeros((ROWS, COLS // 256 * 110), dtype=np.uint8)
        writer.add_tensor(f"blk.0.t{index}.weight", raw, raw_shape=raw.shape,
                          raw_dtype=GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_auto_serves_a_k_quant_mix_packed_in_its_widest_format(tmp_path: Path) -> None:
    fmt, why = resolve_format("auto", _gguf_with(tmp_path, ["Q4_K", "Q5_0", "Q6_K", "Q8_0"]))
    assert fmt == "int8" and "each served packed" in why
    assert resolve_format("auto", _gguf_with(tmp_path, ["Q4_K", "Q4_0"]))[0] == "int4"


def test_auto_loads_a_file_with_a_type_not_served_packed_as_float_and_names_it(tmp_path: Path) -> None:
    fmt, why = resolve_format("auto", _gguf_with(tmp_path, ["Q4_K", "Q3_K"]))
    assert fmt == "float" and "Q3_K" in why and "\n" not in why


def test_a_type_is_held_as_it_is_in_its_own_format_and_in_its_files_widest() -> None:
    raw = _random_blocks("Q6_K", 9)
    assert packed_from_gguf("Q6_K", raw, ROWS, COLS, "int8", "int8") is not None
    assert packed_from_gguf("Q6_K", raw, ROWS, COLS, "int4", "int8") is None  # requantized from float by the caller
    q4k = packed_from_gguf("Q4_K", _random_blocks("Q4_K", 9), ROWS, COLS, "int8", "int8")
    assert q4k is not None and q4k.bits == 4  # a mixed file under its own format: held as the file holds it
    # --weights int8 of an all-int4 file (the default Q4_1 one) requantizes it to int8, as it always did
    assert packed_from_gguf("Q4_1", _random_blocks("Q4_1", 9), ROWS, COLS, "int8", "int4") is None
    assert packed_from_gguf("Q3_K", raw, ROWS, COLS, "int8", None) is None
