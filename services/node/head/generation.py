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
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import orjson

from meshwire.fork import ChoiceGroup, ForkSource
from meshwire.forward_step import Scoring, StepInfo, close_headers
from meshwire.kv_handoff import HandoffSource
from meshwire.sampling_params import MAX_REPLAY_IDS_PER_FRAME, MAX_SEED, SamplingParams, TokenLogprobs
from services.node.engine.compute import ShardRunner
from services.node.engine.sessions import Session, SessionRefused, SessionTable, log_tag
from services.node.head.draft_model import DraftModel
from services.node.head.failover import Failover, FailoverGaveUp, FailoverPolicy
from services.node.head.speculation import DEFAULT_SPECULATE_MAX, SpeculateMode, Speculation
from services.node.head.stops import StopMatcher
from services.node.head.tokens import HeadTokenizer
from services.node.hop.hop_client import INVALID_SAMPLING, ChainFailure, HopClient, send_along
from services.node.hop.route_step import Onward, RouteStepper, StepDone
from services.node.hop.routing import RoutedHop, TrackerRoutes
from services.node.metrics import NodeMetrics
from services.node.pd.kv_pull import HandoffFailed, KvPuller
from services.node.pd.pd_head import PdHead, PrefillPlan, PrefillUnavailable
from services.node.sampling.grammar import GrammarEngine, GrammarError
from services.node.sampling.sampler import Pick, Sampler, SamplingFailed

logger = logging.getLogger(__name__)

FinishReason = Literal["stop", "length"]
CLOSE_TIMEOUT_S: Final = 10.0
"""How long closing a session along the route may take before it is left to the idle sweepers."""
RETRY_AFTER_GIVE_UP: Final = "2"
"""``Retry-After`` of a request that failover gave up on (the tracker may have a route again by then)."""
RETIRE_WAIT_S: Final = 2.0
"""How long a failover waits for the broken session's close on the surviving hops (which frees KV
the replay may need there) before it replays anyway; the close goes on in the background."""
FORK_WAIT_S: Final = 30.0
"""How long a choice of an ``n > 1`` request waits for the first choice's prompt to be in, to fork it
(:mod:`meshwire.fork`), before it prefills its prompt itself."""


@dataclass(frozen=True)
class GenerationRequest:
    """What to generate: prompt ids, limits, stop strings and sampling (with a definite seed)."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    stop: tuple[str, ...]
    sampling: SamplingParams
    echo: str | None = None
    """A completion's prompt text to give back before the answer (``echo``); with ``sampling.logprobs`` set,
    the tail also scores every prompt token."""
    resume: tuple[int, ...] = ()
    """Tokens of this answer already generated and relayed by a head that died (``meshwire.resume``):
    they are replayed, not sent again, and the answer goes on after them."""
    prefill: PrefillPlan | None = None
    """A prefill route to run the prompt along (a long prompt, on a mesh with prefill nodes)."""
    group: ChoiceGroup | None = None
    """The ``n > 1`` request this is one choice of (:mod:`meshwire.fork`): its prompt is prefilled once."""


@dataclass(frozen=True)
class TokenInfo:
    """One generated token with its log-probabilities (only when the request asks for them)."""

    token: int
    logprobs: TokenLogprobs


@dataclass(frozen=True)
class TextDelta:
    """New answer text, safe to send, and the tokens it completes (when log-probabilities are asked for).

    A token's text may be held back (an incomplete character, a possible stop
    string); its log-probabilities go out with the delta that releases its text.
    """

    text: str
    tokens: tuple[TokenInfo, ...] = ()
    ids: tuple[int, ...] = ()
    """Every token fed since the previous delta (whose text this one completes)."""
    echo: Echo | None = None
    """On the first delta of a completion that echoes its prompt: the prompt, given back before ``text``."""


@dataclass(frozen=True)
class Echo:
    """A completion's prompt given back (``echo``): its text, its ids and, when asked for, their log-probabilities
    (the first token has none: nothing precedes it)."""

    text: str
    ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs | None, ...] | None = None


@dataclass(frozen=True)
class Finished:
    """The answer is complete."""

    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int


GenerationEvent = TextDelta | Finished


class GenerationFailed(Exception):
    """The request could not be completed; ``status``/``code`` are what the API answers."""

    def __init__(self, status: int, code: str, message: str, *, retry_after: str | None = None,
                 failed_node: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.retry_after = retry_after
        self.failed_node = failed_node


class RouteFailed(GenerationFailed):
    """A hop of the route failed (unreachable, crashed, lost the session): failover can route around it."""

    def __init__(self, failed_node: str, message: str) -> None:
        super().__init__(502, "hop_failed", message, failed_node=failed_node)


class HandoffRefused(GenerationFailed):
    """The decode route could not take a prefill handoff's KV over (``reason``): it prefills the prompt itself."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(409, "handoff_failed", message)
        self.reason = reason


