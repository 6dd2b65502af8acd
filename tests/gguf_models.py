"""Tiny random models of each served architecture, written as F32 GGUF files the way llama.cpp's converter does.

:func:`build_gguf_model` makes a transformers model of one family (its own
config class, a few layers, hidden size 64, random weights from a fixed
seed, the suite's tiny tokenizer) and writes it with ``gguf.GGUFWriter``:
the ``{arch}.*`` hyper-parameters, the tokenizer as a ``gpt2`` BPE with its
chat template, and every tensor under gguf-py's own name map, transformed as
``convert_hf_to_gguf.py`` transforms it (q/k rows permuted into llama.cpp's
rotary order for ``llama`` files, ``1 + w`` for Gemma's norms, an MoE layer's
experts as one gate, one up and one down tensor, Llama 3's rope scaling as
``rope_freqs``). The model is the reference the mesh must equal.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import gguf
import numpy as np
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from tests.tiny_model import END_OF_TEXT, IM_END, _build_tokenizer

HIDDEN: Final = 64
HEADS: Final = 4
KV_HEADS: Final = 2
HEAD_DIM: Final = 16
INTERMEDIATE: Final = 128
LAYERS: Final = 4
EXPERTS: Final = 4
EXPERTS_USED: Final = 2
MAX_POSITIONS: Final = 4096
INIT_STD: Final = 0.2
NORM_STD: Final = 0.2
"""Norm weights are random too, so a norm read wrong (Gemma's ``1 + w``) changes the answer."""
SEED: Final = 0
LLAMA3_ROPE: Final = {"rope_type": "llama3", "rope_theta": 10_000.0, "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
"""Llama 3.1's rope scaling with a short original context, so that within a few dozen positions its
eight frequencies fall in all three of its bands and change the answer."""
GGUF_ARCH: Final = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                    "qwen3_moe": "qwen3moe", "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3"}


@dataclass(frozen=True)
class GgufModel:
    """A tiny model written as a GGUF: the file, and the transformers model it must answer as."""

    path: Path
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerFast


def family_config(family: str, vocab: int, eos: int, pad: int) -> PretrainedConfig:
    """The config of a tiny model of ``family`` (a name of :data:`FAMILIES`)."""
    common: dict[str, Any] = {"vocab_size": vocab, "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE,
                                  "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
                                  "head_dim": HEAD_DIM, "max_position_embeddings": MAX_POSITIONS, "initializer_range": INIT_STD,
                                  "tie_word_embeddings": False, "bos_token_id": None, "eos_token_id": eos, "pad_token_id": pad}
    if family == "llama":
        return LlamaConfig(**common)
    if family == "llama3":
        return LlamaConfig(**common, rope_parameters=dict(LLAMA3_ROPE))
    if family == "llama_tied":
        return LlamaConfig(**{**common, "tie_word_embeddings": True})
    if family == "mistral":
        return MistralConfig(**common, sliding_window=None)
    if family == "qwen2":
        return Qwen2Config(**common)
    if family == "qwen3":
        return Qwen3Config(**common)
    if family == "gemma2":
        return Gemma2Config(**common, query_pre_attn_scalar=HEAD_DIM, sliding_window=4,
                            attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    if family == "gemma3":
        return Gemma3TextConfig(**common, query_pre_attn_scalar=HEAD_DIM, sliding_window=4,
                                layer_types=["sliding_attention", "full_attention"] * (LAYERS // 2))
    if family == "phi3":
        return Phi3Config(**{**common, "head_dim": HIDDEN // HEADS}, sliding_window=None,
                          rope_parameters={"rope_type": "default", "rope_theta": 10_000.0,
                                           "partial_rotary_factor": 0.5})
    if family == "qwen3_moe":
        return Qwen3MoeConfig(**common, moe_intermediate_size=32, num_experts=EXPERTS,
                              num_experts_per_tok=EXPERTS_USED, norm_topk_prob=True)
    if family == "mixtral":
        return MixtralConfig(**{**common, "intermediate_size": 32}, num_local_experts=EXPERTS,
                             num_experts_per_tok=EXPERTS_USED, sliding_window=None)
    raise ValueError(f"no tiny {family}")


FAMILIES: Final = ("llama", "llama3", "llama_tied", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "qwen3_moe",
                   "mixtral", "phi3")


QUANT_KINDS: Final = ("Q8_0", "Q4_0")
"""Packed formats the tiny models can be written in (:func:`build_gguf_model`'s ``quant``)."""
EMBEDDING_KIND: Final = "Q8_0"
"""The token embedding and the output matrix of a quantized tiny model (a node holds them in int8, so a Q8_0
one is held as it is)."""
BLOCK: Final = 32
ROUTER: Final = "mlp.gate.weight"
"""An MoE router: llama.cpp keeps it in float (``ffn_gate_inp``), and so do the tiny files."""


def build_gguf_model(family: str, dest: Path, *, split_max_tensors: int = 0, quant: str | None = None) -> GgufModel:
    """A tiny random ``family`` model written as ``dest/tiny-<family>.gguf`` (a split set with
    ``split_max_tensors``). With ``quant`` (:data:`QUANT_KINDS`) its matrices are written in that format (the
    embedding and output in :data:`EMBEDDING_KIND`, norms and routers in F32) with every block's scale a value
    bfloat16 holds, and the returned model holds the file's weights as gguf-py dequantizes them: the same
    model, so a node that holds the blocks as they are may differ from it only by its kernels' rounding."""
    dest.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer()
    config = family_config(family, len(tokenizer), tokenizer.convert_tokens_to_ids(IM_END),
                           tokenizer.convert_tokens_to_ids(END_OF_TEXT))
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.normal_(0.0 if "gemma" in config.model_type else 1.0, NORM_STD)
    if quant is not None:
        _snap(model, quant)
    path = dest / f"tiny-{family}{'' if quant is None else '-' + quant}.gguf"
    _write(model, tokenizer, path, family, split_max_tensors, quant)
    if split_max_tensors:
        path = dest / f"tiny-{family}-00001-of-{len(list(dest.glob(f'tiny-{family}-*-of-*.gguf'))):05d}.gguf"
    return GgufModel(path=path, model=model, tokenizer=tokenizer)


def _kind_of(name: str, shape: tuple[int, ...], quant: str | None) -> str | None:
    """The format a tensor is written in (``None``: F32), by its transformers or GGUF name."""
    if quant is None or len(shape) < 2 or shape[-1] % BLOCK or name.endswith((ROUTER, "ffn_gate_inp.weight")):
        return None
    if name.startswith(("model.embed_tokens", "lm_head", "token_embd", "output.")):
        return EMBEDDING_KIND
    return quant


def _quantize(values: np.ndarray, kind: str) -> np.ndarray:
    """``values`` (float32, blocks of 32 along the last axis) as ``kind`` blocks, each scale rounded to a
    bfloat16 value (which float16 holds too): Q8_0 ``d = absmax / 127``, Q4_0 ``d = -max / 8`` with ``max``
    the value of largest magnitude (ggml's choices), the integers the nearest levels. Values this function
    made (:func:`_snap`) come back as the same blocks."""
    blocks = values.astype(np.float32).reshape(-1, BLOCK)
    if kind == "Q8_0":
        d = np.abs(blocks).max(-1, keepdims=True) / np.float32(127)
    else:
        picked = np.take_along_axis(blocks, np.abs(blocks).argmax(-1)[:, None], -1)
        d = picked / np.float32(-8)
    d = torch.from_numpy(np.ascontiguousarray(d)).to(torch.bfloat16).to(torch.float32).numpy()
    safe = np.where(d == 0, np.float32(1), d)
    if kind == "Q8_0":
        q = np.clip(np.rint(blocks / safe), -127, 127).astype(np.int8)
        body = q.view(np.uint8)
    else:
        q = np.clip(np.rint(blocks / safe) + 8, 0, 15).astype(np.uint8)
        body = q[:, :BLOCK // 2] | (q[:, BLOCK // 2:] << np.uint8(4))
    packed = np.concatenate([d.astype(np.float16).view(np.uint8), body], -1)
    return packed.reshape(*values.shape[:-1], -1)


def _snap(model: PreTrainedModel, quant: str) -> None:
    """Every parameter written quantized replaced by what its blocks hold (gguf-py's dequantization)."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            kind = _kind_of(name, tuple(parameter.shape), quant)
            if kind is not None:
                blocks = _quantize(parameter.detach().numpy(), kind)
                held = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[kind])
                parameter.copy_(torch.from_numpy(np.ascontiguousarray(held)).reshape(parameter.shape))


def _write(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, path: Path, family: str,
           split_max_tensors: int, quant: str | None = None) -> None:
    config = model.config
    arch = GGUF_ARCH[config.model_type]
    writer = gguf.GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    writer.add_name(f"tiny {family}")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_vocab_size(config.vocab_size)
    rope = config.rope_parameters
    rope = rope.get("full_attention", rope)
    writer.add_rope_freq_base(rope["rope_theta"])
    if arch == "llama":
        writer.add_rope_dimension_count(config.head_dim)
    if arch == "phi3":
        writer.add_rope_dimension_count(int(config.head_dim * rope.get("partial_rotary_factor", 1.0)))
    if config.model_type == "mixtral":
        writer.add_expert_count(config.num_local_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    if config.model_type == "qwen3_moe":
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if config.model_type == "gemma2":
        writer.add_sliding_window(config.sliding_window)
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if config.model_type == "gemma3_text":
        writer.add_sliding_window(config.sliding_window)
        writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in config.layer_types])
    _write_tokenizer(writer, tokenizer)
    for name, tensor in _tensors(model):
        values = np.ascontiguousarray(tensor.detach().float().numpy())
        kind = _kind_of(name, values.shape, quant)
        if kind is None:
            writer.add_tensor(name, values)
            continue
        blocks = _quantize(values, kind)
        qtype = gguf.GGMLQuantizationType[kind]
        if not np.array_equal(gguf.quants.dequantize(blocks, qtype), values):
            raise AssertionError(f"{name}: the {kind} blocks written do not hold the reference model's values")
        writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _write_tokenizer(writer: gguf.GGUFWriter, tokenizer: PreTrainedTokenizerFast) -> None:
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    tokens = [""] * len(tokenizer)
    for token, index in vocab.items():
        tokens[index] = token
    special = {entry["id"]: entry["content"] for entry in spec["added_tokens"]}
    for index, token in special.items():
        tokens[index] = token
    types = [gguf.TokenType.CONTROL if index in special else gguf.TokenType.NORMAL for index in range(len(tokens))]
    merges = [merge if isinstance(merge, str) else " ".join(merge) for merge in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(tokenizer.convert_tokens_to_ids(IM_END))
    writer.add_pad_token_id(tokenizer.convert_tokens_to_ids(END_OF_TEXT))
    writer.add_unk_token_id(tokenizer.convert_tokens_to_ids(END_OF_TEXT))  # Gemma's tokenizer class wants one
    writer.add_add_bos_token(False)
    writer.add_chat_template(tokenizer.chat_template)


def _permute(weights: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's ``LlamaModel.permute``: q/k rows from transformers' rotary halves into interleaved pairs."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2) \
        .reshape(weights.shape)


def _rope_freqs(config: PretrainedConfig) -> torch.Tensor:
    """``convert_hf_to_gguf.py``'s Llama 3 rope factors: one divisor per rotary frequency."""
    rope = config.rope_parameters
    base, dim = rope["rope_theta"], config.head_dim
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_context / low, old_context / high
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def _tensors(model: PreTrainedModel) -> list[tuple[str, torch.Tensor]]:
    config = model.config
    arch_name = GGUF_ARCH[config.model_type]
    arch = next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == arch_name)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    out: list[tuple[str, torch.Tensor]] = []
    if config.rope_parameters.get("rope_type") == "llama3":
        out.append(("rope_freqs.weight", _rope_freqs(config)))
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if name.endswith("mlp.experts.gate_up_proj"):
            layer = name.split(".")[2]
            half = tensor.shape[1] // 2
            out += [(f"blk.{layer}.ffn_gate_exps.weight", tensor[:, :half]),
                    (f"blk.{layer}.ffn_up_exps.weight", tensor[:, half:])]
            continue
        if name.endswith("mlp.experts.down_proj"):
            out.append((f"blk.{name.split('.')[2]}.ffn_down_exps.weight", tensor))
            continue
        base, suffix = name.rsplit(".", 1)
        mapped = "output" if base == "lm_head" else names.get_name(base)
        if mapped is None:
            raise ValueError(f"gguf-py has no name for {name}")
        if arch_name == "llama" and base.endswith("q_proj"):
            tensor = _permute(tensor, config.num_attention_heads)
        elif arch_name == "llama" and base.endswith("k_proj"):
            tensor = _permute(tensor, config.num_key_value_heads)
        if "gemma" in config.model_type and name.endswith("norm.weight"):
            tensor = tensor + 1
        out.append((f"{mapped}.{suffix}", tensor))
    return out
