"""Quantized GGUFs of the architectures beyond the Llama shape (qwen3, gemma2, gemma3, phi3, and the experts of
qwen3_moe and mixtral) are held packed, and answer as the same model dequantized and run by transformers.

Each tiny model is written in Q8_0 and in Q4_0 (``tests/gguf_models.py``: every block's scale a value
bfloat16 holds, so a node holds the file's weights exactly; the reference model holds them as gguf-py
dequantizes them). A node's products are then the only difference: the native kernel sums float32
products of the same weights in another order than torch's, each output within ``(K + 100) 2^-24
sum|x w|`` of the exact product (``tests/test_quant_kernel.py``), about 1e-5 of it at these widths; through
four layers and the LM head the logits moved by at most 2e-5 (of logits up to 8) when this was written.
:data:`LOGITS_BOUND` allows 1e-3: fifty times that, and far below what a format read wrong moves (a
scale, a nibble order, an expert's rows or a router's choice change logits by 0.1 or more).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Final

import httpx
import pytest
import torch
from torch import nn

from services.node.model.packed_layers import PackedExperts, PackedLinear
from services.node.model.quant.quant_load import resolve_format
from services.node.model.shard import Shard
from services.node.model.shard_load import load_shard
from tests.gguf_mesh import (
    MESSAGES,
    NEW_TOKENS,
    SAMPLING,
    Served,
    expected_text,
    gguf_mesh,
    reference,
    serve_family,
)
from tests.gguf_models import LAYERS

FAMILIES: Final = ("qwen3", "gemma2", "gemma3", "phi3", "qwen3_moe", "mixtral")
MOE: Final = frozenset({"qwen3_moe", "mixtral"})
QUANTS: Final = ("Q8_0", "Q4_0")
MESHED: Final = {"qwen3": "Q4_0", "gemma3": "Q8_0", "qwen3_moe": "Q4_0", "mixtral": "Q8_0"}
"""The family and format pairs also served by real node processes (the others in this process only)."""
LOGITS_BOUND: Final = 1e-3
"""How far a packed shard's logits may be from transformers' on the same weights (module doc)."""
RANGES: Final = ([(0, LAYERS - 1)], [(0, 1), (2, LAYERS - 1)])
PACKED_SHARE: Final = 0.4
"""A node's weights, held packed, are under this share of the same layers in float32 (Q8_0 holds about
0.3 of it at these widths: 8 bits a weight plus a 16-bit scale and zero a group, the float norms beside)."""


@pytest.fixture(scope="module", params=[(family, quant) for family in FAMILIES for quant in QUANTS],
                ids=lambda pair: f"{pair[0]}-{pair[1]}")
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Served:
    family, quant = request.param
    return serve_family(family, tmp_path_factory.mktemp(f"{family}-{quant}"), quant)


def _shards(served: Served, ranges: list[tuple[int, int]]) -> list[Shard]:
    fmt, _ = resolve_format("auto", served.gguf.path)
    return [load_shard(served.folder, start, end, torch.float32, torch.device("cpu"), fmt, served.gguf.path)
            for start, end in ranges]


def _check_held_packed(served: Served, shard: Shard) -> None:
    """Every product of the shard's layers is packed (an MoE layer's experts too); nothing but norms, biases
    and routers stays float, and the layers take a fraction of their bytes in float32."""
    assert shard.weights_format in ("int4", "int8")
    for index in shard.layer_range:
        layer = shard.modules.model.layers[str(index)]
        assert not [name for name, module in layer.named_modules() if isinstance(module, nn.Linear)]
        assert all(parameter.ndim == 1 or name.endswith("mlp.gate.weight")
                   for name, parameter in layer.named_parameters())
        packed = [module for module in layer.modules() if isinstance(module, PackedLinear | PackedExperts)]
        assert packed
        if served.gguf.model.config.model_type in MOE:
            assert any(isinstance(module, PackedExperts) for module in packed)
    layer_bytes = sum(t.numel() * t.element_size() for layer in shard.modules.model.layers.values()
                      for t in [*layer.parameters(), *layer.buffers()])
    assert layer_bytes < PACKED_SHARE * _float_bytes(served, shard.start, shard.end)


def _float_bytes(served: Served, start: int, end: int) -> int:
    names = [f"model.layers.{index}." for index in range(start, end + 1)]
    return sum(p.numel() * 4 for name, p in served.gguf.model.named_parameters() if name.startswith(tuple(names)))


def test_packed_layers_give_transformers_logits_within_the_kernels_bound_and_its_greedy_tokens(
        served: Served) -> None:
    """One shard and two, holding their layers packed (:func:`_check_held_packed`), prompt then decode steps:
    every logit within :data:`LOGITS_BOUND` of transformers' on the same weights, and the same greedy tokens."""
    expected = reference(served)
    model = served.gguf.model
    for ranges in RANGES:
        shards = _shards(served, ranges)
        for shard in shards:
            _check_held_packed(served, shard)
        caches = [shard.new_cache() for shard in shards]
        ids, step, out = served.prompt, served.prompt, []
        for _ in range(NEW_TOKENS):
            hidden = shards[0].embed(step)
            for shard, cache in zip(shards, caches, strict=True):
                hidden = shard.run_layers(hidden, cache, ids.shape[1] - step.shape[1])
            logits = shards[-1].logits_all(hidden, step.shape[1])
            with torch.no_grad():
                theirs = model(ids).logits[0, -step.shape[1]:]
            torch.testing.assert_close(logits, theirs, rtol=0, atol=LOGITS_BOUND)
            out.append(int(logits[-1].argmax()))
            step = torch.tensor([[out[-1]]])
            ids = torch.cat([ids, step], 1)
        assert out == expected, f"{len(ranges)} shard(s)"


