"""Asking the tracker which layers to load (a node started without ``--layers``).

The node posts its :class:`~meshwire.placement.PlacementRequest` to each of its
trackers in order (``POST /v1/placement`` with the credential it registers
with) until one answers. A tracker that is not up yet is retried with a
growing pause, so nodes may start before their tracker; a refusal (the budget
cannot hold one layer, a bad credential) stops the node at start with the
tracker's message (:class:`PlacementRefused`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Final

import httpx
from pydantic import ValidationError

from meshwire.auth import bearer_headers
from meshwire.placement import PlacementAnswer, PlacementRequest

logger = logging.getLogger(__name__)

RETRY_MIN_S: Final = 0.5
RETRY_MAX_S: Final = 5.0
ASK_TIMEOUT_S: Final = 300.0
"""How long a node keeps asking trackers that do not answer before it gives up starting."""


class PlacementRefused(RuntimeError):
    """The tracker will not place this node (or no tracker answered): the node does not start."""


def _message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:500]


async def ask_placement(http: httpx.AsyncClient, trackers: Sequence[str], credential: str,
                        request: PlacementRequest, timeout_s: float = ASK_TIMEOUT_S) -> PlacementAnswer:
    """The range the first answering tracker places this node on; :class:`PlacementRefused` otherwise."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    delay = RETRY_MIN_S
    body = request.model_dump_json()
    headers = {**bearer_headers(credential), "Content-Type": "application/json"}
    while True:
        for tracker in trackers:
            try:
                response = await http.post(f"{tracker}/v1/placement", content=body, headers=headers)
            except httpx.HTTPError as exc:
                logger.warning("placement: tracker %s did not answer: %s", tracker, exc)
                continue
            if response.status_code == 200:
                try:
                    return PlacementAnswer.model_validate_json(response.content)
                except ValidationError as exc:
                    raise PlacementRefused(f"tracker {tracker} answered a placement this node cannot read: "
                                           f"{exc.errors()[0]['msg']}") from None
            if response.status_code < 500:
                raise PlacementRefused(f"tracker {tracker} refused to place this node "
                                       f"({response.status_code}): {_message(response)}")
            logger.warning("placement: tracker %s answered %d: %s", tracker, response.status_code,
                           _message(response))
        if loop.time() + delay > deadline:
            raise PlacementRefused(f"no tracker of {', '.join(trackers)} placed this node within {timeout_s:.0f} s")
        await asyncio.sleep(delay)
        delay = min(delay * 2, RETRY_MAX_S)
