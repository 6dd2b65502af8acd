"""A head's reports of its steps' receipts to the tracker (issue 37): batched, bounded, off the step's path.

Every step's answer brings the head the step's chain of receipts (each hop's,
and a shadow's where the route names one). The tracker verifies them, keeps a
window of them and compares a hop's receipt with its shadow's; it takes them
only from the head of the signed route they were made on (``route`` in the
report, the head's own credential on the call). Reports gather for
:data:`FLUSH_DELAY_S` so that one request carries many steps, grouped by
route; a head whose tracker is slow or away drops what it cannot send beyond
:data:`MAX_PENDING_RECEIPTS` rather than hold memory or slow a stream.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Final

from services.node.hop.routing import NoRoute, TrackerRoutes

logger = logging.getLogger(__name__)

FLUSH_DELAY_S: Final = 0.5
"""How long receipts gather before they are sent: a report carries many steps, the tracker sees them soon."""
MAX_PENDING_RECEIPTS: Final = 8192
"""Most receipts waiting to be sent; more are dropped (and counted) while the tracker is slow."""
MAX_REPORT_RECEIPTS: Final = 256
"""Most receipts in one report (the tracker's bound on a report's body)."""


class ReceiptReporter:
    """Gathers the receipts of a head's steps and sends them to the tracker in the background."""

    def __init__(self, routes: TrackerRoutes) -> None:
        self._routes = routes
        self._pending: dict[str, list[str]] = {}
        self._count = 0
        self._flushing: asyncio.Task[None] | None = None
        self.dropped = 0
        """Receipts dropped because :data:`MAX_PENDING_RECEIPTS` were already waiting."""

    def take(self, route_token: str, receipts: Sequence[str]) -> None:
        """Queue one step's ``receipts``, made along the route ``route_token``; a flush is scheduled."""
        if not self._routes.available or not receipts:
            return
        room = MAX_PENDING_RECEIPTS - self._count
        if room < len(receipts):
            self.dropped += len(receipts)
            return
        self._pending.setdefault(route_token, []).extend(receipts)
        self._count += len(receipts)
        if self._flushing is None or self._flushing.done():
            self._flushing = asyncio.get_running_loop().create_task(self._flush_soon())

    async def _flush_soon(self) -> None:
        await asyncio.sleep(FLUSH_DELAY_S)
        await self.flush()

    async def flush(self) -> None:
        """Send every queued receipt now (what the tracker refuses or cannot take is logged and dropped)."""
        pending, self._pending, self._count = self._pending, {}, 0
        for route_token, receipts in pending.items():
            for start in range(0, len(receipts), MAX_REPORT_RECEIPTS):
                try:
                    await self._routes.report_receipts(route_token, receipts[start:start + MAX_REPORT_RECEIPTS])
                except NoRoute as exc:
                    logger.info("could not report %d receipts to a tracker: %s", len(receipts), exc)
                    return

    async def aclose(self) -> None:
        """Send what is queued (shutdown)."""
        if self._flushing is not None and not self._flushing.done():
            self._flushing.cancel()
        await self.flush()
