"""Whole synthetic models of real shapes as Q4_K_M GGUF files: random weights, llama.cpp's Q4_K_M type mix.

    PYTHONPATH=libs:. .venv/bin/python -m benchmarks.synthetic_gguf llama-8b      # writes it once, with progress

A :class:`BigShape` is a real model's shape, every layer of it (or, for an
MoE too large for a shared machine, fewer layers of its real layer shape),
with its real vocabulary size, so the file weighs what the real Q4_K_M file
does (Llama-3.1-8B: 4.9 GB). Each matrix gets the type llama.cpp's
``llama_model_quantize`` gives it for ``Q4_K_M`` (:func:`q4_k_m_type`): Q4_K,
with Q6_K for the LM head and, in the layers ``use_more_bits`` picks, for
``attn_v`` and ``ffn_down``; norms and MoE routers F32.

The blocks are written directly, not quantized from float: random integers
with per-block scales chosen so that every weight has a standard deviation of
about ``1/sqrt(inputs)`` and no offset, as a trained layer's roughly has
(quantizing a 16 GB F16 file through llama.cpp would give the same types and
sizes in ten times the time and disk). The arithmetic, the bytes read a token
and the memory are a real model's; only the values are not.

The tokenizer is the test suite's tiny BPE (:mod:`tests.tiny_model`) padded
with unreachable filler tokens to the real vocabulary size; the LM head rows
of its end-of-text tokens have a zero scale, so greedy decoding of the random
model never stops early. Files go to :data:`CACHE` and are written once (a
``.partial`` file renamed at the end; progress logged per layer).
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import numpy as np

from benchmarks.gguf_shapes import Shape, add_hyper_parameters

logger = logging.getLogger(__name__)

CACHE: Final = Path(os.environ.get("MESHNET_BENCH_CACHE", "~/.cache/meshnet/bench")).expanduser()
FORMAT_VERSION: Final = 1
"""In the file name: a change to what is written makes a new file instead of reusing a stale one."""
SEED: Final = 0
SUPER_BLOCK: Final = 256
"""Weights in a K-quant super-block."""
Q4_K_BYTES: Final = 144
"""``block_q4_K``: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles."""
Q6_K_BYTES: Final = 210
"""``block_q6_K``: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, f16 d."""
SCALE_LOW, SCALE_HIGH = 16, 32
"""Each sub-block's 6-bit scale is drawn from ``[SCALE_LOW, SCALE_HIGH)`` (Q4_K) or its int8 scale (Q6_K)."""
MEAN_SCALE: Final = (SCALE_LOW + SCALE_HIGH - 1) / 2
Q4_K_MIN_RATIO: Final = 4
"""Q4_K's ``dmin = Q4_K_MIN_RATIO * d``; each sub-block's min is ``7.5 sc / Q4_K_MIN_RATIO``, which centres its
nibbles (``d sc q - dmin m = d sc (q - 7.5)``)."""
NIBBLE_STD: Final = 4.61
"""Standard deviation of a uniform nibble (0..15)."""
SIX_BIT_STD: Final = 18.47
"""Standard deviation of a uniform 6-bit integer less 32 (-32..31)."""
ROUTER_STD: Final = 0.02
LLAMA_FTYPE_MOSTLY_Q4_K_M: Final = 15
QUANTIZATION_VERSION: Final = 2
ROWS_A_CHUNK: Final = 4096
"""Rows generated at once: bounds the writer's memory whatever the tensor's size."""


@dataclass(frozen=True)
class BigShape:
    """A real model's shape, whole: ``experts`` 0 is a dense model."""

    name: str
    arch: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inner: int
    vocab: int
    rope_base: float
    context: int
    experts: int = 0
    used: int = 0
    real_layers: int = 0
    """The real model's layer count where the file has fewer (0: the file has them all)."""

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def layer_shape(self) -> Shape:
        """One layer's shape, as :mod:`benchmarks.gguf_shapes` names it."""
        return Shape(self.name, self.arch, hidden=self.hidden, heads=self.heads, kv_heads=self.kv_heads,
                     head_dim=self.head_dim, inner=self.inner, experts=self.experts, used=self.used)

    @property
    def file_name(self) -> str:
        return f"{self.name}-{self.layers}L-Q4_K_M-v{FORMAT_VERSION}.gguf"


