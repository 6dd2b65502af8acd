"""A quantized hop's output is batch-invariant (issue 37): what lets a spot check compare hidden states exactly.

A tiny Q8_0 GGUF's middle layers (1-2 of 4), held packed, float32 rows and int8 rows: the hidden states of a prompt chunk and
of decode rows are the same bits when each session's steps run alone (``Shard.run_layers``, what the step engine
runs for a lone step) and when they share turns with other sessions' steps (``Shard.run_ragged``, what it runs
for a batch: rows with rows, chunks with chunks, rows beside chunks, a session's first step of one token beside
rows that take the native call), directly and through the step engine the node's ``/forward`` and
``/forward/rows`` run steps with. :func:`~services.node.model.rows_exact.rows_exact_path` names the path such a
shard takes, and names none for float weights or a turn larger than the native kernel takes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import pytest
import torch

from services.node.engine.compute import ComputeWorker, ShardRunner
from services.node.engine.step_engine import StepResult
from services.node.model.kv_cache import ShardCache
from services.node.model.quant import quant_kernel
from services.node.model.quant.packed import NATIVE_MAX_ROWS
from services.node.model.quant.quant_load import resolve_format
from services.node.model.rows_exact import rows_exact_path
from services.node.model.shard import Shard
from services.node.model.shard_load import load_shard
from tests.gguf_mesh import Served, serve_family
from tests.requirements import needs

CPU: Final = torch.device("cpu")
PROMPTS: Final = (5, 3, 7, 1)
"""Prompt lengths of four sessions; the last is a one-token prompt, a first step the native call cannot take."""
STEPS: Final = 3
"""Decode rows per session after its prompt."""
TURN: Final = 512 + 16

pytestmark = needs(quant_kernel.available(), "meshnet's native kernel did not build here (a C++ compiler)")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Served:
    return serve_family("llama", tmp_path_factory.mktemp("llama-q8"), "Q8_0")


@contextlib.contextmanager
def _rows(mode: str) -> Iterator[None]:
    """The process's quantized products take ``mode`` rows for the block (``--activations``)."""
    before = quant_kernel.activations()
    quant_kernel.choose_activations(mode)
    try:
        yield
    finally:
        quant_kernel.choose_activations(before)


