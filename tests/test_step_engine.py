"""The step engine: ready steps of many sessions run as batched turns, each with its own outcome."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import pytest
import torch

from meshwire.sampling_params import SamplingParams
from services.node.engine.compute import ComputeWorker, ShardRunner
from services.node.engine.step_engine import PIPELINE_GROUPS, StepResult
from services.node.model.shard import ShardCache, ShardError
from services.node.model.shard_load import load_shard
from services.node.sampling.sampler import Pick, Sampler, SamplingFailed

CPU: Final = torch.device("cpu")
SESSIONS: Final = 5
GREEDY: Final = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def runner(tiny_model_dir: Path) -> Iterator[ShardRunner]:
    worker = ComputeWorker(threads=1)
    yield ShardRunner(load_shard(tiny_model_dir, 0, 3, torch.float32, CPU), worker, max_batch=4, max_step_tokens=8)
    worker.shutdown()


def prompt(session: int, vocab: int) -> list[int]:
    return [(13 * session + 3 * i + 2) % vocab for i in range(2 + 3 * session)]


async def prefill(runner: ShardRunner, session: int, sampler: Sampler) -> tuple[ShardCache, int]:
    ids = prompt(session, runner.shard.vocab_size)
    cache = runner.new_cache()
    result = await runner.step(cache, position_offset=0, from_layer=0, ids=ids, sampler=sampler)
    assert result.token is not None
    return cache, result.token


async def decode_alone(runner: ShardRunner, session: int, steps: int) -> list[int]:
    sampler = Sampler(GREEDY)
    cache, token = await prefill(runner, session, sampler)
    tokens = [token]
    for _ in range(steps):
        result = await runner.step(cache, position_offset=cache.seq_len, from_layer=0, ids=[tokens[-1]],
                                   sampler=sampler)
        assert result.rows == 1 and result.token is not None
        tokens.append(result.token)
    return tokens


def test_concurrent_decode_steps_run_as_batches_and_each_equals_its_session_alone(runner: ShardRunner) -> None:
    steps = 6

    async def together() -> tuple[list[list[int]], list[int]]:
        samplers = [Sampler(GREEDY) for _ in range(SESSIONS)]
        opened = [await prefill(runner, s, samplers[s]) for s in range(SESSIONS)]
        tokens = [[token] for _, token in opened]
        rows: list[int] = []
        for _ in range(steps):
            results = await asyncio.gather(*(
                runner.step(cache, position_offset=cache.seq_len, from_layer=0, ids=[tokens[s][-1]],
                            sampler=samplers[s]) for s, (cache, _) in enumerate(opened)))
            rows.extend(r.rows for r in results)
            for s, result in enumerate(results):
                assert result.token is not None
                tokens[s].append(result.token)
        return tokens, rows

    tokens, rows = asyncio.run(together())
    alone = [asyncio.run(decode_alone(runner, s, steps)) for s in range(SESSIONS)]
    assert tokens == alone
    assert max(rows) == runner.engine.max_batch, "steps queued together share a batch, up to max_batch"


def test_one_rows_failure_leaves_the_others_in_its_batch_untouched(runner: ShardRunner) -> None:
    class Broken(Sampler):
        def pick(self, logits: torch.Tensor) -> Pick:
            raise SamplingFailed("this session's parameters cannot be sampled")

    async def scenario() -> tuple[list[object], list[int], list[int]]:
        samplers: list[Sampler] = [Sampler(GREEDY), Broken(GREEDY), Sampler(GREEDY)]
        opened = [await prefill(runner, s, Sampler(GREEDY)) for s in range(3)]
        before = [cache.seq_len for cache, _ in opened]
        outcomes = await asyncio.gather(*(
            runner.step(cache, position_offset=cache.seq_len, from_layer=0, ids=[token], sampler=samplers[s])
            for s, (cache, token) in enumerate(opened)), return_exceptions=True)
        return outcomes, before, [cache.seq_len for cache, _ in opened]

    outcomes, before, after = asyncio.run(scenario())
    assert isinstance(outcomes[1], SamplingFailed)
    assert all(getattr(outcomes[i], "rows", 0) == 3 and getattr(outcomes[i], "token", None) is not None
               for i in (0, 2))
    assert after == [n + 1 for n in before]


def test_a_cancelled_step_does_not_fail_its_batch(runner: ShardRunner) -> None:
    async def scenario() -> list[object]:
        opened = [await prefill(runner, s, Sampler(GREEDY)) for s in range(3)]
        tasks = [asyncio.create_task(runner.step(cache, position_offset=cache.seq_len, from_layer=0, ids=[token],
                                                 sampler=Sampler(GREEDY)))
                 for cache, token in opened]
        await asyncio.sleep(0)  # every step is queued
        tasks[0].cancel()
        return await asyncio.gather(*tasks, return_exceptions=True)

    outcomes = asyncio.run(scenario())
    assert isinstance(outcomes[0], asyncio.CancelledError)
    assert all(getattr(o, "token", None) is not None for o in outcomes[1:])


def test_a_prompt_chunk_rides_along_with_decode_rows_within_the_token_budget(runner: ShardRunner) -> None:
    engine = runner.engine

    async def scenario() -> tuple[list[int], list[int]]:
        opened = [await prefill(runner, s, Sampler(GREEDY)) for s in range(3)]
        loop = asyncio.get_running_loop()

        def job(tokens: int, cache: ShardCache) -> object:
            from services.node.engine.step_engine import StepJob
            return StepJob(cache=cache, position_offset=cache.seq_len, from_layer=0, ids=list(range(1, tokens + 1)),
                           hidden=None, sampler=None, future=loop.create_future())

        fresh = [runner.new_cache() for _ in range(3)]
        queued = [job(6, fresh[0]), job(1, opened[0][0]), job(5, fresh[1]), job(1, opened[1][0]),
                  job(1, opened[2][0]), job(1, fresh[2])]
        engine._queue.extend(queued)  # type: ignore[arg-type]
        first = engine.take()
        second = engine.take()
        return [j.tokens for j in first], [j.tokens for j in second]

    first, second = asyncio.run(scenario())
    # rows first (up to max_batch=4), then the oldest chunk even past the 8-token budget; the next chunk waits
    assert first == [1, 1, 1, 1, 6]
    assert second == [5]


def test_prompts_arriving_together_on_a_quantized_shard_share_one_forward_and_a_bad_step_fails_alone(
        tiny_model_dir: Path) -> None:
    """Several sessions' prompt chunks (and a decode row) run as one ragged batch on a quantized head shard;
    each hidden state equals its step alone; a step that does not follow its cache fails on its own."""
    worker = ComputeWorker(threads=1)
    try:
        runner = ShardRunner(load_shard(tiny_model_dir, 0, 1, torch.bfloat16, CPU, weights="int4"), worker,
                             max_batch=4, max_step_tokens=256)
        prompts = [prompt(s, runner.shard.vocab_size) * 4 for s in range(3)]  # 8, 20 and 32 tokens

        async def steps(caches: list[ShardCache], offsets: list[int]) -> list[object]:
            return await asyncio.gather(*(
                runner.step(cache, position_offset=offset, from_layer=0, ids=ids)
                for cache, offset, ids in zip(caches, offsets, [*prompts, [7]], strict=True)),
                return_exceptions=True)

        opened = runner.new_cache()
        asyncio.run(runner.step(opened, position_offset=0, from_layer=0, ids=[3, 4, 5]))
        stale = runner.new_cache()
        together = asyncio.run(steps([runner.new_cache(), runner.new_cache(), stale, opened], [0, 0, 5, 3]))
        assert isinstance(together[2], ShardError) and stale.seq_len == 0
        fresh = [runner.new_cache() for _ in range(2)]
        alone = [asyncio.run(runner.step(cache, position_offset=0, from_layer=0, ids=ids))
                 for cache, ids in zip(fresh, prompts[:2], strict=True)]
        for batched, single in zip(together[:2], alone, strict=True):
            assert isinstance(batched, StepResult) and batched.rows == 3
            assert batched.hidden is not None and single.hidden is not None
            assert (batched.hidden - single.hidden).abs().max() <= 1e-2 * single.hidden.abs().max()
    finally:
        worker.shutdown()


def test_a_pipeline_head_keeps_its_decoding_sessions_in_two_groups(tiny_model_dir: Path) -> None:
    """At the head of a pipeline (a shard that is not the tail) a turn takes the decode rows of at most half the
    sessions decoding through it, so two groups take turns and overlap along the route; a lone session's row
    still runs at once."""
    worker = ComputeWorker(threads=1)
    try:
        runner = ShardRunner(load_shard(tiny_model_dir, 0, 1, torch.bfloat16, CPU, weights="int4"), worker,
                             max_batch=16, max_step_tokens=256)
        assert runner.shard.is_head and not runner.shard.is_tail
        sessions = 6

        async def rows_of_steps(caches: list[ShardCache], steps: int) -> list[list[int]]:
            rows = []
            for _ in range(steps):
                results = await asyncio.gather(*(
                    runner.step(cache, position_offset=cache.seq_len, from_layer=0, ids=[5 + s])
                    for s, cache in enumerate(caches)))
                rows.append([result.rows for result in results])
            return rows

        async def scenario() -> tuple[list[list[int]], list[list[int]]]:
            caches = [runner.new_cache() for _ in range(sessions)]
            for s, cache in enumerate(caches):
                await runner.step(cache, position_offset=0, from_layer=0, ids=prompt(s, runner.shard.vocab_size))
            together = await rows_of_steps(caches, 3)
            for _ in range(4 * PIPELINE_GROUPS):  # the others end; one session decodes on alone
                await rows_of_steps(caches[:1], 1)
            return together, await rows_of_steps(caches[:1], 1)

        together, alone = asyncio.run(scenario())
        assert together == [[sessions // PIPELINE_GROUPS] * sessions] * 3
        assert alone == [[1]]
    finally:
        worker.shutdown()
