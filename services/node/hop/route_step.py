"""One step of one session at this node, then on to the next hop: the head is hop 0.

The head (``generation``: token ids in) and every other hop (``forward``:
hidden states in) take a step the same way, and this is that way, written
once: make room in the session's KV budget, run this node's layers through the
step engine (batched with whatever else is ready), and either answer with the
tail's token or encode the output as a frame for the next hop and send it
(``row_sender`` coalesces decode frames bound for the same hop). Hidden states
go in the layers' own format, or 8-bit quantised (``--wire-dtype int8``,
:mod:`meshwire.q8`); a next hop that does not know ``q8`` refuses the frame
(400 ``bad_encoding``, nothing changed there), and is sent exact frames from
then on. Likewise a next hop that refuses a speculative frame (400
``wire_version``: a node older than speculation) is sent the step's first
position alone, as a plain decode frame, from then on: this node drops the
drafts' KV rows and the step's run is the one token the tail picks, so the
head's request goes on instead of failing. Each caller
keeps only what is its own: the head opens sessions from a request and turns
failures into API errors; a hop checks a received frame against its session
and turns failures into ``/forward`` refusals.

Callers hold ``session.lock`` around :meth:`RouteStepper.run` (steps of one
session are serialised) and map its exceptions: :class:`SessionRefused` (KV
budget), :class:`~services.node.sampling.sampler.SamplingFailed` (the request's
sampling parameters), :class:`~services.node.hop.hop_client.ChainFailure` (the
rest of the route), anything else (this node's layers failed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

import torch

from meshwire import headers as h
from meshwire.forward_step import ForwardAnswer, Scoring, StepInfo
from meshwire.frames import Encoding, encode_frame, wire_bytes
from meshwire.receipts import MAX_CHAIN_RECEIPTS, answer_digest, make_receipt, sha256_hex
from meshwire.route_keys import SigningKey
from meshwire.routes import RouteNode
from meshwire.sampling_params import TokenLogprobs
from services.node.engine.compute import ShardRunner
from services.node.engine.faults import FaultInjector
from services.node.engine.sessions import Session, SessionTable
from services.node.hop.hop_client import ChainFailure, hop_failed
from services.node.hop.row_sender import RowSender
from services.node.metrics import NodeMetrics
from services.node.sampling.sampler import Pick, Sampler
from services.node.settings import WireDType

logger = logging.getLogger(__name__)

RECEIPT_CHAIN: Final = "chain"
"""The :data:`~meshwire.headers.RECEIPTS` value that asks a hop for the step's receipts in its answer."""
WIRE_ENCODINGS: Final[dict[WireDType, Encoding]] = {"native": "identity", "int8": "q8"}
"""The frame encoding of each ``--wire-dtype``."""
MAX_PLAIN_HOPS: Final = 4096
"""Most next hops remembered as not knowing a lossy encoding (the set is cleared when full)."""


@dataclass(frozen=True)
class Onward:
    """Where a step's output goes: the next hop, the step headers addressed to it, and the frame's chunk."""

    node: RouteNode
    info: StepInfo
    chunk_index: int = 0
    chunk_total: int = 1
    shadow: RouteNode | None = None
    """The next hop's shadow (a verifier the route names, issue 37): sent the same frame, its receipt kept."""
    head_shadow: RouteNode | None = None
    """At the head: the head's own shadow (another head the route names): sent the step's token ids as a frame,
    and the head signs a receipt of its own step to compare with the shadow's."""


@dataclass(frozen=True)
class StepDone:
    """A step's outcome along the rest of the route."""

    token: int | None
    """The tail's sampled token (on a frame that samples), else ``None``."""
    node_timings_ms: dict[str, float]
    """Compute time of this node and of every hop after it."""
    logprobs: TokenLogprobs | None = None
    """With the token, when the session asks for log-probabilities."""
    scored: tuple[TokenLogprobs, ...] = ()
    """On a scored prompt step: the log-probabilities of the prompt tokens it named (from the tail)."""
    run: tuple[Pick, ...] | None = None
    """On a speculative step: the verified run (``token`` is its first)."""
    unverified: bool = False
    """On a speculative step: a hop of the route does not take speculative frames, so nothing was verified."""
    output_sha256: str | None = None
    """What this node's own output hashes to, for its receipt (:mod:`meshwire.receipts`): its hidden states as an
    exact (``identity``) frame body carries them, whatever encoding they were sent in, or at the end of the route
    (a tail, or a shadow of a tail) the tokens it answered."""
    receipts: tuple[str, ...] = ()
    """The receipts of the hops after this one (and of a shadow) that came back with the answer."""


