"""What a shard does differently for each architecture, around transformers' own decoder layers.

transformers' model classes do a few things outside their decoder layers
that a shard, which runs the layers alone, must repeat to compute the same:

* the rotary embedding per layer type (Gemma 3's sliding layers rotate with
  another base than its global ones: ``rotary_emb(x, positions, layer_type)``);
* the final logits' soft-capping (Gemma 2: ``tanh(logits / cap) * cap``);
* the attention kernel: a model whose attention soft-caps its scores (Gemma 2)
  has no SDPA path in transformers and runs eager attention;
* Llama 3.x's rope scaling as a GGUF stores it (``rope_freqs``: one divisor per
  rotary frequency, which llama.cpp applies), folded into the rotary table.

Embedding scaling (Gemma's ``sqrt(hidden)``) lives in transformers' embedding
module itself, and the (1+w) RMS norms, pre/post norms, q/k norms, MoE routers
and experts in its decoder layers, so they need nothing here.
"""

from __future__ import annotations

import inspect
from typing import Final

import torch
from torch import nn
from transformers import PretrainedConfig

EAGER_ATTENTION: Final = "eager"


def attention_for(model_class: type, wanted: str, config: PretrainedConfig) -> str:
    """``wanted`` where ``model_class`` supports it, else eager attention (soft-capped scores: Gemma 2)."""
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return EAGER_ATTENTION
    if wanted == "sdpa" and not getattr(model_class, "_supports_sdpa", True):
        return EAGER_ATTENTION
    return wanted


class PositionEmbeddings:
    """The rotary ``(cos, sin)`` of a step's positions for each layer type a shard runs."""

    def __init__(self, rotary: nn.Module, kinds: set[str]) -> None:
        self._rotary = rotary
        self._kinds = sorted(kinds)
        self._per_kind = "layer_type" in inspect.signature(rotary.forward).parameters

    def __call__(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        if not self._per_kind:
            shared = self._rotary(hidden, position_ids=position_ids)
            return dict.fromkeys(self._kinds, shared)
        return {kind: self._rotary(hidden, position_ids, kind) for kind in self._kinds}

    @property
    def per_kind(self) -> bool:
        """Whether layer types rotate differently (then the lean path, which takes one table, does not apply)."""
        return self._per_kind


def divide_rope(rotary: nn.Module, divisors: torch.Tensor) -> None:
    """Fold a GGUF's ``rope_freqs`` into ``rotary``'s frequencies (llama.cpp's Llama 3.x rope scaling)."""
    inv_freq = getattr(rotary, "inv_freq", None)
    if inv_freq is None or inv_freq.shape != divisors.shape:
        raise ValueError(f"rope_freqs of shape {tuple(divisors.shape)} do not fit this model's rotary embedding")
    scaled = (inv_freq.double() / divisors.double()).to(inv_freq.dtype)
    rotary.inv_freq = scaled
    rotary.original_inv_freq = scaled.clone()


def materialize_buffers(modules: nn.Module, device: torch.device) -> None:
    """Compute the buffers a checkpoint does not hold (``persistent=False``) that a meta skeleton left empty:
    the scale of a scaled word embedding (Gemma's ``sqrt(hidden)``)."""
    for module in modules.modules():
        scale = getattr(module, "scalar_embed_scale", None)
        buffer = getattr(module, "embed_scale", None)
        if scale is not None and isinstance(buffer, torch.Tensor) and buffer.is_meta:
            module.embed_scale = torch.tensor(float(scale), device=device)


def soft_cap(logits: torch.Tensor, config: PretrainedConfig) -> torch.Tensor:
    """The final logits soft-capped as the model's ``ForCausalLM`` does (Gemma 2), else as they are."""
    cap = getattr(config, "final_logit_softcapping", None)
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap
