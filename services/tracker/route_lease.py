"""A front-door request's hold on the mesh, from the first route it tries to its very end.

While the tracker forwards a request, the nodes of its route count it as load
(``inflight_requests`` in ``GET /v1/nodes``; the planner prefers idle nodes), and the
head's answer is an open response. :class:`RouteLease` owns both: :meth:`~RouteLease.hold`
moves the load from route to route as the request is retried or continued on another head,
and :meth:`~RouteLease.end` (run exactly once, however the request ends: answered, refused,
failed, or its client gone) takes the load off, closes the answer and runs what was asked to
run at the end (counting an API key's tokens).

It is an async context manager: leaving the ``async with`` block ends it, unless the block
handed it over (:meth:`~RouteLease.hand_over`) to a streamed response, which then ends it
when the stream is done (see :class:`.proxy.ProxiedResponse`).
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import Self

import anyio
import httpx

from meshwire.routes import SignedRoute

from .registry import Registry


class RouteLease:
    """One request's load on its route's nodes and its open answer; ended exactly once."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry
        self._nodes: tuple[str, ...] = ()
        self._answer: httpx.Response | None = None
        self._at_end: list[Callable[[], None]] = []
        self._handed_over = False
        self._ended = False

    @property
    def nodes(self) -> tuple[str, ...]:
        """The node ids now carrying the request (empty between routes)."""
        return self._nodes

    def hold(self, route: SignedRoute | None) -> None:
        """Move the request's load to ``route``'s nodes (``None``: off every node, until the next route)."""
        self._registry.end_request(self._nodes)
        self._nodes = () if route is None or self._ended else tuple(hop.node_id for hop in route.nodes)
        self._registry.begin_request(self._nodes)

    def keep_open(self, answer: httpx.Response) -> None:
        """The head's answer the request relays: closed when the lease ends."""
        self._answer = answer

    def at_end(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` when the lease ends (after the load is off and the answer closed)."""
        self._at_end.append(callback)

    def hand_over(self) -> RouteLease:
        """Leave ending to whoever takes the lease (a response that ends it when its stream is done)."""
        self._handed_over = True
        return self

    async def end(self) -> None:
        """Close the answer, take the load off, run the end's callbacks; only the first call does anything."""
        if self._ended:
            return
        self._ended = True
        try:
            if self._answer is not None:
                with anyio.CancelScope(shield=True):
                    await self._answer.aclose()
        finally:
            self.hold(None)
            for callback in self._at_end:
                callback()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        traceback: TracebackType | None) -> None:
        if kind is not None or not self._handed_over:
            await self.end()