class ForkRefused(Exception):
    """A session could not be opened as a fork of another (this head or a hop refused): prefill instead."""


class RouteBusy(GenerationFailed):
    """A hop of the route refused the session for load (503 ``kv_budget``...): another route may take it."""

    def __init__(self, busy_node: str, code: str, message: str, retry_after: str | None) -> None:
        super().__init__(503, code, message, retry_after=retry_after)
        self.busy_node = busy_node


def sent_text(tokenizer: HeadTokenizer, stop: Sequence[str], ids: Sequence[int]) -> str:
    """The text a head sent for generated ``ids`` (those a continuation replays, ``meshwire.resume``): what
    the detokenizer and the stop matcher let out for them, as :meth:`Generator.generate` rebuilds it."""
    detok = tokenizer.detokenizer()
    stops = StopMatcher(stop)
    return "".join(stops.feed(detok.push(token)).text for token in ids)


def pick_seed(requested: int | None) -> int:
    """The sampler seed: the request's (as ``torch.manual_seed`` would take it), else a random one."""
    if requested is None:
        return secrets.randbits(63)
    seed = requested % (1 << 64)  # torch seeds are unsigned 64-bit; negative seeds wrap as in torch
    return seed if seed <= MAX_SEED else seed & MAX_SEED


def new_session_id() -> str:
    return f"s-{uuid.uuid4().hex}"


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


