"""A GGUF file's metadata as a Hugging Face config: the architectures meshnet serves from a GGUF, and how.

llama.cpp's converter writes a model's hyper-parameters as ``{arch}.*`` keys
(``llama.block_count``, ``qwen3moe.expert_used_count``, ...) and leaves out
what its own runtime hard-codes (Gemma 3's five sliding layers to a global
one, Qwen3-MoE's normalised top-k). :func:`hf_config` reads those keys back
into the transformers config class of the architecture, filling in exactly
what llama.cpp assumes, so the decoder layers transformers builds from it
compute what llama.cpp computes on the same file. transformers' own GGUF
config reader (``modeling_gguf_pytorch_utils``) drops several of these keys
(soft-capping, sliding windows, per-layer patterns, Mixtral's experts) and so
is not used for the config; its tokenizer reader is (:mod:`.gguf_model`).

An architecture not in :data:`SERVED_ARCHITECTURES` is refused with
:class:`GgufConfigError`, one line naming it and the served ones.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Final

from transformers import (
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

Metadata = Mapping[str, Any]
"""A GGUF's metadata: key to value (strings decoded, arrays as lists)."""

SERVED_ARCHITECTURES: Final = ("llama", "qwen2", "qwen3", "qwen3moe", "gemma2", "gemma3", "phi3")
"""GGUF ``general.architecture`` values served (``llama`` covers Llama, Mistral and Mixtral files)."""
GEMMA3_SLIDING_PATTERN: Final = 6
"""llama.cpp's Gemma 3: every sixth layer is global, the others slide (when the file does not say)."""
GEMMA3_LOCAL_ROPE_BASE: Final = 10_000.0
"""llama.cpp's Gemma 3: the rotary base of its sliding layers (when the file does not say)."""
GEMMA2_27B_LAYERS: Final = 46
GEMMA3_27B_LAYERS: Final = 62
"""llama.cpp scales the 27B Gemmas' queries by the hidden size over the heads, the others by the head size."""
DEFAULT_ROPE_BASE: Final = 10_000.0
MAX_GENERATION_TOP_K: Final = 1 << 16


class GgufConfigError(ValueError):
    """The file's architecture, or one of its hyper-parameters, is not one meshnet serves; the message says which."""


def _get(meta: Metadata, arch: str, key: str, default: Any = None) -> Any:
    return meta.get(f"{arch}.{key}", default)


def _need(meta: Metadata, arch: str, key: str) -> Any:
    value = meta.get(f"{arch}.{key}")
    if value is None:
        raise GgufConfigError(f"the GGUF lacks {arch}.{key}")
    return value