ReceiptSink = Callable[[str, Sequence[str]], None]
"""Where a head hands each step's chain of receipts (the route token, the receipts): the tracker's report."""


class RouteStepper:
    """Runs a session's step on this node's layers and passes the result down the route."""

    def __init__(self, *, node_id: str, runner: ShardRunner, sessions: SessionTable, sender: RowSender,
                 metrics: NodeMetrics, wire_dtype: WireDType = "native", faults: FaultInjector | None = None,
                 receipt_sink: ReceiptSink | None = None, receipts: bool = True,
                 hop_key: SigningKey | None = None) -> None:
        self.node_id = node_id
        self._hop_key = hop_key
        """Signs the head's own receipt of a step its route shadows (``None``: the head signs none)."""
        self._runner = runner
        self._sessions = sessions
        self._sender = sender
        self._metrics = metrics
        self._encoding = WIRE_ENCODINGS[wire_dtype]
        self._faults = faults or FaultInjector(None, metrics)
        """``--fault``: what this node's output is perturbed with as it leaves (nothing, but in tests)."""
        self._receipts = receipts
        """``--receipts``: hash each step's output for this node's receipt (off: no hashing, no receipts)."""
        self._receipt_sink = receipt_sink
        """At a head: takes each step's receipts to report them to the tracker (``None``: receipts are dropped)."""
        self._plain_hops: set[str] = set()
        """Next hops (node ids) that refused ``self._encoding``: they are sent exact frames."""
        self._unspeculative_hops: set[str] = set()
        """Next hops (node id and endpoint) that refused a speculative frame (400 ``wire_version``: an older node): a
        speculative step sends them its first position only, as a plain decode frame."""

    async def run(self, session: Session, *, position_offset: int, from_layer: int, tokens: int,
                  ids: Sequence[int] | None = None, hidden: torch.Tensor | None = None,
                  sampler: Sampler | None = None, onward: Onward | None = None,
                  score: Scoring | None = None, draft: tuple[int, ...] | None = None) -> StepDone:
        """Step ``session`` by ``tokens`` positions (``ids`` at the head, ``hidden`` elsewhere).

        ``onward`` is ``None`` where this node ends the route (the tail, or a head
        holding every layer): the answer is then this node's own token. With
        ``draft`` (a speculative step: ``tokens`` is ``len(draft) + 1``) the answer
        is the verified run, and this node's KV cache keeps the run's positions
        only: the rows of rejected drafts are dropped as the answer passes back.
        """
        self._sessions.ensure_room(session, position_offset + tokens)
        own: tuple[str, asyncio.Task[tuple[str, ...]]] | None = None
        if ids is not None and onward is not None and onward.head_shadow is not None and self._receipts \
                and self._hop_key is not None:  # the head's shadow runs the same ids while the head does
            ids_headers, ids_body = _ids_frame(session.session_id, ids, onward)
            own = (sha256_hex(ids_body), asyncio.get_running_loop().create_task(
                self._shadow(onward.head_shadow, ids_headers, ids_body)))
        try:
            return await self._run(session, position_offset=position_offset, from_layer=from_layer, tokens=tokens,
                                   ids=ids, hidden=hidden, sampler=sampler, onward=onward, score=score, draft=draft,
                                   own=own)
        finally:
            if own is not None and not own[1].done():
                own[1].cancel()

    async def _run(self, session: Session, *, position_offset: int, from_layer: int, tokens: int,
                   ids: Sequence[int] | None, hidden: torch.Tensor | None, sampler: Sampler | None,
                   onward: Onward | None, score: Scoring | None, draft: tuple[int, ...] | None,
                   own: tuple[str, asyncio.Task[tuple[str, ...]]] | None) -> StepDone:
        if onward is None and hidden is not None:  # a tail sends no hidden states on: its layers compute wrong
            hidden = self._faults.hidden(position_offset, hidden)
        result = await self._runner.step(session.cache, position_offset=position_offset, from_layer=from_layer,
                                         ids=ids, hidden=hidden, sampler=sampler,
                                         score=score if onward is None else None,
                                         draft=draft if onward is None else None)
        self._sessions.touch(session)
        self._metrics.compute_latency.observe(result.compute_ms / 1000)
        self._metrics.positions_computed.inc(tokens)
        timings = {self.node_id: round(result.compute_ms, 3)}
        if onward is None:
            if result.hidden is not None:  # a shadow of a hop before the tail: it hashes what it would send on
                output = sha256_hex(wire_bytes(self._faults.hidden(position_offset, result.hidden)))
                return StepDone(None, timings, output_sha256=output if self._receipts else None)
            token, run = self._answered(position_offset, result.token, result.run)
            if draft is not None and run is not None:
                self._keep(session, position_offset, len(run))
            answered = () if token is None else [pick.token for pick in run] if run is not None else [token]
            return StepDone(token, timings, result.logprobs, result.scored, run,
                            output_sha256=answer_digest(answered) if self._receipts else None)
        assert result.hidden is not None, "a shard that is not the tail always passes hidden states on"
        hidden = self._faults.hidden(position_offset, result.hidden)
        if onward.info.draft is not None and _address(onward.node) in self._unspeculative_hops:
            hidden, onward = self._unspeculative(session, position_offset, hidden, onward)
        encoding = "identity" if onward.node.node_id in self._plain_hops else self._encoding
        shadowed: asyncio.Task[tuple[str, ...]] | None = None
        try:
            answer, shadowed = await self._send(session, hidden, onward, encoding)
        except ChainFailure as exc:
            if exc.failed_node != onward.node.node_id:
                raise
            if onward.info.draft is not None and exc.refused_code == "wire_version":
                logger.warning("next hop %s does not take speculative frames (%s); sending it one position a step",
                               onward.node.node_id, exc)
                _remember(self._unspeculative_hops, _address(onward.node))
                hidden, onward = self._unspeculative(session, position_offset, hidden, onward)
            elif encoding != "identity" and exc.refused_code == "bad_encoding":
                logger.warning("next hop %s does not take %s frames (%s); sending it exact ones",
                               onward.node.node_id, encoding, exc)
                _remember(self._plain_hops, onward.node.node_id)
                encoding = "identity"
            else:
                raise
            answer, shadowed = await self._send(session, hidden, onward, encoding)
        sent = sha256_hex(wire_bytes(hidden)) if self._receipts else None
        if onward.info.draft is None and draft is not None:  # the route past here verified nothing: a run of one
            if answer.token is None:
                raise hop_failed(onward.node.node_id, "it answered a decode step without a token")
            answer = answer.model_copy(update={"tokens": [answer.token], "unverified": True,
                                               "run_logprobs": None if answer.logprobs is None else [answer.logprobs]})
        run = _run_of(onward.node, answer) if draft is not None else None
        if run is not None:
            self._keep(session, position_offset, len(run))
        receipts = (*(answer.receipts or ()), *((await shadowed) if shadowed is not None else ()))
        if own is not None and sent is not None and self._hop_key is not None:  # the head's receipt, its shadow's
            mine = make_receipt(self._hop_key, route_token=onward.info.route_token, session=session.session_id,
                                node_id=self.node_id, hop_index=0, step=onward.info.step,
                                position_offset=position_offset, positions=tokens, input_sha256=own[0],
                                output_sha256=sent).encode()
            receipts = (mine, *(await own[1]), *receipts)
        if ids is not None and receipts and self._receipt_sink is not None:  # the head: the step's whole chain
            self._receipt_sink(onward.info.route_token, receipts)
        return StepDone(answer.token, {**timings, **answer.node_timings_ms}, answer.logprobs, answer.scored,
                        run, unverified=bool(answer.unverified), output_sha256=sent,
                        receipts=receipts[:MAX_CHAIN_RECEIPTS - 1])

    def _answered(self, position_offset: int, token: int | None,
                  run: tuple[Pick, ...] | None) -> tuple[int | None, tuple[Pick, ...] | None]:
        """The token (and speculative run) this tail answers: what it sampled, unless ``--fault wrong-token``
        picks this step (then a run is cut to its first, wrong, token)."""
        if token is None:
            return token, run
        answered = self._faults.token(position_offset, token, self._runner.shard.vocab_size)
        if answered == token:
            return token, run
        return answered, None if run is None else (Pick(answered, run[0].logprobs),)

    def _unspeculative(self, session: Session, position_offset: int, hidden: torch.Tensor,
                       onward: Onward) -> tuple[torch.Tensor, Onward]:
        """A speculative step turned plain for a next hop that does not know speculative frames (an older
        node): only the step's first position (the last real token) goes on, and this node keeps only its
        KV row; the drafts are never judged, so the step's run is the one token the tail picks."""
        session.cache.truncate(position_offset + 1)
        info = dataclasses.replace(onward.info, draft=None)
        return hidden[:, :1].contiguous(), Onward(onward.node, info, onward.chunk_index, onward.chunk_total)

    def _keep(self, session: Session, position_offset: int, positions: int) -> None:
        """Drop the KV rows of a speculative step's rejected positions: keep ``positions`` from ``position_offset``."""
        session.cache.truncate(position_offset + positions)

    async def _send(self, session: Session, hidden: torch.Tensor, onward: Onward,
                    encoding: Encoding) -> tuple[ForwardAnswer, asyncio.Task[tuple[str, ...]] | None]:
        """Send ``hidden`` on as one frame; the answer, and the shadow's receipts to come where the route names a
        shadow of the next hop (sent the same frame at the same time)."""
        headers, body = encode_frame(hidden, session=session.session_id, chunk_index=onward.chunk_index,
                                     chunk_total=onward.chunk_total, encoding=encoding,
                                     wire_version=onward.info.wire_version,
                                     extra={**onward.info.headers(), **({h.RECEIPTS: RECEIPT_CHAIN} if self._receipts
                                                                        else {})})
        self._metrics.frame_bytes_sent.labels(encoding=encoding).inc(len(body))
        self._metrics.frame_tokens_sent.labels(encoding=encoding).inc(int(hidden.shape[1]))
        shadowed = None
        if onward.shadow is not None:
            shadowed = asyncio.get_running_loop().create_task(self._shadow(onward.shadow, headers, body))
        try:
            return await self._sender.send(onward.node, headers, body), shadowed
        except BaseException:
            if shadowed is not None:
                shadowed.cancel()
            raise

    async def _shadow(self, node: RouteNode, headers: dict[str, str], body: bytes) -> tuple[str, ...]:
        """Send the shadow its copy of a frame; its receipts, or none when it failed (a shadow's failure is never
        the session's: the step goes on with the hop's answer, and this step is not compared)."""
        try:
            answer = await self._sender.send(node, headers, body)
        except Exception as exc:  # noqa: BLE001 - a verifier that fails only loses this comparison
            logger.info("shadow %s did not answer a frame: %s", node.node_id, exc)
            return ()
        return tuple(answer.receipts or ())[:1]


