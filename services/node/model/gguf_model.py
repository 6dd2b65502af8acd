"""``--model FILE.gguf``: a GGUF file served as it is, its metadata in a small folder, its tensors read in place.

:func:`prepare_gguf_folder` reads the file's metadata once
(:mod:`services.node.model.gguf_config` for the config, transformers' GGUF
tokenizer reader for the tokenizer, chat template and special tokens) and
writes what every other part of the node reads from a model folder
(``config.json``, ``generation_config.json``, the tokenizer files) into a
folder under the cache, named after the file, with :data:`GGUF_MARKER` naming
the file. No weight is converted or copied: a shard reads only its own
tensors from the memory-mapped file (:class:`GgufWeights`), so a node holds
its share of the model, not the file.

:class:`GgufWeights` names each transformers parameter's tensor in the file
and undoes what llama.cpp's converter did to it: the rotary row order of
query and key projections in ``llama`` files, the ``+1`` folded into
Gemma's norms, and the experts of an MoE layer stored as one tensor each for
gate, up and down (transformers fuses gate and up).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Final, Self

import filelock
import numpy as np
import torch
from transformers import GenerationConfig, PretrainedConfig

from services.node.model.gguf_config import (
    SERVED_ARCHITECTURES,
    GgufConfigError,
    generation_defaults,
    hf_config,
)
from services.node.model.quant.gguf_file import (
    SPLIT_NAME,
    GgufError,
    GgufFile,
    read_architecture,
    read_index,
    split_parts,
)

logger = logging.getLogger(__name__)

GGUF_MARKER: Final = "meshnet-gguf.json"
"""File in a GGUF's metadata folder naming the GGUF (absolute path, size, mtime); written last."""
FOLDER_FORMAT: Final = 1
"""Version of the metadata folder's layout; another version is prepared again."""
FOLDER_MODE: Final = 0o755
LOCK_TIMEOUT_S: Final = 600.0
"""Longest wait for another process preparing the same file's folder (a large vocabulary takes tens of seconds)."""
PERMUTED_QK: Final = frozenset({"llama", "mistral", "mixtral"})
"""Model types whose GGUF holds q/k rows in llama.cpp's rotary order (its converter permutes ``llama`` files)."""
ONE_PLUS_NORMS: Final = frozenset({"gemma2", "gemma3_text"})
"""Model types whose GGUF norms hold ``1 + w`` (llama.cpp's converter adds the one Gemma's norm applies)."""
ROPE_FREQS: Final = "rope_freqs.weight"
"""Llama 3.x's rope scaling, as llama.cpp stores it: one divisor per rotary frequency."""
_FLOAT_VIEWS: Final = {"F32": np.float32, "F16": np.float16}
_GLOBAL_NAMES: Final = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                        "lm_head.weight": "output.weight"}
_LAYER_NAMES: Final = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",  # Phi-3's fused projections
}
_GEMMA_LAYER_NAMES: Final = {**_LAYER_NAMES, "post_attention_layernorm": "post_attention_norm",
                             "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}


class GgufModelError(ValueError):
    """The GGUF cannot be served; the message says why in one line."""


def is_gguf(path: Path) -> bool:
    """Whether ``path`` names a GGUF file (by its name; the content is checked when read)."""
    return path.suffix.lower() == ".gguf"


def gguf_of_folder(folder: Path) -> Path | None:
    """The GGUF a metadata folder was prepared from, or ``None`` for any other folder."""
    try:
        marker = json.loads((folder / GGUF_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    gguf = Path(marker.get("gguf", ""))
    return gguf if gguf.is_file() else None


def read_metadata(gguf: Path) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    """The metadata of a GGUF (the first part of a split set holds it) and every tensor's shape, by name."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(gguf)
    except (OSError, ValueError) as exc:
        raise GgufModelError(f"{gguf} is not a readable GGUF file: {exc}") from exc
    meta: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        try:
            meta[name] = field.contents()
        except (ValueError, UnicodeDecodeError):
            continue
    tensors = {name: entry.shape for name, entry in GgufFile(gguf).tensors.items()}  # every part's
    return meta, tensors


def gguf_config(gguf: Path) -> tuple[PretrainedConfig, dict[str, Any]]:
    """The transformers config of a GGUF's model and its metadata; a one-line :class:`GgufModelError` when not served."""
    try:
        meta, tensors = read_metadata(gguf)
        return hf_config(meta, tensors), meta
    except (GgufConfigError, GgufError) as exc:
        raise GgufModelError(f"{gguf.name}: {exc}") from exc


def check_servable(gguf: Path) -> None:
    """Refuse, in one line, a GGUF whose architecture or tensor formats meshnet does not serve (fast: the
    header only), so a node says so at start rather than fail while loading."""
    if not gguf.is_file():
        raise GgufModelError(f"{gguf} does not exist")
    try:
        parts = split_parts(gguf)  # first: a later part of a split set is refused by name
        arch = read_architecture(gguf)
        if arch not in SERVED_ARCHITECTURES:
            raise GgufModelError(f"{gguf.name}: GGUF architecture {arch!r} is not served; served: "
                                 f"{', '.join(SERVED_ARCHITECTURES)}")
        kinds: set[str] = set()
        for part in parts:
            kinds |= {entry.kind for entry in read_index(part)[0].values()}
    except GgufError as exc:
        raise GgufModelError(f"{gguf.name}: {exc}") from exc
    unread = sorted(kinds - readable_kinds())
    if unread:
        raise GgufModelError(f"{gguf.name} holds tensors in {', '.join(unread)}, which meshnet cannot read")


def readable_kinds() -> frozenset[str]:
    """The ggml tensor types a shard can read: float ones as they are, quantized ones through gguf-py."""
    from gguf import GGMLQuantizationType
    from gguf.quants import _type_traits

    return frozenset({"F32", "F16", "BF16"} | {GGMLQuantizationType(kind).name for kind in _type_traits})


def prepare_gguf_folder(gguf: Path, cache_dir: Path) -> Path:
    """The metadata folder of ``gguf`` under ``cache_dir`` (module doc), prepared once per file version; nodes
    started together prepare it once (a file lock)."""
    gguf = gguf.expanduser().resolve()
    check_servable(gguf)
    parts = split_parts(gguf)
    stat = gguf.stat()
    source = {"format": FOLDER_FORMAT, "gguf": str(gguf), "bytes": sum(p.stat().st_size for p in parts),
              "mtime_ns": stat.st_mtime_ns}
    digest = hashlib.sha256(json.dumps(source, sort_keys=True).encode()).hexdigest()[:16]
    match = SPLIT_NAME.fullmatch(gguf.name)
    stem = match["stem"] if match else gguf.name.removesuffix(".gguf")
    target = cache_dir / "gguf" / digest / stem
    if _prepared(target, source):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(str(target.with_name(f"{target.name}.lock")), timeout=LOCK_TIMEOUT_S):
        if not _prepared(target, source):  # another node may have prepared it while this one waited
            _prepare(gguf, target, stem, source)
    return target


def _prepared(target: Path, source: dict[str, Any]) -> bool:
    try:
        return bool(json.loads((target / GGUF_MARKER).read_text(encoding="utf-8")) == source)
    except (OSError, ValueError):
        return False


def _prepare(gguf: Path, target: Path, stem: str, source: dict[str, Any]) -> None:
    config, meta = gguf_config(gguf)
    logger.info("reading %s's metadata into %s (once): %s, %d layers", gguf.name, target, config.model_type,
                config.num_hidden_layers)
    staging = Path(tempfile.mkdtemp(prefix=f".{stem}.", dir=target.parent))
    staging.chmod(FOLDER_MODE)
    try:
        config.save_pretrained(staging)
        generation = GenerationConfig.from_model_config(config)
        for key, value in generation_defaults(meta).items():
            setattr(generation, key, value)
        generation.save_pretrained(staging)
        _save_tokenizer(gguf, staging)
        (staging / GGUF_MARKER).write_text(json.dumps(source), encoding="utf-8")
        if target.exists():
            stale = target.with_name(f".{target.name}.stale-{os.getpid()}")
            os.replace(target, stale)
            shutil.rmtree(stale, ignore_errors=True)
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _save_tokenizer(gguf: Path, folder: Path) -> None:
    """The file's tokenizer, chat template and special tokens, as transformers reads them from a GGUF."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except (ValueError, KeyError, OSError) as exc:
        raise GgufModelError(f"{gguf.name}: its tokenizer cannot be read ({exc})") from exc
    if not tokenizer.chat_template:
        logger.warning("%s carries no chat template: /v1/chat/completions will not work with it", gguf.name)
    tokenizer.save_pretrained(folder)


class GgufWeights:
    """A model's parameters read from its GGUF by their transformers names, undoing llama.cpp's conversion."""

    def __init__(self, gguf: Path, config: PretrainedConfig) -> None:
        self.path = gguf
        self.file = GgufFile(gguf)
        self._model_type: str = config.model_type
        self._heads: int = config.num_attention_heads
        self._kv_heads: int = config.num_key_value_heads
        self._names = _GEMMA_LAYER_NAMES if self._model_type in ONE_PLUS_NORMS else _LAYER_NAMES

    def close(self) -> None:
        """Drop the mapping (the pages read stay only in the tensors made from them)."""
        self.file = None  # type: ignore[assignment]

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def gguf_name(self, key: str) -> str:
        """The file's name of transformers parameter ``key``."""
        if key in _GLOBAL_NAMES:
            return _GLOBAL_NAMES[key]
        parts = key.split(".")  # model.layers.I.<module path>.weight|bias
        if parts[-1] in ("weight", "bias"):
            module, leaf = ".".join(parts[3:-1]), parts[-1]
        else:
            module, leaf = ".".join(parts[3:]), "weight"
        if module == "mlp.experts.down_proj":
            return f"blk.{parts[2]}.ffn_down_exps.weight"
        return f"blk.{parts[2]}.{self._names.get(module, module)}.{leaf}"

    def has(self, name: str) -> bool:
        return name in self.file.tensors

    def read(self, name: str) -> torch.Tensor:
        """Tensor ``name`` of the file as float32, in its torch shape."""
        entry = self.file.tensors[name]
        with self.file.borrowed(name) as raw:  # both branches copy the bytes
            values = self._floats(name, entry.kind, raw)
        return torch.from_numpy(values).reshape(entry.shape)

    def _floats(self, name: str, kind: str, raw: np.ndarray) -> np.ndarray:
        """A copy of tensor ``name``'s bytes ``raw`` (type ``kind``) as float32."""
        if kind in _FLOAT_VIEWS:
            values = np.array(raw.reshape(-1).view(_FLOAT_VIEWS[kind]), dtype=np.float32)
        else:
            from gguf import GGMLQuantizationType
            from gguf.quants import dequantize

            try:
                values = np.array(dequantize(raw, GGMLQuantizationType[kind]), dtype=np.float32)
            except NotImplementedError as exc:
                raise GgufModelError(f"{self.path.name}: tensor {name} is {kind}, which meshnet cannot read "
                                     "(served: F32, F16, BF16 and gguf-py's quantized types)") from exc
        return values

    def tensor(self, key: str) -> torch.Tensor | None:
        """transformers parameter ``key`` as float32, or ``None`` when the file lacks it."""
        if key.endswith("mlp.experts.gate_up_proj"):
            layer = key.split(".")[2]
            gate, up = f"blk.{layer}.ffn_gate_exps.weight", f"blk.{layer}.ffn_up_exps.weight"
            if not (self.has(gate) and self.has(up)):
                return None
            return torch.cat([self.read(gate), self.read(up)], dim=1)
        name = self.gguf_name(key)
        if not self.has(name):
            return None
        tensor = self.read(name)
        if self._model_type in PERMUTED_QK and (".attn_q." in name or ".attn_k." in name):
            tensor = tensor[self._rotary_rows(name, tensor.shape[0])]
        if self._model_type in ONE_PLUS_NORMS and name.endswith("norm.weight"):
            tensor = tensor - 1
        return tensor

    def row_order(self, name: str, rows: int) -> torch.Tensor | None:
        """The row order that undoes llama.cpp's rotary order of file tensor ``name`` (q/k of ``llama`` files),
        or ``None`` when its rows are in transformers' order."""
        if self._model_type in PERMUTED_QK and (".attn_q." in name or ".attn_k." in name):
            return self._rotary_rows(name, rows)
        return None

    def _rotary_rows(self, name: str, rows: int) -> torch.Tensor:
        """llama.cpp's rotary row order of q/k undone (as transformers' GGUF loader does)."""
        heads = self._heads if ".attn_q." in name else self._kv_heads
        return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows)

    def rope_divisors(self) -> torch.Tensor | None:
        """Llama 3.x's per-frequency rope divisors (``rope_freqs``), or ``None``."""
        return self.read(ROPE_FREQS) if self.has(ROPE_FREQS) else None
