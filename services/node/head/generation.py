"""The head's generation loop: prompt in, a stream of text out.

One request is one session along one route. The head:

1. opens the session on itself (KV budget: ``prompt + max_tokens``) and runs
   the prompt through its own layers in chunks of ``prefill_chunk_tokens``,
   sending each chunk's hidden states to hop 1 (:class:`SessionChain`); the
   last chunk makes the tail sample the first token;
2. then feeds back one token per step, so every decode frame carries exactly
   one position; the next step starts before the current token's text is
   sent, so streaming it costs the route no time. With speculation
   (:mod:`services.node.head.speculation`) a decode frame carries the last token and
   ``k`` drafted ones, and the step yields the verified run: the accepted drafts
   and one more token. The client still gets one chunk per token: a run's
   tokens go out as consecutive chunks, in one burst;
3. turns tokens into text incrementally (never splitting a character), holds
   back text that may begin a stop string, and ends on an EOS id, a stop
   string or ``max_tokens`` (``stop`` / ``length``);
4. closes the session on every hop when it ends, however it ends (client gone
   included), in a task that a cancelled request cannot interrupt.

Failover. The head keeps the session's token history (prompt and generated
tokens). When a hop fails (:class:`RouteFailed` naming the node), the head
gets a route around it (:mod:`services.node.head.failover`), opens a new session
along it and replays the whole history as a chunked prefill, with
``X-Meshnet-Sample-Draws`` set to the sampler draws made so far, so the new
tail samples exactly the token the old one would have: greedy output is
identical to an uninterrupted run and seeded sampling continues the same
stream. The client sees no gap, no repeated and no lost token: the text
pipeline (detokenizer, stop matcher) only ever sees the next token.

The replay goes through the head's own layers too, in a fresh local session:
the next hop needs the hidden states the head's last layer produces for every
history token, and the head's KV cache does not hold those, so its layers
must run again whatever is reused; starting clean is as cheap and cannot mix
two sessions' states. The old session is closed on the hops that survive
(best effort, before the replay reserves KV again on a shared hop).

The loop's parts live beside it: what goes in and out (:mod:`~services.node.head.events`), how it fails
(:mod:`~services.node.head.failures`), the session along a route (:mod:`~services.node.head.chain`), an
``n > 1`` request's choices (:mod:`~services.node.head.choices`) and the answer's text
(:mod:`~services.node.head.answer_text`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from typing import Any, Final

from meshwire.forward_step import Scoring
from meshwire.kv_handoff import HandoffSource
from meshwire.sampling_params import MAX_REPLAY_IDS_PER_FRAME
from services.node.engine.compute import ShardRunner
from services.node.engine.sessions import SessionTable, log_tag
from services.node.head.answer_text import AnswerText
from services.node.head.chain import ChainOpener, SessionChain, new_session_id
from services.node.head.choices import ChoiceGroups, ChoiceLeader
from services.node.head.draft_model import DraftModel
from services.node.head.events import (
    Echo,
    Finished,
    FinishReason,
    GenerationEvent,
    GenerationRequest,
    TextDelta,
)
from services.node.head.failover import Failover, FailoverGaveUp, FailoverPolicy
from services.node.head.failures import ForkRefused, GenerationFailed, HandoffRefused, RouteBusy, RouteFailed
from services.node.head.speculation import DEFAULT_SPECULATE_MAX, SpeculateMode, Speculation
from services.node.head.tokens import HeadTokenizer
from services.node.hop.hop_client import HopClient
from services.node.hop.route_step import RouteStepper
from services.node.hop.routing import RoutedHop, TrackerRoutes
from services.node.metrics import NodeMetrics
from services.node.pd.pd_head import PdHead, PrefillPlan, PrefillUnavailable
from services.node.sampling.grammar import GrammarEngine
from services.node.sampling.sampler import Pick

logger = logging.getLogger(__name__)

CLOSE_TIMEOUT_S: Final = 10.0
"""How long closing a session along the route may take before it is left to the idle sweepers."""
RETRY_AFTER_GIVE_UP: Final = "2"
"""``Retry-After`` of a request that failover gave up on (the tracker may have a route again by then)."""
RETIRE_WAIT_S: Final = 2.0
"""How long a failover waits for the broken session's close on the surviving hops (which frees KV
the replay may need there) before it replays anyway; the close goes on in the background."""
DEFAULT_FAILOVER: Final = FailoverPolicy()


@dataclass
class History:
    """A session's tokens so far: what failover replays to rebuild a route's caches."""

    prompt: tuple[int, ...]
    generated: list[int] = field(default_factory=list)

    @property
    def draws(self) -> int:
        """Sampler draws made so far (one per sampled token; greedy sessions make none)."""
        return len(self.generated)

    def tokens(self) -> list[int]:
        """Every token so far, prompt first: what a new route replays."""
        return [*self.prompt, *self.generated]


@dataclass
class _Run:
    """One request in flight: what it asked, its tokens and text so far, the session it is on now, its failover
    and speculation state."""

    request: GenerationRequest
    history: History
    text: AnswerText
    chain: SessionChain
    failover: Failover
    speculation: Speculation
    handoff: HandoffSource | None = None
    """Where the prompt's KV is held, until the decode route's first step takes it over."""
    fork: SessionChain | None = None
    """The first choice's session (an ``n > 1`` request), until this one's first step forks it."""
    lead: ChoiceLeader | None = None
    """The ``n > 1`` group this request leads (its first choice), until it ends."""
    upcoming: asyncio.Task[tuple[Pick, ...]] | None = None
    """The next step, started before the current tokens' text went out."""
    ended: bool = False
    """Whether the answer is complete (an EOS id, a stop string or ``max_tokens``)."""
    eos: bool = False
    """Whether it ended on an EOS id."""

    @property
    def finish_reason(self) -> FinishReason:
        return "stop" if self.eos or self.text.stopped else "length"


