"""Batched rows and prompt chunks of the architectures that keep transformers' own decoder layers (qwen3, gemma2,
gemma3, phi3, qwen3_moe, mixtral): ragged steps through those layers (``services/node/model/ragged_layers.py``).

A packed shard (a Q8_0 or Q4_0 file served as it is, or an F32 file given ``--weights int8``) runs every step on
that path, and a session's step must be the same bits alone or beside any others: what verification compares,
and what makes concurrent streams answer what each answers alone. Sessions of different lengths (longer and
shorter than Gemma's sliding window of 4) take decode rows together, then a prompt chunk rides with rows; each
output is compared with the same session's step run alone, bit for bit. A float shard of these architectures
batches its decode rows too, within the rounding of a several-row float product of its solo steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

import pytest
import torch

from services.node.model.quant.quant_load import WeightsFormat, resolve_format
from services.node.model.shard import Shard, ShardCache
from services.node.model.shard_load import load_shard
from tests.gguf_mesh import Served, serve_family
from tests.gguf_models import LAYERS

CPU: Final = torch.device("cpu")
FAMILIES: Final = ("qwen3", "gemma2", "gemma3", "phi3", "qwen3_moe", "mixtral")
FILES: Final = ("Q8_0", "Q4_0", "F32")
"""How each tiny model is written; an F32 file is held packed with ``--weights int8``."""
PROMPT_LENGTHS: Final = (3, 9, 1, 17, 5)
STEPS: Final = 4
CHUNK: Final = 6
FLOAT_TOLERANCE: Final = 1e-5
"""A float shard's batched row against its solo step, relative to the largest value: a few units in float32's
last place (the solo step is transformers' exact path, the row a several-row product)."""


@pytest.fixture(scope="module", params=[(family, kind) for family in FAMILIES for kind in FILES],
                ids=lambda pair: f"{pair[0]}-{pair[1]}")
def packed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Served, WeightsFormat]:
    family, kind = request.param
    served = serve_family(family, tmp_path_factory.mktemp(f"{family}-{kind}"), None if kind == "F32" else kind)
    fmt: WeightsFormat = "int8" if kind == "F32" else resolve_format("auto", served.gguf.path)[0]
    return served, fmt


def _shard(served: Served, fmt: WeightsFormat, start: int = 0, end: int = LAYERS - 1) -> Shard:
    return load_shard(served.folder, start, end, torch.float32, CPU, fmt, served.gguf.path)


def _prompts(shard: Shard) -> list[list[int]]:
    return [[(11 * s + 5 * i + 1) % shard.vocab_size for i in range(n)] for s, n in enumerate(PROMPT_LENGTHS)]


def _prefilled(shard: Shard, start: torch.Tensor | None = None) -> list[ShardCache]:
    """One session per prompt, its prompt run alone (token ids at the head, else ``start``'s hidden states)."""
    caches = []
    for index, ids in enumerate(_prompts(shard)):
        cache = shard.new_cache()
        hidden = shard.embed(torch.tensor([ids])) if start is None else start[index:index + 1, :len(ids)]
        shard.run_layers(hidden, cache, 0, from_layer=shard.start)
        caches.append(cache)
    return caches