def _uniform(value: Any, what: str) -> int:
    """A per-layer array that must hold one value (meshnet's layers share one shape)."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise GgufConfigError(f"{what} differs between layers ({sorted(set(value))}): not served")
        return int(value[0])
    return int(value)


def _rope(meta: Metadata, arch: str, base: float) -> dict[str, Any]:
    """The rotary parameters: the base, and a scaling the file names (linear or yarn)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(base)}
    kind = _get(meta, arch, "rope.scaling.type")
    factor = _get(meta, arch, "rope.scaling.factor")
    if kind in (None, "none") or factor in (None, 1.0):
        return rope
    if kind == "linear":
        return {**rope, "rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        original = _need(meta, arch, "rope.scaling.original_context_length")
        return {**rope, "rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": int(original)}
    raise GgufConfigError(f"rope scaling {kind!r} is not served")


def _common(meta: Metadata, arch: str, tensors: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    hidden = int(_need(meta, arch, "embedding_length"))
    heads = _uniform(_need(meta, arch, "attention.head_count"), "the number of attention heads")
    kv_heads = _uniform(_get(meta, arch, "attention.head_count_kv", heads), "the number of key/value heads")
    head_dim = int(_get(meta, arch, "attention.key_length", 0) or _get(meta, arch, "rope.dimension_count", 0)
                   or hidden // heads)
    value_dim = int(_get(meta, arch, "attention.value_length", head_dim))
    if value_dim != head_dim:
        raise GgufConfigError(f"keys of {head_dim} and values of {value_dim} dimensions: not served")
    embedding = tensors.get("token_embd.weight")
    vocab = _get(meta, arch, "vocab_size") or (embedding[0] if embedding else None)
    if vocab is None:
        tokens = meta.get("tokenizer.ggml.tokens")
        vocab = len(tokens) if tokens else None
    if vocab is None:
        raise GgufConfigError("the GGUF says nothing of its vocabulary size")
    fields: dict[str, Any] = {
        "hidden_size": hidden,
        "num_hidden_layers": int(_need(meta, arch, "block_count")),
        "intermediate_size": _uniform(_get(meta, arch, "feed_forward_length", 0), "the MLP width"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(_get(meta, arch, "attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(_get(meta, arch, "context_length", 4096)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    return fields


def _has_bias(tensors: Mapping[str, tuple[int, ...]], name: str) -> bool:
    return f"blk.0.{name}.bias" in tensors


def _llama_family(meta: Metadata, common: dict[str, Any], tensors: Mapping[str, tuple[int, ...]]) -> PretrainedConfig:
    """``llama`` files: Llama (Llama 3's ``rope_freqs`` are read by the shard), Mistral, Mixtral (experts)."""
    rope = _rope(meta, "llama", _get(meta, "llama", "rope.freq_base", DEFAULT_ROPE_BASE))
    common = {**common, "attention_bias": _has_bias(tensors, "attn_q"), "rope_parameters": rope}
    experts = int(_get(meta, "llama", "expert_count", 0) or 0)
    if experts:
        common.pop("attention_bias")
        return MixtralConfig(**common, num_local_experts=experts,
                             num_experts_per_tok=int(_need(meta, "llama", "expert_used_count")),
                             sliding_window=_get(meta, "llama", "attention.sliding_window"))
    name = str(meta.get("general.name", "")).lower()
    if "mistral" in name:  # llama.cpp writes Mistral as llama; transformers tells them apart by the name too
        common.pop("attention_bias")
        return MistralConfig(**common, sliding_window=_get(meta, "llama", "attention.sliding_window"))
    return LlamaConfig(**common)


def _qwen3_moe(meta: Metadata, common: dict[str, Any]) -> PretrainedConfig:
    arch = "qwen3moe"
    if _get(meta, arch, "expert_shared_count", 0):
        raise GgufConfigError("shared experts are not served")
    return Qwen3MoeConfig(
        **common, rope_parameters=_rope(meta, arch, _get(meta, arch, "rope.freq_base", DEFAULT_ROPE_BASE)),
        num_experts=int(_need(meta, arch, "expert_count")),
        num_experts_per_tok=int(_need(meta, arch, "expert_used_count")),
        moe_intermediate_size=int(_need(meta, arch, "expert_feed_forward_length")),
        norm_topk_prob=True,  # llama.cpp's qwen3moe always normalises the chosen experts' weights
        decoder_sparse_step=1, mlp_only_layers=[])


def _gemma2(meta: Metadata, common: dict[str, Any]) -> PretrainedConfig:
    arch = "gemma2"
    layers, heads = common["num_hidden_layers"], common["num_attention_heads"]
    scalar = common["hidden_size"] // heads if layers == GEMMA2_27B_LAYERS else common["head_dim"]
    return Gemma2Config(
        **common, rope_parameters=_rope(meta, arch, _get(meta, arch, "rope.freq_base", DEFAULT_ROPE_BASE)),
        query_pre_attn_scalar=scalar, sliding_window=int(_need(meta, arch, "attention.sliding_window")),
        attn_logit_softcapping=_get(meta, arch, "attn_logit_softcapping"),
        final_logit_softcapping=_get(meta, arch, "final_logit_softcapping"))


def _gemma3(meta: Metadata, common: dict[str, Any]) -> PretrainedConfig:
    arch = "gemma3"
    layers, heads = common["num_hidden_layers"], common["num_attention_heads"]
    scalar = common["hidden_size"] // heads if layers == GEMMA3_27B_LAYERS else common["head_dim"]
    pattern = _get(meta, arch, "attention.sliding_window_pattern")
    if isinstance(pattern, list):  # one flag a layer: true where the layer slides
        layer_types = ["sliding_attention" if slides else "full_attention" for slides in pattern]
    else:
        period = int(pattern or GEMMA3_SLIDING_PATTERN)
        layer_types = ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(layers)]
    full = _rope(meta, arch, _get(meta, arch, "rope.freq_base", 1_000_000.0))
    local = {"rope_type": "default", "rope_theta": float(_get(meta, arch, "rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE))}
    return Gemma3TextConfig(
        **common, rope_parameters={"full_attention": full, "sliding_attention": local},
        query_pre_attn_scalar=scalar, sliding_window=int(_need(meta, arch, "attention.sliding_window")),
        layer_types=layer_types, final_logit_softcapping=_get(meta, arch, "final_logit_softcapping"),
        attn_logit_softcapping=_get(meta, arch, "attn_logit_softcapping"))


def _phi3(meta: Metadata, common: dict[str, Any], tensors: Mapping[str, tuple[int, ...]]) -> PretrainedConfig:
    """Phi-3: fused q/k/v and gate/up projections, a rotary over part of each head (Phi-3.5/4-mini)."""
    arch = "phi3"
    if "rope_factors_long.weight" in tensors or "rope_factors_short.weight" in tensors:
        raise GgufConfigError("phi3 with longrope scaling (rope_factors_long/short) is not served")
    head_dim = common["hidden_size"] // common["num_attention_heads"]
    rotary = int(_get(meta, arch, "rope.dimension_count", head_dim))
    rope = {**_rope(meta, arch, _get(meta, arch, "rope.freq_base", DEFAULT_ROPE_BASE)),
            "partial_rotary_factor": rotary / head_dim}
    return Phi3Config(**{**common, "head_dim": head_dim}, rope_parameters=rope,
                      sliding_window=_get(meta, arch, "attention.sliding_window"))


def hf_config(meta: Metadata, tensors: Mapping[str, tuple[int, ...]]) -> PretrainedConfig:
    """The transformers config of the model in a GGUF with metadata ``meta`` and tensor shapes ``tensors``."""
    arch = meta.get("general.architecture")
    if arch not in SERVED_ARCHITECTURES:
        raise GgufConfigError(f"GGUF architecture {arch!r} is not served; served: {', '.join(SERVED_ARCHITECTURES)}")
    common = _common(meta, arch, tensors)
    if arch == "llama":
        return _llama_family(meta, common, tensors)
    if arch == "qwen2":
        return Qwen2Config(**common, rope_parameters=_rope(meta, arch, _get(meta, arch, "rope.freq_base", DEFAULT_ROPE_BASE)))
    if arch == "qwen3":
        return Qwen3Config(**common, attention_bias=_has_bias(tensors, "attn_q"),
                           rope_parameters=_rope(meta, arch, _get(meta, arch, "rope.freq_base", DEFAULT_ROPE_BASE)))
    if arch == "qwen3moe":
        return _qwen3_moe(meta, common)
    if arch == "gemma2":
        return _gemma2(meta, common)
    if arch == "phi3":
        return _phi3(meta, common, tensors)
    return _gemma3(meta, common)


def generation_defaults(meta: Metadata) -> dict[str, Any]:
    """The sampling the file recommends (``general.sampling.*``), as ``generation_config.json`` fields."""
    advice: dict[str, Any] = {}
    temperature = meta.get("general.sampling.temp")
    if isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0:
        advice["temperature"] = float(temperature)
    top_p = meta.get("general.sampling.top_p")
    if isinstance(top_p, (int, float)) and 0 < top_p <= 1:
        advice["top_p"] = float(top_p)
    top_k = meta.get("general.sampling.top_k")
    if isinstance(top_k, int) and 0 < top_k <= MAX_GENERATION_TOP_K:
        advice["top_k"] = top_k
    if advice:
        advice["do_sample"] = True
    return advice
