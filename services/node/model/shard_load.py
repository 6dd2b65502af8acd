"""Loading a shard: layers ``start..end`` of a model read alone, as float or packed, from a folder or a GGUF.

:func:`load_shard` builds the model skeleton on the meta device, keeps only the modules the shard needs
(:func:`_kept_modules`), decides how its weights are held (:func:`_served_format`: packed where the quantized
path takes every layer, else float, saying why), reads only their tensors (safetensors, a GGUF's blocks or
its float tensors), and assembles the :class:`~services.node.model.shard.Shard` that runs them. The memory of
the other layers is never allocated.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from services.node.model.architecture import (
    attention_for,
    divide_rope,
    materialize_buffers,
)
from services.node.model.chunk_precision import attention_kernel, compute_chunks_in_float32
from services.node.model.device import chunk_compute_dtype
from services.node.model.gguf_model import GgufWeights, gguf_of_folder
from services.node.model.lean_decode import lean_decoder_for, quantized_lean_decoder, unsupported
from services.node.model.packed_layers import load_packed_layers, packed_layers_problem
from services.node.model.quant.huge_pages import gather
from services.node.model.quant.quant_load import (
    GgufSource,
    SafetensorsSource,
    WeightsFormat,
    float_state,
    load_quantized,
    quantized_problem,
    returned_transients,
    strip_linears,
)
from services.node.model.shard import (
    EMBED_KEY,
    KV_DTYPES,
    LM_HEAD_KEY,
    MaskKind,
    Shard,
    ShardError,
    mask_kinds_of,
)

logger = logging.getLogger(__name__)


def load_shard(path: Path, start: int, end: int, dtype: torch.dtype, device: torch.device,
               weights: WeightsFormat = "float", gguf: Path | None = None, kv_dtype: str = "auto") -> Shard:
    """Load layers ``start..end`` (inclusive) of the model in folder ``path``.

    Only the tensors of the kept modules are read from the safetensors files (or the GGUF the folder names);
    the rest of the model exists only as a meta-device skeleton while loading. ``weights`` ``int8``/``int4``
    packs the layers' products (and the embedding / LM head) as they are read, from ``gguf``'s blocks when
    given (:mod:`services.node.model.quant.quant_load`); layers the quantized path cannot take load as
    ``float``, and the log says why.
    """
    began = time.perf_counter()
    config = _config_of(path, start, end)
    weights_file = gguf_of_folder(path)  # --model FILE.gguf: the weights are in the file, not the folder
    attention = attention_for(AutoModelForCausalLM._model_mapping[type(config)], attention_kernel(dtype, device),
                              config)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention)
    config = skeleton.config  # the object the layers read at run time (attention kernel, layer types)
    decoder = _decoder_of(skeleton)
    modules, layers = _kept_modules(skeleton, decoder, start, end, config.num_hidden_layers)
    kinds = mask_kinds_of(config, start, end)
    in_modules = unsupported(config, layers, kinds) is not None  # not the lean decoder's shape: packed in place
    served = _served_format(weights, config, device, layers, kinds, start, end, gguf or weights_file)
    chunk_dtype = chunk_compute_dtype(dtype, device)
    if served == "float":
        if chunk_dtype != dtype:
            compute_chunks_in_float32(modules.model.layers)
        if weights_file is not None:
            _load_gguf_weights(weights_file, modules, config, dtype, device)
        else:
            _load_weights(path, modules, config, dtype, device)
    elif in_modules:
        chunk_dtype = dtype
        with returned_transients():  # an MoE layer's experts unpack to a byte a weight on their way in
            load_packed_layers(gguf or weights_file, modules, layers, config, served, dtype,  # type: ignore[arg-type]
                               device, is_head=start == 0, is_tail=hasattr(modules, "lm_head"))
        materialize_buffers(modules, device)
    else:
        chunk_dtype = dtype
        _load_packed(path, gguf or weights_file, modules, layers, config, served, dtype, device,
                     is_head=start == 0, is_tail=hasattr(modules, "lm_head"))
    huge = gather(modules) if served != "float" and device.type == "cpu" else None
    modules.eval()
    shard = Shard(
        config=config, start=start, end=end, modules=modules, layers=layers,
        embed_tokens=getattr(modules.model, "embed_tokens", None), norm=getattr(modules.model, "norm", None),
        lm_head=getattr(modules, "lm_head", None), rotary_emb=_rotary(decoder, config, device, weights_file),
        dtype=dtype, device=device, chunk_dtype=chunk_dtype,
        lean=(lean_decoder_for(config, layers, dtype, device, kinds) if served == "float"
              else None if in_modules else quantized_lean_decoder(config, layers)),
        weights_format=served,
    )
    shard.huge_region = huge
    _set_kv_dtype(shard, kv_dtype, served)
    _log_loaded(shard, served, gguf, time.perf_counter() - began)
    return shard


def _config_of(path: Path, start: int, end: int) -> PretrainedConfig:
    """The model's config, once ``start..end`` is known to be a range of its layers."""
    if not (path / "config.json").is_file():
        raise ShardError(f"{path} is not a model folder (no config.json)")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    num_layers = config.num_hidden_layers
    if not 0 <= start <= end < num_layers:
        raise ShardError(
            f"layers {start}-{end} are not a range within the model's {num_layers} layers (0-{num_layers - 1})"
        )
    return config


