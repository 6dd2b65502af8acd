"""All torch work of a node, on one dedicated thread.

A node serves HTTP on an asyncio event loop and runs its layers with torch.
Running a forward on the loop would stall every other request (heartbeats,
health checks, other sessions' frames) for the whole forward; running forwards
on a pool would make torch run two at once and fight over the same cores.
So every forward of this node goes through :class:`ComputeWorker`, a
single-thread executor: the loop never blocks, and torch runs one forward at
a time with all its threads. Each forward (:meth:`ComputeWorker.compute`)
first takes a share of the machine's cores from the
:class:`~services.node.engine.cpu_gate.CpuGate` and runs with that many threads, so
that nodes sharing a machine never run more threads than it has cores.

:class:`ShardRunner` is the node's one verb on top of it: run one step of one
session through this shard (embed at the head, layers, and at the tail the
LM head and the sampler), and it measures the shard's decode speed, which the
node reports to the tracker. Steps reach the worker through the runner's
:class:`~services.node.engine.step_engine.StepEngine`, which runs the decode steps
of all ready sessions as one batch.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Final, ParamSpec, TypeVar

import torch

from meshwire.forward_step import Scoring
from meshwire.sampling_params import TokenLogprobs
from services.node.engine.cpu_gate import CpuGate
from services.node.engine.step_engine import (
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_STEP_TOKENS,
    StepEngine,
    StepJob,
    StepResult,
)
from services.node.model.shard import Shard, ShardCache
from services.node.sampling.sampler import Sampler, token_logprobs

__all__ = ["ComputeWorker", "ShardRunner", "StepResult", "one_torch_thread"]

logger = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")

WARMUP_PROMPT_TOKENS: Final = 8
"""Tokens of the warm-up prefill."""
WARMUP_UNTIMED_STEPS: Final = 3
"""Decode steps run before timing: a process's first forwards pay one-off costs."""
WARMUP_DECODE_STEPS: Final = 8
"""Decode steps timed at warm-up to estimate this shard's decode rate."""
RATE_SMOOTHING: Final = 0.1
"""Weight of the newest decode step in the running decode-rate estimate."""


def one_torch_thread() -> None:
    """Keep the calling thread's torch work on one thread: every thread of a node but its compute thread.

    GNU OpenMP gives each thread that runs a parallel region a team of its
    own, and once it manages more threads than there are cores it stops
    spinning between regions ("throttled": ``GOMP_SPINCOUNT`` no longer
    applies), so the compute thread's workers sleep after every kernel and
    must be woken by a futex for the next. One parallel operation on the
    event loop's thread (a large tensor copied there) was enough: measured
    on 2 cores, 15 int4 layers of the default model went from 3.9 to 11.8 ms
    a decode step, for the life of the process. With this, only the compute
    thread ever forms a team. Reads the count first, so torch's lazy
    per-thread set-up (which applies the process-wide count) has run and
    does not undo it later.
    """
    torch.get_num_threads()
    torch.set_num_threads(1)


