"""One-token decode steps of half-precision CPU shards, without transformers' per-module overhead.

A decode step of a small model on a CPU is mostly overhead: for SmolLM2-135M
in float16 on 2 cores, 30 decoder layers took 20 ms a token through
transformers' modules, of which the matrix products were 11. The rest is
about 50 small operations a layer, each dispatched through ``nn.Module``
calls, decorators and keyword plumbing, and 12 format conversions.

:class:`LeanDecoder` runs the same arithmetic in the same order with fewer,
larger operations: the query, key and value projections as one product, the
gate and up projections as one product, the rotary embedding, the KV-cache
append, float32 attention over the cache (as
:mod:`services.node.model.chunk_precision` computes it) and the residuals, calling
torch directly. Measured on this machine it took the same 30 layers from
20.2 to 14.5 ms a token, and its hidden states were bit-identical to the
transformers path in float16 and bfloat16 over 48 steps (the tests check
that on every build). Fused products are what let it win, and in float32
they round differently from three separate ones, so float32 shards, whose
output must equal transformers token for token, keep transformers' path.

The fused weights are the layers' own storage: each projection's parameter
is rebound as a view into its fused tensor, so no weight is held twice and
prompts (multi-token chunks) keep running through transformers' modules on
the same memory.

A quantized shard's layers (float32 rows, packed products) go one step further:
a turn of decode rows runs every layer in one native call
(``kernels/decode_rows.cpp``, :func:`services.node.model.quant.quant_kernel.decode_rows`),
the norms, rotary, KV append and attention written in C++ around the packed
products, so nothing returns to Python between layers (30 int4 layers and
the LM head of the default model, 2 threads: one row 18.5 -> 6.7 ms, eight
rows 27.3 -> 16.9 ms). Each cache layer is given room for the row first and
counts it after the call returns (:meth:`GrowingLayer.make_room` and
:meth:`~services.node.model.kv_cache.GrowingLayer.advance`), so a call that fails
leaves every cache as it was. Prompt chunks keep the layer-by-layer path;
rows beside them in a ragged turn still take the native call, apart from the
chunks, so a row's output is the same bits whatever shares its turn
(:meth:`LeanDecoder._run_apart`).

Only layers whose structure is known are taken: a Llama-style decoder layer
(Llama, Mistral, Qwen2, SmolLM) with RMS norms, ``q/k/v/o_proj`` and no
per-head query/key norms (Qwen3 has them), a gated SiLU MLP, and full
attention. Anything else returns ``None`` from :func:`lean_decoder_for` and
runs through transformers' own layers, batched rows too (:mod:`services.node.model.ragged_layers`).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.cache_utils import Cache

from services.node.model.chunk_precision import HALF_DTYPES
from services.node.model.kv_cache import GrowingLayer
from services.node.model.quant import quant_kernel
from services.node.model.quant.packed import NATIVE_MAX_ROWS, QuantMatrix

logger = logging.getLogger(__name__)

LEAN_LAYER_CLASSES: Final = frozenset({"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer"})
"""transformers decoder layers whose forward :class:`LeanDecoder` reproduces (given the checks below)."""
LEAN_ACTIVATION: Final = "silu"


@dataclass(frozen=True)
class _LeanLayer:
    """One decoder layer's tensors, fused where that saves operations."""

    input_norm: torch.Tensor
    input_eps: float
    post_norm: torch.Tensor
    post_eps: float
    qkv: torch.Tensor | QuantMatrix
    qkv_bias: torch.Tensor | None
    out: torch.Tensor | QuantMatrix
    out_bias: torch.Tensor | None
    gate_up: torch.Tensor | QuantMatrix
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor | QuantMatrix
    down_bias: torch.Tensor | None
    scaling: float


