"""A contiguous range of a decoder-only model's layers, loaded alone and run step by step.

A node holds layers ``start..end`` (inclusive) of a Llama-like causal LM
(Llama, Mistral, Qwen2/Qwen3, SmolLM: ``model.model.layers``,
``model.model.embed_tokens``, ``model.model.norm``, ``model.lm_head``,
``model.model.rotary_emb``). :func:`~services.node.model.shard_load.load_shard` builds the model skeleton on
the meta device, keeps only the modules this shard needs and reads only their
tensors from the safetensors files, so the memory of the other layers is never
allocated. The head (``start == 0``) also holds the token embedding; the tail
(``end == num_layers - 1``) also holds the final norm and the LM head.

:meth:`Shard.run_layers` does for this shard's layers exactly what
``LlamaModel.forward`` does for all of them (positions, rotary embedding,
causal mask sized against the KV cache before the layers append to it, then
each decoder layer with the cache), so a chain of shards equals the
single-process model token for token. A decode step feeds one token: no
work grows with the context except attention over the cache. Half-precision
shards on a CPU run their decode steps through
:class:`~services.node.model.lean_decode.LeanDecoder`, the same arithmetic with far
fewer operations (bit-identical results, about 30% faster).

With ``--weights int8|int4`` (:mod:`services.node.model.quant.quant_load`) the layers'
products are held packed and exist only in the lean decoder, which then runs
every step of the shard, prompts included (:meth:`LeanDecoder.run_chunk`); a GGUF's
layers of another structure (Qwen3, Gemma, Phi-3, MoE experts) keep transformers'
modules with packed products in place (:mod:`services.node.model.packed_layers`),
and every step of such a shard, a lone one too, runs as a ragged step through those layers
(:mod:`services.node.model.ragged_layers`): decode rows of several sessions and prompt chunks in one pass,
each row the same bits alone or beside others. A float shard of those architectures runs its lone steps
through transformers' exact path and batches its decode rows through the ragged one.

A half-precision shard on a CPU computes attention in float32 (torch's half
SDPA there is ten times slower for a decode step's single query), and on a
CPU without native kernels for its half format, multi-token chunks run their
linear layers in float32 too while decode steps stay in half precision: see
:mod:`services.node.model.chunk_precision`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Final, Literal

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.cache_utils import get_layer_types_and_kwargs
from transformers.masking_utils import (
    create_causal_mask,
    create_sliding_window_causal_mask,
)

from services.node.model.architecture import (
    PositionEmbeddings,
    soft_cap,
)
from services.node.model.chunk_precision import FLOAT32_ATTENTION, attention_kernel
from services.node.model.kv_cache import ShardCache
from services.node.model.lean_decode import LeanDecoder
from services.node.model.quant.huge_pages import HugeRegion
from services.node.model.quant.packed import KERNEL_MAX_ROWS, QuantLinear
from services.node.model.quant.quant_load import (
    WeightsFormat,
)
from services.node.model.ragged_layers import RaggedStep, ragged_kernel

logger = logging.getLogger(__name__)

ShardRole = Literal["whole", "head", "middle", "tail"]
MaskKind = Literal["full_attention", "sliding_attention"]
_MASK_BUILDERS: Final[dict[str, Callable[..., torch.Tensor | None]]] = {
    "full_attention": create_causal_mask,
    "sliding_attention": create_sliding_window_causal_mask,
}

KV_DTYPES: Final[dict[str, torch.dtype | None]] = {"auto": None, "float16": torch.float16,
                                                  "bfloat16": torch.bfloat16}
"""What ``--kv-dtype`` names: the format a quantized shard's KV cache keeps (``auto``: the compute format)."""
EMBED_KEY: Final = "model.embed_tokens.weight"
LM_HEAD_KEY: Final = "lm_head.weight"


class ShardError(ValueError):
    """A shard was asked for something it cannot do (bad range, wrong input, wrong role)."""


