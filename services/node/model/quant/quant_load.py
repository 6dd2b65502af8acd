"""Loading a shard's layers quantized (``--weights int8|int4|auto``), from a GGUF's blocks or a float checkpoint.

:func:`resolve_format` turns ``--weights`` into the format served: ``auto``
serves a quantized file (the default model's Q4_1 GGUF) in its own format
and a float checkpoint as ``float``. :func:`quantized_problem` says why a
shard cannot be served quantized (then the node loads it as ``float`` and
logs the reason): this quantized path is the lean decoder's
(:mod:`services.node.model.lean_decode`), so it takes exactly the layers that path
knows, on a CPU, with matrices the packed format holds (a GGUF's other layer
structures are packed in place instead: :mod:`services.node.model.packed_layers`).

:func:`load_quantized` reads each matrix on its own and packs it at once, so
the node never holds a float copy of its layers: from a GGUF, the blocks of
a type served packed (:func:`packed_from_gguf`: Q4_0, Q4_1, Q4_K as int4;
Q5_0, Q5_1, Q5_K, Q6_K, Q8_0 as int8) become the packed format directly (the
integers as they are, the scales rounded to bfloat16) when its format is the
one asked for, or a narrower one under the file's widest (``auto``'s pick:
:func:`holds_packed`), so a Q4_K_M file's Q4_K, Q5_0, Q6_K and Q8_0 matrices
are each held as they are; another type (of another width than asked for, or
one not served packed: Q2_K, Q3_K, IQ*, for which ``auto`` loads the shard as
float and says why) is dequantized and requantized one matrix at a time; from safetensors, each float matrix is quantized as it
is read. The token embedding and the LM head (one matrix
when tied, as in SmolLM2) are held in int8 in both modes: in bfloat16 they
alone would be 56 MB of the default model's 98 MB file.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Final, Literal, Protocol

import numpy as np
import torch
from safetensors import safe_open
from torch import nn
from transformers import PretrainedConfig

from services.node.model.quant.gguf_file import GgufFile, TensorEntry, read_index
from services.node.model.quant.packed import (
    FORMAT_BITS,
    GGUF_BLOCK_BYTES,
    GGUF_FORMAT,
    GROUP_SIZE,
    PACK_ROWS,
    Groups,
    QuantEmbedding,
    QuantFormat,
    QuantLinear,
    QuantMatrix,
    dequantize_groups,
    gguf_groups,
    groups_of,
    permute_rows,
    shape_problem,
    stack,
)

logger = logging.getLogger(__name__)

WeightsMode = Literal["auto", "float", "int8", "int4"]
WeightsFormat = Literal["float", "int8", "int4"]
EMBEDDING_FORMAT: Final[QuantFormat] = "int8"
"""Format of a quantized shard's token embedding and LM head (module doc)."""

ATTENTION: Final = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP: Final = ("gate_proj", "up_proj", "down_proj")
EMBED_KEY: Final = "model.embed_tokens.weight"
LM_HEAD_KEY: Final = "lm_head.weight"

_GGUF_LAYER_NAMES: Final = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}
_FLOAT_VIEWS: Final = {"F32": np.float32, "F16": np.float16}
PERMUTED_QK: Final = frozenset({"llama", "mistral", "mixtral"})
"""Model types whose GGUF holds q/k rows in llama.cpp's rotary order (its converter permutes ``llama`` files)."""
_GGUF_NAMES: Final = {EMBED_KEY: "token_embd.weight", "model.norm.weight": "output_norm.weight",
                      LM_HEAD_KEY: "output.weight"}


def _layer_kinds(gguf: Path) -> set[str]:
    tensors, _ = read_index(gguf)
    return _matrix_kinds(tensors.values())


ROUTER_TENSOR: Final = ".ffn_gate_inp."
"""An MoE layer's router: llama.cpp keeps it in float in every file type, and so does a packed shard."""


def _matrix_kinds(tensors: Iterable[TensorEntry]) -> set[str]:
    """The types of a file's layer matrices (an MoE layer's 3-D experts included; its float router not)."""
    return {t.kind for t in tensors if t.name.startswith("blk.") and t.name.endswith(".weight")
            and len(t.shape) in (2, 3) and ROUTER_TENSOR not in t.name}


def kinds_format(kinds: Iterable[str]) -> QuantFormat | None:
    """The widest format GGUF types ``kinds`` are held in packed, or ``None`` when one is not served packed."""
    formats = {GGUF_FORMAT.get(kind) for kind in kinds}
    if not formats or None in formats:
        return None
    return max(formats, key=lambda fmt: FORMAT_BITS[fmt])  # type: ignore[arg-type]


