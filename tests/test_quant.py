"""Weights held quantized: the packed format, GGUF blocks read into it, and quantized shards of the tiny model.

The reference everywhere is a float computation over :meth:`QuantMatrix.dequantize` of the values the
kernel holds. These tests take whichever kernel the machine has (meshnet's native one when it is built:
tests/test_quant_kernel.py holds it to float32's own bound). Tolerances, stated once, for the weaker of
the two: torch's packed kernel multiplies bfloat16 activations and rounds its result to bfloat16, so a product agrees with the float product of the same (bfloat16-rounded)
rows to a few bfloat16 steps of the result's magnitude (:data:`PRODUCT_RTOL`); a whole shard whose
reference rounds each product's rows and result to bfloat16 as the kernel does agrees to
:data:`HIDDEN_RTOL` of the hidden states' magnitude (int4 comes out bit-identical here; int8 sums
its two nibble halves inside the kernel).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from torch import nn

from services.node.model.quant import quant_kernel
from services.node.model.quant.packed import (
    GROUP_SIZE,
    KERNEL_DTYPE,
    KERNEL_MAX_ROWS,
    NATIVE_MAX_ROWS,
    QuantError,
    QuantMatrix,
    gguf_groups,
    groups_of,
    unpack,
)
from services.node.model.quant.quant_load import resolve_format
from services.node.model.shard import Shard, ShardError
from services.node.model.shard_load import load_shard
from services.node.settings import DEFAULT_MAX_BATCH

CPU = torch.device("cpu")
PRODUCT_RTOL = 2.0 ** -6
"""A product's largest error, relative to the largest value of the float result (bfloat16 has 8 significant bits)."""
HIDDEN_RTOL = 1e-2
"""A quantized shard's hidden states against the bfloat16-rounding float reference, relative to their magnitude.
Loose on purpose (it holds on either kernel, whole shards, errors compounding): tests/test_decode_reference.py
holds each decode path, layer by layer, to a float64 reference within a derived bound."""
ROWS = (1, 2, 3, 4, 8, 16, 17, 40, 257, 2049)
"""Row counts a product sees: lone and batched decode steps and prompt chunks (the kernel), and a prompt chunk
above :data:`KERNEL_MAX_ROWS` (the matrix dequantized for the call)."""
PROMPT_IDS = [5, 17, 99, 300, 42, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
LONG_PROMPT_IDS = [(7 * i) % 600 + 3 for i in range(300)]
"""Longer than :data:`KERNEL_MAX_ROWS`: its products dequantize their matrices."""
DECODE_STEPS = 6


def _weight(rows: int = 192, cols: int = 96, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


# --- the packed format -------------------------------------------------------------------------------------


def test_unpack_inverts_torchs_packing() -> None:
    q = torch.randint(0, 16, (192, 96), dtype=torch.int32, generator=torch.Generator().manual_seed(1))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    assert torch.equal(unpack(packed, 192).to(torch.int32), q)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("rows", ROWS)
def test_a_quantized_product_equals_the_float_product_of_its_dequantized_matrix(fmt: str, rows: int) -> None:
    matrix = QuantMatrix(groups_of(_weight(), fmt))  # type: ignore[arg-type]
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
    reference = x.to(KERNEL_DTYPE).float() @ matrix.dequantize().t()
    out = matrix.matmul(x)
    assert out.dtype == x.dtype and out.shape == (rows, 192)
    assert (out - reference).abs().max() <= PRODUCT_RTOL * reference.abs().max()


@pytest.mark.parametrize(("fmt", "bound"), [("int4", 0.5 / 15), ("int8", 0.5 / 127)])
def test_quantizing_a_float_matrix_rounds_each_weight_to_the_nearest_level_of_its_group(fmt: str,
                                                                                         bound: float) -> None:
    weight = _weight()
    error = (QuantMatrix(groups_of(weight, fmt)).dequantize() - weight).abs()  # type: ignore[arg-type]
    spread = weight.reshape(192, -1, GROUP_SIZE)
    span = (spread.amax(-1) - spread.amin(-1)) if fmt == "int4" else 2 * spread.abs().amax(-1)
    # half a level of the group's span, plus the bfloat16 rounding of its scale and zero
    limit = (bound * 1.02 + 2.0 ** -8) * span.repeat_interleave(GROUP_SIZE, 1).reshape(192, 96)
    assert bool((error <= limit).all())


def test_embedding_rows_are_read_without_dequantizing_the_others() -> None:
    matrix = QuantMatrix(groups_of(_weight(), "int8"))
    rows = torch.tensor([0, 5, 31, 32, 63, 64, 100, 191, 5])
    assert torch.equal(matrix.rows(rows, torch.float32), matrix.dequantize()[rows])


def test_a_matrix_the_packed_format_cannot_hold_is_refused_with_its_reason() -> None:
    with pytest.raises(QuantError, match="multiple of 64"):
        QuantMatrix(groups_of(_weight(rows=48), "int4"))
    with pytest.raises(QuantError, match="group size 32"):
        groups_of(_weight(cols=40), "int4")


def test_every_decode_batch_of_the_default_size_takes_the_kernel() -> None:
    assert KERNEL_MAX_ROWS >= DEFAULT_MAX_BATCH and KERNEL_MAX_ROWS + 1 in ROWS
    assert NATIVE_MAX_ROWS >= DEFAULT_MAX_BATCH and NATIVE_MAX_ROWS + 1 in ROWS


# --- GGUF blocks -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "fmt"), [("Q4_0", "int4"), ("Q4_1", "int4"), ("Q8_0", "int8")])
def test_gguf_blocks_load_as_their_own_integers_with_bfloat16_scales(kind: str, fmt: str) -> None:
    weight = _weight(seed=3).numpy()
    blocks = gguf_quantize(weight, GGMLQuantizationType[kind])
    file_values = torch.from_numpy(np.array(gguf_dequantize(blocks, GGMLQuantizationType[kind]), dtype=np.float32))
    matrix = QuantMatrix(gguf_groups(kind, blocks, 192, 96))
    assert matrix.format == fmt
    held = matrix.dequantize()
    # the integers are the file's; only d (and Q4_1's m + 8d) are rounded to bfloat16, 2^-9 relative each
    groups = file_values.reshape(192, -1, GROUP_SIZE).abs().amax(-1).repeat_interleave(GROUP_SIZE, 1)
    assert bool(((held - file_values).abs() <= 2.0 ** -8 * 2 * (groups.reshape(192, 96) + 1e-6)).all())
    x = torch.randn(3, 96)
    reference = x.to(KERNEL_DTYPE).float() @ held.t()
    assert (matrix.matmul(x) - reference).abs().max() <= PRODUCT_RTOL * reference.abs().max()


def test_gguf_blocks_of_the_wrong_size_are_refused() -> None:
    blocks = gguf_quantize(_weight().numpy(), GGMLQuantizationType.Q4_1)
    with pytest.raises(QuantError, match="needs"):
        gguf_groups("Q4_1", blocks[:, :-1], 192, 96)
    with pytest.raises(QuantError, match="not one of"):
        gguf_groups("Q3_K", blocks, 192, 96)


def test_auto_serves_a_float_checkpoint_as_float() -> None:
    assert resolve_format("auto", None)[0] == "float"
    assert resolve_format("int4", None)[0] == "int4"


# --- quantized shards of the tiny model ---------------------------------------------------------------------


class _RoundedLinear(nn.Module):
    """A float product whose rows and result are rounded to bfloat16, as torch's packed kernel's are (``rounded``),
    or a float32 product, as meshnet's native kernel computes."""

    def __init__(self, weight: torch.Tensor, rounded: bool = True) -> None:
        super().__init__()
        self.weight = weight
        self.rounded = rounded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.rounded:
            return F.linear(x.float(), self.weight)
        return F.linear(x.to(KERNEL_DTYPE).float(), self.weight).to(KERNEL_DTYPE).float()


def _float_reference(folder: Path, quantized: Shard) -> Shard:
    """A float32 shard of the same layers whose products use the quantized shard's dequantized matrices, rounded
    to bfloat16 around each product where the quantized shard's kernel is torch's."""
    reference = load_shard(folder, quantized.start, quantized.end, torch.float32, CPU)
    rounded = not quant_kernel.available()  # every matrix of a process takes the same layout
    for index in quantized.layer_range:
        packed, layer = quantized._layers[index].quant, reference._layers[index]
        attn, mlp = layer.self_attn, layer.mlp
        q_rows, k_rows = attn.q_proj.out_features, attn.k_proj.out_features
        qkv = packed["qkv"].dequantize()
        attn.q_proj = _RoundedLinear(qkv[:q_rows], rounded)
        attn.k_proj = _RoundedLinear(qkv[q_rows:q_rows + k_rows], rounded)
        attn.v_proj = _RoundedLinear(qkv[q_rows + k_rows:], rounded)
        attn.o_proj = _RoundedLinear(packed["out"].dequantize(), rounded)
        gate_up, inner = packed["gate_up"].dequantize(), mlp.gate_proj.out_features
        mlp.gate_proj, mlp.up_proj = _RoundedLinear(gate_up[:inner], rounded), _RoundedLinear(gate_up[inner:], rounded)
        mlp.down_proj = _RoundedLinear(packed["down"].dequantize(), rounded)
    if quantized.is_head:
        with torch.no_grad():
            reference._embed_tokens.weight.copy_(quantized._embed_tokens.matrix.dequantize())
    if quantized.is_tail:
        reference._lm_head = _RoundedLinear(quantized._lm_head.matrix.dequantize(), rounded)
    return reference


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float) -> bool:
    return bool((a.float() - b.float()).abs().max() <= rtol * b.float().abs().max())


@pytest.mark.parametrize("prompt", [PROMPT_IDS, LONG_PROMPT_IDS], ids=["short", "long"])
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_a_quantized_shard_equals_a_float_reference_of_its_dequantized_weights(tiny_model_dir: Path, fmt: str,
                                                                               prompt: list[int]) -> None:
    quantized = load_shard(tiny_model_dir, 0, 3, torch.float32, CPU, weights=fmt)  # type: ignore[arg-type]
    assert quantized.weights_format == fmt
    reference = _float_reference(tiny_model_dir, quantized)
    caches = quantized.new_cache(), reference.new_cache()
    ids = torch.tensor([prompt])
    hidden = [shard.run_layers(shard.embed(ids), cache, 0) for shard, cache in zip((quantized, reference), caches)]
    assert _close(hidden[0], hidden[1], HIDDEN_RTOL)
    for _ in range(DECODE_STEPS):
        token = torch.tensor([[int(reference.logits_last(hidden[1]).argmax())]])
        hidden = [shard.run_layers(shard.embed(token), cache, cache.seq_len)
                  for shard, cache in zip((quantized, reference), caches)]
        assert _close(hidden[0], hidden[1], HIDDEN_RTOL)
    assert _close(quantized.logits_last(hidden[0]), reference.logits_last(hidden[1]), 4 * HIDDEN_RTOL)


def test_a_quantized_shard_holds_a_fraction_of_the_float_bytes(tiny_model_dir: Path) -> None:
    whole = load_shard(tiny_model_dir, 0, 3, torch.float32, CPU).weight_bytes()
    int8 = load_shard(tiny_model_dir, 0, 3, torch.float32, CPU, weights="int8").weight_bytes()
    int4 = load_shard(tiny_model_dir, 0, 3, torch.float32, CPU, weights="int4").weight_bytes()
    assert int4 < int8 < whole / 3  # float32: 4 bytes a weight; int8 1 + scales; int4 mostly half a byte


def test_batched_rows_of_a_quantized_shard_equal_each_row_alone(tiny_model_dir: Path) -> None:
    shard = load_shard(tiny_model_dir, 0, 3, torch.bfloat16, CPU, weights="int4")
    prompts = [[5, 6, 7], [40, 41, 42, 43, 44], [9]]
    solo, batched = [], []
    for prompt in prompts:
        for into in (solo, batched):
            cache = shard.new_cache()
            shard.run_layers(shard.embed(torch.tensor([prompt])), cache, 0)
            into.append(cache)
    token = torch.tensor([[3]])
    alone = [shard.run_layers(shard.embed(token), cache, cache.seq_len) for cache in solo]
    rows = torch.cat([shard.embed(token)] * len(prompts))
    together = shard.run_rows(rows, batched, [cache.seq_len for cache in batched], 0)
    for row, single in enumerate(alone):
        assert _close(together[row:row + 1], single, HIDDEN_RTOL)


def test_prompt_chunks_and_decode_rows_of_a_quantized_shard_run_as_one_ragged_batch(tiny_model_dir: Path) -> None:
    """A turn's chunks and rows laid end to end, one pass over the weights: each equals its step alone, and
    every cache holds what it would alone, so the sessions decode on as if they had run alone."""
    shard = load_shard(tiny_model_dir, 0, 3, torch.bfloat16, CPU, weights="int4")
    assert shard.batches_chunks
    opened = [[5, 6, 7], [40, 41, 42, 43, 44]]
    steps = [LONG_PROMPT_IDS[:40], [3], PROMPT_IDS, [9]]  # a fresh chunk, a row, a fresh chunk, a row
    solo, batched = [], []
    for into in (solo, batched):
        for index, step in enumerate(steps):
            cache = shard.new_cache()
            if len(step) == 1:  # a decode row continues a session opened with a prompt
                shard.run_layers(shard.embed(torch.tensor([opened[index // 2]])), cache, 0)
            into.append(cache)
    alone = [shard.run_layers(shard.embed(torch.tensor([step])), cache, cache.seq_len)
             for step, cache in zip(steps, solo, strict=True)]
    ids = torch.tensor([[token for step in steps for token in step]])
    together = shard.run_ragged(shard.embed(ids), batched, [cache.seq_len for cache in batched],
                                [len(step) for step in steps], 0)
    at = 0
    for step, single in zip(steps, alone, strict=True):
        assert _close(together[:, at:at + len(step)], single, HIDDEN_RTOL)
        at += len(step)
    assert [cache.seq_len for cache in batched] == [cache.seq_len for cache in solo]
    token = torch.tensor([[11]])
    for one, other in zip(solo, batched, strict=True):
        assert _close(shard.run_layers(shard.embed(token), other, other.seq_len),
                      shard.run_layers(shard.embed(token), one, one.seq_len), HIDDEN_RTOL)


def test_a_ragged_batch_refuses_a_step_that_does_not_follow_its_cache_and_changes_nothing(
        tiny_model_dir: Path) -> None:
    shard = load_shard(tiny_model_dir, 0, 3, torch.bfloat16, CPU, weights="int4")
    good, stale = shard.new_cache(), shard.new_cache()
    shard.run_layers(shard.embed(torch.tensor([[5, 6]])), stale, 0)
    ids = torch.tensor([[1, 2, 3, 4]])
    with pytest.raises(ShardError, match="does not follow"):
        shard.run_ragged(shard.embed(ids), [good, stale], [0, 0], [2, 2], 0)
    assert (good.seq_len, stale.seq_len) == (0, 2)
    assert shard.step_problem(stale, 0, 0) is not None and shard.step_problem(good, 0, 0) is None
    float_shard = load_shard(tiny_model_dir, 0, 3, torch.float32, CPU)
    with pytest.raises(ShardError, match="run alone"):
        float_shard.run_ragged(float_shard.embed(ids), [float_shard.new_cache()] * 2, [0, 0], [2, 2], 0)


def test_a_quantized_route_of_two_shards_equals_the_quantized_whole(tiny_model_dir: Path) -> None:
    whole = load_shard(tiny_model_dir, 0, 3, torch.bfloat16, CPU, weights="int4")
    head = load_shard(tiny_model_dir, 0, 1, torch.bfloat16, CPU, weights="int4")
    tail = load_shard(tiny_model_dir, 2, 3, torch.bfloat16, CPU, weights="int4")
    ids = torch.tensor([PROMPT_IDS])
    one = whole.logits_last(whole.run_layers(whole.embed(ids), whole.new_cache(), 0))
    mid = head.run_layers(head.embed(ids), head.new_cache(), 0)
    two = tail.logits_last(tail.run_layers(mid, tail.new_cache(), 0))
    assert torch.equal(one, two)


def test_a_layer_type_the_quantized_path_cannot_take_loads_as_float_and_says_why(
        tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "gelu-model"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["hidden_act"] = "gelu"
    (folder / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING, logger="services.node.model.shard"):
        shard = load_shard(folder, 0, 3, torch.float32, CPU, weights="int4")
    assert shard.weights_format == "float"
    assert any("load as float" in r.message and "activation 'gelu'" in r.message for r in caplog.records)
    ids = torch.tensor([PROMPT_IDS])
    assert shard.logits_last(shard.run_layers(shard.embed(ids), shard.new_cache(), 0)).shape == (shard.vocab_size,)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_a_quantized_tail_takes_a_drafts_logits_in_one_pass_bit_for_bit_as_one_position_at_a_time(
        tiny_model_dir: Path, fmt: str) -> None:
    """A speculative step's verification reads the logits after each of its k + 1 positions: one LM head
    product for all of them must give each exactly what a decode step ending there gets (greedy output is
    the same with speculation or without)."""
    shard = load_shard(tiny_model_dir, 2, 3, torch.float32, CPU, weights=fmt)  # type: ignore[arg-type]
    assert shard.lm_head_rows_apart
    hidden = torch.randn((1, 7, shard.hidden_size), generator=torch.Generator().manual_seed(3))
    together = shard.logits_tail(hidden, 5)
    for index in range(5):
        assert torch.equal(together[index], shard.logits_last(hidden[:, :3 + index])), index
    assert not load_shard(tiny_model_dir, 2, 3, torch.float32, CPU).lm_head_rows_apart
