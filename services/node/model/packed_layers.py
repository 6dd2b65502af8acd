"""A GGUF's layers held packed inside transformers' own modules: any architecture, MoE experts included.

The lean decoder (:mod:`services.node.model.lean_decode`) runs packed layers of the Llama shape (Llama,
Mistral, Qwen2) with fused products and one native call a decode step. Every other architecture served
from a GGUF (Qwen3's per-head q/k norms, Gemma 2/3's extra norms, sliding windows and soft-capping, Phi-3's
fused ``qkv_proj`` and ``gate_up_proj``, the experts of Qwen3-MoE and Mixtral) keeps transformers' own
decoder layers, which compute exactly what the architecture does, and has its products packed in place:

* every ``nn.Linear`` of a layer becomes a :class:`PackedLinear` over the file's blocks, in the layout the
  file holds it (a fused ``attn_qkv`` or ``ffn_up`` is one packed matrix, as in the file);
* an MoE layer's experts (``ffn_{gate,up,down}_exps``: one 3-D tensor each, ``[experts, rows, cols]``)
  become :class:`PackedExperts`: one packed gate+up matrix and one packed down matrix per expert, and a step
  runs only the experts its tokens were routed to, each over all the rows routed to it at once;
* the token embedding and the LM head are held as the lean path holds them (int8,
  :func:`~services.node.model.quant.quant_load.load_embedding_and_head`), Gemma's ``sqrt(hidden)``
  embedding scale kept.

Norms, biases and routers (``ffn_gate_inp``, which llama.cpp keeps in float) stay float, read through
:class:`~services.node.model.gguf_model.GgufWeights`, which undoes what llama.cpp's converter did to them.
A matrix whose rows are not a multiple of the packed layout's block of 64 (a small model's k/v) is padded
with zero rows and its product cut back (:func:`padded`). Products are the native kernel's: float32 rows
and sums over the file's integers and bfloat16-rounded scales, each output within ``(K + 100) 2^-24
sum|x w|`` of the exact product (``tests/test_quant_kernel.py``). A shard's steps, prompts included, run
layer by layer through transformers as ragged steps (:mod:`services.node.model.ragged_layers`): decode rows of
several sessions and prompt chunks in one pass. The packed kernel computes each row on its own, whatever rows
ride with it; torch's float product does not (one row and several round differently), so what stays float
and is a product (a router, a linear the file holds in float) runs one row at a time
(:class:`RowwiseRouter`, :class:`RowwiseLinear`): a session's step is then the same bits alone or in any batch.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Final

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from services.node.model.gguf_model import GgufWeights
from services.node.model.quant.packed import (
    GGUF_BLOCK_BYTES,
    GROUP_SIZE,
    NIBBLE_MID,
    ROW_BLOCK,
    Groups,
    QuantFormat,
    QuantMatrix,
    dequantize_groups,
    gguf_groups,
    groups_of,
    permute_rows,
    stack,
)
from services.node.model.quant.quant_load import (
    GgufSource,
    holds_packed,
    kinds_format,
    load_embedding_and_head,
)

logger = logging.getLogger(__name__)

FLOAT_KINDS: Final = frozenset({"F32", "F16", "BF16"})
EXPERT_TENSORS: Final = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


class PackedLinear(nn.Module):
    """``nn.Linear`` over a packed matrix whose rows may have been padded to the layout's block (cut back here)."""

    def __init__(self, groups: Groups, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features = groups.out_features
        self.in_features = int(groups.q.shape[1])
        self.matrix = QuantMatrix(padded(groups))
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matrix.matmul(x)
        if self.matrix.out_features != self.out_features:
            out = out[..., :self.out_features]
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}"


class PackedExperts(nn.Module):
    """An MoE layer's experts, each one packed gate+up and one packed down matrix; the same call as
    transformers' experts module (``hidden [T, hidden]``, ``top_k_index`` and ``top_k_weights`` ``[T, k]``).

    Only the experts some token was routed to run, in expert order, each once over all its rows (as
    transformers' own loop does), so a decode row costs its ``k`` experts, not all of them."""

    def __init__(self, gate_up: list[PackedLinear], down: list[PackedLinear], act_fn: nn.Module) -> None:
        super().__init__()
        self.gate_up = nn.ModuleList(gate_up)
        self.down = nn.ModuleList(down)
        self.act_fn = act_fn
        self.num_experts = len(gate_up)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        top_k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        at = 0
        for expert, count in enumerate(counts):
            if count == 0 or expert >= self.num_experts:
                at += count
                continue
            picked = order[at:at + count]
            at += count
            tokens, slots = picked // top_k, picked % top_k
            gate, up = self.gate_up[expert](hidden_states[tokens]).chunk(2, dim=-1)
            rows = self.down[expert](self.act_fn(gate) * up) * top_k_weights[tokens, slots, None]
            out.index_add_(0, tokens, rows.to(out.dtype))
        return out