class LeanDecoder:
    """Runs one-token decode steps through a shard's layers (see the module docstring)."""

    def __init__(self, config: PretrainedConfig, layers: dict[int, _LeanLayer], *, solo: bool = True,
                 grouped_rows: bool = False) -> None:
        self._layers = layers
        self.solo = solo
        """Whether one-token steps of a lone session take this path too (half precision on a CPU), or only
        batched rows (a float32 shard's lone steps keep transformers' exact path)."""
        self.grouped_rows = grouped_rows
        """Whether a decode row attends with each KV head's query heads as one group, reading its keys and
        values once instead of once per query head, with two matrix products on a CPU (a turn of four short
        rows and one 2,048-token row of the default model, int4 on one thread: 47.2 ms with transformers'
        per-head attention, 45.0 grouped in torch's fused kernel, 40.5 grouped in meshnet's kernel). It rounds differently from transformers' attention, so only quantized shards, which never
        match transformers bit for bit, take it; a half-precision shard's lone steps must."""
        self._fused = _fused_layers(layers) if grouped_rows else None
        """Each layer's tensors as :func:`services.node.model.quant.quant_kernel.decode_rows` takes them, where every layer
        can run there (quantized, native layout, no biases, float32 norms); else ``None``."""
        self.fused = self._fused is not None
        """Whether decode rows (a step whose segments are all one token) run as one native call for all layers
        (``kernels/decode_rows.cpp``) instead of layer by layer through torch."""
        self._fused_ranges: dict[tuple[int, int], tuple[list[torch.Tensor], list[int], list[float]]] = {}
        self._heads: int = config.num_attention_heads
        self._kv_heads: int = config.num_key_value_heads
        self._head_dim: int = getattr(config, "head_dim", None) or config.hidden_size // self._heads
        self._intermediate: int = config.intermediate_size
        self._scaling: float = next(iter(layers.values())).scaling if layers else 1.0

    def run(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Cache,
            first: int, last: int) -> torch.Tensor:
        """Layers ``first..last`` on one token's ``hidden`` (``[1, 1, hidden]``), appending to ``cache``.

        ``cos``/``sin`` are the rotary embedding of the token's position (``[1, 1, head_dim]``):
        a batch of one row (:meth:`run_rows`).
        """
        return self.run_rows(hidden, cos, sin, (cache,), first, last)

    def run_rows(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, caches: Sequence[Cache],
                 first: int, last: int) -> torch.Tensor:
        """Layers ``first..last`` on one token of each of B sessions: ``hidden`` is ``[B, 1, hidden]``.

        Row ``i`` is the next token of the session whose cache is ``caches[i]``;
        ``cos``/``sin`` (``[B, 1, head_dim]``) are each row's own position. The
        products run once over all B rows; attention runs per row against its
        own cache, whatever its length. Row ``i`` of the result is what
        :meth:`run` gives for that row alone, up to the rounding of a B-row
        matrix product (see ``docs/architecture.md``, batched steps).
        """
        rows = len(caches)
        if hidden.shape[0] != rows or hidden.shape[1] != 1:
            raise ValueError(f"rows must be [B, 1, hidden] with one cache each, got {list(hidden.shape)} "
                             f"and {rows} caches")
        out = self.run_ragged(hidden.view(1, rows, -1), cos.view(1, rows, -1), sin.view(1, rows, -1),
                              [(cache, 1) for cache in caches], first, last)
        return out.view(rows, 1, -1)

    def run_chunk(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Cache,
                  first: int, last: int) -> torch.Tensor:
        """Layers ``first..last`` on ``n`` consecutive tokens of one session (``hidden`` ``[1, n, hidden]``).

        The path of quantized shards, whose layers exist only here: a prompt
        chunk attends causally to the cache and to itself (each token to the
        ones before it), in float32 on a CPU as a decode step does.
        """
        if hidden.ndim != 3 or hidden.shape[0] != 1:
            raise ValueError(f"a chunk must be [1, n, hidden], got {list(hidden.shape)}")
        return self.run_ragged(hidden, cos, sin, [(cache, int(hidden.shape[1]))], first, last)

    def run_ragged(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   segments: Sequence[tuple[Cache, int]], first: int, last: int) -> torch.Tensor:
        """Layers ``first..last`` on the tokens of several sessions laid end to end: ``hidden`` ``[1, T, hidden]``.

        ``segments`` are ``(cache, n)`` in order: the next ``n`` positions of
        ``hidden`` are ``n`` consecutive tokens of that cache's session (a decode
        row is ``n = 1``, a prompt chunk more), ``cos``/``sin`` (``[1, T,
        head_dim]``) each position's own rotary embedding. Every product runs
        once over all ``T`` positions (one pass over the weights for the whole
        turn, which is what makes chunked prefill cheap beside decode rows);
        attention runs per segment against its own cache, causally within a
        chunk. Rows and chunks are this with one kind of segment.
        """
        total = sum(n for _, n in segments)
        if hidden.ndim != 3 or hidden.shape[0] != 1 or hidden.shape[1] != total or min(n for _, n in segments) < 1:
            raise ValueError(f"ragged positions must be [1, T, hidden] with T the sum of the segments "
                             f"{[n for _, n in segments]}, got {list(hidden.shape)}")
        if self.fused:
            rows = [index for index, (cache, n) in enumerate(segments) if n == 1 and _fusable(cache, first, last)]
            if len(rows) == len(segments):
                out = self._run_fused(hidden, cos, sin, [cache for cache, _ in segments], first, last)
                if out is not None:
                    return out
            elif rows:
                out = self._run_apart(hidden, cos, sin, segments, rows, first, last)
                if out is not None:
                    return out
        return self._run_layers(hidden, cos, sin, segments, first, last)

    def _run_apart(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   segments: Sequence[tuple[Cache, int]], rows: Sequence[int], first: int,
                   last: int) -> torch.Tensor | None:
        """A turn mixing decode rows with prompt chunks (or with rows the native call cannot take): the rows in
        one native call, the rest layer by layer, each position's output put back in its place; ``None``
        (nothing changed) where the native call cannot take the rows.

        Why apart: the native call and the layer-by-layer path round differently (``tests/test_decode_rows.py``),
        so a row run in the ragged pass beside a chunk would not be the bits it is alone or beside other rows.
        Kept apart, a row's output is the same whatever shares its turn, which is what lets a spot check
        compare two replicas' hidden states by exact hash (:func:`services.node.model.rows_exact.rows_exact_path`).
        It costs a second pass over the weights in such a turn (one decode step's worth beside the chunk's)."""
        starts = list(itertools.accumulate((n for _, n in segments), initial=0))
        row_set = set(rows)
        row_at = torch.tensor([starts[index] for index in rows])
        rest_at = torch.tensor([at for index in range(len(segments)) if index not in row_set
                                for at in range(starts[index], starts[index + 1])])
        fused = self._run_fused(hidden[:, row_at], cos[:, row_at], sin[:, row_at],
                                [segments[index][0] for index in rows], first, last)
        if fused is None:
            return None
        rest = self._run_layers(hidden[:, rest_at], cos[:, rest_at], sin[:, rest_at],
                                [segment for index, segment in enumerate(segments) if index not in row_set],
                                first, last)
        out = torch.empty_like(hidden)
        out[:, row_at] = fused.to(out.dtype)
        out[:, rest_at] = rest
        return out

    def _run_layers(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    segments: Sequence[tuple[Cache, int]], first: int, last: int) -> torch.Tensor:
        """Layers ``first..last`` one at a time through torch (the packed products through their kernel)."""
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        for index in range(first, last + 1):
            hidden = self._layer(index, hidden, cos, sin, segments)
        return hidden

    def _run_fused(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, caches: Sequence[Cache],
                   first: int, last: int) -> torch.Tensor | None:
        """Decode rows through layers ``first..last`` in one native call, or ``None`` (nothing changed) where
        the call cannot take them: rows not float32 on a CPU, too many, or a cache layer not a growing one
        holding the session's prompt. Each cache layer gets room for the row first and counts it after."""
        rows = len(caches)
        if hidden.dtype != torch.float32 or hidden.device.type != "cpu" or rows > NATIVE_MAX_ROWS \
                or not quant_kernel.decode_rows_ready():
            return None
        layers = [cache.layers[index] for index in range(first, last + 1) for cache in caches]
        keys, values, lengths = [], [], []
        for layer in layers:
            if not isinstance(layer, GrowingLayer) or not layer.make_room(1):
                return None
            key_buffer, value_buffer = layer.buffers  # type: ignore[misc]
            keys.append(key_buffer)
            values.append(value_buffer)
            lengths.append(layer.get_seq_length())
        if len({key.dtype for key in keys} | {value.dtype for value in values}) != 1:
            return None
        weights, bits, eps = self._fused_range(first, last)
        width = hidden.shape[-1]
        out = quant_kernel.decode_rows(hidden.reshape(rows, width), cos.reshape(rows, -1), sin.reshape(rows, -1),
                                       weights, bits, eps, keys, values, lengths, self._scaling, self._heads,
                                       self._kv_heads)
        for layer in layers:
            layer.advance(1)
        return out.view(1, rows, width)

    def _fused_range(self, first: int, last: int) -> tuple[list[torch.Tensor], list[int], list[float]]:
        """The native call's weight, bits and eps lists for layers ``first..last`` (made once per range)."""
        key = (first, last)
        if key not in self._fused_ranges:
            assert self._fused is not None
            weights: list[torch.Tensor] = []
            bits: list[int] = []
            eps: list[float] = []
            for index in range(first, last + 1):
                layer_weights, layer_bits, layer_eps = self._fused[index]
                weights.extend(layer_weights)
                bits.extend(layer_bits)
                eps.extend(layer_eps)
            self._fused_ranges[key] = (weights, bits, eps)
        return self._fused_ranges[key]

    def _layer(self, index: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               segments: Sequence[tuple[Cache, int]]) -> torch.Tensor:
        w = self._layers[index]
        total = x.shape[1]
        heads, kv_heads, dim = self._heads, self._kv_heads, self._head_dim
        qkv = _product(_rms_norm(x, w.input_norm, w.input_eps), w.qkv, w.qkv_bias)
        q, k, v = qkv.view(1, total, heads + 2 * kv_heads, dim).transpose(1, 2).split([heads, kv_heads, kv_heads], 1)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        wide = _attention_dtype(x)
        attended = []
        at = 0
        for cache, n in segments:
            keys, values = cache.layers[index].update(k[:, :, at:at + n], v[:, :, at:at + n])
            if n == 1 and self.grouped_rows:  # a decode row: each KV head's query heads attend as one group
                grouped = q[:, :, at:at + 1].reshape(1, kv_heads, heads // kv_heads, dim)
                attended.append(_grouped_row_attention(grouped.to(wide), keys, values,  # as cached: widened as read
                                                       w.scaling).reshape(1, heads, 1, dim))
            else:
                attended.append(F.scaled_dot_product_attention(
                    q[:, :, at:at + n].to(wide), keys.to(wide), values.to(wide),
                    attn_mask=_causal(n, keys.shape[2], x), scale=w.scaling, enable_gqa=True))
            at += n
        joined = (attended[0] if len(attended) == 1 else torch.cat(attended, 2)).to(x.dtype)
        x = x + _product(joined.transpose(1, 2).reshape(1, total, heads * dim), w.out, w.out_bias)
        return self._mlp(w, x)

    def _mlp(self, w: _LeanLayer, x: torch.Tensor) -> torch.Tensor:
        gate, up = _product(_rms_norm(x, w.post_norm, w.post_eps), w.gate_up, w.gate_up_bias).split(
            [self._intermediate, self._intermediate], -1)
        return x + _product(F.silu(gate) * up, w.down, w.down_bias)


def _fusable(cache: Cache, first: int, last: int) -> bool:
    """Whether a decode row of ``cache``'s session can take the native call: every layer's cache a growing one
    already holding the session's earlier positions (a session's first step, one token, cannot)."""
    return all(isinstance(layer, GrowingLayer) and layer.buffers is not None
               for layer in (cache.layers[index] for index in range(first, last + 1)))


def _fused_layers(layers: dict[int, _LeanLayer]) -> dict[int, tuple[list[torch.Tensor], list[int], list[float]]] | None:
    """Each layer's norms, packed matrices and scales, bits and eps for the native decode-rows call, or ``None``
    when a layer cannot take it (a float or torch-layout matrix, a bias, norms not float32) or the scaling
    differs between layers."""
    if len({layer.scaling for layer in layers.values()}) != 1:
        return None
    fused = {}
    for index, layer in layers.items():
        matrices = (layer.qkv, layer.out, layer.gate_up, layer.down)
        if any(not isinstance(m, QuantMatrix) or m.layout != "native" for m in matrices) \
                or any(b is not None for b in (layer.qkv_bias, layer.out_bias, layer.gate_up_bias, layer.down_bias)) \
                or any(n.dtype != torch.float32 or not n.is_contiguous() for n in (layer.input_norm, layer.post_norm)):
            return None
        weights = [layer.input_norm, layer.post_norm]
        for matrix in matrices:
            assert isinstance(matrix, QuantMatrix)
            weights.extend((matrix.packed, matrix.scale_zeros))
        fused[index] = (weights, [m.bits for m in matrices], [layer.input_eps, layer.post_eps])  # type: ignore[union-attr]
    return fused


ROW_KERNEL_CACHE_DTYPES: Final = (torch.float32, torch.float16, torch.bfloat16)
"""Cache formats meshnet's row-attention kernel reads (widening 16-bit ones to float32 as it loads them)."""


def _grouped_row_attention(grouped: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                           scaling: float) -> torch.Tensor:
    """One decode row's attention, each KV head's query heads as one group: ``[1, kv, G, dim]`` against
    ``[1, kv, L, dim]`` keys and values.

    A decode row's attention should cost the read of its keys and values.
    torch's CPU flash attention is blocked for long runs of queries and took
    twice that for the handful a row has; meshnet's kernel
    (``kernels/row_attention.cpp``) reads each key and value once for the
    whole group, at about the speed of reading them (the default model, 30
    layers of 2,048 cached positions, one thread: 10.0 ms in torch's, 5.6 in
    the kernel, 5.4 to sum the same bytes; 2.9 from a float16 cache). Without the kernel (no AVX-512,
    no build), two matrix products around a softmax on a CPU, the fused
    kernel elsewhere.
    """
    if (grouped.device.type == "cpu" and grouped.dtype == torch.float32 and keys.dtype in ROW_KERNEL_CACHE_DTYPES
            and values.dtype == keys.dtype and keys.stride(-1) == 1 and values.stride(-1) == 1
            and quant_kernel.row_attention_ready()):
        return quant_kernel.row_attention(grouped[0].contiguous(), keys[0], values[0], scaling).unsqueeze(0)
    keys, values = keys.to(grouped.dtype), values.to(grouped.dtype)  # a 16-bit cache (--kv-dtype) read wide
    if grouped.device.type != "cpu":
        return F.scaled_dot_product_attention(grouped, keys, values, scale=scaling)
    scores = torch.matmul(grouped, keys.transpose(-1, -2)).mul_(scaling)
    return torch.matmul(scores.softmax(-1), values)


def _causal(n: int, total: int, x: torch.Tensor) -> torch.Tensor | None:
    """The mask of ``n`` new positions attending to a cache of ``total`` (theirs included): each sees the
    ones before it. ``None`` for one position, which sees the whole cache."""
    if n == 1:
        return None
    return torch.arange(total, device=x.device).unsqueeze(0) <= torch.arange(total - n, total,
                                                                           device=x.device).unsqueeze(1)


def _product(x: torch.Tensor, weight: torch.Tensor | QuantMatrix, bias: torch.Tensor | None) -> torch.Tensor:
    """``x W^T + b``: torch's dense product, or the packed kernel of a quantized matrix."""
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight, bias)
    out = weight.matmul(x)
    return out if bias is None else out + bias

