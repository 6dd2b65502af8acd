"""Prompt chunks in float32 over half-precision weights, on CPUs without fast half kernels.

On a CPU without native kernels for a shard's half format (float16 on most
x86 CPUs, see :func:`services.node.device.chunk_compute_dtype`), multi-token
chunks (prompts, replays) run their linear layers and attention in float32,
on weights converted as they are used, while one-token decode steps stay on
the half-precision kernels that make float16 the fastest format to decode in.
:func:`compute_chunks_in_float32` swaps a skeleton's linear layers, and the
attention kernel :data:`FLOAT32_CHUNKS_ATTENTION` is registered with
transformers when this module is imported.
"""

from __future__ import annotations

from typing import Final

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

FLOAT32_CHUNKS_ATTENTION: Final = "meshnet_sdpa_float32_chunks"
"""The same kernel, run in float32 for multi-token queries; registered with transformers below."""


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


def _sdpa_float32_chunks(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: object,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' SDPA attention, computed in float32 for a query of several tokens.

    Half-precision SDPA on a CPU without native half kernels is about four
    times slower than float32 at prompt lengths; a decode step's single
    query keeps the half-precision path. The keys and values of the cache are
    converted for the call (a fraction of what attention over them costs).
    """
    if query.shape[-2] == 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()
    out, weights = sdpa_attention_forward(
        module, query.float(), key.float(), value.float(), attention_mask, **kwargs
    )
    return out.to(query.dtype), weights


# transformers' extension point for attention kernels: shards that need it name it at load; the
# masks are SDPA's, so a mask built for this kernel is exactly the one built for "sdpa".
AttentionInterface.register(FLOAT32_CHUNKS_ATTENTION, _sdpa_float32_chunks)
AttentionMaskInterface.register(FLOAT32_CHUNKS_ATTENTION, sdpa_mask)


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