class RowwiseLinear(nn.Linear):
    """A float ``nn.Linear`` computed one row at a time, so each row's bits do not depend on the rows beside it
    (torch's float product rounds a lone row differently from the same row among others)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        flat = input.reshape(-1, self.in_features)
        rows = [F.linear(row, self.weight, self.bias) for row in flat.split(1)]
        return torch.cat(rows).view(*input.shape[:-1], self.out_features)


class RowwiseRouter(nn.Module):
    """An MoE router (transformers' own: its top-k and the architecture's normalisation, Qwen3-MoE's
    ``norm_topk_prob`` or Mixtral's always) run one row at a time, so a row picks the same experts with the same
    weights alone or in any batch: its float product is the one thing of an MoE block that would round a row
    differently beside others. The router's weight stays named as in the checkpoint (``mlp.gate.weight``).

    One call per row: a decode batch costs a handful; a prompt chunk of T tokens costs T small calls a layer
    (tens of microseconds each), small beside its experts' products."""

    def __init__(self, router: nn.Module) -> None:
        super().__init__()
        self.weight = router.weight
        self._router = (router,)  # not a registered child: its weight is this module's, named once

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        router = self._router[0]
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        outs = [router(row) for row in flat.split(1)]
        return tuple(torch.cat(parts) for parts in zip(*outs, strict=True))


def rowwise_float_products(layers: dict[int, nn.Module]) -> int:
    """Make what stays float and is a product in ``layers`` (routers, float linears) run a row at a time
    (:class:`RowwiseRouter`, :class:`RowwiseLinear`); their count. Call once the weights are loaded."""
    count = 0
    for layer in layers.values():
        for path, module in list(layer.named_modules()):
            if type(module) is nn.Linear:
                module.__class__ = RowwiseLinear
                count += 1
            elif _is_router(module):
                parent, _, leaf = path.rpartition(".")
                setattr(layer.get_submodule(parent) if parent else layer, leaf, RowwiseRouter(module))
                count += 1
    return count


def _is_router(module: nn.Module) -> bool:
    """transformers' MoE top-k routers: a ``weight`` ``[experts, hidden]`` and ``top_k``, called on the hidden
    states (Qwen3-MoE's and Mixtral's ``mlp.gate``)."""
    weight = getattr(module, "weight", None)
    return (not isinstance(module, nn.Linear | RowwiseRouter) and isinstance(weight, torch.Tensor)
            and weight.ndim == 2 and hasattr(module, "top_k"))


def padded(groups: Groups) -> Groups:
    """``groups`` with zero rows added up to a multiple of :data:`ROW_BLOCK` (they multiply to zero)."""
    rows, cols = groups.q.shape
    extra = -rows % ROW_BLOCK
    if not extra:
        return groups
    fill = NIBBLE_MID if groups.bits == 4 else 0
    q = torch.cat([groups.q, torch.full((extra, cols), fill, dtype=groups.q.dtype)])
    scale = torch.cat([groups.scale, groups.scale.new_zeros(extra, groups.scale.shape[1])])
    zero = torch.cat([groups.zero, groups.zero.new_zeros(extra, groups.zero.shape[1])])
    return Groups(q=q, scale=scale, zero=zero, bits=groups.bits, group=groups.group)


def packed_layers_problem(config: PretrainedConfig, layers: dict[int, nn.Module], device: torch.device,
                          gguf: Path | None) -> str | None:
    """Why layers of ``config`` cannot be held packed in transformers' modules here, or ``None`` when they can."""
    if gguf is None:
        return "layers of this architecture are held packed from a GGUF file only"
    if device.type != "cpu":
        return f"the packed kernel wired here is the CPU one, and this node runs on {device}"
    if config.vocab_size % ROW_BLOCK or config.hidden_size % GROUP_SIZE:
        return (f"the embedding ({config.vocab_size} x {config.hidden_size}) is not a multiple of "
                f"{ROW_BLOCK} x {GROUP_SIZE}")
    for index, layer in layers.items():
        for name, module in layer.named_modules():
            cols = _columns(module)
            if cols is not None and cols % GROUP_SIZE:
                return f"layer {index}'s {name} has {cols} inputs, not a multiple of the group size {GROUP_SIZE}"
    return None


def _columns(module: nn.Module) -> int | None:
    """The inputs of a product this path packs (a linear, an experts module's down matrix), else ``None``."""
    if isinstance(module, nn.Linear):
        return module.in_features
    if _is_experts(module):
        return int(min(module.down_proj.shape[-1], module.gate_up_proj.shape[-1]))
    return None


def _is_experts(module: nn.Module) -> bool:
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.ndim == 3


class _PackedReader:
    """A GGUF's layer matrices as packed groups in ``fmt`` (each type held as it is where it can be)."""

    def __init__(self, gguf: Path, config: PretrainedConfig, fmt: QuantFormat) -> None:
        self.weights = GgufWeights(gguf, config)
        self.fmt = fmt
        tensors = self.weights.file.tensors.values()
        self.own_format = kinds_format({t.kind for t in tensors if t.name.startswith("blk.")
                                        and t.kind not in FLOAT_KINDS and len(t.shape) >= 2})
        self.float_file = self.own_format is None and all(
            t.kind in FLOAT_KINDS for t in tensors if t.name.startswith("blk."))

    def packs(self, name: str) -> bool:
        """Whether the file's tensor ``name`` is held packed: a quantized type, or any matrix of a float file
        given ``--weights int8|int4``. A float matrix in a quantized file (a router) stays float."""
        entry = self.weights.file.tensors.get(name)
        return entry is not None and (entry.kind not in FLOAT_KINDS or self.float_file)

    def groups(self, name: str, rows: int, cols: int) -> Groups:
        """Tensor ``name`` (``rows x cols`` weights, a 3-D tensor's leading dims folded into the rows)."""
        entry = self.weights.file.tensors[name]
        if entry.kind not in FLOAT_KINDS and entry.kind in GGUF_BLOCK_BYTES:
            with self.weights.file.borrowed(name) as raw:  # gguf_groups copies the blocks
                groups = gguf_groups(entry.kind, raw, rows, cols)
            if not holds_packed(entry.kind, self.fmt, self.own_format):
                groups = groups_of(dequantize_groups(groups), self.fmt)
        else:
            groups = groups_of(self.weights.read(name).reshape(rows, cols), self.fmt)
        order = self.weights.row_order(name, rows)
        return groups if order is None else permute_rows(groups, order)


def _slice(groups: Groups, start: int, end: int) -> Groups:
    return Groups(q=groups.q[start:end], scale=groups.scale[start:end], zero=groups.zero[start:end],
                  bits=groups.bits, group=groups.group)


def load_packed_layers(gguf: Path, modules: nn.Module, layers: dict[int, nn.Module], config: PretrainedConfig,
                       fmt: QuantFormat, dtype: torch.dtype, device: torch.device, *, is_head: bool,
                       is_tail: bool) -> int:
    """Pack the products of ``layers`` in place (module doc), read every other tensor ``modules`` holds as
    float, and hold the embedding / LM head packed; returns how many matrices were packed."""
    reader = _PackedReader(gguf, config, fmt)
    packed = 0
    for index, layer in layers.items():
        packed += _pack_layer(reader, index, layer)
    scale = None
    if is_head:
        scale = getattr(modules.model.embed_tokens, "scalar_embed_scale", None)
        del modules.model.embed_tokens
    if is_tail:
        del modules.lm_head
    wanted = {key for key, tensor in modules.state_dict().items() if tensor.is_meta}
    state: dict[str, torch.Tensor] = {}
    for key in sorted(wanted):
        tensor = reader.weights.tensor(key)
        if tensor is None:
            raise ValueError(f"{gguf.name} lacks {key}")
        state[key] = tensor.to(device=device, dtype=dtype)
    modules.load_state_dict(state, strict=False, assign=True)
    load_embedding_and_head(GgufSource(gguf, config), modules, dtype, has_embedding=is_head, has_head=is_tail,
                            tied=bool(getattr(config, "tie_word_embeddings", False)), embed_scale=scale)
    reader.weights.close()
    rowwise_float_products(layers)
    logger.info("packed %d matrices of layers %d-%d as %s inside transformers' layers", packed, min(layers),
                max(layers), fmt)
    return packed


def _pack_layer(reader: _PackedReader, index: int, layer: nn.Module) -> int:
    """Replace ``layer``'s linears and experts by packed ones where the file's tensor is packed; their count."""
    count = 0
    for path, module in list(layer.named_modules()):
        if not path:
            continue
        parent, _, leaf = path.rpartition(".")
        owner = layer.get_submodule(parent) if parent else layer
        if isinstance(module, nn.Linear):
            name = reader.weights.gguf_name(f"model.layers.{index}.{path}.weight")
            if not reader.packs(name):
                continue
            bias = None
            if module.bias is not None:
                bias = reader.weights.tensor(f"model.layers.{index}.{path}.bias")
                if bias is None:
                    raise ValueError(f"the GGUF lacks the bias of layer {index}'s {path}")
            setattr(owner, leaf, PackedLinear(reader.groups(name, module.out_features, module.in_features),
                                              None if bias is None else bias.to(torch.float32)))
            count += 1
        elif _is_experts(module):
            names = [f"blk.{index}.{tensor}.weight" for tensor in EXPERT_TENSORS]
            if not all(reader.packs(name) for name in names):
                continue
            setattr(owner, leaf, _packed_experts(reader, names, module))
            count += 2 * int(module.gate_up_proj.shape[0])
    return count


def _packed_experts(reader: _PackedReader, names: list[str], experts: nn.Module) -> PackedExperts:
    count, double, hidden = experts.gate_up_proj.shape
    inner = double // 2
    gate = reader.groups(names[0], count * inner, hidden)
    up = reader.groups(names[1], count * inner, hidden)
    down = reader.groups(names[2], count * hidden, inner)
    gate_up = [PackedLinear(stack([_slice(gate, e * inner, (e + 1) * inner), _slice(up, e * inner, (e + 1) * inner)]))
               for e in range(count)]
    downs = [PackedLinear(_slice(down, e * hidden, (e + 1) * hidden)) for e in range(count)]
    return PackedExperts(gate_up, downs, experts.act_fn)