def gguf_format(gguf: Path) -> QuantFormat | None:
    """The widest format the decoder-layer matrices of ``gguf`` are held in packed (each in its own:
    :func:`packed_from_gguf`), or ``None`` when one of their types is not served packed (float, Q2_K, IQ*)."""
    return kinds_format(_layer_kinds(gguf))


def resolve_format(mode: WeightsMode, gguf: Path | None) -> tuple[WeightsFormat, str]:
    """The format to serve for ``--weights mode`` and why (a quantized file's own under ``auto``)."""
    if mode != "auto":
        return mode, f"--weights {mode}"
    if gguf is None:
        return "float", "--weights auto: the checkpoint is float"
    native = gguf_format(gguf)
    if native is None:
        others = sorted(kind for kind in _layer_kinds(gguf) if kind not in GGUF_FORMAT)
        return "float", (f"--weights auto: {gguf.name}'s layers hold {', '.join(others)}, not served packed "
                         f"(packed: {', '.join(GGUF_FORMAT)}), so they load as float")
    kinds = ", ".join(sorted(_layer_kinds(gguf)))
    return native, f"--weights auto: {gguf.name} holds its layers in {kinds}, each served packed as it is"


def holds_packed(kind: str, fmt: QuantFormat, file_format: QuantFormat | None) -> bool:
    """Whether a GGUF type is served as it is under ``fmt``: its format family is ``fmt``, or it is narrower and
    ``fmt`` is the file's own (``file_format``, :func:`kinds_format` of its layers), so ``auto`` serves a Q4_K_M
    file's Q4_K, Q5_0 and Q6_K matrices each as it is, while ``--weights int8`` of a Q4_1 file still requantizes
    its layers to int8 as before."""
    held = GGUF_FORMAT.get(kind)
    return held == fmt or (held is not None and FORMAT_BITS[held] < FORMAT_BITS[fmt] and fmt == file_format)


def packed_from_gguf(kind: str, raw: np.ndarray, rows: int, cols: int, fmt: QuantFormat,
                     file_format: QuantFormat | None) -> Groups | None:
    """A GGUF tensor's blocks (type ``kind``, ``rows x cols`` weights, its raw bytes) as the packed format's
    groups, exactly (the file's integers, its scales rounded to bfloat16), when :func:`holds_packed` (types
    and their families: :data:`~services.node.model.quant.packed.GGUF_FORMAT`, Q4_0/Q4_1/Q4_K int4, Q5_0/Q5_1/
    Q5_K int5 and Q6_K/Q8_0 int8 in the int8 family); ``None`` when not (a float type, Q2_K, IQ*, or a type
    of another width than asked for): then the caller dequantizes it and quantizes the floats to ``fmt``."""
    if not holds_packed(kind, fmt, file_format):
        return None
    return gguf_groups(kind, raw, rows, cols)


def quantized_problem(config: PretrainedConfig, device: torch.device,
                      lean_problem: str | None) -> str | None:
    """Why a shard of ``config`` on ``device`` cannot be served quantized, or ``None`` when it can."""
    if device.type != "cpu":
        return f"the packed int4 kernel wired here is the CPU one, and this node runs on {device}"
    if lean_problem is not None:
        return f"the quantized path is the lean decoder's, which cannot take these layers: {lean_problem}"
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    hidden, inner = config.hidden_size, config.intermediate_size
    for name, rows, cols in (("q/k/v", (heads + 2 * kv_heads) * dim, hidden), ("o", hidden, heads * dim),
                             ("gate/up", 2 * inner, hidden), ("down", hidden, inner),
                             ("embedding", config.vocab_size, hidden)):
        if (problem := shape_problem(rows, cols)) is not None:
            return f"the {name} matrix: {problem}"
    return None


class TensorSource(Protocol):
    """Where a quantized shard's tensors come from, one at a time."""

    def float_tensor(self, key: str) -> torch.Tensor | None:
        """The float tensor named ``key`` (checkpoint names), or ``None`` when the source lacks it."""

    def groups(self, key: str, fmt: QuantFormat) -> Groups | None:
        """The matrix named ``key`` quantized to ``fmt``, or ``None`` when the source lacks it."""

    def matrix(self, key: str, fmt: QuantFormat) -> QuantMatrix | None:
        """The matrix named ``key`` packed in ``fmt``, built a slice of rows at a time where the source can."""


class SafetensorsSource:
    """A float checkpoint: each matrix is quantized as it is read."""

    def __init__(self, folder: Path) -> None:
        self._where: dict[str, Path] = {}
        for file in sorted(folder.glob("*.safetensors")):
            with safe_open(str(file), framework="pt", device="cpu") as reader:
                for key in reader.keys():  # noqa: SIM118 - safe_open is not a mapping
                    self._where[key] = file

    def float_tensor(self, key: str) -> torch.Tensor | None:
        file = self._where.get(key)
        if file is None:
            return None
        with safe_open(str(file), framework="pt", device="cpu") as reader:
            return reader.get_tensor(key)

    def groups(self, key: str, fmt: QuantFormat) -> Groups | None:
        weight = self.float_tensor(key)
        return None if weight is None else groups_of(weight, fmt)

    def matrix(self, key: str, fmt: QuantFormat) -> QuantMatrix | None:
        groups = self.groups(key, fmt)
        return None if groups is None else QuantMatrix(groups)


