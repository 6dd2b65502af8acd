"""Weights kept quantized in memory and multiplied by a quantized CPU kernel.

``--weights int4`` and ``--weights int8`` keep a shard's decoder-layer
products (and, for the default model, its token embedding / LM head) as
integers (4, 5 or 8 bits) with one scale and one zero per group of
:data:`GROUP_SIZE` inputs (16 for Q6_K),
and multiply them with meshnet's native kernel
(:mod:`services.node.model.quant.quant_kernel`, the ``native`` layout below) or, where
it is not built, ``torch.ops.aten._weight_int4pack_mm_for_cpu`` (the
``aten`` layout); a layer is never dequantized whole for a decode step.

The native layout and kernel: a matrix is blocks of :data:`NATIVE_BLOCK`
output rows; ``packed`` int32 ``[out/16, in*bits/32, 16]`` holds in dword
``[b, c, j]`` the inputs ``c*32/bits ..`` of row ``16 b + j`` (int4: nibble
``i`` is input ``8 c + i``, 0..15; int8: byte ``i`` is input ``4 c + i``, a
signed byte: int8 is one byte a weight, not two nibble matrices; int5:
``[out/16, in*6/32, 16]``, below), and ``scale_zeros`` bfloat16
``[out/16, in/group, 2, 16]`` the scale and zero of each row's groups. The kernel computes, per group, ``s * sum((q - 8) x) +
z * sum(x)`` (int4; ``q`` for int8) with float32 rows and float32 sums,
unpacking each weight tile once for up to 16 rows (AVX-512; from 8 rows AMX
where the CPU has it, the rows as three bfloat16 pieces that add up to them
exactly): up to :data:`NATIVE_MAX_ROWS` rows take it, a larger product
dequantizes the matrix for the call (float32 too). On one path a row's
output is the same bits whatever rows ride with it (tests/test_quant_kernel.py
states the error bound). The rest of these notes describe torch's kernel and
its layout, the fallback.

What torch 2.13 offers on a CPU, measured on the development machine (an
AVX512-BF16/FP16 Xeon, 1 thread, one ``3072 x 576`` product, the fastest of
repeated runs on a shared, loaded machine, so ratios rather than times):

* ``_weight_int4pack_mm_for_cpu`` (group-wise scale and zero) and
  ``_weight_int8pack_mm`` (one scale per output channel only) are fast only
  with **bfloat16** activations: 0.17 ms (int4) and 0.21 ms (int8) for one
  row against 0.6-0.9 ms for a dense bfloat16/float16 product, but 7-12 ms
  with float32 or float16 activations (a generic path). The kernel also
  refuses float32 scales next to bfloat16 activations. So every quantized
  product here converts its rows to bfloat16 and its result back.
* Their cost grows with the rows (about 0.1 ms a row for that product) where
  a dense product's barely does: at 8 rows int4 and dense bfloat16 cost the
  same, at 16 rows int4 costs 2-3x more; dequantizing the matrix first costs
  more still up to a few hundred rows, but the kernel's results on prompt
  chunks drift: with prompts through the kernel the default model's greedy
  answers agreed with the float mesh on 17 of 20 test prompts and lost
  "Paris" (``tests/test_quant_default.py``), against 19 of 20 through the
  dequantized product. So only up to :data:`KERNEL_MAX_ROWS` rows (every
  decode batch at the default ``--max-batch``) take the kernel; a larger
  product dequantizes this one matrix to float32 for the call and frees it, as :mod:`services.node.model.chunk_precision` does for
  float32 chunks, and computes what the kernel computes (bfloat16 rows,
  float32 weights and sums, a bfloat16 result). A dequantized bfloat16
  matrix would be faster for long prompts but rounds every weight again.

One format serves both modes. The kernel computes ``w = (q - 8) * s + z``
for a 4-bit ``q`` per group of inputs, so:

* **int4** (Q4_0, Q4_1, or a float weight's group min/max): Q4_0's
  ``(q - 8) * d`` is ``s = d, z = 0``; Q4_1's ``q * d + m`` is
  ``s = d, z = m + 8 d``; a float group gets ``s = (max - min) / 15`` and
  ``z = min + 8 s``.
* **int8** (Q8_0, or a float weight's symmetric group absmax): an 8-bit
  ``q = 16 hi + lo`` is split into two nibbles and the input is fed twice,
  ``x W^T = [x, x] [W_hi | W_lo]^T`` with ``W_hi = (hi+8 - 8) * 16 d`` and
  ``W_lo = (lo - 8) * d + 8 d``: exact, 8 bits a weight, one kernel call.

Scales and zeros are stored in bfloat16 (the kernel's format with bfloat16
activations), so a GGUF's float16 ``d`` and ``m`` are rounded to bfloat16
(relative error at most 2^-9 each); the integers are the file's own. The
tests compare every product with a float product over :func:`dequantize` of
the same stored values, and (tests/test_quant_formats.py) with the exact
float64 product of the blocks as the GGUF spec reads them.

GGUF's block types (:func:`gguf_groups`), each held exactly as integers with a
scale and zero per group, the layout the native kernel multiplies fastest
(``benchmarks/kernels.py --formats``, one run, 1 thread, ratios to Q4_1's
time; cache-resident 576 x 1536 / Llama-8B's 4096 x 4096 at 1 row):

* Q4_0, Q4_1 and Q4_K as **int4** (Q4_K's super-block ``d``, ``dmin`` and
  6-bit scales and mins unpacked at load to ``s = d sc``, ``z = 8 s - dmin
  m`` per 32 inputs): 0.96-1.02x.
* Q5_0, Q5_1 and Q5_K as **int5**: ``q - 16`` (-16..15), six integers a
  dword (bits ``5i..5i+4`` hold ``q + 16``), a group of 32 in 6 dwords, 6 bits
  a weight; one shift and one two-table permute give a weight as one shift
  and one permute give a nibble: 0.95-1.04x / 1.23-1.35x. As signed bytes
  they had cost 1.26x / 1.75-1.84x.
* Q6_K and Q8_0 as **int8** (Q6_K's ``q - 32`` with ``s = d sc`` per
  sub-block of 16: the kernel's groups may be 16 inputs, :data:`SMALL_GROUP`):
  1.26-1.32x / 1.54-1.77x.

A fused product whose parts differ (a Q4_K_M file's Q5_0 q/k beside a Q8_0
or Q6_K v) takes the widest integers and the smallest group, exactly
(:func:`stack`). The 16-bit scale and zero per group cost 1 bit a weight
(2 for Q6_K): the default model's Q4_K_M file (100.6 MB) is 122 MiB packed.
Other types (Q2_K, Q3_K, IQ*, the float ones) are not held packed:
:mod:`services.node.model.quant.quant_load` says so and loads float.

The packed layout (``_convert_weight_to_int4pack_for_cpu``, ``innerKTiles``
has no effect on the CPU) is blocks of 64 output rows: byte ``[b, k, j]`` of
the ``[N/64, K, 32]`` view holds row ``64 b + j`` in its low nibble and row
``64 b + 32 + j`` in its high one. :func:`unpack` inverts it, which is how
one matrix is dequantized for a prompt and how embedding rows are read.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from services.node.model.quant import quant_kernel

logger = logging.getLogger(__name__)

QuantFormat = Literal["int4", "int8"]
Layout = Literal["native", "aten"]
GROUP_SIZE: Final = 32
"""Inputs sharing one scale and zero (GGUF's Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 block size, K-quants' sub-block)."""
SMALL_GROUP: Final = 16
"""The other group size a matrix may have: Q6_K's sub-blocks of 16 inputs, each with its own scale."""
TORCH_GROUP: Final = 32
"""The group size torch's kernel is called with: a matrix of :data:`SMALL_GROUP` is spread for it, each group
of 16 inputs followed by 16 of zero weight and zero input."""
ROW_BLOCK: Final = 64
"""Output rows of one block of the kernel's packed layout; a quantized matrix has a multiple of them."""
KERNEL_MAX_ROWS: Final = 16
"""Products of up to this many rows run on the packed kernel; larger ones (prompt chunks) dequantize the matrix
for the call. Speed alone would put the line near 300 rows (one ``3072 x 576`` int4 matrix, 1 thread: kernel
1.8 / 2.6 / 5.2 / 8.7 ms at 16 / 32 / 64 / 128 rows, dequantizing and a float32 product 17-23 ms), but prompts
through the kernel cost the default model greedy answers (see the module notes)."""
NATIVE_BLOCK: Final = 16
"""Output rows of one block of the native layout (one 16-lane float32 vector of the kernel)."""
NATIVE_MAX_ROWS: Final = 2048
"""Products of up to this many rows run on the native kernel; larger ones dequantize the matrix for the call.
Both compute float32 rows and sums, so the line is speed alone. With AMX, many rows pass over each unpacked
weight tile in sets that stay in L2 (``kernels/quant_mm.cpp``, ``block_amx_rows``), so the kernel's cost
grows linearly with the rows and stays below the dequantized product's (1 thread, random int4 matrices:
gate/up 3072x576 at 256 / 512 rows 3.9 / 8.6 ms against 11.7 / 17.2 dequantized, down 576x1536 2.5 / 5.0
against 5.2 / 8.0); the line only bounds the kernel's scratch (the rows' pieces: 3 x rows x in x 2 bytes)."""
KERNEL_DTYPE: Final = torch.bfloat16
"""Activation, scale and zero format of the CPU kernel's fast path."""
QUANTIZED_DTYPE: Final = torch.float32
"""What a quantized CPU shard computes in besides its products (``--dtype auto``): a bfloat16 residual stream
made greedy answers of the default model drift (see services/node/runtime.py)."""
NIBBLE_MID: Final = 8
INT5_MID: Final = 16
"""An int5 integer ``q`` (-16..15) is stored as ``q + 16``."""
INT5_BITS: Final = 5
INT5_PER_DWORD: Final = 6
"""int5 integers a native dword holds (bits ``5i..5i+4``): one shift and one two-table permute unpack each."""
INT5_SLOTS: Final = 36
"""Slots of the 6 dwords a group of 32 int5 integers takes (the last 4 unused): 6 bits a weight."""
INT4_LEVELS: Final = 15
INT8_MAX: Final = 127
PACK_ROWS: Final = 1024
"""Rows packed at a time: the packing call takes int32, so a whole 49,152-row embedding would need 226 MB."""


