"""The lean decode path of half-precision CPU shards: bit-identical to transformers' path, weights held once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.node.model.lean_decode import lean_decoder_for
from services.node.model.shard import Shard
from services.node.model.shard_load import load_shard

CPU = torch.device("cpu")
STEPS = 24


def decode(shard: Shard, tokens: list[int], *, lean: bool) -> list[torch.Tensor]:
    """Hidden states of a prefill then one-token steps, with the lean path on or off."""
    saved = shard.lean
    shard.lean = saved if lean else None
    try:
        cache = shard.new_cache()
        outs = [shard.run_layers(shard.embed(torch.tensor([tokens[:5]])), cache, 0)]
        for token in tokens[5:]:
            outs.append(shard.run_layers(shard.embed(torch.tensor([[token]])), cache, cache.seq_len))
        return outs
    finally:
        shard.lean = saved


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_decode_steps_are_bit_identical_with_and_without_the_lean_path(
        tiny_model_dir: Path, dtype: torch.dtype) -> None:
    shard = load_shard(tiny_model_dir, 0, 3, dtype, CPU)
    assert shard.lean is not None, "a Llama shard in half precision on a CPU takes the lean path"
    tokens = [(7 * i + 3) % shard.vocab_size for i in range(5 + STEPS)]
    fast, slow = decode(shard, tokens, lean=True), decode(shard, tokens, lean=False)
    for step, (a, b) in enumerate(zip(fast, slow, strict=True)):
        assert torch.equal(a, b), f"step {step} differs"


def test_a_shard_entered_midway_runs_the_lean_path_from_its_start_layer(tiny_model_dir: Path) -> None:
    shard = load_shard(tiny_model_dir, 1, 3, torch.float16, CPU)
    hidden = torch.randn(1, 4, shard.hidden_size, generator=torch.Generator().manual_seed(1)).half()
    outs = {}
    for lean in (True, False):
        saved, shard.lean = shard.lean, (shard.lean if lean else None)
        cache = shard.new_cache()
        shard.run_layers(hidden, cache, 0, from_layer=2)
        outs[lean] = shard.run_layers(hidden[:, :1], cache, 4, from_layer=2)
        shard.lean = saved
    assert torch.equal(outs[True], outs[False])


def test_float32_shards_keep_transformers_path_for_lone_steps(tiny_model_dir: Path) -> None:
    """In float32 fused products round differently, and float32 output must equal transformers exactly:
    the lean path serves only batched rows there."""
    lean = load_shard(tiny_model_dir, 0, 3, torch.float32, CPU).lean
    assert lean is not None and not lean.solo


def test_the_fused_weights_are_the_layers_own_storage(tiny_model_dir: Path) -> None:
    shard = load_shard(tiny_model_dir, 0, 3, torch.float16, CPU)
    for layer in shard.modules.model.layers.values():
        attn, mlp = layer.self_attn, layer.mlp
        storages = {attn.q_proj.weight.untyped_storage().data_ptr(), attn.k_proj.weight.untyped_storage().data_ptr(),
                    attn.v_proj.weight.untyped_storage().data_ptr()}
        assert len(storages) == 1, "q, k and v are views of one fused tensor, not copies"
        assert mlp.gate_proj.weight.untyped_storage().data_ptr() == mlp.up_proj.weight.untyped_storage().data_ptr()
    params = list(shard.modules.parameters())
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in params}
    assert sum(storages.values()) == sum(p.numel() * p.element_size() for p in params), "no weight is held twice"


def test_layers_the_lean_path_does_not_know_run_through_transformers(tiny_model_dir: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    shard = load_shard(tiny_model_dir, 0, 3, torch.float32, CPU)
    layers = {index: shard.modules.model.layers[str(index)] for index in range(4)}
    caplog.set_level("INFO")
    sliding = dict.fromkeys(layers, "sliding_attention")
    assert lean_decoder_for(shard.config, layers, torch.float16, CPU, sliding) is None
    assert "uses sliding_attention" in caplog.text
    full = dict.fromkeys(layers, "full_attention")
    on_gpu = lean_decoder_for(shard.config, layers, torch.float16, torch.device("cuda"), full)
    assert on_gpu is not None and not on_gpu.solo, "a GPU batches rows this way, and keeps transformers for one"
    layers[2].self_attn.q_norm = torch.nn.Identity()  # as Qwen3 has
    assert lean_decoder_for(shard.config, layers, torch.float16, CPU, full) is None
    assert "normalises queries and keys per head" in caplog.text