class Generator:
    """Runs requests on this head: the generation loop over a :class:`SessionChain`, with failover."""

    def __init__(self, *, runner: ShardRunner, sessions: SessionTable, hops: HopClient, tokenizer: HeadTokenizer,
                 stepper: RouteStepper, metrics: NodeMetrics, prefill_chunk_tokens: int,
                 routes: TrackerRoutes | None = None, model_id: str = "",
                 failover: FailoverPolicy = DEFAULT_FAILOVER, grammar: GrammarEngine | None = None,
                 pd: PdHead | None = None, speculate: SpeculateMode = "off",
                 speculate_max: int = DEFAULT_SPECULATE_MAX, draft_model: DraftModel | None = None) -> None:
        self._runner = runner
        self._chains = ChainOpener(runner=runner, sessions=sessions, hops=hops, stepper=stepper)
        self.tokenizer = tokenizer
        self._metrics = metrics
        self._chunk = prefill_chunk_tokens
        self._routes = routes
        self._model_id = model_id
        self._failover = failover
        self.grammar = grammar
        """Structured outputs' engine (``None``: requests with a grammar are refused)."""
        self._pd = pd
        self._speculate = speculate
        self._speculate_max = speculate_max
        self._draft_model = draft_model
        """The head's draft model (``--draft-model``); ``None``: drafts come from prompt lookup."""
        self._closing: set[asyncio.Task[None]] = set()
        self._generating = 0
        """Requests generating on this head now (speculation's ``auto`` stands down when there are many)."""
        self._groups = ChoiceGroups()
        self.successor: Generator | None = None
        """The generator this node serves with after it moved to another range (placement, issue 36): a request
        still running here opens its next session there when it fails over (the move closed its session)."""

    async def generate(self, request: GenerationRequest, hop: RoutedHop | None) -> AsyncIterator[GenerationEvent]:
        """Generate the answer to ``request`` along ``hop``'s route (``None``: alone), as events."""
        run = self._start(request, hop)
        self._generating += 1
        try:
            picks = await self._opening(run)
            while True:
                deltas = self._take(run, picks)
                if not run.ended:
                    # The next step starts before these tokens' text goes out: sending it (SSE, the
                    # tracker, the client) overlaps the route's work instead of adding to every token.
                    run.upcoming = asyncio.create_task(self._next_tokens(run))
                    await asyncio.sleep(0)  # let it reach the compute thread first
                for delta in deltas:  # a run's tokens: one chunk each, in one burst
                    yield delta
                if run.ended:
                    break
                picks = await self._upcoming(run)
            last = run.text.finish()  # what was held back for a character or a stop string
            if last is not None:
                yield last
            yield Finished(finish_reason=run.finish_reason, prompt_tokens=len(request.prompt_ids),
                           completion_tokens=len(run.history.generated))
        finally:
            self._generating -= 1
            await self._end(run)

    # --- the steps of generate ------------------------------------------------------------

    def _start(self, request: GenerationRequest, hop: RoutedHop | None) -> _Run:
        """The request's run: its first session along ``hop``'s route, and the text of a continued answer's
        tokens rebuilt (none of it sent again)."""
        history = History(prompt=request.prompt_ids, generated=list(request.resume))
        text = AnswerText(self.tokenizer, request.stop)
        text.replay(request.resume)
        return _Run(request=request, history=history, text=text, chain=self._chain(hop, request, history),
                    failover=Failover(self._failover, self._routes, model=self._model_id,
                                      shard=lambda: self.current()._runner.shard),
                    speculation=Speculation(self._mode_for(request), self._speculate_max, model=self._draft_model,
                                            busy=lambda: self._generating))

    async def _opening(self, run: _Run) -> tuple[Pick, ...]:
        """The answer's first token(s): its ``n > 1`` group joined first, its session handed to the group's
        waiting choices after, and a completion's echoed prompt made ready to go out with the first text."""
        request = run.request
        joined = await self._groups.join(request, run.chain.hop, run.chain.session_id)
        run.lead, run.fork = joined.lead, joined.fork
        picks = await self._first_tokens(run)
        if run.lead is not None:
            run.lead.publish(run.chain)
        if request.echo is not None and not request.resume:
            scored = None if request.sampling.logprobs is None else (None, *run.chain.scored)
            run.text.echo = Echo(request.echo, request.prompt_ids, scored)
        return picks

    def _take(self, run: _Run, picks: tuple[Pick, ...]) -> list[TextDelta]:
        """Add a step's tokens (one, or a speculative step's verified run) to the answer; the deltas whose text
        may go out. Sets ``run.ended`` at an EOS id, a stop string or ``max_tokens``."""
        deltas: list[TextDelta] = []
        for pick in picks:
            run.history.generated.append(pick.token)
            self._metrics.tokens_generated.inc()
            if pick.token in self.tokenizer.eos_ids:
                run.eos = run.ended = True
                break
            delta = run.text.push(pick)
            if delta is not None:
                deltas.append(delta)
            if run.text.stopped or len(run.history.generated) >= run.request.max_tokens:
                run.ended = True
                break
        return deltas

    @staticmethod
    async def _upcoming(run: _Run) -> tuple[Pick, ...]:
        """The step started ahead: its tokens."""
        assert run.upcoming is not None
        picks = await run.upcoming
        run.upcoming = None
        return picks

    async def _end(self, run: _Run) -> None:
        """However the request ended (its client gone included): its group released, a step still in flight
        cancelled, its session closed."""
        if run.lead is not None:
            self._groups.leave(run.lead)
        if run.upcoming is not None:  # the client went away while a step was in flight
            run.upcoming.cancel()
        run.speculation.close()
        await self._close(run, run.upcoming)

    # --- the route's steps ------------------------------------------------------------------

    def _mode_for(self, request: GenerationRequest) -> SpeculateMode:
        """The request's speculation: ``auto`` speculates on greedy requests only, because a seeded sampled
        stream is promised to equal transformers' token for token, and speculative sampling keeps its
        distribution but not that stream; ``on`` speculates on both (for tests and benchmarks)."""
        if self._speculate == "auto" and not request.sampling.greedy:
            return "off"
        if request.sampling.grammar is not None:  # the tail verifies drafts without a grammar's mask
            return "off"
        return self._speculate

    def current(self) -> Generator:
        """The generator this node serves with now: this one, or the last it moved to (:attr:`successor`)."""
        generator = self
        while generator.successor is not None:
            generator = generator.successor
        return generator

    def _chain(self, hop: RoutedHop | None, request: GenerationRequest, history: History) -> SessionChain:
        """A new session for ``request`` along ``hop``'s route, whose prefill replays ``history``."""
        return self._chains.open(hop, session_id=new_session_id(), sampling=request.sampling,
                                 reserve=len(request.prompt_ids) + request.max_tokens,
                                 sample_draws=history.draws, replayed=tuple(history.generated),
                                 prompt_tokens=len(request.prompt_ids), grammar=self.grammar)

    async def _first_tokens(self, run: _Run) -> tuple[Pick, ...]:
        """The answer's first token: from the prefill route when there is one to use, else from the route."""
        # A grammar's state and an echoed prompt's scores live at the tail that runs the prompt: those take
        # the decode route's own prefill.
        request = run.request
        if (request.prefill is not None and self._pd is not None and not request.resume
                and request.sampling.grammar is None and request.echo is None):
            pick = await self._prefill_elsewhere(run, request, request.prefill, self._pd)
            if pick is not None:
                return (pick,)
        return await self._next_tokens(run)

    async def _prefill_elsewhere(self, run: _Run, request: GenerationRequest, plan: PrefillPlan,
                                 pd: PdHead) -> Pick | None:
        """Run the prompt on the prefill route; its first token, or ``None`` when the decode route must prefill."""
        problem = await pd.puller.layout_problem()
        if problem is not None:
            self._fallback(run, problem.reason, str(problem))
            return None
        if run.chain.hop is None:
            self._fallback(run, "no_route", "this head has no signed decode route to hand the prompt's KV to")
            return None
        session_id = new_session_id()
        try:
            answer = await pd.prefill(plan, run.chain.hop, session_id, request.prompt_ids, request.sampling)
        except PrefillUnavailable as exc:
            self._fallback(run, "prefill_failed", str(exc))
            return None
        run.handoff = HandoffSource(session=session_id, dp_group=answer.dp_group, positions=answer.positions,
                                    route=plan.token)
        return Pick(answer.token, answer.logprobs)

    def _fallback(self, run: _Run, reason: str, message: str) -> None:
        self._metrics.pd_fallbacks.labels(reason=reason).inc()
        self._metrics.pd_requests.labels(outcome="fallback").inc()
        logger.warning("session %s: no prefill/decode handoff (%s): %s; the decode route prefills the prompt",
                       log_tag(run.chain.session_id), reason, message)

    async def _adopt(self, run: _Run, handoff: HandoffSource) -> Pick:
        """The decode route's first step on the pulled KV; on a refused handoff, its own prefill of the history."""
        chain, history = run.chain, run.history
        assert self._pd is not None
        try:
            pick = await chain.adopt(handoff, history.generated[-1], history.draws, self._pd.puller)
        except HandoffRefused as exc:
            self._fallback(run, exc.reason, str(exc))
            closing = self._spawn_close(chain)
            await asyncio.wait({closing}, timeout=RETIRE_WAIT_S)
            run.chain = self._chain(chain.hop, run.request, history)
            return await self._prefill(run.chain, history.tokens())
        self._metrics.pd_requests.labels(outcome="handoff").inc()
        return pick

    async def _forked(self, run: _Run, leader: SessionChain) -> Pick:
        """The first token of a choice whose session forks the first choice's; on a refused fork, a prefill."""
        chain, history = run.chain, run.history
        try:
            pick = await chain.fork(leader, history.prompt)
        except ForkRefused as exc:
            self._metrics.forks.labels(outcome="refused").inc()
            logger.info("session %s could not fork the first choice's prompt (%s); prefilling it",
                        log_tag(chain.session_id), exc)
            closing = self._spawn_close(chain)
            await asyncio.wait({closing}, timeout=RETIRE_WAIT_S)
            run.chain = self._chain(chain.hop, run.request, history)
            return await self._prefill(run.chain, history.tokens())
        self._metrics.forks.labels(outcome="forked").inc()
        self._metrics.fork_positions.inc(len(history.prompt) - 1)
        return pick

    async def _next_tokens(self, run: _Run) -> tuple[Pick, ...]:
        """The token(s) that follow ``history``, moving the request to a new route while hops fail.

        A fresh session (the first, or one opened by failover) is prefilled
        with the whole history; an established one decodes the last token,
        with drafted tokens after it when the request's speculation says so
        (then the answer is the verified run).
        """
        try:
            while True:
                chain = run.chain
                wrong = self._quarantined_hop(chain)
                if wrong is not None:  # the tracker found it computing wrong: this stream leaves it now
                    await self._move(run, wrong, "the tracker quarantined it for computing wrong", failed=False,
                                     why="quarantined")
                    continue
                try:
                    async with run.failover.bounded():
                        if chain.prefilled:
                            token = await self._decode(run)
                        elif run.fork is not None:
                            leader, run.fork = run.fork, None
                            token = (await self._forked(run, leader),)
                        elif run.handoff is not None:
                            handoff, run.handoff = run.handoff, None
                            token = (await self._adopt(run, handoff),)
                        else:
                            token = (await self._replay(run),)
                except RouteFailed as exc:
                    assert exc.failed_node is not None
                    await self._move(run, exc.failed_node, str(exc), failed=True)
                except RouteBusy as exc:
                    if not run.failover.recovering:
                        raise  # the route the request came with is busy: the caller may try later or elsewhere
                    await self._move(run, exc.busy_node, str(exc), failed=False)
                else:
                    run.failover.recovered()
                    return token
        except FailoverGaveUp as exc:
            self._metrics.failovers.labels(reason="failed", outcome="gave_up").inc()
            logger.warning("session %s gives up: %s", log_tag(run.chain.session_id), exc)
            raise GenerationFailed(503, exc.code, str(exc), retry_after=RETRY_AFTER_GIVE_UP,
                                   failed_node=exc.failed_node) from None

    def _quarantined_hop(self, chain: SessionChain) -> str | None:
        """A node after this head on ``chain``'s route that the tracker quarantined (its last heartbeat answer),
        or ``None``. A stream the tracker relays is moved by the tracker too; one started on this head directly
        is moved only by this. This head itself is not looked for: a quarantined head is out of the tracker's
        routes, and it is the one computing wrong."""
        routes = self._routes
        if chain.hop is None or routes is None or not routes.trust.quarantined:
            return None
        return next((node_id for node_id in chain.hop.node_ids[1:] if node_id in routes.trust.quarantined), None)

    async def _move(self, run: _Run, node_id: str, reason: str, *, failed: bool, why: str | None = None) -> None:
        """Leave the broken session for a new one along a route that avoids ``node_id`` (``why``: the metric's
        reason, when it is neither a failure nor a busy node)."""
        old = run.chain
        closing = self._spawn_close(old, failed_node=node_id if failed else None)
        hop = await run.failover.reroute(node_id, reason, failed=failed,
                                         route=old.hop.token if old.hop is not None else None)
        await asyncio.wait({closing}, timeout=RETIRE_WAIT_S)
        run.chain = self.current()._chain(hop, run.request, run.history)  # on this node's layers now
        label = why or ("failed" if failed else "busy")
        self._metrics.failovers.labels(reason=label, outcome="moved").inc()
        logger.warning("session %s: node %s %s (%s); moving to session %s along %s, replaying %d tokens",
                       log_tag(old.session_id), node_id, {"failed": "failed", "busy": "is busy"}.get(label, label),
                       reason,
                       log_tag(run.chain.session_id),
                       " -> ".join(hop.node_ids), len(run.history.tokens()))

    async def _replay(self, run: _Run) -> Pick:
        """A fresh session's first step: the whole history prefilled (a grammar's replay, or a prompt the tail
        scores, in small frames)."""
        history, request = run.history, run.request
        return await self._prefill(run.chain, history.tokens(),
                                   grammar=request.sampling.grammar is not None and bool(history.generated),
                                   score=request.prompt_scoring(len(history.generated)))

    async def _prefill(self, chain: SessionChain, ids: list[int], *, grammar: bool = False,
                       score: int | None = None) -> Pick:
        """Run ``ids`` (the prompt, or a replayed history) through the route in chunks; the next token.

        A grammar-constrained replay sends frames of at most :data:`MAX_REPLAY_IDS_PER_FRAME` tokens: each
        carries its generated ids to the tail in a header, which must stay small; so does a prompt whose tokens
        the tail scores (``score``: the alternatives wanted per token), each frame naming the tokens that follow
        its positions.
        """
        size = min(self._chunk, MAX_REPLAY_IDS_PER_FRAME) if grammar or score is not None else self._chunk
        starts = range(0, len(ids), size)
        token: Pick | None = None
        for index, start in enumerate(starts):
            chunk = ids[start:start + size]
            scoring = None if score is None else Scoring(tuple(ids[start + 1:start + 1 + size]), score)
            picks = await chain.step(chunk, chunk_index=index, chunk_total=len(starts), score=scoring)
            token = picks[0] if picks else None
        if token is None:
            raise GenerationFailed(500, "no_token", "the route produced no token for the prompt")
        return token

    async def _decode(self, run: _Run) -> tuple[Pick, ...]:
        """Feed back the last token (and drafted ones, when speculating) and get the next token(s)."""
        chain, speculation = run.chain, run.speculation
        tokens = run.history.tokens()
        draft = await speculation.draft(tokens, run.request.max_tokens - len(run.history.generated))
        began = time.perf_counter()
        picks = await chain.step([tokens[-1], *draft], draft=draft)
        if not picks:
            raise GenerationFailed(500, "no_token", "the route produced no token for a decode step")
        wall_ms = (time.perf_counter() - began) * 1000.0
        compute_ms = sum(chain.last_timings.values())
        speculation.observe(len(draft), len(picks), wall_ms, compute_ms)
        if draft and chain.last_unverified:
            logger.info("session %s: a hop of the route does not take speculative frames; no more drafts",
                        log_tag(chain.session_id))
            speculation.stop()
        self._count_decode(run, draft, picks, wall_ms, compute_ms)
        return picks

    def _count_decode(self, run: _Run, draft: tuple[int, ...], picks: tuple[Pick, ...], wall_ms: float,
                      compute_ms: float) -> None:
        """A decode step in the metrics (and, debugging, the log): its time, its drafts and how many held."""
        speculative = str(bool(draft)).lower()
        self._metrics.decode_steps.labels(speculative=speculative).inc()
        self._metrics.decode_step_seconds.labels(speculative=speculative).inc(wall_ms / 1000.0)
        self._metrics.decode_compute_seconds.labels(speculative=speculative).inc(compute_ms / 1000.0)
        if logger.isEnabledFor(logging.DEBUG):
            chain = run.chain
            logger.debug("session %s: decode step k=%d emitted=%d wall %.1f ms compute %.1f ms (%s); %s",
                         log_tag(chain.session_id), len(draft), len(picks), wall_ms, compute_ms,
                         ", ".join(f"{node} {ms:.1f}" for node, ms in chain.last_timings.items()),
                         run.speculation.describe())
        if draft:
            self._metrics.drafted_tokens.inc(len(draft))
            self._metrics.accepted_tokens.inc(len(picks) - 1)

    def _spawn_close(self, chain: SessionChain, failed_node: str | None = None) -> asyncio.Task[None]:
        """Close ``chain`` in a task a cancelled request cannot interrupt (bounded by :data:`CLOSE_TIMEOUT_S`)."""
        return self._track(asyncio.wait_for(chain.close(failed_node), CLOSE_TIMEOUT_S))

    def _track(self, closing: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run ``closing`` as a task that :meth:`drain` waits for."""
        task = asyncio.create_task(closing)
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        return task

    async def _close(self, run: _Run, pending: asyncio.Task[tuple[Pick, ...]] | None) -> None:
        """Close the request's session once ``pending`` (a step cancelled in flight) has settled; wait if we may.

        The close is a task of its own, started before any wait: a request being
        cancelled (its client went away) may not reach a second ``await``.
        """
        task = self._track(self._settle_then_close(run, pending))
        try:
            await asyncio.shield(task)
        except TimeoutError:  # closing is best effort: the sessions expire anyway
            logger.info("closing session %s timed out after %.0f s", log_tag(run.chain.session_id), CLOSE_TIMEOUT_S)

    async def _settle_then_close(self, run: _Run, pending: asyncio.Task[tuple[Pick, ...]] | None) -> None:
        if pending is not None:
            await asyncio.gather(pending, return_exceptions=True)  # it may have moved the request (failover)
        await asyncio.wait_for(run.chain.close(), CLOSE_TIMEOUT_S)

    async def drain(self) -> None:
        """Wait for the closes still in flight (shutdown)."""
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