@pytest.fixture(params=["float32", "int8"])
def rows(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each kind of rows a quantized product may take: float32, and int8 (``--activations auto`` on a CPU with
    integer dot products)."""
    with _rows(request.param):
        yield request.param


@pytest.fixture
def float32_rows() -> Iterator[None]:
    with _rows("float32"):
        yield


def _middle(served: Served) -> Shard:
    fmt, _ = resolve_format("auto", served.gguf.path)
    shard = load_shard(served.folder, 1, 2, torch.float32, CPU, fmt, served.gguf.path)
    assert shard.weights_format == "int8" and shard.lean is not None
    return shard


def _inputs(shard: Shard) -> list[list[torch.Tensor]]:
    """Each session's frames: its prompt chunk, then :data:`STEPS` decode rows (hidden states from layer 0)."""
    gen = torch.Generator().manual_seed(7)
    return [[torch.randn(1, n, shard.hidden_size, generator=gen)]
            + [torch.randn(1, 1, shard.hidden_size, generator=gen) for _ in range(STEPS)] for n in PROMPTS]


def _turn(shard: Shard, caches: list[ShardCache], frames: list[tuple[int, torch.Tensor]]) -> list[torch.Tensor]:
    """One ragged turn of ``(session, frame)`` steps, as the step engine runs a batch; each step's output."""
    states = torch.cat([frame for _, frame in frames], 1)
    lengths = [frame.shape[1] for _, frame in frames]
    out = shard.run_ragged(states, [caches[s] for s, _ in frames], [caches[s].seq_len for s, _ in frames],
                           lengths, shard.start)
    ends = [sum(lengths[:i + 1]) for i in range(len(lengths))]
    return [out[:, end - n:end] for end, n in zip(ends, lengths, strict=True)]


def test_a_chunk_and_a_row_are_the_same_bits_alone_and_beside_other_sessions_steps(
        served: Served, rows: str) -> None:
    shard = _middle(served)
    inputs = _inputs(shard)
    alone: list[list[torch.Tensor]] = []
    for frames in inputs:
        cache = shard.new_cache()
        alone.append([shard.run_layers(frame, cache, cache.seq_len, from_layer=shard.start) for frame in frames])
    caches = [shard.new_cache() for _ in PROMPTS]
    got: dict[tuple[int, int], torch.Tensor] = {}
    for turn in PLAN:
        outs = _turn(shard, caches, [(s, inputs[s][step]) for s, step in turn])
        got.update(zip(turn, outs, strict=True))
    assert len(got) == len(PROMPTS) * (STEPS + 1)
    for (s, step), out in got.items():
        assert torch.equal(out, alone[s][step]), f"session {s}, step {step}"


PLAN: Final = (
    ((0, 0), (1, 0)),  # two prompt chunks together
    ((0, 1), (1, 1), (2, 0), (3, 0)),  # rows beside a chunk and a one-token first step
    ((0, 2), (1, 2), (2, 1), (3, 1)),  # rows only (the native call)
    ((2, 2), (0, 3)),
    ((3, 2), (1, 3), (2, 3)),
    ((3, 3),),
)
"""Turns of ``(session, step)``: every step of :data:`PROMPTS` sessions, in varied company."""


def test_through_the_step_engine_a_step_is_the_same_bits_alone_and_in_a_turn_with_others(
        served: Served, rows: str) -> None:
    """The node's own path (``ShardRunner.step``, what ``/forward`` and ``/forward/rows`` call): steps submitted
    together share a turn (batched), and each one's hidden states equal its session's steps submitted alone."""
    worker = ComputeWorker(threads=1)
    try:
        runner = ShardRunner(_middle(served), worker, max_batch=8, max_step_tokens=64)
        inputs = _inputs(runner.shard)

        async def run(caches: list[ShardCache], turn: tuple[tuple[int, int], ...]) -> list[StepResult]:
            return list(await asyncio.gather(*(
                runner.step(caches[s], position_offset=caches[s].seq_len, from_layer=runner.shard.start,
                            hidden=inputs[s][step]) for s, step in turn)))

        alone_caches = [runner.new_cache() for _ in PROMPTS]
        alone = {(s, step): asyncio.run(run(alone_caches, ((s, step),)))[0]
                 for s in range(len(PROMPTS)) for step in range(STEPS + 1)}
        caches = [runner.new_cache() for _ in PROMPTS]
        batched = 0
        for turn in PLAN:
            for key, result in zip(turn, asyncio.run(run(caches, turn)), strict=True):
                assert result.hidden is not None and alone[key].hidden is not None
                assert torch.equal(result.hidden, alone[key].hidden), f"session {key[0]}, step {key[1]}"
                batched += result.rows > 1
        assert batched > 0, "no turn ran its rows batched: the test saw nothing"
    finally:
        worker.shutdown()


def test_the_path_is_named_for_a_quantized_cpu_shard_and_for_nothing_else(
        served: Served, tiny_model_dir: Path, float32_rows: None) -> None:
    shard = _middle(served)
    path = rows_exact_path(shard, "float32", TURN)
    if int(torch.ops.meshnet_quant.best_isa()) == 4:  # AMX: a product's path depends on its rows
        assert path is None
    else:
        assert path is not None and path.startswith("float32-") and path.endswith("/kv-float32")
        assert rows_exact_path(shard, "int8", TURN) is not None
        assert rows_exact_path(shard, "int8", TURN) != path
    assert rows_exact_path(shard, "float32", NATIVE_MAX_ROWS + 1) is None
    assert rows_exact_path(load_shard(tiny_model_dir, 1, 2, torch.float32, CPU), "float32", TURN) is None
