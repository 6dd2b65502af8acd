"""One step of one session at this node, then on to the next hop: the head is hop 0.

The head (``generation``: token ids in) and every other hop (``forward``:
hidden states in) take a step the same way, and this is that way, written
once: make room in the session's KV budget, run this node's layers through the
step engine (batched with whatever else is ready), and either answer with the
tail's token or encode the output as a frame for the next hop and send it
(``row_sender`` coalesces decode frames bound for the same hop). Each caller
keeps only what is its own: the head opens sessions from a request and turns
failures into API errors; a hop checks a received frame against its session
and turns failures into ``/forward`` refusals.

Callers hold ``session.lock`` around :meth:`RouteStepper.run` (steps of one
session are serialised) and map its exceptions: :class:`SessionRefused` (KV
budget), :class:`~services.node.sampling.SamplingFailed` (the request's
sampling parameters), :class:`~services.node.hop_client.ChainFailure` (the
rest of the route), anything else (this node's layers failed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from meshwire.forward_step import Scoring, StepInfo
from meshwire.frames import encode_frame
from meshwire.routes import RouteNode
from meshwire.sampling_params import TokenLogprobs
from services.node.compute import ShardRunner
from services.node.metrics import NodeMetrics
from services.node.row_sender import RowSender
from services.node.sampling import Sampler
from services.node.sessions import Session, SessionTable


@dataclass(frozen=True)
class Onward:
    """Where a step's output goes: the next hop, the step headers addressed to it, and the frame's chunk."""

    node: RouteNode
    info: StepInfo
    chunk_index: int = 0
    chunk_total: int = 1


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


class RouteStepper:
    """Runs a session's step on this node's layers and passes the result down the route."""

    def __init__(self, *, node_id: str, runner: ShardRunner, sessions: SessionTable, sender: RowSender,
                 metrics: NodeMetrics) -> None:
        self.node_id = node_id
        self._runner = runner
        self._sessions = sessions
        self._sender = sender
        self._metrics = metrics

    async def run(self, session: Session, *, position_offset: int, from_layer: int, tokens: int,
                  ids: Sequence[int] | None = None, hidden: torch.Tensor | None = None,
                  sampler: Sampler | None = None, onward: Onward | None = None,
                  score: Scoring | None = None) -> StepDone:
        """Step ``session`` by ``tokens`` positions (``ids`` at the head, ``hidden`` elsewhere).

        ``onward`` is ``None`` where this node ends the route (the tail, or a head
        holding every layer): the answer is then this node's own token.
        """
        self._sessions.ensure_room(session, position_offset + tokens)
        result = await self._runner.step(session.cache, position_offset=position_offset, from_layer=from_layer,
                                         ids=ids, hidden=hidden, sampler=sampler,
                                         score=score if onward is None else None)
        self._sessions.touch(session)
        self._metrics.compute_latency.observe(result.compute_ms / 1000)
        self._metrics.positions_computed.inc(tokens)
        timings = {self.node_id: round(result.compute_ms, 3)}
        if onward is None:
            return StepDone(result.token, timings, result.logprobs, result.scored)
        assert result.hidden is not None, "a shard that is not the tail always passes hidden states on"
        headers, body = encode_frame(result.hidden, session=session.session_id, chunk_index=onward.chunk_index,
                                     chunk_total=onward.chunk_total, extra=onward.info.headers())
        answer = await self._sender.send(onward.node, headers, body)
        return StepDone(answer.token, {**timings, **answer.node_timings_ms}, answer.logprobs, answer.scored)