def _step_batched_and_alone(shard: Shard, tokens: list[int], batched: list[ShardCache],
                            solo: list[ShardCache]) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of every session: all as one batch of rows over ``batched``, and each alone over
    ``solo``; the two outputs, row for row."""
    rows = shard.run_rows(shard.embed(torch.tensor([tokens])).transpose(0, 1), batched,
                          [c.seq_len for c in batched], from_layer=0)
    alone = torch.cat([shard.run_layers(shard.embed(torch.tensor([[t]])), cache, cache.seq_len)
                       for t, cache in zip(tokens, solo, strict=True)])
    return rows, alone

def test_a_packed_shard_s_rows_and_chunks_are_each_session_s_own_steps_bit_for_bit(
        packed: tuple[Served, WeightsFormat]) -> None:
    served, fmt = packed
    shard = _shard(served, fmt)
    assert shard.weights_format == fmt and shard.in_layers and shard.batches_rows and shard.batches_chunks
    batched, solo = _prefilled(shard), _prefilled(shard)
    tokens = [ids[-1] for ids in _prompts(shard)]
    for _ in range(STEPS):
        rows, alone = _step_batched_and_alone(shard, tokens, batched, solo)
        assert torch.equal(rows, alone)
        assert torch.equal(shard.logits_rows(rows), shard.logits_rows(alone))
        tokens = [int(t) for t in shard.logits_rows(alone).argmax(-1)]
    # a prompt chunk of a new session rides with three decode rows: each segment is its own step alone
    chunk = [(3 * i + 2) % shard.vocab_size for i in range(CHUNK)]
    newcomer, newcomer_alone = shard.new_cache(), shard.new_cache()
    caches, lengths = [batched[0], newcomer, batched[3], batched[1]], [1, CHUNK, 1, 1]
    ids = [tokens[0], *chunk, tokens[3], tokens[1]]
    out = shard.run_ragged(shard.embed(torch.tensor([ids])), caches, [c.seq_len for c in caches], lengths, 0)
    expected = torch.cat([
        shard.run_layers(shard.embed(torch.tensor([[tokens[0]]])), solo[0], solo[0].seq_len),
        shard.run_layers(shard.embed(torch.tensor([chunk])), newcomer_alone, 0),
        shard.run_layers(shard.embed(torch.tensor([[tokens[3]]])), solo[3], solo[3].seq_len),
        shard.run_layers(shard.embed(torch.tensor([[tokens[1]]])), solo[1], solo[1].seq_len)], 1)
    assert torch.equal(out, expected)
    assert [c.seq_len for c in batched] == [c.seq_len for c in solo]
    assert newcomer.seq_len == newcomer_alone.seq_len == CHUNK


def test_rows_of_a_packed_shard_entered_midway_are_bit_for_bit_their_solo_steps(
        packed: tuple[Served, WeightsFormat]) -> None:
    """The back half of a two-node split (layers 2-3: between layers, inside the expert layers of an MoE),
    fed hidden states as a hop is."""
    served, fmt = packed
    shard = _shard(served, fmt, 2, LAYERS - 1)
    start = torch.randn(len(PROMPT_LENGTHS), max(PROMPT_LENGTHS), shard.hidden_size,
                        generator=torch.Generator().manual_seed(5))
    batched, solo = _prefilled(shard, start), _prefilled(shard, start)
    step = torch.randn(len(PROMPT_LENGTHS), 1, shard.hidden_size, generator=torch.Generator().manual_seed(6))
    rows = shard.run_rows(step, batched, [c.seq_len for c in batched], from_layer=2)
    alone = torch.cat([shard.run_layers(step[i:i + 1], cache, cache.seq_len, from_layer=2)
                       for i, cache in enumerate(solo)])
    assert torch.equal(rows, alone)


@pytest.mark.parametrize("family", ["gemma2", "qwen3_moe"])
def test_a_float_shard_batches_rows_within_a_float_product_s_rounding(family: str, tmp_path: Path) -> None:
    """An F32 file served as float: decode rows batch (through transformers' layers) and each stays within
    :data:`FLOAT_TOLERANCE` of its solo step, which is transformers' exact path."""
    served = serve_family(family, tmp_path)
    shard = _shard(served, "float")
    assert shard.batches_rows and not shard.batches_chunks and not shard.in_layers
    batched, solo = _prefilled(shard), _prefilled(shard)
    tokens = [ids[-1] for ids in _prompts(shard)]
    for _ in range(STEPS):
        rows, alone = _step_batched_and_alone(shard, tokens, batched, solo)
        assert ((rows - alone).abs().max() / alone.abs().max()).item() <= FLOAT_TOLERANCE
        tokens = [int(t) for t in shard.logits_rows(alone).argmax(-1)]


def test_a_failed_ragged_step_leaves_every_cache_as_it_was(tmp_path: Path) -> None:
    """Gemma 2's sliding layers included: sessions past the window of 4, a batch that fails in layer 2, then
    the next batch is bit for bit what it is on caches that never saw the failure."""
    served = serve_family("gemma2", tmp_path, "Q4_0")
    shard = _shard(served, "int4")
    caches, untouched = _prefilled(shard), _prefilled(shard)
    before = [c.seq_len for c in caches]
    layer = shard.modules.model.layers["2"]
    saved = layer.mlp.forward
    layer.mlp.forward = lambda x: x[..., :3]  # an output that cannot be added back
    rows = shard.embed(torch.tensor([[4 + index for index in range(len(caches))]])).transpose(0, 1)
    try:
        with pytest.raises(RuntimeError, match="size of tensor"):
            shard.run_rows(rows, caches, [c.seq_len for c in caches], from_layer=0)
    finally:
        layer.mlp.forward = saved
    assert [c.seq_len for c in caches] == before
    assert torch.equal(shard.run_rows(rows, caches, before, from_layer=0),
                       shard.run_rows(rows, untouched, before, from_layer=0))