class QuantError(ValueError):
    """A matrix cannot be held in the quantized format (its shape, or its source blocks)."""


@dataclass(frozen=True)
class Groups:
    """A matrix as integers with a scale and a zero per group of inputs: ``q`` ``[N, K]`` (int4: uint8 0..15,
    the weight ``(q - 8) s + z``; int8 and int5: int8 (-16..15 for int5), the weight ``q s + z``), ``scale`` and
    ``zero`` (float32 ``[N, K/group]``, values bfloat16 holds exactly), ``bits`` (4, 5 or 8) and ``group``
    (:data:`GROUP_SIZE`, or :data:`SMALL_GROUP` for GGUF's Q6_K; int5 only in groups of 32)."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int = 4
    group: int = 32

    @property
    def out_features(self) -> int:
        return int(self.q.shape[0])

    @property
    def repeat(self) -> int:
        """How many times torch's kernel is fed the input (int8 is two nibble matrices there: module doc)."""
        return 1 if self.bits == 4 else 2


def shape_problem(out_features: int, in_features: int) -> str | None:
    """Why an ``[out, in]`` matrix cannot take the packed format, or ``None`` when it can."""
    if out_features % ROW_BLOCK:
        return f"{out_features} output rows are not a multiple of {ROW_BLOCK}"
    if in_features % GROUP_SIZE:
        return f"{in_features} inputs are not a multiple of the group size {GROUP_SIZE}"
    return None


