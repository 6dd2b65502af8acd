"""A GGUF's metadata as a transformers config: what llama.cpp writes, and what it leaves to its runtime."""

from __future__ import annotations

from typing import Any

import pytest

from services.node.model.gguf_config import GgufConfigError, generation_defaults, hf_config

TENSORS = {"token_embd.weight": (640, 64), "output.weight": (640, 64)}


def _meta(arch: str, **extra: Any) -> dict[str, Any]:
    base = {"general.architecture": arch, f"{arch}.embedding_length": 64, f"{arch}.block_count": 12,
            f"{arch}.feed_forward_length": 128, f"{arch}.attention.head_count": 4,
            f"{arch}.attention.head_count_kv": 2, f"{arch}.attention.layer_norm_rms_epsilon": 1e-6}
    base.update({f"{arch}.{key}" if not key.startswith(("general.", "tokenizer.")) else key: value
                 for key, value in extra.items()})
    return base


def test_a_llama_file_is_llama_mistral_or_mixtral_as_llama_cpp_tells_them_apart() -> None:
    assert hf_config(_meta("llama"), TENSORS).model_type == "llama"
    assert hf_config({**_meta("llama"), "general.name": "Mistral 7B"}, TENSORS).model_type == "mistral"
    mixtral = hf_config(_meta("llama", expert_count=8, expert_used_count=2), TENSORS)
    assert (mixtral.model_type, mixtral.num_local_experts, mixtral.num_experts_per_tok) == ("mixtral", 8, 2)


def test_what_llama_cpp_hard_codes_is_filled_in() -> None:
    moe = hf_config(_meta("qwen3moe", expert_count=8, expert_used_count=2, expert_feed_forward_length=32), TENSORS)
    assert moe.norm_topk_prob and moe.moe_intermediate_size == 32
    gemma3 = hf_config(_meta("gemma3", **{"attention.sliding_window": 512}), TENSORS)
    assert [i for i, kind in enumerate(gemma3.layer_types) if kind == "full_attention"] == [5, 11]
    assert gemma3.rope_parameters["sliding_attention"]["rope_theta"] == 10_000.0
    assert gemma3.query_pre_attn_scalar == 16
    gemma2 = hf_config(_meta("gemma2", **{"attention.sliding_window": 4096, "final_logit_softcapping": 30.0,
                                          "attn_logit_softcapping": 50.0}), TENSORS)
    assert (gemma2.final_logit_softcapping, gemma2.attn_logit_softcapping) == (30.0, 50.0)
    assert hf_config(_meta("llama"), {"token_embd.weight": (640, 64)}).tie_word_embeddings


@pytest.mark.parametrize(("meta", "tensors", "says"), [
    (_meta("deepseek2"), TENSORS, "architecture 'deepseek2' is not served"),
    (_meta("phi3"), {**TENSORS, "rope_factors_long.weight": (48,)}, "longrope"),
    (_meta("llama", **{"attention.head_count_kv": [2, 2, 4]}), TENSORS, "differs between layers"),
    (_meta("qwen3moe", expert_count=8, expert_used_count=2, expert_feed_forward_length=32, expert_shared_count=1),
     TENSORS, "shared experts"),
    (_meta("llama", **{"rope.scaling.type": "su", "rope.scaling.factor": 2.0}), TENSORS, "rope scaling 'su'"),
])
def test_what_is_not_served_is_named_in_one_line(meta: dict[str, Any], tensors: dict[str, tuple[int, ...]],
                                                 says: str) -> None:
    with pytest.raises(GgufConfigError, match=says) as refused:
        hf_config(meta, tensors)
    assert "\n" not in str(refused.value)


def test_the_files_sampling_advice_is_taken_within_bounds() -> None:
    assert generation_defaults({"general.sampling.temp": 0.7, "general.sampling.top_k": 40}) == {
        "temperature": 0.7, "top_k": 40, "do_sample": True}
    assert generation_defaults({"general.sampling.temp": -1.0, "general.sampling.top_p": 3.0,
                                "general.sampling.top_k": 10**9}) == {}
