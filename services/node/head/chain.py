"""One session of the head along one route: the steps a generation is made of.

A :class:`SessionChain` opens the session on this head (its KV budget reserved), runs each step through
the head's own layers and on along the route (:mod:`services.node.hop.route_step`), and closes it here and
on every hop. Besides plain steps (a prompt chunk, a decode token with its drafts) it opens a session as a
fork of another's prompt (``n > 1``) or on KV a prefill route holds (a prefill/decode handoff).
:class:`ChainOpener` holds what every chain of this node needs, so a caller opens one by naming only its
own session.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import orjson

from meshwire.fork import ForkSource
from meshwire.forward_step import Scoring, StepInfo, close_headers
from meshwire.kv_handoff import HandoffSource
from meshwire.routes import RouteNode
from meshwire.sampling_params import SamplingParams, TokenLogprobs
from services.node.engine.compute import ShardRunner
from services.node.engine.sessions import Session, SessionRefused, SessionTable, log_tag
from services.node.head.failures import (
    ForkRefused,
    GenerationFailed,
    HandoffRefused,
    RouteFailed,
    generation_failure,
)
from services.node.hop.hop_client import INVALID_SAMPLING, ChainFailure, HopClient, send_along
from services.node.hop.route_step import Onward, RouteStepper, StepDone
from services.node.hop.routing import RoutedHop
from services.node.pd.kv_pull import HandoffFailed, KvPuller
from services.node.sampling.grammar import GrammarEngine, GrammarError
from services.node.sampling.sampler import Pick, Sampler, SamplingFailed

logger = logging.getLogger(__name__)


def new_session_id() -> str:
    """A new session's id (random: the head and every hop key the session by it)."""
    return f"s-{uuid.uuid4().hex}"



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
            raise generation_failure(exc) from exc
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
            score=score, hold=self._hold, draft=draft, handoff=handoff, fork=fork), chunk_index, chunk_total,
            self.hop.next_shadow, self.hop.route.shadow_of(0))

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
        shadow = self.hop.route.shadow  # a verifier's shadow session is closed by the head itself
        await asyncio.gather(*(self._close_from(i) for i in starts),
                             *(() if shadow is None else (self._close_from(shadow.hop_index, shadow.node),)))

    async def _close_from(self, index: int, node: RouteNode | None = None) -> None:
        assert self.hop is not None
        node = node or self.hop.route.nodes[index]
        try:
            await send_along(self._hops, node, close_headers(self.session_id, self.hop.token, index,
                                                             node.start_layer), b"")
        except ChainFailure as exc:
            logger.info("closing session %s along the route failed at %s: %s", log_tag(self.session_id),
                        exc.failed_node or exc.busy_node, exc)



@dataclass(frozen=True)
class ChainOpener:
    """What every session chain of this node runs on: its shard, its session table, its hops and its route steps."""

    runner: ShardRunner
    sessions: SessionTable
    hops: HopClient
    stepper: RouteStepper

    def open(self, hop: RoutedHop | None, *, session_id: str, sampling: SamplingParams, reserve: int,
             sample_draws: int = 0, replayed: tuple[int, ...] = (), prompt_tokens: int = 0,
             grammar: GrammarEngine | None = None, hold: str | None = None) -> SessionChain:
        """A new chain for session ``session_id`` along ``hop``'s route (``None``: this head alone); nothing is
        opened until its first step."""
        return SessionChain(runner=self.runner, sessions=self.sessions, hops=self.hops, stepper=self.stepper,
                            hop=hop, session_id=session_id, sampling=sampling, reserve=reserve,
                            sample_draws=sample_draws, replayed=replayed, prompt_tokens=prompt_tokens,
                            grammar=grammar, hold=hold)