class ComputeWorker:
    """A single-thread executor for torch: one forward at a time, never on the event loop."""

    def __init__(self, threads: int | None = None) -> None:
        self._max_threads = threads if threads is not None else torch.get_num_threads()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="meshnet-torch",
                                            initializer=_init_thread, initargs=(self._max_threads,))
        self._gate: CpuGate | None = None
        self._on_gate_wait: Callable[[float], None] | None = None

    def use_gate(self, gate: CpuGate | None, on_wait: Callable[[float], None] | None = None) -> None:
        """Make every later :meth:`compute` hold ``gate``; ``on_wait`` hears the seconds each waited for it."""
        self._gate = gate
        self._on_gate_wait = on_wait

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run ``fn(*args, **kwargs)`` on the torch thread and await its result (no gate: loading, I/O)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    async def compute(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Like :meth:`run`, on the share of the cores the CPU gate gives: for forwards and timings."""
        return await self.run(self._gated, functools.partial(fn, *args, **kwargs))

    def _gated(self, call: Callable[[], T]) -> T:
        if self._gate is None:
            return call()
        with self._gate.hold(self._max_threads) as share:
            if self._on_gate_wait is not None:
                self._on_gate_wait(share.waited_s)
            if torch.get_num_threads() != share.threads:
                torch.set_num_threads(share.threads)
            return call()

    def shutdown(self) -> None:
        """Stop the thread once the work already queued is done, and let go of the gate's lock file."""
        self._executor.shutdown(wait=True, cancel_futures=True)
        if self._gate is not None:
            self._gate.close()


def _init_thread(threads: int) -> None:
    """The compute thread's own count, set after torch's lazy set-up so a later process-wide change (another
    thread's :func:`one_torch_thread`) leaves it alone."""
    torch.get_num_threads()
    torch.set_num_threads(threads)


class ShardRunner:
    """Runs sessions' steps through one shard on the compute worker, batched by its :class:`StepEngine`."""

    def __init__(self, shard: Shard, worker: ComputeWorker, *, max_batch: int = DEFAULT_MAX_BATCH,
                 max_step_tokens: int = DEFAULT_MAX_STEP_TOKENS,
                 on_batch: Callable[[int], None] | None = None) -> None:
        self.shard = shard
        self._worker = worker
        self._decode_s: float | None = None
        self._on_batch = on_batch
        self.engine = StepEngine(shard, worker.compute, self._job_sync, max_batch=max_batch,
                                 max_step_tokens=max_step_tokens, on_turn=self._rows_ran)

    @property
    def decode_tokens_per_s(self) -> float:
        """This shard's decode speed (one-token steps a second), warm-up measured, then live."""
        if not self._decode_s:
            return 0.0
        return 1.0 / self._decode_s

    def new_cache(self, reserve_tokens: int | None = None) -> ShardCache:
        """An empty KV cache sized for ``reserve_tokens`` (it grows beyond if it must)."""
        return self.shard.new_cache(reserve_tokens)

    async def step(self, cache: ShardCache, *, position_offset: int, from_layer: int,
                   ids: Sequence[int] | None = None, hidden: torch.Tensor | None = None,
                   sampler: Sampler | None = None, score: Scoring | None = None,
                   draft: tuple[int, ...] | None = None) -> StepResult:
        """Run one step: ``ids`` (head) or ``hidden`` (other hops) at ``position_offset``.

        At the tail, ``sampler`` picks the next token; without one (a prefill
        chunk that is not the last) no logits are computed. With ``draft`` (a
        speculative step) the tail verifies the drafted tokens and the result
        carries the run it emits. The step waits for the engine's next turn and
        may run batched with other sessions' steps.
        """
        return await self.engine.submit(cache, position_offset=position_offset, from_layer=from_layer, ids=ids,
                                        hidden=hidden, sampler=sampler, score=score, draft=draft)

    def _job_sync(self, job: StepJob) -> StepResult:
        """One step alone (a lone decode row, or a prompt chunk): the shard's exact single-session path."""
        result = self._step_sync(job.cache, job.position_offset, job.from_layer, job.ids, job.hidden, job.sampler,
                                 job.score, job.draft)
        if job.is_row:
            self._rows_ran(1, result.compute_ms / 1000.0)
        return result

    def _rows_ran(self, rows: int, seconds: float) -> None:
        """A decode step of ``rows`` sessions took ``seconds`` (called on the compute thread)."""
        self._record_decode(seconds)
        if self._on_batch is not None:
            self._on_batch(rows)

    def _step_sync(self, cache: ShardCache, position_offset: int, from_layer: int,
                   ids: Sequence[int] | None, hidden: torch.Tensor | None, sampler: Sampler | None,
                   score: Scoring | None = None, draft: tuple[int, ...] | None = None) -> StepResult:
        began = time.perf_counter()
        with torch.inference_mode():
            if ids is not None:
                states = self.shard.embed(torch.tensor([list(ids)], dtype=torch.long))
            elif hidden is not None:
                states = hidden
            else:
                raise ValueError("a step needs token ids or hidden states")
            states = self.shard.run_layers(states, cache, position_offset, from_layer=from_layer)
            if self.shard.is_tail and draft is not None and sampler is not None:
                run = tuple(sampler.verify(self.shard.logits_tail(states, len(draft) + 1), draft))
                out = StepResult(hidden=None, token=run[0].token, compute_ms=_ms_since(began), logprobs=run[0].logprobs,
                                 run=run)
            elif self.shard.is_tail:
                pick = sampler.pick(self.shard.logits_last(states)) if sampler is not None else None
                out = StepResult(hidden=None, token=None if pick is None else pick.token, compute_ms=_ms_since(began),
                                 logprobs=None if pick is None else pick.logprobs,
                                 scored=() if score is None else self._scored(states, score))
            else:
                out = StepResult(hidden=states.to("cpu").contiguous(), token=None, compute_ms=_ms_since(began))
        return out

    def _scored(self, states: torch.Tensor, score: Scoring) -> tuple[TokenLogprobs, ...]:
        """The log-probability of ``score.ids[j]`` after position ``j`` of ``states``, with alternatives."""
        logits = self.shard.logits_all(states, len(score.ids))
        return tuple(token_logprobs(logits[j], token, score.top) for j, token in enumerate(score.ids))

    def _record_decode(self, seconds: float) -> None:
        if self._decode_s is None:
            self._decode_s = seconds
        else:
            self._decode_s = (1 - RATE_SMOOTHING) * self._decode_s + RATE_SMOOTHING * seconds

    async def warm_up(self) -> float:
        """Run a short prefill and timed decode steps on a scratch cache; the measured tokens/s.

        The first forwards of a process are slow (allocator, kernels); doing
        them here keeps them out of the first request and gives the tracker a
        real decode rate at registration.
        """
        return await self._worker.compute(self._warm_up_sync)

    def _warm_up_sync(self) -> float:
        cache = self.shard.new_cache()
        generator = torch.Generator().manual_seed(0)
        with torch.inference_mode():
            self._scratch_step(cache, WARMUP_PROMPT_TOKENS, 0, generator)
            for _ in range(WARMUP_UNTIMED_STEPS):
                self._scratch_step(cache, 1, cache.seq_len, generator)
            began = time.perf_counter()
            for _ in range(WARMUP_DECODE_STEPS):
                self._scratch_step(cache, 1, cache.seq_len, generator)
            per_step = (time.perf_counter() - began) / WARMUP_DECODE_STEPS
        self._decode_s = per_step
        logger.info("warm-up: layers %d-%d decode %.1f ms a token (%.1f tokens/s)",
                    self.shard.start, self.shard.end, per_step * 1000, self.decode_tokens_per_s)
        return self.decode_tokens_per_s

    def _scratch_step(self, cache: ShardCache, n: int, offset: int, generator: torch.Generator) -> None:
        if self.shard.is_head:
            ids = torch.randint(0, self.shard.vocab_size, (1, n), generator=generator)
            states = self.shard.embed(ids)
        else:
            states = torch.randn((1, n, self.shard.hidden_size), generator=generator).to(self.shard.dtype)
        states = self.shard.run_layers(states, cache, offset, from_layer=self.shard.start)
        if self.shard.is_tail:
            self.shard.logits_last(states)


def _ms_since(began: float) -> float:
    return (time.perf_counter() - began) * 1000.0