class GgufSource:
    """A GGUF file: blocks of a type served packed become the packed format without a float copy (module doc)."""

    def __init__(self, gguf: Path, config: PretrainedConfig) -> None:
        self.path = gguf
        self._file = GgufFile(gguf)
        self._own_format = kinds_format(_matrix_kinds(self._file.tensors.values()))
        self._heads: int = config.num_attention_heads
        self._kv_heads: int = config.num_key_value_heads
        self._permuted = config.model_type in PERMUTED_QK
        """Whether the file holds q/k rows in llama.cpp's rotary order (``llama`` files; not Qwen's)."""

    def _name(self, key: str) -> str:
        if key in _GGUF_NAMES:
            return _GGUF_NAMES[key]
        parts = key.split(".")  # model.layers.I.<module path>.weight|bias
        module, leaf = ".".join(parts[3:-1]), parts[-1]
        return f"blk.{parts[2]}.{_GGUF_LAYER_NAMES.get(module, module)}.{leaf}"

    def float_tensor(self, key: str) -> torch.Tensor | None:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        name = self._name(key)
        tensor = self._file.tensors.get(name)
        if tensor is None:
            return None
        with self._file.borrowed(name) as raw:  # every branch copies the bytes it reads
            if tensor.kind in GGUF_BLOCK_BYTES and len(tensor.shape) == 2:  # our own reader: gguf-py's is slow
                return self._unpermute(key, dequantize_groups(gguf_groups(tensor.kind, raw, *tensor.shape)))
            if tensor.kind in _FLOAT_VIEWS:
                values = raw.view(_FLOAT_VIEWS[tensor.kind])
            else:
                values = dequantize(raw, GGMLQuantizationType[tensor.kind])
            flat = torch.from_numpy(np.array(values, dtype=np.float32))
        return self._unpermute(key, flat.reshape(tensor.shape))

    def groups(self, key: str, fmt: QuantFormat) -> Groups | None:
        name = self._name(key)
        tensor = self._file.tensors.get(name)
        if tensor is None or len(tensor.shape) != 2:
            return None
        rows, cols = tensor.shape
        with self._file.borrowed(name) as raw:  # gguf_groups copies the blocks
            groups = packed_from_gguf(tensor.kind, raw, rows, cols, fmt, self._own_format)
        if groups is None:  # a wider or a float type: this one matrix goes through float
            weight = self.float_tensor(key)
            return None if weight is None else groups_of(weight, fmt)
        order = self._row_order(key, rows)
        return groups if order is None else permute_rows(groups, order)

    def matrix(self, key: str, fmt: QuantFormat) -> QuantMatrix | None:
        name = self._name(key)
        tensor = self._file.tensors.get(name)
        if (tensor is None or len(tensor.shape) != 2 or not holds_packed(tensor.kind, fmt, self._own_format)
                or self._row_order(key, tensor.shape[0]) is not None):
            groups = self.groups(key, fmt)
            return None if groups is None else QuantMatrix(groups)
        rows, cols = tensor.shape
        with self._file.borrowed(name) as raw:  # packed slice by slice, each slice's blocks copied
            return QuantMatrix.from_parts(gguf_groups(tensor.kind, raw[row:row + PACK_ROWS],
                                                      len(raw[row:row + PACK_ROWS]), cols)
                                          for row in range(0, rows, PACK_ROWS))

    def _row_order(self, key: str, rows: int) -> torch.Tensor | None:
        """llama.cpp's rotary row order of q/k undone (as transformers' GGUF loader does)."""
        if not self._permuted:
            return None
        if ".q_proj." in key:
            heads = self._heads
        elif ".k_proj." in key:
            heads = self._kv_heads
        else:
            return None
        return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows)

    def _unpermute(self, key: str, weight: torch.Tensor) -> torch.Tensor:
        order = self._row_order(key, weight.shape[0]) if weight.ndim >= 1 else None
        return weight if order is None else weight[order]


class QuantHeld(nn.Module):
    """Stands in for a projection whose weight the lean decoder holds packed; keeps its bias, if any."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this projection is held quantized: its layer runs through the lean decoder only")


def strip_linears(layers: dict[int, nn.Module]) -> None:
    """Replace each layer's projections with :class:`QuantHeld` (their weights will be packed, not loaded)."""
    for layer in layers.values():
        for parent, names in ((layer.self_attn, ATTENTION), (layer.mlp, MLP)):
            for name in names:
                setattr(parent, name, QuantHeld(getattr(parent, name)))