class SessionChain:
    """One session of this head along one route (or alone, when the head holds every layer)."""

    def __init__(self, *, runner: ShardRunner, sessions: SessionTable, hops: HopClient, stepper: RouteStepper,
                 hop: RoutedHop | None, session_id: str, sampling: SamplingParams, reserve: int,
                 sample_draws: int = 0, replayed: tuple[int, ...] = (), prompt_tokens: int = 0,
                 grammar: GrammarEngine | None = None, hold: str | None = None) -> None:
        self._runner = runner
        self._sessions = sessions
        self._hops = hops
        self._stepper = stepper
        self.hop = hop
        self.session_id = session_id
        self._sampling = sampling
        self._sampling_json = orjson.dumps(sampling.model_dump()).decode()
        self._reserve = reserve
        self._sample_draws = sample_draws
        self._replayed = replayed
        """The generated ids this session's prefill replays (a grammar's state is rebuilt from them)."""
        self._prompt_tokens = prompt_tokens
        self._grammar = grammar
        self._session: Session | None = None
        self._step = 0
        self._closed = False
        self._hold = hold
        """A prefill route's chain: every hop keeps the prompt's KV for a handoff to the decode route whose
        digest this is (``X-Meshnet-Handoff-Hold``)."""
        self.prefilled = False
        """True once the route produced its first token (the prefill is done; decode steps follow)."""
        self.scored: list[TokenLogprobs] = []
        """The prompt tokens' log-probabilities the tail reported (an echoed completion's), in order."""
        self.pulled_bytes = 0
        """Bytes of KV this head pulled for a handoff (:meth:`adopt`)."""
        self.last_timings: dict[str, float] = {}
        """Compute time of each node in the last step."""
        self.last_unverified = False
        """Whether the last step's drafts went unjudged: a hop of the route does not take speculative frames."""

    @property
    def solo(self) -> bool:
        """True when this head runs every layer itself."""
        return self.hop is None or self.hop.next is None

    async def step(self, ids: Sequence[int], *, chunk_index: int = 0, chunk_total: int = 1,
                   score: Scoring | None = None, draft: tuple[int, ...] = ()) -> tuple[Pick, ...] | None:
        """Run ``ids`` through the whole route; the sampled token on the last chunk, else ``None``.

        With ``score``, the tail also reports the log-probabilities of the tokens it names (kept in :attr:`scored`).
        With ``draft`` (a speculative decode step: ``ids`` is the last token and
        then the drafted ones) the answer is the verified run, one token or more.
        """
        samples = chunk_index == chunk_total - 1
        session = self._open() if self._session is None else self._session
        async with session.lock:
            if session.closed:
                raise GenerationFailed(503, "session_expired", f"session {self.session_id} was closed on the head")
            offset = session.position
            onward = self._onward(
                offset, samples=samples, chunk_index=chunk_index, chunk_total=chunk_total,
                # On every frame of a replayed prefill: the tail creates its sampler on the last one.
                sample_draws=self._sample_draws if self._sample_draws and not self.prefilled else None,
                sample_ids=self._replayed_in(offset, len(ids)), score=score, draft=draft or None)
            sampler = (await self._local_sampler(session)) if self.solo and samples else None
            answer = await self._run_step(session, offset, ids, sampler, onward, score=score, draft=draft or None)
        if score is not None:
            if len(answer.scored) != len(score.ids):
                assert self.hop is not None
                raise RouteFailed(self.hop.route.nodes[-1].node_id, "the tail did not score the prompt tokens")
            self.scored.extend(answer.scored)
        pick = self._picked(answer, samples)
        self.last_timings = answer.node_timings_ms
        self.last_unverified = answer.unverified
        if answer.run is not None:
            return answer.run
        return None if pick is None else (pick,)

    async def _run_step(self, session: Session, offset: int, ids: Sequence[int], sampler: Sampler | None,
                        onward: Onward | None, *, score: Scoring | None = None, draft: tuple[int, ...] | None = None,
                        refused: Callable[[ChainFailure], Exception] | None = None) -> StepDone:
        """One step of ``session`` along the route (the caller holds its lock), counted, its failures as the
        generator reports them; ``refused`` makes the exception for a hop that refused a fork's or a handoff's
        KV (the caller then prefills instead)."""
        try:
            answer = await self._stepper.run(session, position_offset=offset, from_layer=0, tokens=len(ids),
                                             ids=ids, sampler=sampler, onward=onward, score=score, draft=draft)
        except SessionRefused as exc:
            raise GenerationFailed(503, exc.code, str(exc), retry_after=str(exc.retry_after_s)) from None
        except SamplingFailed as exc:
            raise GenerationFailed(400, INVALID_SAMPLING, str(exc)) from None
        except ChainFailure as exc:  # the frame went out: the step counts
            self._step += 1
            if refused is not None and exc.handoff_failed:
                raise refused(exc) from exc
            raise _generation_failure(exc) from exc
        self._step += 1
        return answer

    async def fork(self, leader: SessionChain, prompt: Sequence[int]) -> Pick:
        """Open this session as a fork of ``leader``'s (the same prompt, along the same route): every node copies
        the first ``len(prompt) - 1`` KV rows of the leader's session, then the last prompt token runs as a
        one-token step that samples this session's first token. Raises :class:`ForkRefused` when this head or
        a hop cannot fork (the caller prefills instead)."""
        positions = len(prompt) - 1
        session = self._open() if self._session is None else self._session
        async with session.lock:
            if session.closed:
                raise GenerationFailed(503, "session_expired", f"session {self.session_id} was closed on the head")
            source = leader._session
            same_route = (self.hop is None and leader.hop is None) or (
                self.hop is not None and leader.hop is not None and self.hop.token == leader.hop.token)
            if source is None or source.closed or not same_route or session.position != 0:
                raise ForkRefused("the first choice's session is gone or on another route")
            try:
                session.cache.copy_prefix(source.cache, positions)  # type: ignore[attr-defined]
            except ValueError as exc:
                raise ForkRefused(str(exc)) from None
            offset = session.position
            onward = self._onward(offset, samples=True, sample_draws=None,
                                  fork=ForkSource(leader.session_id, positions))
            sampler = (await self._local_sampler(session)) if self.solo else None
            answer = await self._run_step(session, offset, [prompt[-1]], sampler, onward,
                                          refused=lambda exc: ForkRefused(str(exc)))
        self.last_timings = answer.node_timings_ms
        pick = self._picked(answer, True)
        assert pick is not None
        return pick

    async def adopt(self, handoff: HandoffSource, token: int, draws: int, puller: KvPuller) -> Pick:
        """The decode route's first step on a prompt prefilled elsewhere: pull, then feed ``token`` back.

        This head pulls its own layers' KV of the prompt (:mod:`services.node.pd.kv_pull`); the
        step's frame carries ``handoff`` so every later hop pulls its layers before it runs;
        the tail's sampler skips the ``draws`` the prefill route's tail made. Raises
        :class:`HandoffRefused` when this node or a hop could not take the KV over.
        """
        session = self._open() if self._session is None else self._session
        self._sample_draws = draws
        async with session.lock:
            if session.closed:
                raise GenerationFailed(503, "session_expired", f"session {self.session_id} was closed on the head")
            if session.position == 0:
                shard = self._runner.shard
                try:
                    if self.hop is None:
                        raise HandoffFailed("no_route", "this head has no signed route to pull a handoff's KV with")
                    pulled = await puller.pull_into(session.cache, handoff, 0, shard.end, shard.device,  # type: ignore[arg-type]
                                                    self.hop.token)
                except HandoffFailed as exc:
                    raise HandoffRefused(exc.reason, str(exc)) from None
                self.pulled_bytes = pulled
            offset = session.position
            onward = self._onward(offset, samples=True, sample_draws=draws or None, handoff=handoff)
            sampler = (await self._local_sampler(session)) if self.solo else None
            answer = await self._run_step(session, offset, [token], sampler, onward,
                                          refused=lambda exc: HandoffRefused("hop_refused", str(exc)))
        pick = self._picked(answer, True)
        assert pick is not None
        return pick

    def _onward(self, offset: int, *, samples: bool, sample_draws: int | None, chunk_index: int = 0,
                chunk_total: int = 1, sample_ids: tuple[int, ...] | None = None, score: Scoring | None = None,
                draft: tuple[int, ...] | None = None, handoff: HandoffSource | None = None,
                fork: ForkSource | None = None) -> Onward | None:
        """The next hop of this step's frame and its step headers (``None``: this head runs every layer).

        Every frame of the session names the route, hop 1 and the step; the first
        one reserves the session's KV; a frame that samples carries the sampling
        parameters; the rest is the frame's own (replay draws and ids, scoring, a
        draft, a handoff to take over).
        """
        if self.solo:
            return None
        assert self.hop is not None and self.hop.next is not None
        nxt = self.hop.next
        return Onward(nxt, StepInfo(
            route_token=self.hop.token, hop_index=1, start_layer=nxt.start_layer, step=self._step,
            position_offset=offset, reserve=self._reserve if self._step == 0 else None,
            sampling=self._sampling_json if samples else None, sample_draws=sample_draws, sample_ids=sample_ids,
            score=score, hold=self._hold, draft=draft, handoff=handoff, fork=fork), chunk_index, chunk_total)

    def _picked(self, answer: StepDone, samples: bool) -> Pick | None:
        if samples and answer.token is None:
            assert self.hop is not None  # a head alone always samples its own token
            raise RouteFailed(self.hop.route.nodes[-1].node_id, "the tail answered no token")
        self.prefilled = self.prefilled or samples
        return None if answer.token is None else Pick(answer.token, answer.logprobs)

    def _open(self) -> Session:
        try:
            self._session = self._sessions.open(self.session_id, self._reserve, self._runner.new_cache(self._reserve))
            self._session.hold = self._hold is not None
            self._session.handoff_for = self._hold
        except SessionRefused as exc:
            raise GenerationFailed(503, exc.code, str(exc), retry_after=str(exc.retry_after_s)) from None
        return self._session

    def _replayed_in(self, offset: int, tokens: int) -> tuple[int, ...] | None:
        """The generated ids among positions ``offset..offset+tokens`` of a replayed grammar-constrained prefill."""
        if self._sampling.grammar is None or self.prefilled or not self._replayed:
            return None
        start = max(offset - self._prompt_tokens, 0)
        end = min(offset + tokens - self._prompt_tokens, len(self._replayed))
        return self._replayed[start:end] if end > start else None

    async def _local_sampler(self, session: Session) -> Sampler:
        if session.sampler is None:
            constraint = None
            if self._sampling.grammar is not None:
                assert self._grammar is not None
                try:
                    constraint = await asyncio.to_thread(self._grammar.constraint, self._sampling.grammar,
                                                         self._replayed)
                except GrammarError as exc:
                    raise GenerationFailed(400, INVALID_SAMPLING, str(exc)) from None
            session.sampler = Sampler(self._sampling, constraint)
            session.sampler.skip(self._sample_draws)
        return session.sampler

    async def close(self, failed_node: str | None = None) -> None:
        """Free the session here and along the route (best effort: idle expiry catches the rest).

        A close frame travels down the route from hop 1 and stops where the
        route is broken; with ``failed_node`` named, the hops past it are sent
        their own close, so the survivors of a failure free their caches too.
        Closing twice does nothing the second time.
        """
        if self._closed:
            return
        self._closed = True
        session = self._session
        if session is not None:
            async with session.lock:
                self._sessions.close(self.session_id)
        if self.hop is None or self.hop.next is None or self._step == 0:
            return
        nodes = self.hop.route.nodes
        starts = [i for i in range(1, len(nodes))
                  if nodes[i].node_id != failed_node and (i == 1 or nodes[i - 1].node_id == failed_node)]
        await asyncio.gather(*(self._close_from(i) for i in starts))

    async def _close_from(self, index: int) -> None:
        assert self.hop is not None
        node = self.hop.route.nodes[index]
        try:
            await send_along(self._hops, node, close_headers(self.session_id, self.hop.token, index,
                                                             node.start_layer), b"")
        except ChainFailure as exc:
            logger.info("closing session %s along the route failed at %s: %s", log_tag(self.session_id),
                        exc.failed_node or exc.busy_node, exc)