# --- from float weights ----------------------------------------------------------------------------


def _grouped(weight: torch.Tensor) -> torch.Tensor:
    rows, cols = weight.shape
    if cols % GROUP_SIZE:
        raise QuantError(f"{cols} inputs are not a multiple of the group size {GROUP_SIZE}")
    return weight.detach().to(torch.float32).reshape(rows, cols // GROUP_SIZE, GROUP_SIZE)


def _bf16(values: torch.Tensor) -> torch.Tensor:
    """``values`` rounded to what the kernel holds (bfloat16), kept as float32."""
    return values.to(KERNEL_DTYPE).to(torch.float32)


def int4_groups(weight: torch.Tensor) -> Groups:
    """Asymmetric 4-bit groups of a float ``[N, K]`` weight: each group's min..max in 16 levels."""
    w = _grouped(weight)
    low, high = w.amin(-1), w.amax(-1)
    scale = _bf16(((high - low) / INT4_LEVELS).clamp_min(torch.finfo(KERNEL_DTYPE).tiny))
    zero = _bf16(low + NIBBLE_MID * scale)
    q = torch.round((w - zero.unsqueeze(-1)) / scale.unsqueeze(-1) + NIBBLE_MID).clamp(0, INT4_LEVELS)
    return Groups(q=q.to(torch.uint8).reshape(weight.shape), scale=scale, zero=zero, bits=4)


def int8_signed_groups(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None,
                       group: int = GROUP_SIZE, bits: int = 8) -> Groups:
    """Signed 8-bit groups (``bits=5``: -16..15): ``q`` int8 ``[N, K]``, ``scale`` (and ``zero``, default none)
    ``[N, K/group]``, rounded to bfloat16."""
    scale = _bf16(scale.to(torch.float32))
    zero = torch.zeros_like(scale) if zero is None else _bf16(zero.to(torch.float32))
    return Groups(q=q.to(torch.int8), scale=scale, zero=zero, bits=bits, group=group)


def _nibble_halves(groups: Groups) -> Groups:
    """An int8 matrix as torch's kernel takes it: two 4-bit matrices over the input fed twice (module doc),
    ``q = 16 hi + lo``: ``[hi + 8 | lo]`` with scales ``[16 s | s]`` and zeros ``[z | 8 s]``."""
    rows, cols = groups.q.shape
    nibbles = torch.empty(rows, 2 * cols, dtype=torch.uint8)
    for row in range(0, rows, PACK_ROWS):  # in slices: int16 copies of a whole embedding would be large
        wide = groups.q[row:row + PACK_ROWS].to(torch.int16)
        nibbles[row:row + PACK_ROWS, :cols] = torch.bitwise_right_shift(wide, 4) + NIBBLE_MID  # -8..7 -> 0..15
        nibbles[row:row + PACK_ROWS, cols:] = torch.bitwise_and(wide, 15)  # 0..15
    scale = groups.scale
    return Groups(q=nibbles, scale=torch.cat([scale * 16, scale], 1),
                  zero=torch.cat([groups.zero, scale * NIBBLE_MID], 1), bits=4, group=groups.group)


def _spread(groups: Groups) -> Groups:
    """A 4-bit matrix of :data:`SMALL_GROUP` as one of :data:`TORCH_GROUP`: each group's 16 inputs followed by 16
    padding weights (their inputs are zero: :meth:`QuantMatrix.matmul` spreads the rows alike)."""
    rows, cols = groups.q.shape
    q = groups.q.view(rows, cols // SMALL_GROUP, SMALL_GROUP)
    padded = torch.cat([q, torch.full_like(q, NIBBLE_MID)], -1).reshape(rows, 2 * cols)
    return Groups(q=padded, scale=groups.scale, zero=groups.zero, bits=4, group=TORCH_GROUP)


def widened(groups: Groups, bits: int = 8) -> Groups:
    """A matrix in ``bits`` (5 or 8, at least its own), exactly: int4's ``q - 8`` as a signed byte, an int5's
    bytes as they are, the same scales and zeros."""
    if groups.bits == bits:
        return groups
    q = groups.q if groups.bits == 5 else (groups.q.to(torch.int16) - NIBBLE_MID).to(torch.int8)
    return Groups(q=q, scale=groups.scale, zero=groups.zero, bits=bits, group=groups.group)


def regrouped(groups: Groups, group: int) -> Groups:
    """``groups`` with groups of ``group`` inputs (a divisor of its own): each scale and zero repeated, exactly."""
    if group == groups.group:
        return groups
    if groups.group % group:
        raise QuantError(f"groups of {groups.group} inputs cannot be split into groups of {group}")
    times = groups.group // group
    return Groups(q=groups.q, scale=groups.scale.repeat_interleave(times, 1),
                  zero=groups.zero.repeat_interleave(times, 1), bits=groups.bits, group=group)


def int8_groups(weight: torch.Tensor) -> Groups:
    """Symmetric 8-bit groups of a float ``[N, K]`` weight: each group's absmax as 127."""
    w = _grouped(weight)
    scale = _bf16((w.abs().amax(-1) / INT8_MAX).clamp_min(torch.finfo(KERNEL_DTYPE).tiny))
    q = torch.round(w / scale.unsqueeze(-1)).clamp(-INT8_MAX - 1, INT8_MAX).to(torch.int8)
    return int8_signed_groups(q.reshape(weight.shape), scale)


def groups_of(weight: torch.Tensor, fmt: QuantFormat) -> Groups:
    """``weight`` quantized to ``fmt`` (rounded to the nearest level of its group)."""
    return int4_groups(weight) if fmt == "int4" else int8_groups(weight)


# --- from GGUF blocks ------------------------------------------------------------------------------

FORMAT_BITS: Final[dict[QuantFormat, int]] = {"int4": 4, "int8": 8}
"""Each format family's widest integers (what ``--weights`` asks for is a ceiling: :func:`quant_load.packed_from_gguf`)."""
SUPER_BLOCK: Final = 256
"""Weights of one K-quant super-block (ggml's ``QK_K``)."""
GGUF_BLOCK_BYTES: Final = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34,
                           "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
"""Bytes of one block of each GGUF type this module reads (:data:`GGUF_BLOCK_WEIGHTS` weights)."""
GGUF_BLOCK_WEIGHTS: Final = {kind: SUPER_BLOCK if kind.endswith("_K") else GROUP_SIZE for kind in GGUF_BLOCK_BYTES}
GGUF_FORMAT: Final[dict[str, QuantFormat]] = {"Q4_0": "int4", "Q4_1": "int4", "Q4_K": "int4", "Q5_0": "int8",
                                              "Q5_1": "int8", "Q5_K": "int8", "Q6_K": "int8", "Q8_0": "int8"}
"""The format family each GGUF type is held in exactly (up to the bfloat16 rounding of its scales and zeros):
4-bit integers as int4; 5-bit ones as int5 (:data:`GGUF_BITS`: six a dword, 6 bits a weight, the int8 family);
6- and 8-bit ones as signed bytes (int8)."""
GGUF_BITS: Final = {kind: 5 if kind.startswith("Q5") else FORMAT_BITS[fmt] for kind, fmt in GGUF_FORMAT.items()}
"""The integers' width in the native layout of each GGUF type."""


def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte ``at`` of each block (``[..., bytes]`` uint8) as float32."""
    return b[..., at:at + 2].contiguous().view(torch.float16)[..., 0].to(torch.float32)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Bytes ``[..., n]`` as their low nibbles then their high ones, ``[..., 2n]`` (ggml's order in a block)."""
    return torch.cat([torch.bitwise_and(packed, 15), torch.bitwise_right_shift(packed, 4)], -1)


def _high_bits(qh: torch.Tensor, count: int) -> torch.Tensor:
    """Bit ``i`` of the little-endian bytes ``[..., count/8]`` for ``i < count``, ``[..., count]`` uint8 0/1."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return torch.bitwise_and(torch.bitwise_right_shift(qh.unsqueeze(-1), shifts), 1).flatten(-2)[..., :count]


def _k_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 8 six-bit scales and mins of a super-block from its 12 bytes (ggml's ``get_scale_min_k4``)."""
    p = packed.to(torch.int32)
    low_sc, low_m = torch.bitwise_and(p[..., 0:4], 63), torch.bitwise_and(p[..., 4:8], 63)
    high_sc = torch.bitwise_and(p[..., 8:12], 15) | torch.bitwise_left_shift(torch.bitwise_right_shift(p[..., 0:4], 6), 4)
    high_m = torch.bitwise_right_shift(p[..., 8:12], 4) | torch.bitwise_left_shift(torch.bitwise_right_shift(p[..., 4:8], 6), 4)
    return torch.cat([low_sc, high_sc], -1).to(torch.float32), torch.cat([low_m, high_m], -1).to(torch.float32)


def _k_quant_groups(kind: str, b: torch.Tensor, rows: int, cols: int) -> Groups:
    """Q4_K, Q5_K and Q6_K super-blocks (``b`` ``[rows, blocks, bytes]``) as groups of their sub-blocks.

    Q4_K: ``d``, ``dmin`` (float16), 12 bytes of 6-bit scales and mins, 128 bytes of nibbles, 64 weights per 32
    bytes (low nibbles then high); a weight is ``d sc q - dmin m``, held as int4 with ``s = d sc`` and ``z = 8 s -
    dmin m``. Q5_K adds 32 bytes of fifth bits (bit ``2c`` of byte ``l`` for weight ``l`` of chunk ``c``'s low
    nibbles, ``2c + 1`` for its high ones) before the nibbles; held as int8 ``q - 16`` with ``z = 16 s - dmin m``.
    Q6_K: 128 bytes of low nibbles, 64 of 2-bit high parts, 16 int8 scales, ``d``; a weight is ``d sc (q - 32)``
    per sub-block of 16, held as int8 ``q - 32`` with ``s = d sc`` and no zero (ggml's ``dequantize_row_q*_K``).
    """
    blocks = b.shape[1]
    if kind == "Q6_K":
        ql, qh = b[..., 0:128].view(rows, blocks, 2, 64), b[..., 128:192].view(rows, blocks, 2, 32)
        low = _nibbles(ql.view(rows, blocks, 2, 2, 32)).view(rows, blocks, 2, 2, 2, 32)  # [.., half, l>=32, hi, l]
        two = torch.stack([torch.bitwise_and(torch.bitwise_right_shift(qh, 2 * i), 3) for i in range(4)], 3)
        # weight 128 h + 32 j + l: nibble of ql[64 h + l + 32 (j & 1)] (high when j >= 2), bits 2j of qh[32 h + l]
        nib = low.permute(0, 1, 2, 4, 3, 5).reshape(rows, blocks, 2, 4, 32)  # j = 2 * high + second
        q = (nib.to(torch.int16) | torch.bitwise_left_shift(two.to(torch.int16), 4)) - 32
        sc = b[..., 192:208].contiguous().view(torch.int8).to(torch.float32)
        scale = (_f16(b, 208).unsqueeze(-1) * sc).reshape(rows, cols // SMALL_GROUP)
        return int8_signed_groups(q.reshape(rows, cols), scale, group=SMALL_GROUP)
    d, dmin = _f16(b, 0).unsqueeze(-1), _f16(b, 2).unsqueeze(-1)
    sc, m = _k_scales_mins(b[..., 4:16])
    scale = d * sc  # exact in float32: an 11-bit significand times a 6-bit integer
    offset = dmin * m
    nibbles = _nibbles(b[..., -128:].view(rows, blocks, 4, 32))  # [.., chunk, 64]: sub-blocks 2c then 2c + 1
    if kind == "Q4_K":
        zero = scale * NIBBLE_MID - offset
        return Groups(q=nibbles.reshape(rows, cols), scale=_bf16(scale).reshape(rows, -1),
                      zero=_bf16(zero).reshape(rows, -1), bits=4)
    fifth = _high_bits(b[..., 16:48], 256).view(rows, blocks, 32, 8)  # [.., l, bit]
    fifth = fifth.permute(0, 1, 3, 2).reshape(rows, blocks, 4, 64)  # bit 2c: low nibbles of chunk c; 2c+1: high
    q = (nibbles.to(torch.int16) | torch.bitwise_left_shift(fifth.to(torch.int16), 4)) - 16
    return int8_signed_groups(q.reshape(rows, cols), scale.reshape(rows, -1),
                              (scale * 16 - offset).reshape(rows, -1), bits=5)


def gguf_groups(kind: str, blocks: np.ndarray, rows: int, cols: int) -> Groups:
    """The groups of a GGUF ``kind`` tensor of ``rows x cols`` weights from its raw bytes (``uint8``).

    Blocks of 32 weights (ggml's ``block_q4_0`` .. ``block_q8_0``): ``d`` (float16), for Q4_1/Q5_1 ``m``
    (float16), for Q5_0/Q5_1 the 32 fifth bits (little-endian), then 16 bytes whose low nibbles are weights
    0..15 and high nibbles 16..31; Q8_0 is ``d`` then 32 int8 weights. Q4_0 ``(q - 8) d`` and Q4_1 ``q d + m``
    are int4 (``s = d``, ``z = 0`` or ``m + 8 d``); Q5_0 ``(q - 16) d`` and Q5_1 ``q d + m`` are int8 ``q - 16``
    (``z = 0`` or ``m + 16 d``). K-quants: :func:`_k_quant_groups`. Scales and zeros are rounded to bfloat16.
    """
    size = GGUF_BLOCK_BYTES.get(kind)
    if size is None:
        raise QuantError(f"GGUF type {kind} is not one of {sorted(GGUF_BLOCK_BYTES)}")
    per_block = GGUF_BLOCK_WEIGHTS[kind]
    if cols % per_block:
        raise QuantError(f"{cols} inputs are not a multiple of {kind}'s block of {per_block}")
    raw = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(-1)
    per_row = cols // per_block
    if raw.size != rows * per_row * size:
        raise QuantError(f"{kind} tensor of {rows}x{cols} needs {rows * per_row * size} bytes, got {raw.size}")
    b = torch.from_numpy(raw.reshape(rows, per_row, size).copy())
    if kind.endswith("_K"):
        return _k_quant_groups(kind, b, rows, cols)
    d = _f16(b, 0)
    if kind == "Q8_0":
        q = b[..., 2:].contiguous().view(torch.int8).reshape(rows, cols)
        return int8_signed_groups(q, d)
    offset = 4 if kind in ("Q4_1", "Q5_1") else 2
    m = _f16(b, 2) if offset == 4 else None
    if kind.startswith("Q5"):
        fifth = _high_bits(b[..., offset:offset + 4], GROUP_SIZE)
        q = (_nibbles(b[..., offset + 4:]).to(torch.int16) | torch.bitwise_left_shift(fifth.to(torch.int16), 4)) - 16
        return int8_signed_groups(q.reshape(rows, cols), d, None if m is None else m + 16 * d, bits=5)
    q = _nibbles(b[..., offset:]).reshape(rows, cols)
    scale = _bf16(d)
    zero = torch.zeros_like(scale) if m is None else _bf16(m + NIBBLE_MID * d)
    return Groups(q=q.to(torch.uint8), scale=scale, zero=zero, bits=4)


def dequantize_groups(groups: Groups) -> torch.Tensor:
    """The float32 ``[N, K]`` matrix ``groups`` stands for (a GGUF matrix on its way to the other width)."""
    rows, cols = groups.q.shape
    centred = groups.q.to(torch.float32) - (NIBBLE_MID if groups.bits == 4 else 0)
    w = centred.view(rows, -1, groups.group) * groups.scale.unsqueeze(-1) + groups.zero.unsqueeze(-1)
    return w.reshape(rows, cols)


def permute_rows(groups: Groups, order: torch.Tensor) -> Groups:
    """``groups`` with its output rows reordered (GGUF stores Llama's q/k rows in llama.cpp's rotary order)."""
    return Groups(q=groups.q[order], scale=groups.scale[order], zero=groups.zero[order], bits=groups.bits,
                  group=groups.group)


def stack(parts: list[Groups]) -> Groups:
    """Several matrices of one input size as one, their outputs one after the other (fused q/k/v). Parts of
    different formats meet in the widest bits and the smallest group, exactly (:func:`widened`,
    :func:`regrouped`): a Q4_K_M file's q and k may be Q5_0 (int8) beside a Q4_K v (int4)."""
    bits, group = max(p.bits for p in parts), min(p.group for p in parts)
    if bits == 5 and group != GROUP_SIZE:  # int5 comes in groups of 32 only
        bits = 8
    same = [regrouped(widened(p, bits) if p.bits != bits else p, group) for p in parts]
    return Groups(q=torch.cat([p.q for p in same]), scale=torch.cat([p.scale for p in same]),
                  zero=torch.cat([p.zero for p in same]), bits=bits, group=group)


# --- the packed matrix -----------------------------------------------------------------------------


class QuantMatrix(nn.Module):
    """One ``[out, in]`` matrix held quantized; ``x @ W^T`` by :meth:`matmul`.

    ``packed`` and ``scale_zeros`` are buffers, so a shard counts their bytes
    as its weights. In the ``native`` layout
    (:mod:`services.node.model.quant.quant_kernel`) ``packed`` is int32
    ``[out / 16, in * bits / 32, 16]`` and ``scale_zeros`` bfloat16
    ``[out / 16, in / group, 2, 16]`` (module doc). In the ``aten`` layout
    (torch's kernel) the matrix is 4-bit: int8 as two nibble halves over the
    input fed twice (``repeat``), a group of 16 spread to 32 (``spread``);
    ``packed`` is uint8 ``[out, in']`` and ``scale_zeros`` bfloat16
    ``[in' / 32, out, 2]`` with ``in' = in * repeat * spread``. ``layout=None``
    takes the native one when its kernel is available.
    """

    def __init__(self, groups: Groups, layout: Layout | None = None) -> None:
        super().__init__()
        self._take([groups], layout)

    @classmethod
    def from_parts(cls, parts: Iterable[Groups], layout: Layout | None = None) -> QuantMatrix:
        """One matrix from consecutive slices of its rows (each a multiple of :data:`ROW_BLOCK`), packed as they
        come, so a large matrix (an embedding) never exists unpacked whole."""
        matrix = cls.__new__(cls)
        nn.Module.__init__(matrix)
        matrix._take(parts, layout)
        return matrix

    def _take(self, parts: Iterable[Groups], layout: Layout | None) -> None:
        self.layout: Layout = layout or ("native" if quant_kernel.available() else "aten")
        if self.layout == "native" and not quant_kernel.available():
            raise QuantError("the native layout needs meshnet's kernel, which is not available here")
        packed, scale_zeros, bits, group, cols = [], [], 0, GROUP_SIZE, 0
        for groups in parts:
            rows, cols = groups.q.shape
            if (problem := shape_problem(rows, cols)) is not None:
                raise QuantError(problem)
            if bits and (groups.bits, groups.group) != (bits, group):
                raise QuantError("the slices of one matrix must share their format")
            bits, group = groups.bits, groups.group
            for row in range(0, rows, PACK_ROWS):  # row blocks pack independently (module doc)
                part = _slice(groups, row, row + PACK_ROWS)
                if self.layout == "native":
                    ints, scales = _native_pack(part)
                    packed.append(ints)
                    scale_zeros.append(scales)
                else:
                    ints, scales = _aten_pack(part)
                    packed.append(ints)
                    scale_zeros.append(scales)
        native = self.layout == "native"
        self.register_buffer("packed", torch.cat(packed))
        self.register_buffer("scale_zeros", torch.cat(scale_zeros, 0 if native else 1).contiguous())
        self.in_features = cols
        self.out_features = int(self.packed.shape[0]) * (NATIVE_BLOCK if native else 1)
        self.bits = bits
        self.group = group
        self.repeat = 1 if bits == 4 else 2
        self.spread = TORCH_GROUP // group
        self.format: QuantFormat = "int4" if bits == 4 else "int8"

    @property
    def max_kernel_rows(self) -> int:
        """The most rows a product takes on the kernel; more dequantize the matrix for the call."""
        return NATIVE_MAX_ROWS if self.layout == "native" else KERNEL_MAX_ROWS

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W^T`` for ``x`` of shape ``[..., in]``, in ``x``'s format (module doc: rows decide the kernel)."""
        lead = x.shape[:-1]
        if self.layout == "native":  # float32 rows, weights and sums either way
            flat = x.reshape(-1, self.in_features).to(torch.float32)
            if flat.shape[0] > NATIVE_MAX_ROWS:
                out = F.linear(flat, self.dequantize(torch.float32))
            else:
                out = quant_kernel.mm(flat, self.packed, self.scale_zeros, self.bits)
            return out.to(x.dtype).reshape(*lead, self.out_features)
        flat = x.reshape(-1, self.in_features).to(KERNEL_DTYPE)
        if flat.shape[0] > KERNEL_MAX_ROWS:  # the kernel's arithmetic: bfloat16 rows, float32 weights and sums
            out = F.linear(flat.to(torch.float32), self.dequantize(torch.float32)).to(KERNEL_DTYPE)
        else:
            if self.repeat > 1:
                flat = flat.repeat(1, self.repeat)
            if self.spread > 1:
                grouped = flat.view(flat.shape[0], -1, self.group)
                flat = torch.cat([grouped, torch.zeros_like(grouped)], -1).reshape(flat.shape[0], -1)
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, TORCH_GROUP, self.scale_zeros)
        return out.to(x.dtype).reshape(*lead, self.out_features)

    def unpacked(self) -> torch.Tensor:
        """The 4-bit integers torch's kernel takes, ``[out, in * repeat]`` uint8 0..15 (int8 as its two nibble
        halves; a spread matrix without its padding)."""
        if self.layout == "aten":
            return self._unspread(unpack(self.packed, self.out_features))
        q = _native_integers(self.packed, self.bits)
        if self.bits == 4:
            return q.to(torch.uint8)
        return torch.cat([torch.bitwise_right_shift(q, 4) + NIBBLE_MID, torch.bitwise_and(q, 15)], 1).to(torch.uint8)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float ``[out, in]`` matrix the kernel multiplies by (for a large product, or a reference); in
        float64 the exact values, in float32 rounded once more than the native kernel rounds them."""
        if self.layout == "native":
            scales = self.scale_zeros.permute(0, 3, 1, 2).reshape(self.out_features, -1, 2)
            return _native_dequantize(_native_integers(self.packed, self.bits), scales, self.bits, dtype)
        return self._aten_values(unpack(self.packed, self.out_features), self.scale_zeros, dtype)

    def rows(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``index`` (long ``[n]``) of the float matrix, without dequantizing the others (embeddings)."""
        if self.layout == "native":
            block, lane = index // NATIVE_BLOCK, index % NATIVE_BLOCK
            q = _lane_integers(self.packed[block, :, lane], self.bits)
            return _native_dequantize(q, self.scale_zeros[block, :, :, lane], self.bits, dtype)
        view = self.packed.view(self.out_features // ROW_BLOCK, -1, ROW_BLOCK // 2)
        block, within = index // ROW_BLOCK, index % ROW_BLOCK
        picked = view[block, :, within % (ROW_BLOCK // 2)]  # [n, in']
        high = (within >= ROW_BLOCK // 2).unsqueeze(-1)
        q = torch.where(high, torch.bitwise_right_shift(picked, 4), torch.bitwise_and(picked, 15))
        return self._aten_values(q, self.scale_zeros[:, index], dtype)

    def _unspread(self, values: torch.Tensor) -> torch.Tensor:
        """Columns of torch's layout without a spread matrix's padding (``[n, in * repeat]``)."""
        if self.spread == 1:
            return values
        rows = values.shape[0]
        return values.view(rows, -1, TORCH_GROUP)[..., :self.group].reshape(rows, -1)

    def _aten_values(self, q: torch.Tensor, scale_zeros: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The float rows of torch-layout integers ``q`` ``[n, in']`` and their ``scale_zeros`` ``[in'/32, n, 2]``."""
        w = self._unspread(_dequantize(q, scale_zeros))
        if self.repeat > 1:
            w = w.view(w.shape[0], self.repeat, self.in_features).sum(1)
        return w.to(dtype)

    def extra_repr(self) -> str:
        return f"{self.format}, in={self.in_features}, out={self.out_features}, group={self.group}, {self.layout}"


def unpack(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """Invert ``_convert_weight_to_int4pack_for_cpu``: ``[out, cols]`` uint8 0..15 (layout in the module doc)."""
    view = packed.view(out_features // ROW_BLOCK, -1, ROW_BLOCK // 2)
    both = torch.cat([torch.bitwise_and(view, 15), torch.bitwise_right_shift(view, 4)], -1)
    return both.transpose(1, 2).reshape(out_features, -1)


def _dequantize(q: torch.Tensor, scale_zeros: torch.Tensor) -> torch.Tensor:
    """``(q - 8) s + z`` in float32 of 4-bit ``q`` ``[rows, cols]`` and torch's ``scale_zeros`` ``[cols/32, rows, 2]``."""
    rows, cols = q.shape
    sz = scale_zeros.to(torch.float32).transpose(0, 1)  # [rows, groups, 2]
    w = (q.to(torch.float32).view(rows, cols // TORCH_GROUP, TORCH_GROUP) - NIBBLE_MID) * sz[..., :1] + sz[..., 1:]
    return w.reshape(rows, cols)


def _slice(groups: Groups, start: int, end: int) -> Groups:
    return Groups(q=groups.q[start:end], scale=groups.scale[start:end], zero=groups.zero[start:end],
                  bits=groups.bits, group=groups.group)


def _aten_pack(groups: Groups) -> tuple[torch.Tensor, torch.Tensor]:
    """``groups`` in torch's layout: int8 as nibble halves, a group of 16 spread to 32 (module doc)."""
    four = _nibble_halves(groups) if groups.bits != 4 else groups
    if four.group != TORCH_GROUP:
        four = _spread(four)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(four.q.to(torch.int32), 1)
    return packed, torch.stack([four.scale, four.zero], -1).transpose(0, 1).to(KERNEL_DTYPE)


def _native_pack(groups: Groups) -> tuple[torch.Tensor, torch.Tensor]:
    """``groups`` in the native layout (module doc): int32 ``[rows/16, in*bits/32, 16]`` integers and bfloat16
    ``[rows/16, in/group, 2, 16]`` scales and zeros."""
    rows, cols = groups.q.shape
    blocks = rows // NATIVE_BLOCK
    if groups.bits == 5:  # six integers + 16 a dword, bits 5i..5i+4; a group's 32 in 6 dwords (module doc)
        q = (groups.q.to(torch.int32) + INT5_MID).view(rows, cols // GROUP_SIZE, GROUP_SIZE)
        q = torch.cat([q, q.new_zeros(rows, cols // GROUP_SIZE, INT5_SLOTS - GROUP_SIZE)], -1)
        q = q.view(rows, -1, INT5_PER_DWORD) << (INT5_BITS * torch.arange(INT5_PER_DWORD, dtype=torch.int32))
        dwords = q.sum(-1, dtype=torch.int32).view(blocks, NATIVE_BLOCK, -1)
        packed = dwords.transpose(1, 2).contiguous()
        scales = torch.stack([groups.scale, groups.zero], -1).view(blocks, NATIVE_BLOCK, -1, 2).permute(0, 2, 3, 1)
        return packed, scales.to(KERNEL_DTYPE).contiguous()
    if groups.bits == 4:
        q = groups.q.view(blocks, NATIVE_BLOCK, cols // 8, 4, 2)
        data = torch.bitwise_or(q[..., 0], torch.bitwise_left_shift(q[..., 1], 4))  # [blocks, 16, dwords, 4]
    else:
        data = groups.q.contiguous().view(torch.uint8).view(blocks, NATIVE_BLOCK, cols // 4, 4)
    packed = data.transpose(1, 2).contiguous().view(torch.int32).squeeze(-1)  # [blocks, dwords, 16]
    scales = torch.stack([groups.scale, groups.zero], -1).view(blocks, NATIVE_BLOCK, -1, 2).permute(0, 2, 3, 1)
    return packed, scales.to(KERNEL_DTYPE).contiguous()


def _lane_integers(dwords: torch.Tensor, bits: int) -> torch.Tensor:
    """The integers of native dwords ``[..., n]`` (int32, consecutive inputs of one row) as int16: 0..15 for
    int4, -128..127 for int8, -16..15 for int5 (``[..., n * 32 / 6]``: each group's 6 dwords hold 32)."""
    if bits == 5:
        shifts = INT5_BITS * torch.arange(INT5_PER_DWORD, dtype=torch.int32)
        slots = torch.bitwise_and(torch.bitwise_right_shift(dwords.unsqueeze(-1), shifts), 31)
        per_group = slots.reshape(*dwords.shape[:-1], -1, INT5_SLOTS)[..., :GROUP_SIZE]
        return (per_group.flatten(-2) - INT5_MID).to(torch.int16)
    data = dwords.contiguous().view(torch.uint8)  # little-endian: the first inputs in the low byte
    if bits == 8:
        return data.view(torch.int8).to(torch.int16)
    both = torch.stack([torch.bitwise_and(data, 15), torch.bitwise_right_shift(data, 4)], -1)
    return both.flatten(-2).to(torch.int16)


def _native_integers(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """A native matrix's integers, int16 ``[out, in]``."""
    return _lane_integers(packed.transpose(1, 2).reshape(-1, packed.shape[1]), bits)


def _native_dequantize(q: torch.Tensor, scale_zeros: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """``(q - 8) s + z`` (int4) or ``q s + z`` (int8) of native integers ``[n, in]`` and their scales and zeros
    ``[n, in/group, 2]``; in float64 when asked for it (exact), else float32."""
    rows, cols = q.shape
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    sz = scale_zeros.to(compute)
    centred = q.to(compute) - (NIBBLE_MID if bits == 4 else 0)
    w = centred.view(rows, sz.shape[-2], -1) * sz[..., :1] + sz[..., 1:]
    return w.reshape(rows, cols).to(dtype)


class QuantLinear(nn.Module):
    """``nn.Linear`` over a :class:`QuantMatrix` (the LM head of a quantized tail)."""

    def __init__(self, matrix: QuantMatrix, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.matrix = matrix
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matrix.matmul(x)
        return out if self.bias is None else out + self.bias.to(out.dtype)


class QuantEmbedding(nn.Module):
    """``nn.Embedding`` over a :class:`QuantMatrix`: only the looked-up rows are dequantized."""

    def __init__(self, matrix: QuantMatrix, dtype: torch.dtype, scale: float | None = None) -> None:
        super().__init__()
        self.matrix = matrix
        self.dtype = dtype
        self.scale = scale
        """A scaled embedding's factor (Gemma's ``sqrt(hidden)``), applied as transformers applies it."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(torch.long)
        rows = self.matrix.rows(flat, self.dtype).reshape(*ids.shape, self.matrix.in_features)
        return rows if self.scale is None else rows * torch.tensor(self.scale).to(self.dtype)