def _kept_modules(skeleton: nn.Module, decoder: nn.Module, start: int, end: int,
                  num_layers: int) -> tuple[nn.Module, dict[int, nn.Module]]:
    """The modules this shard keeps of the skeleton (its layers; the embedding at the head; the final norm and
    the LM head at the tail), under the names the checkpoints use, and its layers by index."""
    modules = nn.Module()
    modules.model = nn.Module()
    modules.model.layers = nn.ModuleDict({str(i): decoder.layers[i] for i in range(start, end + 1)})
    if start == 0:
        modules.model.embed_tokens = decoder.embed_tokens
    if end == num_layers - 1:
        modules.model.norm = decoder.norm
        modules.lm_head = skeleton.lm_head
    return modules, {i: modules.model.layers[str(i)] for i in range(start, end + 1)}


def _served_format(weights: WeightsFormat, config: PretrainedConfig, device: torch.device,
                   layers: dict[int, nn.Module], kinds: dict[int, MaskKind], start: int,
                   end: int, gguf: Path | None) -> WeightsFormat:
    """``weights`` where a quantized path takes every layer of the shard (the lean decoder's for the Llama
    shape, transformers' own layers with packed products for the others from a GGUF:
    :mod:`services.node.model.packed_layers`), else ``float`` (and the log says why)."""
    if weights == "float":
        return "float"
    lean_problem = unsupported(config, layers, kinds)
    if lean_problem is None:
        why = quantized_problem(config, device, None)
    else:
        why = packed_layers_problem(config, layers, device, gguf)
        why = None if why is None else f"{lean_problem}, and {why}"
    if why is None:
        return weights
    logger.warning("--weights %s: layers %d-%d load as float instead: %s", weights, start, end, why)
    return "float"


def _rotary(decoder: nn.Module, config: PretrainedConfig, device: torch.device,
            weights_file: Path | None) -> nn.Module:
    """The shard's own rotary embedding (with a GGUF's rope divisors folded in, where the file has them)."""
    with torch.device(device):
        rotary_emb = type(decoder.rotary_emb)(config=config)
    rotary_emb.eval()
    if weights_file is not None:
        with GgufWeights(weights_file, config) as source:
            if (divisors := source.rope_divisors()) is not None:
                divide_rope(rotary_emb, divisors.to(device))
    return rotary_emb


def _set_kv_dtype(shard: Shard, kv_dtype: str, served: WeightsFormat) -> None:
    """``--kv-dtype``: a quantized shard's KV cache format; a float shard keeps its own, and says so."""
    if kv_dtype == "auto":
        return
    if served == "float":
        logger.warning("--kv-dtype %s applies to quantized weights only: layers %d-%d keep their KV cache as %s",
                       kv_dtype, shard.start, shard.end, _name(shard.kv_dtype or shard.dtype))
    else:
        shard.kv_dtype = KV_DTYPES[kv_dtype]


def _log_loaded(shard: Shard, served: WeightsFormat, gguf: Path | None, seconds: float) -> None:
    chunks = ("" if shard.chunk_dtype == shard.dtype
              else f" (multi-token chunks in {_name(shard.chunk_dtype)}: no native {_name(shard.dtype)} matrix "
                   "kernels here)")
    logger.info(
        "loaded layers %d-%d of %d (%s) as %s%s on %s%s, KV cache as %s: %.1f MiB in %.2f s",
        shard.start, shard.end, shard.config.num_hidden_layers, shard.role, _name(shard.dtype),
        "" if served == "float" else f" with {served} weights" + (f" from {gguf.name}" if gguf else ""),
        shard.device, chunks, _name(shard.kv_dtype or shard.dtype), shard.weight_bytes() / (1 << 20), seconds,
    )


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _decoder_of(skeleton: nn.Module) -> nn.Module:
    """The inner decoder (``model.model``), checked for the parts a shard needs."""
    decoder = getattr(skeleton, "model", None)
    needed = ("layers", "embed_tokens", "norm", "rotary_emb")
    if (
        decoder is None
        or not all(hasattr(decoder, name) for name in needed)
        or not hasattr(skeleton, "lm_head")
    ):
        raise ShardError(
            f"{type(skeleton).__name__} is not a Llama-like decoder-only model "
            "(needs model.layers, model.embed_tokens, model.norm, model.rotary_emb and lm_head)"
        )
    return decoder


