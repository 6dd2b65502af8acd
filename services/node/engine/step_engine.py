"""The step engine: every session's step on this node goes through one queue, and runs in batches.

A node serves many sessions at once: as a head it runs the steps of its own
requests, as a hop the frames other heads send. Each step used to be one
forward of its own, so eight streams cost eight forwards per token on every
node. The engine collects the steps that are ready and runs them together:

* **Decode rows** (one token each) of every ready session entering the shard
  at the same layer run as one batch of up to ``max_batch`` rows
  (:meth:`~services.node.model.shard.Shard.run_rows`): the projections and the MLP
  are one product over all rows, attention runs per session against its own
  KV cache. At the tail each row is sampled with its own session's sampler,
  so a seeded stream draws exactly what it draws alone.
* **Prompt chunks** (several tokens) run in the same compute turn: the
  oldest waiting chunk always, more while the turn's tokens stay within
  ``max_step_tokens``. So a long prompt costs the streams already decoding at
  most one chunk (``prefill_chunk_tokens``) per step, instead of stalling them
  for the whole prompt. On a quantized shard (every step there runs on the
  batched path: the lean decoder, or transformers' layers as ragged steps,
  :mod:`services.node.model.ragged_layers`) the turn's chunks and rows entering at the same layer are
  one ragged batch, laid end to end (:meth:`~services.node.model.shard.Shard.run_ragged`):
  one pass over the packed weights for all of them, where eight prompts
  arriving together used to dequantize every matrix eight times. On a float
  shard a chunk runs alone, through transformers' exact path.

**Two groups in flight** at the head of a pipeline (a shard that is the
head but not the tail): the rows of a turn there are at most half the
sessions that decode through it (:data:`PIPELINE_GROUPS`), so the sessions
split into two groups that take turns. While the next node computes one
group, the head computes the other, instead of every node waiting for the
whole batch to come round (eight streams over two nodes went in lock-step:
each node idle while the other computed, and on two machines half the cores
idle). Once split, the groups stay apart, since each comes back on its own;
should they meet again (a node that ran both in one turn) the head splits
them again. The split only changes which rows share a product,
which was already whichever were ready.

A step waiting alone is run at once (the engine never waits for company: a
lone stream is as fast as before). Steps that arrive while a turn is on the
compute thread form the next turn. Before taking a turn the engine lets the
event loop run a few rounds (:data:`GATHER_ROUNDS`), so frames that reached
the node together (a head's batch fans out into one frame per session) are
read and join the same turn.

Each step's outcome is its own: a row whose sampling fails, or whose caller
went away (a cancelled future), does not touch the others in its turn. A
failure of the batched forward itself leaves every cache in the batch as it
was, and fails those steps only.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

import torch

from meshwire.forward_step import Scoring
from meshwire.sampling_params import TokenLogprobs
from services.node.engine.outcomes import settle
from services.node.model.kv_cache import ShardCache
from services.node.model.shard import Shard
from services.node.sampling.sampler import Pick, Sampler
from services.node.settings import DEFAULT_MAX_BATCH, DEFAULT_MAX_STEP_TOKENS

logger = logging.getLogger(__name__)

GATHER_ROUNDS: Final = 4
"""Event-loop rounds the engine yields before taking a turn, so frames that arrived together join it."""
PIPELINE_GROUPS: Final = 2
"""Groups of decode rows the head of a pipeline keeps in flight (module doc): two keep a head and the rest of the
route computing at the same time."""
RECENT_ROW_TURNS: Final = 4 * PIPELINE_GROUPS
"""Row turns within which a session that ran a decode row still counts as decoding through this engine (each
session runs one row every :data:`PIPELINE_GROUPS` turns or so; one that ended stops counting after this)."""


@dataclass(frozen=True)
class StepResult:
    """What one step of one session through this shard produced."""

    hidden: torch.Tensor | None
    """Output hidden states ``[1, n, hidden]`` on the CPU, to pass on; ``None`` at the tail."""
    token: int | None
    """The sampled token, at the tail on a frame that samples; else ``None``."""
    compute_ms: float
    rows: int = 1
    """Decode rows in the batch this step ran in (1: alone, or a prompt chunk)."""
    logprobs: TokenLogprobs | None = None
    """With the token, when the session's sampler was asked for log-probabilities."""
    scored: tuple[TokenLogprobs, ...] = ()
    """At the tail, on a prompt step with a :class:`~meshwire.forward_step.Scoring`: each named token's."""
    run: tuple[Pick, ...] | None = None
    """On a speculative step at the tail: the verified run (accepted drafts, then the tail's own pick);
    ``token`` is its first."""