SHAPES: Final = {
    "llama-8b": BigShape("llama-8b", "llama", layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128,
                         inner=14336, vocab=128256, rope_base=500_000.0, context=8192),
    "qwen3moe-30b-a3b": BigShape("qwen3moe-30b-a3b", "qwen3moe", layers=12, hidden=2048, heads=32, kv_heads=4,
                                 head_dim=128, inner=768, vocab=151936, rope_base=1_000_000.0, context=8192,
                                 experts=128, used=8, real_layers=48),
}
"""Llama-3.1-8B whole; Qwen3-30B-A3B's layer (128 experts of 768, 8 routed) in 12 of its 48 layers."""


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's ``use_more_bits``: the layers a ``_M`` mix gives its wider type (first and last eighth, and
    every third between)."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def q4_k_m_type(tensor: str, layer: int, layers: int) -> str:
    """The ggml type llama.cpp's ``Q4_K_M`` gives matrix ``tensor`` (``attn_v``, ``ffn_down``, ``output``...)
    of ``layer`` (of ``layers``), for models with fewer than 8 experts or none (no Mixtral ``Q8_0`` bump)."""
    if tensor == "output":
        return "Q6_K"
    if tensor in ("attn_v", "ffn_down", "ffn_down_exps") and use_more_bits(layer, layers):
        return "Q6_K"
    return "Q4_K"