def _tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class Shard:
    """Layers ``start..end`` of one model on one device, ready to run sessions through."""

    def __init__(
        self,
        *,
        config: PretrainedConfig,
        start: int,
        end: int,
        modules: nn.Module,
        layers: dict[int, nn.Module],
        embed_tokens: nn.Module | None,
        norm: nn.Module | None,
        lm_head: nn.Module | None,
        rotary_emb: nn.Module,
        dtype: torch.dtype,
        device: torch.device,
        chunk_dtype: torch.dtype | None = None,
        lean: LeanDecoder | None = None,
        weights_format: WeightsFormat = "float",
    ) -> None:
        self.config = config
        self.start = start
        self.end = end
        self.num_layers: int = config.num_hidden_layers
        self.is_head = start == 0
        self.is_tail = end == self.num_layers - 1
        self.hidden_size: int = config.hidden_size
        self.vocab_size: int = config.vocab_size
        self.dtype = dtype
        self.device = device
        self.chunk_dtype = dtype if chunk_dtype is None else chunk_dtype
        """Format of the linear layers of multi-token chunks (decode steps run in ``dtype``)."""
        self.modules = modules
        """Every parameter this shard holds, named as in the checkpoint (``model.layers.3.mlp...``)."""
        self._layers = layers
        self._embed_tokens = embed_tokens
        self._norm = norm
        self._lm_head = lm_head
        self._rotary_emb = rotary_emb
        self._mask_kinds: dict[int, MaskKind] = mask_kinds_of(config, start, end)
        self._positions = PositionEmbeddings(rotary_emb, set(self._mask_kinds.values()))
        self._windows: dict[int, int | None] = {
            index: int(config.sliding_window) if kind == "sliding_attention" else None
            for index, kind in self._mask_kinds.items()}
        """Each layer's sliding window (``None``: full attention), for ragged steps' attention."""
        self.lean = lean
        self.huge_region: HugeRegion | None = None
        """The huge-page mapping a quantized CPU shard's packed matrices live in (:mod:`services.node.model.quant.huge_pages`);
        held here so it lives as long as they do."""
        self.weights_format: WeightsFormat = weights_format
        """``float``, or the packed format (:mod:`services.node.model.quant.packed`) every step of this shard runs through
        the lean decoder with."""
        self.kv_dtype: torch.dtype | None = torch.float32 if attention_kernel(dtype, device) == FLOAT32_ATTENTION \
            else None
        """Format the KV cache keeps (``None``: the shard's): float32 where attention runs in float32."""
        """The fast path of one-token steps (:mod:`services.node.model.lean_decode`), where it applies."""

    @property
    def role(self) -> ShardRole:
        """Where the shard sits in a route: it embeds tokens (head), samples them (tail), both, or neither."""
        if self.is_head and self.is_tail:
            return "whole"
        return "head" if self.is_head else "tail" if self.is_tail else "middle"

    @property
    def layer_range(self) -> range:
        """The absolute layer numbers this shard holds."""
        return range(self.start, self.end + 1)

    def weight_bytes(self) -> int:
        """Bytes of parameters and buffers held (tied weights counted once)."""
        seen: set[int] = set()
        total = 0
        for tensor in [*self.modules.parameters(), *self.modules.buffers(), *self._rotary_emb.buffers()]:
            if tensor.data_ptr() in seen:
                continue
            seen.add(tensor.data_ptr())
            total += _tensor_bytes(tensor)
        return total

    def new_cache(self, reserve_tokens: int | None = None) -> ShardCache:
        """An empty KV cache for one new session on this shard.

        ``reserve_tokens`` (prompt + max_tokens, ``X-Meshnet-Reserve``) sizes the
        buffers once, so a session that stays within it never reallocates.
        """
        return ShardCache(self.config, self.layer_range, reserve_tokens, self.kv_dtype)

    @torch.inference_mode()
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings of ``input_ids`` (``[1, n]``) as ``[1, n, hidden]``; head only."""
        if self._embed_tokens is None:
            raise ShardError(f"layers {self.start}-{self.end} are not the head: no token embedding here")
        if input_ids.ndim != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] < 1:
            raise ShardError(f"input_ids must have shape [1, n>=1], got {list(input_ids.shape)}")
        if input_ids.dtype not in (torch.long, torch.int32, torch.int64):
            raise ShardError(f"input_ids must be integers, got {input_ids.dtype}")
        low, high = int(input_ids.min()), int(input_ids.max())
        if low < 0 or high >= self.vocab_size:
            raise ShardError(f"token ids must be in 0..{self.vocab_size - 1}, got {low}..{high}")
        return self._embed_tokens(input_ids.to(device=self.device, dtype=torch.long))

    @torch.inference_mode()
    def run_layers(
        self,
        hidden: torch.Tensor,
        cache: ShardCache,
        position_offset: int,
        from_layer: int | None = None,
    ) -> torch.Tensor:
        """Run layers ``from_layer..end`` on ``hidden`` (``[1, n, hidden]``) for tokens at
        positions ``position_offset..position_offset+n-1``, appending their keys and
        values to ``cache``; return the output hidden states ``[1, n, hidden]``.

        ``position_offset`` must equal the tokens the cache already holds: a step
        that does not follow the session's previous one is refused, because its
        attention would silently be wrong.
        """
        first = self.start if from_layer is None else from_layer
        if first not in self.layer_range:
            raise ShardError(f"from_layer {first} is outside this shard's layers {self.start}-{self.end}")
        if cache.entry_layer is None:
            cache.entry_layer = first
        elif cache.entry_layer != first:
            raise ShardError(f"session entered this shard at layer {cache.entry_layer}, not {first}")
        if (
            hidden.ndim != 3
            or hidden.shape[0] != 1
            or hidden.shape[1] < 1
            or hidden.shape[2] != self.hidden_size
        ):
            raise ShardError(
                f"hidden states must have shape [1, n>=1, {self.hidden_size}], got {list(hidden.shape)}"
            )
        held = cache.seq_len
        _check_follows(position_offset, held)

        hidden = hidden.to(device=self.device, dtype=self.dtype)
        n = hidden.shape[1]
        position_ids = torch.arange(position_offset, position_offset + n, device=self.device).unsqueeze(0)
        if self.weights_format != "float" and self.lean is not None:
            return self._run_quantized(hidden, cache, position_ids, first, held)
        if self.in_layers:
            return self._run_in_layers(hidden, [cache], [held], [n], first)
        masks = self._masks(hidden, cache, position_ids, first)
        position_embeddings = self._positions(hidden, position_ids)
        undo = cache.rollback_point()
        try:
            if n == 1 and self.lean is not None and self.lean.solo and all(mask is None for mask in masks.values()):
                cos, sin = position_embeddings["full_attention"]
                return self.lean.run(hidden, cos, sin, cache.kv, first, self.end)
            for index in range(first, self.end + 1):
                kind = self._mask_kinds[index]
                out = self._layers[index](
                    hidden,
                    attention_mask=masks[kind],
                    position_embeddings=position_embeddings[kind],
                    position_ids=position_ids,
                    cache=cache.kv,
                    use_cache=True,
                )
                hidden = out[0] if isinstance(out, tuple) else out
        except BaseException:
            undo()  # leave the session as it was before this step (e.g. out of memory)
            raise
        return hidden

    def _run_quantized(self, hidden: torch.Tensor, cache: ShardCache, position_ids: torch.Tensor, first: int,
                       held: int) -> torch.Tensor:
        """A step of a quantized shard: its layers exist only in the lean decoder, prompts included."""
        assert self.lean is not None
        cos, sin = self._rotary_emb(hidden, position_ids=position_ids)
        try:
            if hidden.shape[1] == 1:
                return self.lean.run(hidden, cos, sin, cache.kv, first, self.end)
            return self.lean.run_chunk(hidden, cos, sin, cache.kv, first, self.end)
        except BaseException:
            cache.truncate(held)
            raise

    def _run_in_layers(self, hidden: torch.Tensor, caches: Sequence[ShardCache], held: Sequence[int],
                       lengths: Sequence[int], first: int) -> torch.Tensor:
        """Layers ``first..end`` of transformers on a ragged step (``hidden`` ``[1, T, hidden]``, each session's
        ``lengths[i]`` positions from ``held[i]``): :mod:`services.node.model.ragged_layers`. Every cache is left
        as it was if the step fails."""
        position_ids = torch.cat([torch.arange(offset, offset + n) for offset, n in zip(held, lengths, strict=True)])
        position_ids = position_ids.to(self.device).unsqueeze(0)
        position_embeddings = self._positions(hidden, position_ids)
        step = RaggedStep(caches=[cache.kv for cache in caches], lengths=lengths, offsets=held,
                          windows=self._windows)
        undo = [cache.rollback_point() for cache in caches]
        try:
            with ragged_kernel(self.config):
                for index in range(first, self.end + 1):
                    out = self._layers[index](hidden, attention_mask=None,
                                              position_embeddings=position_embeddings[self._mask_kinds[index]],
                                              position_ids=position_ids, cache=step, use_cache=True, ragged=step)
                    hidden = out[0] if isinstance(out, tuple) else out
        except BaseException:
            for restore in undo:
                restore()
            raise
        return hidden

    @property
    def in_layers(self) -> bool:
        """Whether every step, a lone one too, runs as a ragged step through transformers' layers: a packed
        shard of an architecture the lean decoder does not take (:mod:`services.node.model.packed_layers`), so
        a session's step is the same bits alone or batched."""
        return self.lean is None and self.weights_format != "float"

    @property
    def batches_rows(self) -> bool:
        """Whether decode rows of several sessions run as one batch here: through the lean decoder (the Llama
        shape), else through transformers' own layers (:mod:`services.node.model.ragged_layers`)."""
        return True

    @property
    def batches_chunks(self) -> bool:
        """Whether prompt chunks join a turn's batch too (:meth:`run_ragged`): quantized shards, whose every
        step runs on the batched path (the lean decoder, or the ragged one through transformers' layers), where
        a chunk alone would take the same path, so several sessions' prompts and decode rows cost one pass over
        the weights."""
        return self.weights_format != "float"

    def step_problem(self, cache: ShardCache, position_offset: int, from_layer: int) -> str | None:
        """Why a step of ``cache``'s session at ``position_offset`` entering at ``from_layer`` cannot run
        here, or ``None``: the checks :meth:`run_layers` makes, for keeping a bad step out of a batch."""
        if from_layer not in self.layer_range:
            return f"from_layer {from_layer} is outside this shard's layers {self.start}-{self.end}"
        if cache.entry_layer not in (None, from_layer):
            return f"a session entered this shard at layer {cache.entry_layer}, not {from_layer}"
        if position_offset != cache.seq_len:
            return f"position offset {position_offset} does not follow the {cache.seq_len} tokens in the KV cache"
        return None

    @torch.inference_mode()
    def run_rows(self, hidden: torch.Tensor, caches: Sequence[ShardCache], offsets: Sequence[int],
                 from_layer: int) -> torch.Tensor:
        """One decode step of B sessions at once: ``hidden`` is ``[B, 1, hidden]``, row ``i`` the next
        token of the session of ``caches[i]``, at position ``offsets[i]``; returns ``[B, 1, hidden]``.

        :meth:`run_ragged` with one position per session.
        """
        rows = len(caches)
        if hidden.ndim != 3 or hidden.shape[0] != rows or hidden.shape[1] != 1 or hidden.shape[2] != self.hidden_size:
            raise ShardError(f"decode rows must have shape [{rows}, 1, {self.hidden_size}], got {list(hidden.shape)}")
        out = self.run_ragged(hidden.view(1, rows, self.hidden_size), caches, offsets, [1] * rows, from_layer)
        return out.view(rows, 1, self.hidden_size)

    @torch.inference_mode()
    def run_ragged(self, hidden: torch.Tensor, caches: Sequence[ShardCache], offsets: Sequence[int],
                   lengths: Sequence[int], from_layer: int) -> torch.Tensor:
        """One step of several sessions at once, laid end to end: ``hidden`` is ``[1, T, hidden]``, its next
        ``lengths[i]`` positions the tokens of the session of ``caches[i]`` from position ``offsets[i]``
        (1 for a decode row, more for a prompt chunk); returns ``[1, T, hidden]``.

        The products run once over all ``T`` positions, attention per session
        against its own cache (:meth:`LeanDecoder.run_ragged`, or transformers'
        layers with ragged attention: :mod:`services.node.model.ragged_layers`);
        prompt chunks only where :attr:`batches_chunks`. As in :meth:`run_layers`,
        each offset must equal the tokens its cache holds. If the step fails,
        every cache is left as it was.
        """
        total = sum(lengths)
        if not (len(caches) == len(offsets) == len(lengths)) or min(lengths, default=0) < 1:
            raise ShardError(f"a batch needs one offset and a positive length per cache, got {len(caches)} caches, "
                             f"offsets {list(offsets)}, lengths {list(lengths)}")
        if max(lengths) > 1 and not self.batches_chunks:
            raise ShardError("prompt chunks of a float shard run alone, through run_layers")
        if hidden.ndim != 3 or hidden.shape[0] != 1 or hidden.shape[1] != total or hidden.shape[2] != self.hidden_size:
            raise ShardError(f"a batch of {total} positions must have shape [1, {total}, {self.hidden_size}], "
                             f"got {list(hidden.shape)}")
        for cache, offset in zip(caches, offsets, strict=True):
            if (problem := self.step_problem(cache, offset, from_layer)) is not None:
                raise ShardError(problem)
        held = [cache.seq_len for cache in caches]
        for cache in caches:
            cache.entry_layer = from_layer
        hidden = hidden.to(device=self.device, dtype=self.dtype)
        if self.lean is None:
            return self._run_in_layers(hidden, caches, held, lengths, from_layer)
        position_ids = torch.cat([torch.arange(offset, offset + n) for offset, n in zip(held, lengths, strict=True)])
        cos, sin = self._rotary_emb(hidden, position_ids=position_ids.to(self.device).unsqueeze(0))
        try:
            return self.lean.run_ragged(hidden, cos, sin, [(cache.kv, n) for cache, n in zip(caches, lengths, strict=True)],
                                        from_layer, self.end)
        except BaseException:
            for cache, length in zip(caches, held, strict=True):
                cache.truncate(length)
            raise

    @torch.inference_mode()
    def logits_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head of the last position of every row: float32 ``[B, vocab]``; tail only."""
        if self._norm is None or self._lm_head is None:
            raise ShardError(f"layers {self.start}-{self.end} are not the tail: no LM head here")
        last = hidden[:, -1, :].to(device=self.device, dtype=self.dtype)
        return soft_cap(self._lm_head(self._norm(last)), self.config).to(dtype=torch.float32)

    @torch.inference_mode()
    def logits_at(self, hidden: torch.Tensor, positions: Sequence[int]) -> torch.Tensor:
        """Final norm and LM head of ``positions`` of a ragged batch's ``hidden`` (``[1, T, hidden]``): float32
        ``[len(positions), vocab]``; tail only."""
        return self.logits_rows(hidden[0, list(positions)].unsqueeze(1))

    @torch.inference_mode()
    def logits_all(self, hidden: torch.Tensor, positions: int) -> torch.Tensor:
        """Final norm and LM head of the first ``positions`` positions of ``hidden`` (``[1, n, hidden]``):
        float32 ``[positions, vocab]``; tail only (a prompt's own log-probabilities)."""
        if self._norm is None or self._lm_head is None:
            raise ShardError(f"layers {self.start}-{self.end} are not the tail: no LM head here")
        states = hidden[0, :positions, :].to(device=self.device, dtype=self.dtype)
        return soft_cap(self._lm_head(self._norm(states)), self.config).to(dtype=torch.float32)

    @torch.inference_mode()
    def logits_tail(self, hidden: torch.Tensor, positions: int) -> torch.Tensor:
        """The logits after each of the last ``positions`` positions of ``hidden``: float32 ``[positions, vocab]``.

        Each row is computed as :meth:`logits_last` computes it for a frame ending
        there (one position at a time), so a verified token is the one a decode
        step would have picked.
        """
        if not 1 <= positions <= hidden.shape[1]:
            raise ShardError(f"cannot take the logits of {positions} positions of a frame of {hidden.shape[1]}")
        length = hidden.shape[1]
        if self.lm_head_rows_apart and positions <= KERNEL_MAX_ROWS:
            # One pass over the LM head for every position (it is the largest matrix of a small model's tail:
            # a pass per position made each drafted token cost a third of a whole decode step there).
            return self.logits_all(hidden[:, length - positions:], positions)
        return torch.stack([self.logits_last(hidden[:, : length - positions + index + 1])
                            for index in range(positions)])

    @property
    def lm_head_rows_apart(self) -> bool:
        """Whether the LM head computes each row of a product on its own, whatever the other rows (the packed
        kernel of a quantized head, up to :data:`~services.node.model.quant.packed.KERNEL_MAX_ROWS` rows): then several
        positions' logits from one product are bit for bit each one's alone. A float head's product may
        round a row differently beside others (another kernel), so it runs one position at a time."""
        return isinstance(self._lm_head, QuantLinear)

    @torch.inference_mode()
    def logits_last(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head of the last position of ``hidden``: a float32 ``[vocab]``; tail only."""
        if self._norm is None or self._lm_head is None:
            raise ShardError(f"layers {self.start}-{self.end} are not the tail: no LM head here")
        if hidden.ndim != 3 or hidden.shape[0] != 1 or hidden.shape[2] != self.hidden_size:
            raise ShardError(
                f"hidden states must have shape [1, n, {self.hidden_size}], got {list(hidden.shape)}"
            )
        last = hidden[:, -1:, :].to(device=self.device, dtype=self.dtype)
        logits = soft_cap(self._lm_head(self._norm(last)), self.config)
        return logits[0, -1].to(dtype=torch.float32)

    def _masks(
        self, hidden: torch.Tensor, cache: ShardCache, position_ids: torch.Tensor, first: int
    ) -> dict[MaskKind, torch.Tensor | None]:
        """One attention mask per kind of layer run, sized against the cache before this step."""
        masks: dict[MaskKind, torch.Tensor | None] = {}
        for index in range(first, self.end + 1):
            kind = self._mask_kinds[index]
            if kind in masks:
                continue
            masks[kind] = _MASK_BUILDERS[kind](
                config=self.config,
                inputs_embeds=hidden,
                attention_mask=None,
                cache=cache.kv,
                position_ids=position_ids,
                layer_idx=index,
            )
        return masks


def _check_follows(position_offset: int, held: int) -> None:
    """Refuse a step whose first position is not the next one of its cache: its attention would be wrong."""
    if position_offset != held:
        raise ShardError(f"position offset {position_offset} does not follow the {held} tokens in the KV cache")


def mask_kinds_of(config: PretrainedConfig, start: int, end: int) -> dict[int, MaskKind]:
    layer_types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    kinds: dict[int, MaskKind] = {}
    for index in range(start, end + 1):
        kind = layer_types[index]
        if kind not in _MASK_BUILDERS:
            raise ShardError(f"layer {index} has attention type {kind!r}, which meshnet does not support")
        kinds[index] = kind  # type: ignore[assignment]
    return kinds
