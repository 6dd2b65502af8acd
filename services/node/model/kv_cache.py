"""The KV cache of one session on one shard.

transformers' ``DynamicLayer`` appends each step's keys and values with
``torch.cat``, which copies the whole cache every token: at a 2,000-token
context that is as much memory traffic as attention itself. The layers here
keep keys and values in a buffer with spare room (sized from the session's
reservation, else doubling when full), so a decode step writes one token and
attention reads a view of the filled part: the step costs attention and
nothing else that grows with the context.

The cache is indexed by absolute layer number, as the decoder layers expect;
layers this shard does not run stay empty and cost nothing.

A half-precision shard on a CPU computes attention in float32
(:mod:`services.node.model.chunk_precision`), so its cache stores keys and values
in float32 (``store_dtype``): converting the whole cache for every layer of
every decode step cost more than attention itself at long contexts (on 2
nodes of SmolLM2, 1,500-token steps took 1.33 times the 30-token ones). The
values are exactly the half-precision ones (every half value is a float32
value), so results do not change; the cache takes twice the memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Final

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

MIN_CAPACITY_TOKENS: Final = 256
"""Smallest buffer a layer allocates when the session did not say how long it may grow."""


class _FilledPart:
    """A layer's ``keys`` (or ``values``): the view of its buffer's filled part, made when read, so a step that
    writes the buffers directly (the fused decode rows, :meth:`GrowingLayer.advance`) only moves ``_length``.
    Before the buffer exists it is whatever transformers assigned (its lazy initialisation sets empty tensors)."""

    def __init__(self, buffer: str) -> None:
        self._buffer = buffer
        self._unbuffered = f"_unbuffered{buffer}"

    def __get__(self, layer: GrowingLayer | None, owner: type) -> torch.Tensor | None:
        if layer is None:
            return self  # type: ignore[return-value]
        buffer = getattr(layer, self._buffer)
        if buffer is None:
            return getattr(layer, self._unbuffered, None)
        return buffer[:, :, : layer._length]

    def __set__(self, layer: GrowingLayer, value: torch.Tensor | None) -> None:
        setattr(layer, self._unbuffered, value)


class GrowingLayer(DynamicLayer):
    """A full-attention cache layer whose keys/values live in a buffer grown geometrically.

    ``keys``/``values`` are views of the filled part, so every transformers
    helper that reads them (sequence length, mask sizes) works unchanged.
    """

    def __init__(self, reserve_tokens: int | None = None, store_dtype: torch.dtype | None = None) -> None:
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None
        self._length = 0
        super().__init__()
        self._reserve = reserve_tokens
        self._store_dtype = store_dtype
        """Format the keys and values are kept in (``None``: the format they arrive in)."""

    keys = _FilledPart("_key_buffer")
    values = _FilledPart("_value_buffer")

    @property
    def buffers(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The key and value buffers ``[1, kv_heads, capacity, head_dim]`` (``None`` before the first token)."""
        if self._key_buffer is None or self._value_buffer is None:
            return None
        return self._key_buffer, self._value_buffer

    def make_room(self, tokens: int) -> bool:
        """Grow the buffers, if needed, to hold ``tokens`` more positions; ``False`` when there are none yet."""
        if self._key_buffer is None or self._value_buffer is None:
            return False
        end = self._length + tokens
        if end > self._key_buffer.shape[-2]:
            self._grow(self._key_buffer, self._value_buffer, end)
        return True

    def advance(self, tokens: int) -> None:
        """Count ``tokens`` more positions, written into the buffers by the caller (after :meth:`make_room`)."""
        self._length += tokens

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``[batch, kv_heads, n, head_dim]`` keys and values; return all keys and values so far."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self._length + key_states.shape[-2]
        if self._key_buffer is None or end > self._key_buffer.shape[-2]:
            self._grow(key_states, value_states, end)
        assert self._key_buffer is not None and self._value_buffer is not None
        self._key_buffer[:, :, self._length : end].copy_(key_states)
        self._value_buffer[:, :, self._length : end].copy_(value_states)
        self._length = end
        return self._key_buffer[:, :, :end], self._value_buffer[:, :, :end]

    def get_seq_length(self) -> int:
        """Tokens held."""
        return self._length

    def nbytes(self) -> int:
        """Bytes allocated for this layer's keys and values (the spare room included)."""
        if self._key_buffer is None or self._value_buffer is None:
            return 0
        return _bytes(self._key_buffer) + _bytes(self._value_buffer)

    def reset(self) -> None:
        """Forget every token and free the buffers."""
        super().reset()
        self._key_buffer = self._value_buffer = None
        self._length = 0

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens (transformers' convention: a value <= 0)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes the negative number of tokens to remove, got {tokens_to_remove}")
        self._length = max(self._length + tokens_to_remove, 0)

    def _grow(self, key_states: torch.Tensor, value_states: torch.Tensor, needed: int) -> None:
        current = 0 if self._key_buffer is None else self._key_buffer.shape[-2]
        if current == 0 and self._reserve is not None and self._reserve >= needed:
            capacity = self._reserve
        else:
            capacity = max(needed, 2 * current, MIN_CAPACITY_TOKENS)
        keys = _empty_like_with_length(key_states, capacity, self._store_dtype)
        values = _empty_like_with_length(value_states, capacity, self._store_dtype)
        if self._key_buffer is not None and self._value_buffer is not None and self._length:
            keys[:, :, : self._length].copy_(self._key_buffer[:, :, : self._length])
            values[:, :, : self._length].copy_(self._value_buffer[:, :, : self._length])
        self._key_buffer, self._value_buffer = keys, values


def _empty_like_with_length(states: torch.Tensor, length: int, dtype: torch.dtype | None) -> torch.Tensor:
    batch, heads, _, dim = states.shape
    return torch.empty((batch, heads, length, dim), dtype=dtype or states.dtype, device=states.device)


def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class ShardCache:
    """The KV cache of one session for the layers of one shard.

    A session always enters the shard at the same layer (its route's
    ``start_layer``), whose length is the session's length.
    """

    def __init__(self, config: PretrainedConfig, layers: range, reserve_tokens: int | None = None,
                 store_dtype: torch.dtype | None = None) -> None:
        if reserve_tokens is not None and reserve_tokens < 1:
            raise ValueError(f"a session must reserve at least one token of KV cache, got {reserve_tokens}")
        self.kv = DynamicCache(config=config)
        for index in layers:
            if type(self.kv.layers[index]) is DynamicLayer:  # sliding-window layers keep their own class
                self.kv.layers[index] = GrowingLayer(reserve_tokens, store_dtype)
        self.entry_layer: int | None = None
        """First layer this session runs on the shard; set by its first step."""

    @property
    def seq_len(self) -> int:
        """Tokens the cache holds (0 before the first step)."""
        if self.entry_layer is None:
            return 0
        return self.kv.get_seq_length(self.entry_layer)

    def truncate(self, length: int) -> None:
        """Forget every token after the first ``length`` in every layer (undoes a step that failed midway)."""
        for layer in self.kv.layers:
            held = layer.get_seq_length() if layer.is_initialized else 0
            if held > length:
                layer.crop(length - held)

    def rollback_point(self) -> Callable[[], None]:
        """A function that puts the cache back as it is now, to undo a step that fails midway.

        Growing layers are cut back to their length (:meth:`truncate`). A sliding-window layer cannot be: it
        drops its oldest position as it takes a new one (and transformers refuses to crop it past its window),
        but each append makes new tensors, so the ones it holds now are kept here and given back."""
        held = self.seq_len
        sliding = [(layer, layer.is_initialized, layer.keys, layer.values, layer.cumulative_length)
                   for layer in self.kv.layers if isinstance(layer, DynamicSlidingWindowLayer)]

        def restore() -> None:
            for layer, initialized, keys, values, cumulative in sliding:
                layer.is_initialized, layer.keys, layer.values = initialized, keys, values
                layer.cumulative_length = cumulative
            for layer in self.kv.layers:
                if not isinstance(layer, DynamicSlidingWindowLayer) and layer.is_initialized \
                        and layer.get_seq_length() > held:
                    layer.crop(held - layer.get_seq_length())

        return restore

    def copy_prefix(self, source: ShardCache, length: int) -> None:
        """Start this empty cache with a copy of ``source``'s first ``length`` tokens (a fork, ``meshwire.fork``).

        Raises :class:`ValueError` when it cannot: this cache is not empty, ``source`` holds fewer tokens, or a
        layer is not a plain growing one (a sliding window keeps only its last tokens).
        """
        if self.seq_len or source.entry_layer is None:
            raise ValueError("a fork starts an empty cache from a source that ran a step")
        if source.seq_len < length:
            raise ValueError(f"the source holds {source.seq_len} tokens, not {length}")
        pairs = []
        for mine, theirs in zip(self.kv.layers, source.kv.layers, strict=True):
            if not theirs.is_initialized:
                continue
            if not isinstance(mine, GrowingLayer) or not isinstance(theirs, GrowingLayer):
                raise ValueError("only full-attention layers can be forked")  # noqa: TRY004 - a refusal, not a bug
            pairs.append((mine, theirs))
        for mine, theirs in pairs:
            mine.update(theirs.keys[:, :, :length], theirs.values[:, :, :length])
        self.entry_layer = source.entry_layer

    def nbytes(self) -> int:
        """Bytes of memory the cache's keys and values take."""
        total = 0
        for layer in self.kv.layers:
            if isinstance(layer, GrowingLayer):
                total += layer.nbytes()
            else:
                total += sum(_bytes(t) for t in _layer_tensors(layer))
        return total


def _layer_tensors(layer: object) -> Iterator[torch.Tensor]:
    for name in ("keys", "values"):
        tensor = getattr(layer, name, None)
        if isinstance(tensor, torch.Tensor):
            yield tensor
