"""Sending decode frames to the next hop together: one ``POST /forward/rows`` per hop per batch.

The step engine (:mod:`services.node.engine.step_engine`) finishes the decode rows
of a batch at the same moment, and each session then sends its row on to its
next hop. :class:`RowSender` gathers the one-token frames bound for the same
hop in that moment into one batched request
(:mod:`meshwire.row_batch`): the next hop receives them together, so its own
engine runs them as one batch too, and the route carries one request per hop
per batch instead of one per session.

A frame that is alone when its group is sent goes as a plain ``POST
/forward``, exactly as before; so do prompt chunks. Each frame's answer is
judged as :func:`~services.node.hop.hop_client.send_along` judges one: a token,
or the :class:`~services.node.hop.hop_client.ChainFailure` it means for that
session. A batch that cannot be delivered at all fails each of its frames
with the hop's failure, so each session's head fails over on its own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from meshwire import headers as h
from meshwire.forward_step import ForwardAnswer
from meshwire.frames import get_header
from meshwire.routes import RouteNode
from meshwire.row_batch import CONTENT_TYPE, MAX_ROWS, ROWS_PATH, RowAnswer, decode_answers, encode_rows
from services.node.engine.outcomes import outcome_of, settle
from services.node.hop.hop_client import (
    ChainFailure,
    HopAnswer,
    HopClient,
    HopUnreachable,
    hop_failed,
    judge_answer,
    judge_payload,
    send_along,
)

logger = logging.getLogger(__name__)

GATHER_ROUNDS: Final = 2
"""Event-loop rounds a group waits for the rest of its batch's frames before it is sent."""
GroupKey = tuple[str, str, str | None]
"""Frames share a request when they go to the same node at the same address (node id, endpoint, relay)."""


@dataclass(eq=False)
class _Pending:
    headers: Mapping[str, str]
    body: bytes
    future: asyncio.Future[ForwardAnswer] = field(repr=False)


class RowSender:
    """Sends this node's frames to next hops, decode frames for the same hop batched into one request."""

    def __init__(self, hops: HopClient, max_rows: int = MAX_ROWS) -> None:
        self._hops = hops
        self._max_rows = max(1, min(max_rows, MAX_ROWS))
        self._groups: dict[GroupKey, list[_Pending]] = {}
        self._flushing: set[asyncio.Task[None]] = set()

    async def send(self, node: RouteNode, headers: Mapping[str, str], body: bytes) -> ForwardAnswer:
        """Send one frame to ``node``: batched with the other decode frames bound there now, else alone."""
        if not _is_decode_row(headers):
            return await send_along(self._hops, node, headers, body)
        key = (node.node_id, node.endpoint, node.relay_addr)
        pending = _Pending(headers=headers, body=body, future=asyncio.get_running_loop().create_future())
        group = self._groups.get(key)
        if group is None:
            self._groups[key] = group = []
            task = asyncio.get_running_loop().create_task(self._flush(node, key))
            self._flushing.add(task)
            task.add_done_callback(self._flushing.discard)
        group.append(pending)
        return await pending.future

    async def _flush(self, node: RouteNode, key: GroupKey) -> None:
        for _ in range(GATHER_ROUNDS):
            await asyncio.sleep(0)
        frames = [p for p in self._groups.pop(key, []) if not p.future.done()]
        batches = [frames[i:i + self._max_rows] for i in range(0, len(frames), self._max_rows)]
        await asyncio.gather(*(self._deliver(node, batch) for batch in batches))

    async def _deliver(self, node: RouteNode, batch: list[_Pending]) -> None:
        if len(batch) == 1:
            settle(batch[0].future, await outcome_of(send_along(self._hops, node, batch[0].headers, batch[0].body)))
            return
        try:
            answer = await self._hops.post_frame(node, batch_headers(batch[0].headers),
                                                 encode_rows([(p.headers, p.body) for p in batch]),
                                                 path=ROWS_PATH, content_type=CONTENT_TYPE)
        except HopUnreachable as exc:
            failure = hop_failed(node.node_id, exc.reason)
            for pending in batch:
                settle(pending.future, self._hops.attested(failure, node, pending.headers))
            return
        except Exception as exc:
            logger.exception("sending a batch of %d frames to %s failed", len(batch), node.node_id)
            for pending in batch:
                settle(pending.future, exc)
            return
        for pending, outcome in zip(batch, _row_outcomes(node, answer, len(batch)), strict=True):
            if isinstance(outcome, ChainFailure):  # signed as send_along signs a single frame's failure
                outcome = self._hops.attested(outcome, node, pending.headers)
            settle(pending.future, outcome)


def batch_headers(row: Mapping[str, str]) -> dict[str, str]:
    """A batch's own headers: the wire version, and the route and hop index of one of its rows, so the next hop
    can verify the batch's proof with the hop key that route names for this node before it reads the batch."""
    out = {h.WIRE: h.WIRE_VERSION}
    for name in (h.ROUTE, h.HOP_INDEX):
        value = get_header(row, name)
        if value is not None:
            out[name] = value
    return out


def _row_outcomes(node: RouteNode, answer: HopAnswer, rows: int) -> list[ForwardAnswer | BaseException]:
    """Each row's outcome from a batch answer (a whole-batch refusal is every row's)."""
    if answer.status != 200:
        return [_judged(node, answer) for _ in range(rows)]
    try:
        answers = decode_answers(answer.body, rows)
    except ValueError as exc:
        return [hop_failed(node.node_id, f"its answer to a batch of frames is not one ({exc})") for _ in range(rows)]
    return [_judged_row(node, row) for row in answers]


def _judged(node: RouteNode, answer: HopAnswer) -> ForwardAnswer | BaseException:
    try:
        return judge_answer(node, answer)
    except ChainFailure as exc:
        return exc


def _judged_row(node: RouteNode, row: RowAnswer) -> ForwardAnswer | BaseException:
    try:
        return judge_payload(node, row.status, row.body, row.retry_after)
    except ChainFailure as exc:
        return exc


def _is_decode_row(headers: Mapping[str, str]) -> bool:
    """A data frame of one token: the kind a batch of decode steps sends (not a prompt chunk, not a close)."""
    shape = get_header(headers, h.SHAPE)
    return get_header(headers, h.CONTROL) is None and shape is not None and shape.split(",")[:2] == ["1", "1"]
