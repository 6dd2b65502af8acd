"""Ragged steps through transformers' own decoder layers: several sessions' tokens in one pass, any architecture.

The lean decoder (:mod:`services.node.model.lean_decode`) batches the rows of the Llama shape by computing
its layers itself. Every other architecture (Qwen3's per-head q/k norms, Gemma 2/3's (1+w) norms before and
after attention and MLP, sliding windows and soft-capped scores, Phi-3's fused ``qkv_proj`` and
``gate_up_proj``, the routers and experts of Qwen3-MoE and Mixtral) keeps transformers' decoder layers, which
compute exactly what the architecture does. Everything in such a layer but attention works on each position
alone (norms, products, routers, experts), so a step of several sessions laid end to end (``[1, T, hidden]``,
each session's next ``n`` positions one *segment*) can go through the layer as one sequence, if attention
keeps the segments apart. Two things make it do so, for the duration of one call (:func:`ragged_layers`):

* the layers get a :class:`RaggedStep` as their ``cache``: its ``update`` splits the step's keys and values
  by segment and appends each part to its own session's cache layer (a growing one, or transformers'
  sliding-window one, which keeps its last ``window - 1`` positions), keeping what each segment attends to;
* the config's attention kernel is :data:`RAGGED_ATTENTION` (:func:`ragged_attention`): attention per segment
  against its own keys and values, causal within a chunk, each position's sliding window its own, Gemma 2's
  soft-capping applied to the scores as transformers' eager kernel does.

A segment's attention reads nothing of the others, and the per-position work rounds a position the same
whatever sits beside it where the products do (the packed kernel, and routers run a row at a time:
:class:`~services.node.model.packed_layers.RowwiseRouter`), so a packed shard's session gets the same bits
alone or in any batch; a float shard's products round a row differently beside others (torch's float matrix
product), as the lean decoder's float rows do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.cache_utils import Cache
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

RAGGED_ATTENTION: Final = "meshnet_ragged"
"""The attention kernel name a ragged call sets on the shard's config (:func:`ragged_layers`)."""


@dataclass
class RaggedStep:
    """The sessions of one ragged call, handed to the layers as their ``cache``.

    ``caches[i]`` is the KV cache of the session whose ``lengths[i]`` positions come next in the step,
    starting at its position ``offsets[i]``; ``windows`` maps each layer run to its sliding window
    (``None``: full attention)."""

    caches: Sequence[Cache]
    lengths: Sequence[int]
    offsets: Sequence[int]
    windows: Mapping[int, int | None]
    attended: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    """Per layer, each segment's keys and values after its append (what it attends to); set by :meth:`update`."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object,
               **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        """Append each segment's part of ``key_states``/``value_states`` (``[1, kv_heads, T, dim]``) to its own
        session's cache layer; return the step's own keys and values (the kernel reads :attr:`attended`)."""
        parts = []
        at = 0
        for cache, n in zip(self.caches, self.lengths, strict=True):
            parts.append(cache.layers[layer_idx].update(key_states[:, :, at:at + n], value_states[:, :, at:at + n]))
            at += n
        self.attended[layer_idx] = parts
        return key_states, value_states


def ragged_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, *, scaling: float | None = None,
                     softcap: float | None = None, ragged: RaggedStep | None = None,
                     **kwargs: object) -> tuple[torch.Tensor, None]:
    """Attention of a ragged step (module doc): ``query`` ``[1, heads, T, dim]``, each segment against its own
    keys and values; returns ``[1, T, heads, dim]`` as transformers' kernels do."""
    if ragged is None:
        raise RuntimeError(f"{RAGGED_ATTENTION} attention runs only inside ragged_layers (it needs the segments)")
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    window = ragged.windows.get(layer)
    scale = float(scaling) if scaling is not None else float(module.head_dim) ** -0.5  # type: ignore[arg-type]
    wide = torch.float32 if query.device.type == "cpu" else query.dtype
    out = []
    at = 0
    for (keys, values), n, offset in zip(ragged.attended[layer], ragged.lengths, ragged.offsets, strict=True):
        q = query[:, :, at:at + n].to(wide)
        mask = _mask(offset, n, keys.shape[2], window, query.device)
        keys, values = keys.to(wide), values.to(wide)
        if softcap is None:
            attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        else:
            attended = _soft_capped(q, keys, values, mask, scale, float(softcap))
        out.append(attended)
        at += n
    joined = out[0] if len(out) == 1 else torch.cat(out, 2)
    return joined.to(query.dtype).transpose(1, 2).contiguous(), None


def _mask(offset: int, n: int, held: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """Which of the ``held`` keys (the last ``held`` positions up to ``offset + n - 1``) each of the ``n``
    queries at ``offset..offset + n - 1`` sees: those not after it and, in a sliding layer, within its window
    (transformers' ``kv > q - window``). ``None`` where every query sees every key."""
    end = offset + n
    keys = torch.arange(end - held, end, device=device).unsqueeze(0)
    queries = torch.arange(offset, end, device=device).unsqueeze(1)
    seen = keys <= queries
    if window is not None:
        seen &= keys > queries - window
    return None if bool(seen.all()) else seen.unsqueeze(0).unsqueeze(0)


def _soft_capped(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                 scale: float, cap: float) -> torch.Tensor:
    """transformers' eager attention with soft-capped scores (Gemma 2), operation for operation."""
    groups = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
    scores = torch.matmul(q, keys.transpose(2, 3)) * scale
    scores = torch.tanh(scores / cap) * cap
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    return torch.matmul(F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), values)


AttentionInterface.register(RAGGED_ATTENTION, ragged_attention)
AttentionMaskInterface.register(RAGGED_ATTENTION, sdpa_mask)  # never built in a ragged call; named for completeness


@contextlib.contextmanager
def ragged_kernel(config: PretrainedConfig) -> Iterator[None]:
    """``config``'s attention kernel set to :data:`RAGGED_ATTENTION` for the block (the compute thread runs one
    step at a time, so nothing else reads it meanwhile), then restored."""
    before = config._attn_implementation
    config._attn_implementation = RAGGED_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before