@dataclass(eq=False)
class StepJob:
    """One session's step waiting for (or in) a compute turn."""

    cache: ShardCache
    position_offset: int
    from_layer: int
    ids: Sequence[int] | None
    hidden: torch.Tensor | None
    sampler: Sampler | None
    future: asyncio.Future[StepResult] = field(repr=False)
    score: Scoring | None = None
    draft: tuple[int, ...] | None = None
    """The drafted tokens a speculative step's positions 1..k hold (the tail verifies them)."""

    @property
    def tokens(self) -> int:
        """Positions this step adds to its session."""
        if self.ids is not None:
            return len(self.ids)
        return 0 if self.hidden is None else int(self.hidden.shape[1])

    @property
    def is_row(self) -> bool:
        """A one-token decode step, which can share a batch (a scored or speculative step never does)."""
        return self.tokens == 1 and self.score is None and self.draft is None

    @property
    def group(self) -> tuple[int, bool]:
        """Rows batch together when they enter at the same layer in the same form (token ids or hidden states)."""
        return self.from_layer, self.ids is not None


SingleStep = Callable[[StepJob], StepResult]
"""Runs one job alone on the compute thread (the shard's exact single-session path)."""


class StepEngine:
    """The queue of ready steps of one node, run in batched turns on its compute worker."""

    def __init__(self, shard: Shard, compute: Callable[..., Awaitable[object]], single: SingleStep, *, max_batch: int = DEFAULT_MAX_BATCH,
                 max_step_tokens: int = DEFAULT_MAX_STEP_TOKENS,
                 on_turn: Callable[[int, float], None] | None = None) -> None:
        if max_batch < 1 or max_step_tokens < 1:
            raise ValueError(f"max_batch ({max_batch}) and max_step_tokens ({max_step_tokens}) must be positive")
        self._shard = shard
        self._compute = compute
        self._single = single
        self.max_batch = max_batch
        self.max_step_tokens = max_step_tokens
        self._on_turn = on_turn
        self._queue: deque[StepJob] = deque()
        self._pipelined = shard.is_head and not shard.is_tail
        """Whether this shard heads a pipeline: its rows split into :data:`PIPELINE_GROUPS` groups."""
        self._row_turns = 0
        self._last_row_turn: dict[int, int] = {}
        """Each decoding session's cache (by ``id``) and the row turn it last ran a row in (pipeline heads only)."""
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def submit(self, cache: ShardCache, *, position_offset: int, from_layer: int,
                     ids: Sequence[int] | None = None, hidden: torch.Tensor | None = None,
                     sampler: Sampler | None = None, score: Scoring | None = None,
                     draft: tuple[int, ...] | None = None) -> StepResult:
        """Queue one step and wait for its result (its own exception if it, alone, failed)."""
        if ids is None and hidden is None:
            raise ValueError("a step needs token ids or hidden states")
        job = StepJob(cache=cache, position_offset=position_offset, from_layer=from_layer, ids=ids, hidden=hidden,
                      sampler=sampler, future=asyncio.get_running_loop().create_future(), score=score,
                      draft=draft)
        self._queue.append(job)
        if self._task is None or self._task.done() or self._task.get_loop() is not job.future.get_loop():
            self._wake = asyncio.Event()  # an event belongs to the loop that first waits on it
            self._task = asyncio.create_task(self._run(), name="step-engine")
        self._wake.set()
        return await job.future

    async def stop(self) -> None:
        """Stop taking turns; steps still queued fail."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._fail_queued(RuntimeError("the node is stopping"))

    # --- the loop ---------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            await self._turns()
        except asyncio.CancelledError:
            raise
        except Exception:  # a dead engine would hang every later step: say so loudly, fail what waits
            logger.exception("the step engine stopped")
            self._fail_queued(RuntimeError("the step engine stopped"))
            raise

    def _fail_queued(self, exc: BaseException) -> None:
        _fail(list(self._queue), exc)
        self._queue.clear()

    async def _turns(self) -> None:
        while True:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
            for _ in range(GATHER_ROUNDS):
                await asyncio.sleep(0)
            turn = self.take()
            if not turn:
                continue
            try:
                outcomes = await self._compute(self._turn_sync, turn)
            except asyncio.CancelledError:
                _fail(turn, RuntimeError("the node is stopping"))
                raise
            except Exception as exc:  # noqa: BLE001 - the worker itself failed (shut down): these steps cannot run
                _fail(turn, exc)
                continue
            assert isinstance(outcomes, list)
            for job, outcome in zip(turn, outcomes, strict=True):
                settle(job.future, outcome)

    def take(self) -> list[StepJob]:
        """The next turn: the rows of the oldest row's group (at most ``max_batch``), then prompt chunks.

        Chunks: the oldest always (a prompt is never starved by rows), more while
        the turn stays within ``max_step_tokens``. Everything else stays queued in order.
        """
        live = [job for job in self._queue if not job.future.done()]
        rows = [job for job in live if job.is_row]
        batch = [job for job in rows if job.group == rows[0].group][:self.row_cap(rows)] if rows else []
        self._count_rows(batch)
        budget = self.max_step_tokens - len(batch)
        chunks: list[StepJob] = []
        for job in live:
            if job.is_row:
                continue
            if chunks and job.tokens > budget:
                break
            chunks.append(job)
            budget -= job.tokens
        taken = {id(job) for job in (*batch, *chunks)}
        self._queue = deque(job for job in live if id(job) not in taken)
        return [*batch, *chunks]

    def row_cap(self, ready: Sequence[StepJob]) -> int:
        """The most decode rows the next turn takes: ``max_batch``; at the head of a pipeline, at most
        ``1/PIPELINE_GROUPS`` of the sessions decoding through it (the ``ready`` rows' and those of the recent
        row turns), so the sessions split into groups that overlap along the route (module doc)."""
        if not self._pipelined:
            return self.max_batch
        decoding = len(self._last_row_turn.keys() | {id(job.cache) for job in ready})
        return max(1, min(self.max_batch, -(-decoding // PIPELINE_GROUPS)))

    def _count_rows(self, batch: list[StepJob]) -> None:
        """Remember the sessions of a row turn at a pipeline's head, forgetting those quiet for
        :data:`RECENT_ROW_TURNS` turns."""
        if not self._pipelined or not batch:
            return
        self._row_turns += 1
        for job in batch:
            self._last_row_turn[id(job.cache)] = self._row_turns
        oldest = self._row_turns - RECENT_ROW_TURNS
        if len(self._last_row_turn) > len(batch):
            self._last_row_turn = {key: turn for key, turn in self._last_row_turn.items() if turn > oldest}

    # --- on the compute thread ----------------------------------------------------------

    def _turn_sync(self, turn: list[StepJob]) -> list[StepResult | BaseException]:
        """Run a turn: each group of steps that can share a forward as one batch, the others alone."""
        shard = self._shard
        outcomes: dict[int, StepResult | BaseException] = {}
        if shard.batches_rows:
            groups: dict[tuple[int, bool], list[StepJob]] = {}
            for job in turn:
                if job.is_row or (shard.batches_chunks and job.score is None and job.draft is None):
                    # a scored prompt and a speculative step run alone (the tail reads every position)
                    groups.setdefault(job.group, []).append(job)
            for jobs in groups.values():
                runnable = [job for job in jobs
                            if shard.step_problem(job.cache, job.position_offset, job.from_layer) is None]
                if len(runnable) > 1:  # a step the shard would refuse runs alone below, to fail on its own
                    outcomes.update(self._batch_sync(runnable))
        for job in turn:
            if id(job) not in outcomes:
                outcomes[id(job)] = self._one(job)
        return [outcomes[id(job)] for job in turn]

    def _one(self, job: StepJob) -> StepResult | BaseException:
        try:
            return self._single(job)
        except Exception as exc:  # noqa: BLE001 - a step's failure is that step's outcome, for its caller to judge
            return exc

    def _batch_sync(self, jobs: list[StepJob]) -> dict[int, StepResult | BaseException]:
        """One forward over the steps of ``jobs`` (decode rows, and prompt chunks where the shard
        :attr:`~services.node.model.shard.Shard.batches_chunks`), laid end to end; each step's own outcome."""
        began = time.perf_counter()
        shard = self._shard
        lengths = [job.tokens for job in jobs]
        try:
            with torch.inference_mode():
                if jobs[0].ids is not None:
                    states = shard.embed(torch.tensor([[token for job in jobs for token in job.ids or ()]]))
                else:
                    states = torch.cat([job.hidden for job in jobs if job.hidden is not None], 1)
                out = shard.run_ragged(states, [job.cache for job in jobs], [job.position_offset for job in jobs],
                                       lengths, jobs[0].from_layer)
                ends = list(itertools.accumulate(lengths))
                sampled = [index for index, job in enumerate(jobs) if job.sampler is not None]
                logits = shard.logits_at(out, [ends[index] - 1 for index in sampled]) \
                    if shard.is_tail and sampled else None
        except Exception as exc:  # noqa: BLE001 - fails these steps only; the caches were restored
            logger.warning("a batch of %d steps (%d positions) failed: %s", len(jobs), sum(lengths), exc)
            return {id(job): exc for job in jobs}
        outcomes: dict[int, StepResult | BaseException] = {}
        hidden = None if shard.is_tail else out.to("cpu")
        elapsed_ms = (time.perf_counter() - began) * 1000.0
        row_of = {index: row for row, index in enumerate(sampled)}
        for index, job in enumerate(jobs):
            try:
                if hidden is not None:
                    outcomes[id(job)] = StepResult(hidden=hidden[:, ends[index] - lengths[index]:ends[index]].contiguous(),
                                                   token=None, compute_ms=elapsed_ms, rows=len(jobs))
                    continue
                pick = None
                if job.sampler is not None and logits is not None:
                    pick = job.sampler.pick(logits[row_of[index]])
                outcomes[id(job)] = StepResult(hidden=None, token=None if pick is None else pick.token,
                                               compute_ms=elapsed_ms, rows=len(jobs),
                                               logprobs=None if pick is None else pick.logprobs)
            except Exception as exc:  # noqa: BLE001 - this row's sampling: its session's fault, nobody else's
                outcomes[id(job)] = exc
        if self._on_turn is not None and all(job.is_row for job in jobs):
            self._on_turn(len(jobs), elapsed_ms / 1000.0)
        return outcomes


def _fail(turn: list[StepJob], exc: BaseException) -> None:
    for job in turn:
        settle(job.future, exc)
