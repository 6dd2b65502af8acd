"""Moving one session's KV between a shard's cache and the handoff wire.

A pull chunk is one tensor ``[2 * layers, kv_heads, positions, head_dim]``:
layer ``first``'s keys, its values, the next layer's keys, and so on, for
positions ``start..end-1`` (:mod:`meshwire.kv_handoff`). :func:`read_kv` cuts
it from a held session's cache on a prefill node; :func:`append_kv` appends
it to a fresh session's cache on a decode node, which then holds exactly the
prefill node's keys and values (copied, never recomputed).
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from meshwire.frames import DTYPE_NAMES, ITEMSIZE
from meshwire.kv_handoff import KVShape
from services.node.model.kv_cache import GrowingLayer, ShardCache
from services.node.model.shard import Shard


class KVTransferError(ValueError):
    """A cache cannot give or take the KV asked for."""


def kv_shape(shard: Shard) -> KVShape:
    """The shape of ``shard``'s KV cache in the layout's terms (every layer of the model)."""
    config: PretrainedConfig = shard.config
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    dtype = DTYPE_NAMES[shard.kv_dtype or shard.dtype]
    return KVShape(num_layers=shard.num_layers, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                   itemsize=ITEMSIZE[dtype], max_positions=int(getattr(config, "max_position_embeddings", 0) or 0))


def _layer(cache: ShardCache, index: int) -> GrowingLayer:
    layer = cache.kv.layers[index]
    if not isinstance(layer, GrowingLayer):
        raise KVTransferError(f"layer {index} is not a full-attention cache layer this node can hand off")
    return layer


def read_kv(cache: ShardCache, first: int, last: int, start: int, end: int) -> torch.Tensor:
    """Keys and values of layers ``first..last`` at positions ``start..end-1``, as one contiguous CPU tensor."""
    parts: list[torch.Tensor] = []
    for index in range(first, last + 1):
        layer = _layer(cache, index)
        if layer.get_seq_length() < end:
            raise KVTransferError(f"layer {index} holds {layer.get_seq_length()} positions, not {end}")
        parts.append(layer.keys[0, :, start:end])
        parts.append(layer.values[0, :, start:end])
    return torch.stack(parts).to("cpu").contiguous()


def append_kv(cache: ShardCache, first: int, chunk: torch.Tensor, device: torch.device) -> None:
    """Append a pulled chunk (layers ``first..``) to ``cache``'s layers, after the positions they hold."""
    if chunk.dim() != 4 or chunk.shape[0] % 2:
        raise KVTransferError(f"a KV chunk is [2 * layers, heads, positions, head_dim], not {list(chunk.shape)}")
    for offset in range(chunk.shape[0] // 2):
        keys = chunk[2 * offset].unsqueeze(0).to(device)
        values = chunk[2 * offset + 1].unsqueeze(0).to(device)
        _layer(cache, first + offset).update(keys, values)


def held_positions(cache: ShardCache, first: int, last: int) -> set[int]:
    """The distinct lengths layers ``first..last`` of ``cache`` hold (one value when they agree)."""
    return {_layer(cache, index).get_seq_length() for index in range(first, last + 1)}
