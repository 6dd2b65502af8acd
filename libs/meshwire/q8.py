"""8-bit blockwise quantisation of activations: the ``q8`` frame encoding, for slow links.

A hidden state of SmolLM2 is 576 values: 2,304 bytes a token in float32.
Across the internet a decode frame is small enough that its size hardly
matters, but a prefill of a long prompt, or many sessions' rows batched onto
one link, is bandwidth-bound. ``q8`` sends each block of :data:`BLOCK`
consecutive values (in C order over the whole tensor) as one float32 scale
(the block's largest magnitude / 127) and one signed byte per value,
``round(value / scale)``: 1.06 bytes a value instead of 4 (or 2). The
receiver multiplies back and casts to the frame's announced dtype, so the
layers after it see the format they always see.

It is lossy: the error of a value is at most half its block's scale. Whether
greedy tokens change is measured (``python -m benchmarks.wire_dtype``), and
the node's default (``--wire-dtype native``) sends exact values.

Body layout (little-endian)::

    float32 scale[ceil(n / BLOCK)] | int8 value[n]

The encoding name is the format's version: a later layout gets a new name,
and a node that does not know a name refuses the frame (400 ``bad_encoding``),
which a sender answers by sending that hop exact frames.
"""

from __future__ import annotations

import math
import sys
from typing import Final

import torch

BLOCK: Final = 32
"""Values that share one scale."""
LEVELS: Final = 127
"""Largest magnitude of a quantised value (symmetric: -127..127)."""
_SCALE_BYTES: Final = 4


def blocks(numel: int) -> int:
    """Scales a tensor of ``numel`` values carries."""
    return math.ceil(numel / BLOCK)


def q8_nbytes(numel: int) -> int:
    """Bytes of the ``q8`` body of a tensor of ``numel`` values."""
    return blocks(numel) * _SCALE_BYTES + numel


def quantize(tensor: torch.Tensor) -> bytes:
    """The ``q8`` body of ``tensor`` (any float dtype, any shape)."""
    flat = tensor.detach().to(device="cpu", dtype=torch.float32).reshape(-1)
    numel = flat.numel()
    padded = torch.nn.functional.pad(flat, (0, blocks(numel) * BLOCK - numel)).reshape(-1, BLOCK)
    scales = padded.abs().amax(dim=1) / LEVELS
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    values = torch.round(padded / safe.unsqueeze(1)).clamp_(-LEVELS, LEVELS).to(torch.int8).reshape(-1)[:numel]
    return _le_bytes(scales.contiguous()) + values.numpy().tobytes()


def dequantize(body: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The tensor of ``shape`` a ``q8`` body carries, as ``dtype``; ``ValueError`` when the length is wrong."""
    numel = math.prod(shape)
    if len(body) != q8_nbytes(numel):
        raise ValueError(f"a q8 body of {numel} values is {q8_nbytes(numel)} bytes, not {len(body)}")
    count = blocks(numel)
    raw = torch.frombuffer(bytearray(body[:count * _SCALE_BYTES]), dtype=torch.uint8)
    if sys.byteorder != "little":
        raw = raw.reshape(-1, _SCALE_BYTES).flip(1).reshape(-1).contiguous()
    scales = raw.view(torch.float32)
    values = torch.frombuffer(bytearray(body[count * _SCALE_BYTES:]), dtype=torch.int8).to(torch.float32)
    padded = torch.nn.functional.pad(values, (0, count * BLOCK - numel)).reshape(-1, BLOCK)
    return (padded * scales.unsqueeze(1)).reshape(-1)[:numel].reshape(shape).to(dtype)


def _le_bytes(tensor: torch.Tensor) -> bytes:
    raw = tensor.reshape(-1).view(torch.uint8)
    if sys.byteorder != "little":
        raw = raw.reshape(-1, tensor.element_size()).flip(1).reshape(-1)
    return raw.numpy().tobytes()