def _ids_frame(session_id: str, ids: Sequence[int], onward: Onward) -> tuple[dict[str, str], bytes]:
    """The frame a head sends its shadow: the step's token ids (as float32 values of shape ``[1, n, 1]``, exact
    below 2**24), addressed to hop 0, with what only the head's layers use of the step's headers."""
    info = dataclasses.replace(onward.info, hop_index=0, start_layer=0, sampling=None, sample_draws=None,
                               sample_ids=None, score=None, hold=None, handoff=None, fork=None)
    tensor = torch.tensor(list(ids), dtype=torch.float32).view(1, -1, 1)
    return encode_frame(tensor, session=session_id, chunk_index=onward.chunk_index, chunk_total=onward.chunk_total,
                        encoding="identity", wire_version=info.wire_version,
                        extra={**info.headers(), h.RECEIPTS: RECEIPT_CHAIN})


def _address(node: RouteNode) -> str:
    """A next hop as the node id at its endpoint (an upgraded node at a new address is asked afresh)."""
    return f"{node.node_id} {node.endpoint}"


def _remember(hops: set[str], node_id: str) -> None:
    """Add ``node_id`` to a bounded set of next hops (cleared when it reaches :data:`MAX_PLAIN_HOPS`)."""
    if len(hops) >= MAX_PLAIN_HOPS:
        hops.clear()
    hops.add(node_id)


def _run_of(node: RouteNode, answer: ForwardAnswer) -> tuple[Pick, ...]:
    """The verified run a speculative step's answer carries; a route that answered without one failed."""
    if answer.tokens is None:
        raise hop_failed(node.node_id, "it answered a speculative frame without the verified run")
    logprobs = answer.run_logprobs or []
    return tuple(Pick(token, logprobs[index] if index < len(logprobs) else None)
                 for index, token in enumerate(answer.tokens))