def load_quantized(source: TensorSource, modules: nn.Module, layers: dict[int, nn.Module],
                   fmt: QuantFormat, dtype: torch.dtype, *, has_embedding: bool, has_head: bool,
                   tied: bool, progress: Callable[[str], None] = logger.info) -> None:
    """Pack every projection of ``layers`` (and the embedding / LM head held here) into ``layer.quant``.

    The layers' projections must already be :class:`QuantHeld` (:func:`strip_linears`).
    """
    for count, (index, layer) in enumerate(layers.items(), 1):
        prefix = f"model.layers.{index}."

        def read(name: str, prefix: str = prefix) -> Groups:
            groups = source.groups(f"{prefix}{name}.weight", fmt)
            if groups is None:
                raise ValueError(f"the weights lack {prefix}{name}.weight")
            return groups

        layer.quant = nn.ModuleDict({
            "qkv": QuantMatrix(stack([read(f"self_attn.{p}") for p in ATTENTION[:3]])),
            "out": QuantMatrix(read("self_attn.o_proj")),
            "gate_up": QuantMatrix(stack([read("mlp.gate_proj"), read("mlp.up_proj")])),
            "down": QuantMatrix(read("mlp.down_proj")),
        })
        if count % 5 == 0 or count == len(layers):
            progress(f"packed {count}/{len(layers)} layers as {fmt}")
    load_embedding_and_head(source, modules, dtype, has_embedding=has_embedding, has_head=has_head, tied=tied)


def load_embedding_and_head(source: TensorSource, modules: nn.Module, dtype: torch.dtype, *, has_embedding: bool,
                            has_head: bool, tied: bool, embed_scale: float | None = None) -> None:
    """The token embedding and the LM head held here, packed in :data:`EMBEDDING_FORMAT` (one matrix when
    tied); ``embed_scale`` is a scaled embedding's factor (Gemma)."""
    if not (has_embedding or has_head):
        return
    key = EMBED_KEY if (has_embedding or tied) else LM_HEAD_KEY
    matrix = source.matrix(key, EMBEDDING_FORMAT)
    if matrix is None:
        raise ValueError(f"the weights lack {key}")
    if has_embedding:
        modules.model.embed_tokens = QuantEmbedding(matrix, dtype, embed_scale)
    if has_head:
        if not tied and has_embedding:
            head = source.matrix(LM_HEAD_KEY, EMBEDDING_FORMAT)
            if head is None:
                raise ValueError(f"the weights lack {LM_HEAD_KEY}")
            matrix = head
        modules.lm_head = QuantLinear(matrix)


M_MMAP_THRESHOLD: Final = -3
"""glibc ``mallopt`` parameter: allocations from this size on get their own pages, returned when freed."""
LOAD_MMAP_THRESHOLD: Final = 128 << 10
"""While packing: every transient of a matrix is returned to the system as soon as it is freed."""
SERVE_MMAP_THRESHOLD: Final = 32 << 20
"""After loading: glibc's own ceiling for its dynamic threshold, so steps reuse heap memory as before."""


@contextmanager
def returned_transients() -> Iterator[None]:
    """Keep the packing's large transients from staying in the process after the load.

    glibc raises its mmap threshold each time a large block is freed, so the
    int32 copy a packing call takes (tens of MB for an embedding) comes from
    the heap the next time and its pages are kept: measured on the default
    model's tail, 390 MiB of peak growth for 65 MiB of weights, against 200
    MiB with the threshold fixed. A no-op where the C library is not glibc.
    """
    libc = _glibc()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, LOAD_MMAP_THRESHOLD)
    try:
        yield
    finally:
        if libc is not None:
            libc.mallopt(M_MMAP_THRESHOLD, SERVE_MMAP_THRESHOLD)
            libc.malloc_trim(0)


def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def float_state(source: TensorSource, wanted: set[str], dtype: torch.dtype,
                device: torch.device) -> dict[str, torch.Tensor]:
    """The float tensors named ``wanted`` (norms, biases) from ``source``, cast to ``dtype``."""
    state: dict[str, torch.Tensor] = {}
    for key in sorted(wanted):
        tensor = source.float_tensor(key)
        if tensor is None:
            raise ValueError(f"the weights lack {key}")
        state[key] = tensor.to(device=device, dtype=dtype) if tensor.is_floating_point() else tensor.to(device)
    return state


__all__ = ["GGUF_BLOCK_BYTES", "GROUP_SIZE", "GgufSource", "QuantHeld", "SafetensorsSource", "WeightsFormat",
           "WeightsMode", "float_state", "load_embedding_and_head", "load_quantized", "quantized_problem", "resolve_format",
           "strip_linears"]