def _scores_prompt(request: GenerationRequest, history: History) -> int | None:
    """Alternatives per prompt token the tail must score on this prefill (``None``: no scoring).

    Only a completion that echoes its prompt with log-probabilities asks, and only before its first token
    (a replay after it does not: the echo has been given)."""
    if request.echo is None or request.sampling.logprobs is None or history.generated:
        return None
    return request.sampling.logprobs


def _generation_failure(exc: ChainFailure) -> GenerationFailed:
    if exc.client_fault:
        return GenerationFailed(exc.status, str(exc.body.get("error", {}).get("code") or INVALID_SAMPLING), str(exc))
    if exc.failed_node is not None:
        return RouteFailed(exc.failed_node, str(exc))
    code = str(exc.body.get("error", {}).get("code") or "kv_budget")
    return RouteBusy(exc.busy_node or "unknown", code, str(exc), exc.retry_after)


DEFAULT_FAILOVER: Final = FailoverPolicy()


@dataclass
class _Run:
    """One request in flight: the session it is on now, and its failover state."""

    chain: SessionChain
    failover: Failover
    speculation: Speculation
    handoff: HandoffSource | None = None
    """Where the prompt's KV is held, until the decode route's first step takes it over."""
    fork: SessionChain | None = None
    """The first choice's session (an ``n > 1`` request), until this one's first step forks it."""


