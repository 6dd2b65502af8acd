"""float32 arithmetic over half-precision weights and caches, where a CPU computes it faster.

Two cases, both on a CPU:

* Attention of every half-precision shard runs in float32
  (:data:`FLOAT32_ATTENTION`, registered with transformers when this module
  is imported; :func:`attention_kernel` picks it). torch's CPU SDPA in
  float16 or bfloat16 takes a generic path that is about ten times slower
  than float32 for a decode step's single query (at a 1,500-token context on
  an AMD EPYC: 2.4 ms against 0.24 ms per layer, conversion of the cached
  keys and values included), so attention dominated a long-context decode
  step. float32 also rounds less: softmax and the weighted sum of the values
  keep float32 precision and only the output is rounded to the half format.
* On a CPU without native kernels for a shard's half format (float16 on most
  x86 CPUs, see :func:`services.node.model.device.chunk_compute_dtype`),
  multi-token chunks (prompts, replays) also run their linear layers in
  float32, on weights converted as they are used, while one-token decode
  steps stay on the half-precision kernels that make float16 the fastest
  format to decode in: :func:`compute_chunks_in_float32` swaps a skeleton's
  linear layers.

Such shards keep their KV cache in float32 (:mod:`services.node.model.kv_cache`), so
the cache is not converted again for every layer of every step.
"""

from __future__ import annotations

from typing import Final

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

SDPA_ATTENTION: Final = "sdpa"
"""transformers' own kernel, the one ``from_pretrained`` picks by default: float32 and GPU shards use it."""
FLOAT32_ATTENTION: Final = "meshnet_sdpa_float32"
"""The same kernel computed in float32 over half-precision inputs; registered with transformers below."""
HALF_DTYPES: Final = frozenset({torch.float16, torch.bfloat16})


def attention_kernel(dtype: torch.dtype, device: torch.device) -> str:
    """The attention implementation a shard of ``dtype`` weights on ``device`` loads with.

    :data:`FLOAT32_ATTENTION` for a half format on a CPU, else
    :data:`SDPA_ATTENTION`, so that a float32 shard computes exactly what
    transformers computes.
    """
    return FLOAT32_ATTENTION if device.type == "cpu" and dtype in HALF_DTYPES else SDPA_ATTENTION


def _is_one_token(states: torch.Tensor) -> bool:
    """Whether ``states`` (``[..., features]``) holds a single row: a decode step."""
    return states.numel() <= states.shape[-1]


class Float32ChunkLinear(nn.Linear):
    """A linear layer over half-precision weights whose multi-token inputs are computed in float32.

    One token goes through the half-precision kernel as it would in
    transformers. Several tokens go through float32, on a copy of the weight
    made for the call and freed after it: converting costs a few percent of
    the product at prompt lengths, while a kept float32 copy would triple the
    memory of the weights. The output is rounded back to the weights' format.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if _is_one_token(input):
            return F.linear(input, self.weight, self.bias)
        bias = None if self.bias is None else self.bias.float()
        return F.linear(input.float(), self.weight.float(), bias).to(input.dtype)


def sdpa_in_float32(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: object,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' SDPA attention, computed in float32 and rounded back to the query's format.

    Grouped-query heads are matched inside SDPA (``enable_gqa``, which
    transformers uses whenever no mask is needed, as for a decode step under
    full attention) rather than by copying the keys and values per query head.
    The cached keys and values are already float32 (the shard's cache keeps that format),
    so only the new query is converted; half-precision SDPA would cost ten times as much.
    """
    if query.dtype == torch.float32:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()
    out, weights = sdpa_attention_forward(
        module, query.float(), key.float(), value.float(), attention_mask, **kwargs
    )
    return out.to(query.dtype), weights


# transformers' extension point for attention kernels: shards that need it name it at load; the
# masks are SDPA's, so a mask built for this kernel is exactly the one built for "sdpa".
AttentionInterface.register(FLOAT32_ATTENTION, sdpa_in_float32)
AttentionMaskInterface.register(FLOAT32_ATTENTION, sdpa_mask)


def compute_chunks_in_float32(layers: nn.Module) -> None:
    """Replace every linear layer under ``layers`` (still on the meta device) by a :class:`Float32ChunkLinear`."""
    for parent in list(layers.modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                with torch.device("meta"):
                    replacement = Float32ChunkLinear(
                        child.in_features,
                        child.out_features,
                        bias=child.bias is not None,
                        dtype=child.weight.dtype,
                    )
                setattr(parent, child_name, replacement)