def _attention_dtype(x: torch.Tensor) -> torch.dtype:
    """Format attention is computed in: float32 on a CPU (as :mod:`~services.node.model.chunk_precision` does), else
    the rows' own (a GPU's half-precision attention kernels are fast)."""
    return torch.float32 if x.device.type == "cpu" else x.dtype


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama RMS norm, operation for operation (float32 statistics, then the input's format)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def lean_decoder_for(config: PretrainedConfig, layers: dict[int, nn.Module], dtype: torch.dtype,
                     device: torch.device, mask_kinds: dict[int, str]) -> LeanDecoder | None:
    """A :class:`LeanDecoder` over ``layers`` (weights loaded), or ``None`` where it does not apply.

    Builds the fused tensors and rebinds the layers' projection weights as views of them
    (the same values: transformers' modules compute exactly what they did). Every
    shard of a known structure gets one for batched decode rows; lone decode steps
    take it only in half precision on a CPU (:attr:`LeanDecoder.solo`).
    """
    why_not = _unsupported(config, layers, mask_kinds)
    if why_not is not None:
        logger.info("decode steps run through transformers' modules (rows batch as ragged steps there): %s", why_not)
        return None
    solo = device.type == "cpu" and dtype in HALF_DTYPES
    return LeanDecoder(config, {index: _fuse(layer) for index, layer in layers.items()}, solo=solo)


def quantized_lean_decoder(config: PretrainedConfig, layers: dict[int, nn.Module]) -> LeanDecoder:
    """A :class:`LeanDecoder` over layers whose projections were packed into ``layer.quant``
    (:func:`services.node.model.quant.quant_load.load_quantized`); it runs every step of such a shard, prompts too."""
    return LeanDecoder(config, {index: _quantized(layer) for index, layer in layers.items()}, solo=True,
                       grouped_rows=True)


def _quantized(layer: nn.Module) -> _LeanLayer:
    attn, mlp, quant = layer.self_attn, layer.mlp, layer.quant
    qkv_bias = None if attn.q_proj.bias is None else torch.cat([attn.q_proj.bias, attn.k_proj.bias,
                                                                 attn.v_proj.bias])
    gate_up_bias = None if mlp.gate_proj.bias is None else torch.cat([mlp.gate_proj.bias, mlp.up_proj.bias])
    return _LeanLayer(
        input_norm=layer.input_layernorm.weight, input_eps=float(layer.input_layernorm.variance_epsilon),
        post_norm=layer.post_attention_layernorm.weight,
        post_eps=float(layer.post_attention_layernorm.variance_epsilon),
        qkv=quant["qkv"], qkv_bias=qkv_bias, out=quant["out"], out_bias=attn.o_proj.bias,
        gate_up=quant["gate_up"], gate_up_bias=gate_up_bias, down=quant["down"], down_bias=mlp.down_proj.bias,
        scaling=float(attn.scaling),
    )