def _load_weights(
    path: Path,
    modules: nn.Module,
    config: PretrainedConfig,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Read exactly the tensors ``modules`` names from the safetensors files and assign them."""
    wanted = set(modules.state_dict().keys())
    # A tied LM head *is* the embedding (as in transformers), whatever else the checkpoint stores.
    tied = LM_HEAD_KEY in wanted and bool(getattr(config, "tie_word_embeddings", False))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ShardError(f"no .safetensors files in {path}")

    state: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as reader:
            for key in reader.keys():  # noqa: SIM118 - safe_open is not a mapping
                if tied and key == LM_HEAD_KEY:
                    continue
                if key in wanted:
                    state[key] = _cast(reader.get_tensor(key), dtype, device)
                elif tied and key == EMBED_KEY:
                    state[LM_HEAD_KEY] = _cast(reader.get_tensor(key), dtype, device)
    if tied and EMBED_KEY in state:
        state[LM_HEAD_KEY] = state[EMBED_KEY]  # head and tail on one node: one matrix, two roles

    missing = sorted(wanted - state.keys())
    if missing:
        raise ShardError(f"checkpoint in {path} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    modules.load_state_dict(state, strict=True, assign=True)
    materialize_buffers(modules, device)
    leftover = [name for name, t in [*modules.named_parameters(), *modules.named_buffers()] if t.is_meta]
    if leftover:
        raise ShardError(f"tensors not in the checkpoint and not computable: {leftover[:3]}")


def _load_gguf_weights(gguf: Path, modules: nn.Module, config: PretrainedConfig, dtype: torch.dtype,
                       device: torch.device) -> None:
    """Read exactly the tensors ``modules`` names from the GGUF (:class:`GgufWeights`) and assign them."""
    wanted = set(modules.state_dict().keys())
    tied = LM_HEAD_KEY in wanted and bool(getattr(config, "tie_word_embeddings", False))
    state: dict[str, torch.Tensor] = {}
    with GgufWeights(gguf, config) as source:
        for key in sorted(wanted):
            tensor = source.tensor(EMBED_KEY if tied and key == LM_HEAD_KEY else key)
            if tensor is not None:
                state[key] = _cast(tensor, dtype, device)
    if tied and EMBED_KEY in state:
        state[LM_HEAD_KEY] = state[EMBED_KEY]
    missing = sorted(wanted - state.keys())
    if missing:
        raise ShardError(f"{gguf.name} lacks {len(missing)} tensors this shard needs, e.g. {missing[:3]}")
    modules.load_state_dict(state, strict=True, assign=True)
    materialize_buffers(modules, device)
    leftover = [name for name, t in [*modules.named_parameters(), *modules.named_buffers()] if t.is_meta]
    if leftover:
        raise ShardError(f"tensors not in {gguf.name} and not computable: {leftover[:3]}")


def _load_packed(path: Path, gguf: Path | None, modules: nn.Module, layers: dict[int, nn.Module],
                 config: PretrainedConfig, fmt: WeightsFormat, dtype: torch.dtype, device: torch.device, *,
                 is_head: bool, is_tail: bool) -> None:
    """The quantized load: norms and biases as floats, every product packed as it is read."""
    assert fmt != "float"
    strip_linears(layers)
    if is_head:
        del modules.model.embed_tokens
    if is_tail:
        del modules.lm_head
    source = GgufSource(gguf, config) if gguf is not None else SafetensorsSource(path)
    wanted = set(modules.state_dict().keys())
    modules.load_state_dict(float_state(source, wanted, dtype, device), strict=True, assign=True)
    with returned_transients():
        load_quantized(source, modules, layers, fmt, dtype, has_embedding=is_head, has_head=is_tail,
                       tied=bool(getattr(config, "tie_word_embeddings", False)))


def _cast(tensor: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if tensor.is_floating_point():
        return tensor.to(device=device, dtype=dtype)
    return tensor.to(device=device)