def _weight_bytes(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    match = re.search(r"^meshnet_node_weight_bytes(?:\{[^}]*\})? (\S+)$", text, re.MULTILINE)
    assert match is not None, "the node reports no meshnet_node_weight_bytes"
    return float(match.group(1))


@pytest.mark.parametrize(("family", "quant"), MESHED.items())
def test_one_and_two_node_processes_answer_as_transformers_holding_the_layers_packed(
        family: str, quant: str, tmp_path: Path) -> None:
    """Real nodes given the quantized GGUF: greedy and seeded answers are transformers', each token's
    log-probability within the bound, and each node holds its layers packed (its reported weight bytes)."""
    served = serve_family(family, tmp_path, quant)
    greedy, seeded = reference(served), reference(served, SAMPLING)
    with torch.no_grad():
        ids = torch.cat([served.prompt, torch.tensor([greedy])], 1)
        logprobs = served.gguf.model(ids).logits[0].log_softmax(-1)
    start = served.prompt.shape[1] - 1
    expected_logprobs = [float(logprobs[start + i, token]) for i, token in enumerate(greedy)]
    with gguf_mesh(served) as mesh:
        for name, node in mesh.nodes.items():
            start_layer, end_layer = (0, LAYERS - 1) if name == "full" else (0, 1) if name == "front" else (2, 3)
            assert _weight_bytes(node.url) < PACKED_SHARE * _float_bytes(served, start_layer, end_layer) + \
                _edge_bytes(served, start_layer, end_layer), name
        for hops in (1, 2):
            assert mesh.answer(hops) == (expected_text(served, greedy), len(greedy)), f"{hops} node(s), greedy"
            assert mesh.answer(hops, SAMPLING) == (expected_text(served, seeded), len(seeded)), f"{hops}, seeded"
            done = mesh.client(hops).chat.completions.create(model=mesh.model, messages=MESSAGES, temperature=0,
                                                             max_tokens=NEW_TOKENS, logprobs=True)
            assert done.choices[0].logprobs is not None and done.choices[0].logprobs.content is not None
            theirs = [entry.logprob for entry in done.choices[0].logprobs.content]
            assert len(theirs) == len(expected_logprobs)
            assert all(math.isclose(a, b, abs_tol=2 * LOGITS_BOUND) for a, b in zip(theirs, expected_logprobs,
                                                                                    strict=True)), (theirs,
                                                                                                    expected_logprobs)


def _edge_bytes(served: Served, start: int, end: int) -> int:
    """Bytes of the embedding (at the head) and the LM head (at the tail) held in int8 with their scales,
    and the final norm: a generous allowance of 1.5 bytes a weight."""
    config = served.gguf.model.config
    matrices = (start == 0) + (end == LAYERS - 1)
    return int(1.5 * matrices * config.vocab_size * config.hidden_size) + 4 * config.hidden_size