def unsupported(config: PretrainedConfig, layers: dict[int, nn.Module], mask_kinds: dict[int, str]) -> str | None:
    """Why the lean path cannot reproduce these layers, or ``None`` when it can (also the quantized path's test)."""
    return _unsupported(config, layers, mask_kinds)


def _unsupported(config: PretrainedConfig, layers: dict[int, nn.Module], mask_kinds: dict[int, str]) -> str | None:
    """Why the lean path cannot reproduce these layers, or ``None`` when it can."""
    if getattr(config, "hidden_act", None) != LEAN_ACTIVATION:
        return f"activation {getattr(config, 'hidden_act', None)!r} is not {LEAN_ACTIVATION}"
    for index, layer in layers.items():
        name = type(layer).__name__
        if name not in LEAN_LAYER_CLASSES:
            return f"layer {index} is a {name}"
        if mask_kinds.get(index) != "full_attention":
            return f"layer {index} uses {mask_kinds.get(index)}"
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None or any(not hasattr(attn, part)
                                              for part in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return f"layer {index} has an unexpected attention module"
        if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
            return f"layer {index} normalises queries and keys per head"
        if any(not hasattr(mlp, part) for part in ("gate_proj", "up_proj", "down_proj")):
            return f"layer {index} has an unexpected MLP"
        if any(not hasattr(norm, "variance_epsilon") or not hasattr(norm, "weight")
               for norm in (layer.input_layernorm, layer.post_attention_layernorm)):
            return f"layer {index} has an unexpected norm"
        biases = {attn.q_proj.bias is None, attn.k_proj.bias is None, attn.v_proj.bias is None}
        if len(biases) > 1 or (mlp.gate_proj.bias is None) != (mlp.up_proj.bias is None):
            return f"layer {index} has biases on some projections only"
    return None


def _fuse(layer: nn.Module) -> _LeanLayer:
    attn, mlp = layer.self_attn, layer.mlp
    qkv, qkv_bias = _fuse_linears(attn.q_proj, attn.k_proj, attn.v_proj)
    gate_up, gate_up_bias = _fuse_linears(mlp.gate_proj, mlp.up_proj)
    return _LeanLayer(
        input_norm=layer.input_layernorm.weight, input_eps=float(layer.input_layernorm.variance_epsilon),
        post_norm=layer.post_attention_layernorm.weight,
        post_eps=float(layer.post_attention_layernorm.variance_epsilon),
        qkv=qkv, qkv_bias=qkv_bias, out=attn.o_proj.weight, out_bias=attn.o_proj.bias,
        gate_up=gate_up, gate_up_bias=gate_up_bias, down=mlp.down_proj.weight, down_bias=mlp.down_proj.bias,
        scaling=float(attn.scaling),
    )


def _fuse_linears(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) stacking ``linears``' outputs; each linear's parameters become views of it."""
    weight = torch.cat([linear.weight.detach() for linear in linears])
    bias = None if linears[0].bias is None else torch.cat([linear.bias.detach() for linear in linears])
    row = 0
    for linear in linears:
        rows = linear.out_features
        linear.weight = nn.Parameter(weight[row:row + rows], requires_grad=False)
        if bias is not None:
            linear.bias = nn.Parameter(bias[row:row + rows], requires_grad=False)
        row += rows
    return weight, bias