def _pack_k4_scales(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """The 12 bytes of ``block_q4_K.scales`` holding eight 6-bit scales and mins (``[..., 8]`` each), the inverse
    of llama.cpp's ``get_scale_min_k4``."""
    sc, m = scales.astype(np.uint8), mins.astype(np.uint8)
    out = np.empty((*sc.shape[:-1], 12), dtype=np.uint8)
    out[..., 0:4] = sc[..., 0:4] | ((sc[..., 4:8] >> 4) << 6)
    out[..., 4:8] = m[..., 0:4] | ((m[..., 4:8] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:8] & 0xF) | ((m[..., 4:8] & 0xF) << 4)
    return out


def _random_bytes(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return np.frombuffer(rng.bytes(int(np.prod(shape))), dtype=np.uint8).reshape(shape)


def q4_k_rows(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """``rows`` random Q4_K rows of ``cols`` weights (module doc), ``uint8 [rows, cols / 256 * 144]``."""
    blocks = cols // SUPER_BLOCK
    d = np.float16(1.0 / (MEAN_SCALE * NIBBLE_STD * np.sqrt(cols)))
    out = np.empty((rows, blocks, Q4_K_BYTES), dtype=np.uint8)
    out[..., 0:2] = np.frombuffer(d.tobytes(), dtype=np.uint8)
    out[..., 2:4] = np.frombuffer(np.float16(Q4_K_MIN_RATIO * float(d)).tobytes(), dtype=np.uint8)
    scales = rng.integers(SCALE_LOW, SCALE_HIGH, size=(rows, blocks, 8), dtype=np.uint8)
    mins = np.minimum(np.rint(7.5 * scales.astype(np.float32) / Q4_K_MIN_RATIO), 63).astype(np.uint8)
    out[..., 4:16] = _pack_k4_scales(scales, mins)
    out[..., 16:] = _random_bytes(rng, (rows, blocks, 128))
    return out.reshape(rows, -1)


def q6_k_rows(rng: np.random.Generator, rows: int, cols: int, silent: tuple[int, ...] = ()) -> np.ndarray:
    """``rows`` random Q6_K rows of ``cols`` weights; rows ``silent`` (indexes into these rows) are all zero."""
    blocks = cols // SUPER_BLOCK
    out = np.empty((rows, blocks, Q6_K_BYTES), dtype=np.uint8)
    out[..., :192] = _random_bytes(rng, (rows, blocks, 192))
    out[..., 192:208] = rng.integers(SCALE_LOW, SCALE_HIGH, size=(rows, blocks, 16), dtype=np.uint8)
    d = np.float16(1.0 / (MEAN_SCALE * SIX_BIT_STD * np.sqrt(cols)))
    out[..., 208:210] = np.frombuffer(d.tobytes(), dtype=np.uint8)
    for row in silent:
        out[row, :, 208:210] = 0
    return out.reshape(rows, -1)


@dataclass(frozen=True)
class _Tensor:
    """One tensor of the file: its name, GGUF byte shape, type and how to make its bytes (in order)."""

    name: str
    byte_shape: tuple[int, ...]
    kind: str
    make: Callable[[], np.ndarray]


def _matrix(rng: np.random.Generator, name: str, kind: str, leading: tuple[int, ...], cols: int,
            silent: tuple[int, ...] = ()) -> _Tensor:
    rows = int(np.prod(leading))
    per_row = cols // SUPER_BLOCK * (Q4_K_BYTES if kind == "Q4_K" else Q6_K_BYTES)

    def make() -> np.ndarray:
        out = np.empty((rows, per_row), dtype=np.uint8)
        for begin in range(0, rows, ROWS_A_CHUNK):
            end = min(rows, begin + ROWS_A_CHUNK)
            if kind == "Q4_K":
                out[begin:end] = q4_k_rows(rng, end - begin, cols)
            else:
                mine = tuple(row - begin for row in silent if begin <= row < end)
                out[begin:end] = q6_k_rows(rng, end - begin, cols, mine)
        return out.reshape(*leading, per_row)

    return _Tensor(name, (*leading, per_row), kind, make)


def _floats(name: str, values: Callable[[], np.ndarray], shape: tuple[int, ...]) -> _Tensor:
    return _Tensor(name, shape, "F32", values)


def _tensors(shape: BigShape, rng: np.random.Generator, silent: tuple[int, ...]) -> Iterator[_Tensor]:
    """Every tensor of ``shape``'s file, in the order llama.cpp's converter writes them."""
    h, n = shape.hidden, shape.layers
    ones = lambda size: lambda: np.ones(size, dtype=np.float32)
    yield _matrix(rng, "token_embd.weight", "Q4_K", (shape.vocab,), h)
    q_rows, kv_rows = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    for layer in range(n):
        blk = f"blk.{layer}"
        yield _floats(f"{blk}.attn_norm.weight", ones(h), (h,))
        yield _matrix(rng, f"{blk}.attn_q.weight", q4_k_m_type("attn_q", layer, n), (q_rows,), h)
        yield _matrix(rng, f"{blk}.attn_k.weight", q4_k_m_type("attn_k", layer, n), (kv_rows,), h)
        yield _matrix(rng, f"{blk}.attn_v.weight", q4_k_m_type("attn_v", layer, n), (kv_rows,), h)
        yield _matrix(rng, f"{blk}.attn_output.weight", q4_k_m_type("attn_output", layer, n), (h,), q_rows)
        if shape.moe:
            d = shape.head_dim
            yield _floats(f"{blk}.attn_q_norm.weight", ones(d), (d,))
            yield _floats(f"{blk}.attn_k_norm.weight", ones(d), (d,))
            experts = shape.experts
            yield _floats(f"{blk}.ffn_gate_inp.weight",
                          lambda experts=experts: rng.standard_normal((experts, h), dtype=np.float32) * ROUTER_STD, (experts, h))
            yield _matrix(rng, f"{blk}.ffn_gate_exps.weight", q4_k_m_type("ffn_gate_exps", layer, n),
                          (experts, shape.inner), h)
            yield _matrix(rng, f"{blk}.ffn_up_exps.weight", q4_k_m_type("ffn_up_exps", layer, n),
                          (experts, shape.inner), h)
            yield _matrix(rng, f"{blk}.ffn_down_exps.weight", q4_k_m_type("ffn_down_exps", layer, n),
                          (experts, h), shape.inner)
        else:
            yield _matrix(rng, f"{blk}.ffn_gate.weight", q4_k_m_type("ffn_gate", layer, n), (shape.inner,), h)
            yield _matrix(rng, f"{blk}.ffn_up.weight", q4_k_m_type("ffn_up", layer, n), (shape.inner,), h)
            yield _matrix(rng, f"{blk}.ffn_down.weight", q4_k_m_type("ffn_down", layer, n), (h,), shape.inner)
        yield _floats(f"{blk}.ffn_norm.weight", ones(h), (h,))
    yield _floats("output_norm.weight", ones(h), (h,))
    yield _matrix(rng, "output.weight", "Q6_K", (shape.vocab,), h, silent)


def _write_padded_tokenizer(writer: object, vocab: int) -> tuple[int, ...]:
    """The test suite's tiny tokenizer padded to ``vocab`` tokens; the ids of its end-of-text tokens."""
    import gguf

    from tests.gguf_models import _write_tokenizer
    from tests.tiny_model import END_OF_TEXT, IM_END, _build_tokenizer

    tokenizer = _build_tokenizer()
    if len(tokenizer) > vocab:
        raise ValueError(f"the tiny tokenizer has {len(tokenizer)} tokens, more than {vocab}")

    class Padded:
        """``writer`` with the token list and types padded by unreachable filler tokens (no merge makes them)."""

        def __getattr__(self, name: str) -> object:
            return getattr(writer, name)

        def add_token_list(self, tokens: list[str]) -> None:
            writer.add_token_list([*tokens, *(f"<fill{i}>" for i in range(vocab - len(tokens)))])  # type: ignore[attr-defined]

        def add_token_types(self, types: list[int]) -> None:
            writer.add_token_types([*types, *[gguf.TokenType.NORMAL] * (vocab - len(types))])  # type: ignore[attr-defined]

    _write_tokenizer(Padded(), tokenizer)  # type: ignore[arg-type]
    return tuple(tokenizer.convert_tokens_to_ids(token) for token in (IM_END, END_OF_TEXT))


def write_big_shape(shape: BigShape, dest: Path = CACHE, *, progress: Callable[[str], None] = logger.info) -> Path:
    """``shape``'s synthetic Q4_K_M file (module doc) under ``dest``: written once, then reused."""
    import gguf

    path = dest / shape.file_name
    if path.exists():
        return path
    dest.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    partial = path.with_suffix(".partial")
    writer = gguf.GGUFWriter(partial, shape.arch)
    writer.add_name(f"synthetic {shape.name} (random Q4_K_M weights)")
    writer.add_file_type(LLAMA_FTYPE_MOSTLY_Q4_K_M)
    writer.add_quantization_version(QUANTIZATION_VERSION)
    add_hyper_parameters(writer, shape.layer_shape, layers=shape.layers, context=shape.context, vocab=shape.vocab,
                         rope_base=shape.rope_base, rms_eps=1e-5 if shape.arch == "llama" else 1e-6)
    silent = _write_padded_tokenizer(writer, shape.vocab)
    rng = np.random.default_rng(SEED)
    tensors = list(_tensors(shape, rng, silent))
    for tensor in tensors:
        kind = gguf.GGMLQuantizationType[tensor.kind]
        dtype = np.dtype(np.float32) if tensor.kind == "F32" else np.dtype(np.uint8)
        nbytes = int(np.prod(tensor.byte_shape)) * dtype.itemsize
        writer.add_tensor_info(tensor.name, tensor.byte_shape, dtype, nbytes,
                               raw_dtype=None if tensor.kind == "F32" else kind)
    total = sum(int(np.prod(t.byte_shape)) * (4 if t.kind == "F32" else 1) for t in tensors)
    progress(f"writing {path.name}: {len(tensors)} tensors, {total / 2**30:.2f} GiB (once)")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    written = 0
    for tensor in tensors:
        data = tensor.make()
        writer.write_tensor_data(data)
        written += data.nbytes
        if tensor.name.endswith("ffn_norm.weight") or tensor.name.startswith(("token_embd", "output.")):
            label = ".".join(tensor.name.split(".")[:2]) if tensor.name.startswith("blk.") else tensor.name
            progress(f"{label}: {written / 2**30:.2f} of {total / 2**30:.2f} GiB, {time.perf_counter() - began:.0f} s")
    writer.close()
    os.replace(partial, path)
    progress(f"{path} written in {time.perf_counter() - began:.0f} s")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("shapes", nargs="+", choices=list(SHAPES))
    parser.add_argument("--dest", type=Path, default=CACHE)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for name in args.shapes:
        write_big_shape(SHAPES[name], args.dest)


if __name__ == "__main__":
    main()