@dataclass
class _Group:
    """The choices of one ``n > 1`` request on this head: the first one's prompt, route and session once in."""

    prompt: tuple[int, ...]
    route_token: str | None
    leader: asyncio.Future[SessionChain | None]


class Generator:
    """Runs requests on this head: the generation loop over a :class:`SessionChain`, with failover."""

    def __init__(self, *, runner: ShardRunner, sessions: SessionTable, hops: HopClient, tokenizer: HeadTokenizer,
                 stepper: RouteStepper, metrics: NodeMetrics, prefill_chunk_tokens: int,
                 routes: TrackerRoutes | None = None, model_id: str = "",
                 failover: FailoverPolicy = DEFAULT_FAILOVER, grammar: GrammarEngine | None = None,
                 pd: PdHead | None = None, speculate: SpeculateMode = "off",
                 speculate_max: int = DEFAULT_SPECULATE_MAX, draft_model: DraftModel | None = None) -> None:
        self._runner = runner
        self._sessions = sessions
        self._hops = hops
        self._stepper = stepper
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
        self._groups: dict[str, _Group] = {}
        """``n > 1`` requests whose first choice is generating here, by the tracker's group id."""
        """Requests generating on this head now (speculation's ``auto`` stands down when there are many)."""

    async def generate(self, request: GenerationRequest, hop: RoutedHop | None) -> AsyncIterator[GenerationEvent]:
        """Generate the answer to ``request`` along ``hop``'s route (``None``: alone), as events."""
        history = History(prompt=request.prompt_ids, generated=list(request.resume))
        run = _Run(chain=self._chain(hop, request, history),
                   failover=Failover(self._failover, self._routes, model=self._model_id, shard=self._runner.shard),
                   speculation=Speculation(self._mode_for(request), self._speculate_max, model=self._draft_model,
                                           busy=lambda: self._generating))
        detok = self.tokenizer.detokenizer()
        stops = StopMatcher(request.stop)
        for token in request.resume:  # rebuild the text state of what was already sent, sending none of it
            stops.feed(detok.push(token))
        fed: list[int] = []
        """Tokens fed since the last delta."""
        reason: FinishReason = "length"
        stopped = False
        upcoming: asyncio.Task[tuple[Pick, ...]] | None = None
        pending: list[TokenInfo] = []
        """Log-probabilities of tokens whose text has not gone out yet."""
        self._generating += 1
        lead: _Group | None = None
        try:
            lead = await self._join_group(run, request, hop)
            picks = await self._first_tokens(run, request, history)
            if lead is not None and not lead.leader.done():
                chain = run.chain
                same = chain.prefilled and (chain.hop.token if chain.hop else None) == lead.route_token
                lead.leader.set_result(chain if same else None)
            echo = None
            if request.echo is not None and not request.resume:
                scored = None if request.sampling.logprobs is None else (None, *run.chain.scored)
                echo = Echo(request.echo, request.prompt_ids, scored)
            while True:
                deltas: list[TextDelta] = []
                ended = False
                for pick in picks:  # one token, or a speculative step's verified run
                    token = pick.token
                    history.generated.append(token)
                    self._metrics.tokens_generated.inc()
                    if token in self.tokenizer.eos_ids:
                        reason, ended = "stop", True
                        break
                    if pick.logprobs is not None:
                        pending.append(TokenInfo(token, pick.logprobs))
                    fed.append(token)
                    out = stops.feed(detok.push(token))
                    if out.text:  # the echo goes out with the first text (and the ids a continuation must not repeat)
                        deltas.append(TextDelta(out.text, tuple(pending), tuple(fed), echo))
                        echo = None
                        pending.clear()
                        fed.clear()
                    if out.stopped:
                        reason, stopped, ended = "stop", True, True
                        break
                    if len(history.generated) >= request.max_tokens:
                        ended = True
                        break
                if not ended:
                    # The next step starts before these tokens' text goes out: sending it (SSE, the
                    # tracker, the client) overlaps the route's work instead of adding to every token.
                    upcoming = asyncio.create_task(self._next_tokens(run, request, history))
                    await asyncio.sleep(0)  # let it reach the compute thread first
                for delta in deltas:  # a run's tokens: one chunk each, in one burst
                    yield delta
                if ended:
                    break
                assert upcoming is not None
                picks = await upcoming
                upcoming = None
            if not stopped:  # the end: release what was held back for a character or a stop string
                out = stops.feed(detok.flush())
                rest = out.text if out.stopped else out.text + stops.flush()
                if out.stopped:
                    reason = "stop"
                if rest or pending or echo is not None:
                    yield TextDelta(rest, tuple(pending), tuple(fed), echo)
            yield Finished(finish_reason=reason, prompt_tokens=len(request.prompt_ids),
                           completion_tokens=len(history.generated))
        finally:
            self._generating -= 1
            if lead is not None:
                if not lead.leader.done():
                    lead.leader.set_result(None)
                if request.group is not None and self._groups.get(request.group.group) is lead:
                    del self._groups[request.group.group]
            if upcoming is not None:  # the client went away while a step was in flight
                upcoming.cancel()
            run.speculation.close()
            await self._close(run, upcoming)

    async def _join_group(self, run: _Run, request: GenerationRequest, hop: RoutedHop | None) -> _Group | None:
        """An ``n > 1`` choice: the group it now leads (the first to arrive), or ``None`` after waiting (at most
        :data:`FORK_WAIT_S`) for the leader's prompt, whose session this one then forks (``run.fork``).

        A choice forks only a leader with the same prompt along the same route; a resumed answer, a prefill/decode
        split and a prompt whose tokens are scored take no part.
        """
        group = request.group
        if (group is None or request.resume or request.prefill is not None or len(request.prompt_ids) < 2
                or _scores_prompt(request, History(request.prompt_ids)) is not None):
            return None
        token = None if hop is None else hop.token
        entry = self._groups.get(group.group)
        if entry is None:
            entry = _Group(request.prompt_ids, token, asyncio.get_running_loop().create_future())
            self._groups[group.group] = entry
            return entry
        if entry.prompt != request.prompt_ids or entry.route_token != token:
            return None
        try:
            run.fork = await asyncio.wait_for(asyncio.shield(entry.leader), FORK_WAIT_S)
        except TimeoutError:
            logger.info("session %s: the first choice's prompt is not in after %.0f s; prefilling",
                        log_tag(run.chain.session_id), FORK_WAIT_S)
        return None

    def _mode_for(self, request: GenerationRequest) -> SpeculateMode:
        """The request's speculation: ``auto`` speculates on greedy requests only, because a seeded sampled
        stream is promised to equal transformers' token for token, and speculative sampling keeps its
        distribution but not that stream; ``on`` speculates on both (for tests and benchmarks)."""
        if self._speculate == "auto" and not request.sampling.greedy:
            return "off"
        if request.sampling.grammar is not None:  # the tail verifies drafts without a grammar's mask
            return "off"
        return self._speculate

    def _chain(self, hop: RoutedHop | None, request: GenerationRequest, history: History) -> SessionChain:
        return SessionChain(runner=self._runner, sessions=self._sessions, hops=self._hops, stepper=self._stepper,
                            hop=hop, session_id=new_session_id(), sampling=request.sampling,
                            reserve=len(request.prompt_ids) + request.max_tokens,
                            sample_draws=history.draws, replayed=tuple(history.generated),
                            prompt_tokens=len(request.prompt_ids), grammar=self.grammar)

    async def _first_tokens(self, run: _Run, request: GenerationRequest, history: History) -> tuple[Pick, ...]:
        """The answer's first token: from the prefill route when there is one to use, else from the route."""
        # A grammar's state and an echoed prompt's scores live at the tail that runs the prompt: those take
        # the decode route's own prefill.
        if (request.prefill is not None and self._pd is not None and not request.resume
                and request.sampling.grammar is None and request.echo is None):
            pick = await self._prefill_elsewhere(run, request, request.prefill, self._pd)
            if pick is not None:
                return (pick,)
        return await self._next_tokens(run, request, history)

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

    async def _adopt(self, run: _Run, request: GenerationRequest, history: History, handoff: HandoffSource) -> Pick:
        """The decode route's first step on the pulled KV; on a refused handoff, its own prefill of the history."""
        chain = run.chain
        assert self._pd is not None
        try:
            pick = await chain.adopt(handoff, history.generated[-1], history.draws, self._pd.puller)
        except HandoffRefused as exc:
            self._fallback(run, exc.reason, str(exc))
            closing = self._spawn_close(chain)
            await asyncio.wait({closing}, timeout=RETIRE_WAIT_S)
            run.chain = self._chain(chain.hop, request, history)
            return await self._prefill(run.chain, history.tokens())
        self._metrics.pd_requests.labels(outcome="handoff").inc()
        return pick

    async def _forked(self, run: _Run, request: GenerationRequest, history: History, leader: SessionChain) -> Pick:
        """The first token of a choice whose session forks the first choice's; on a refused fork, a prefill."""
        chain = run.chain
        try:
            pick = await chain.fork(leader, history.prompt)
        except ForkRefused as exc:
            self._metrics.forks.labels(outcome="refused").inc()
            logger.info("session %s could not fork the first choice's prompt (%s); prefilling it",
                        log_tag(chain.session_id), exc)
            closing = self._spawn_close(chain)
            await asyncio.wait({closing}, timeout=RETIRE_WAIT_S)
            run.chain = self._chain(chain.hop, request, history)
            return await self._prefill(run.chain, history.tokens())
        self._metrics.forks.labels(outcome="forked").inc()
        self._metrics.fork_positions.inc(len(history.prompt) - 1)
        return pick

    async def _next_tokens(self, run: _Run, request: GenerationRequest, history: History) -> tuple[Pick, ...]:
        """The token(s) that follow ``history``, moving the request to a new route while hops fail.

        A fresh session (the first, or one opened by failover) is prefilled
        with the whole history; an established one decodes the last token,
        with drafted tokens after it when the request's speculation says so
        (then the answer is the verified run).
        """
        try:
            while True:
                chain = run.chain
                try:
                    async with run.failover.bounded():
                        if chain.prefilled:
                            token = await self._decode(chain, history, request, run.speculation)
                        elif run.fork is not None:
                            leader, run.fork = run.fork, None
                            token = (await self._forked(run, request, history, leader),)
                        elif run.handoff is not None:
                            handoff, run.handoff = run.handoff, None
                            token = (await self._adopt(run, request, history, handoff),)
                        else:
                            token = (await self._prefill(chain, history.tokens(), grammar=request.sampling.grammar
                                                         is not None and bool(history.generated),
                                                         score=_scores_prompt(request, history)),)
                except RouteFailed as exc:
                    assert exc.failed_node is not None
                    await self._move(run, request, history, exc.failed_node, str(exc), failed=True)
                except RouteBusy as exc:
                    if not run.failover.recovering:
                        raise  # the route the request came with is busy: the caller may try later or elsewhere
                    await self._move(run, request, history, exc.busy_node, str(exc), failed=False)
                else:
                    run.failover.recovered()
                    return token
        except FailoverGaveUp as exc:
            self._metrics.failovers.labels(reason="failed", outcome="gave_up").inc()
            logger.warning("session %s gives up: %s", log_tag(run.chain.session_id), exc)
            raise GenerationFailed(503, exc.code, str(exc), retry_after=RETRY_AFTER_GIVE_UP,
                                   failed_node=exc.failed_node) from None

    async def _move(self, run: _Run, request: GenerationRequest, history: History, node_id: str, reason: str,
                    *, failed: bool) -> None:
        """Leave the broken session for a new one along a route that avoids ``node_id``."""
        old = run.chain
        closing = self._spawn_close(old, failed_node=node_id if failed else None)
        hop = await run.failover.reroute(node_id, reason, failed=failed,
                                         route=old.hop.token if old.hop is not None else None)
        await asyncio.wait({closing}, timeout=RETIRE_WAIT_S)
        run.chain = self._chain(hop, request, history)
        self._metrics.failovers.labels(reason="failed" if failed else "busy", outcome="moved").inc()
        logger.warning("session %s: node %s %s (%s); moving to session %s along %s, replaying %d tokens",
                       log_tag(old.session_id), node_id, "failed" if failed else "is busy", reason,
                       log_tag(run.chain.session_id),
                       " -> ".join(hop.node_ids), len(history.tokens()))

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

    async def _decode(self, chain: SessionChain, history: History, request: GenerationRequest,
                      speculation: Speculation) -> tuple[Pick, ...]:
        """Feed back the last token (and drafted ones, when speculating) and get the next token(s)."""
        tokens = history.tokens()
        draft = await speculation.draft(tokens, request.max_tokens - len(history.generated))
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
        speculative = str(bool(draft)).lower()
        self._metrics.decode_steps.labels(speculative=speculative).inc()
        self._metrics.decode_step_seconds.labels(speculative=speculative).inc(wall_ms / 1000.0)
        self._metrics.decode_compute_seconds.labels(speculative=speculative).inc(compute_ms / 1000.0)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("session %s: decode step k=%d emitted=%d wall %.1f ms compute %.1f ms (%s); %s",
                         log_tag(chain.session_id), len(draft), len(picks), wall_ms, compute_ms,
                         ", ".join(f"{node} {ms:.1f}" for node, ms in chain.last_timings.items()),
                         speculation.describe())
        if draft:
            self._metrics.drafted_tokens.inc(len(draft))
            self._metrics.accepted_tokens.inc(len(picks) - 1)
        return picks

    def _spawn_close(self, chain: SessionChain, failed_node: str | None = None) -> asyncio.Task[None]:
        """Close ``chain`` in a task a cancelled request cannot interrupt (bounded by :data:`CLOSE_TIMEOUT_S`)."""
        return self._track(asyncio.wait_for(chain.close(failed_node), CLOSE_TIMEOUT_S))

    def _track(self, closing: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run ``closing`` as a task that :meth:`drain` waits for."""
        task = asyncio.create_task(closing)
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        return task

    async def _close(self, run: _Run, pending: asyncio.Task[int] | None) -> None:
        """Close the request's session once ``pending`` (a step cancelled in flight) has settled; wait if we may.

        The close is a task of its own, started before any wait: a request being
        cancelled (its client went away) may not reach a second ``await``.
        """
        task = self._track(self._settle_then_close(run, pending))
        try:
            await asyncio.shield(task)
        except TimeoutError:  # closing is best effort: the sessions expire anyway
            logger.info("closing session %s timed out after %.0f s", log_tag(run.chain.session_id), CLOSE_TIMEOUT_S)

    async def _settle_then_close(self, run: _Run, pending: asyncio.Task[int] | None) -> None:
        if pending is not None:
            await asyncio.gather(pending, return_exceptions=True)  # it may have moved the request (failover)
        await asyncio.wait_for(run.chain.close(), CLOSE_TIMEOUT_S)

    async def drain(self) -> None:
        """Wait for the closes still in flight (shutdown)."""
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
