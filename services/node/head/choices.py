"""The choices of an ``n > 1`` request on this head: the first one's prompt is prefilled once, the others fork it.

The tracker sends each choice as a request of its own, naming their group (:mod:`meshwire.fork`). The first
choice to arrive leads: once its prompt is in, it publishes its session. A later choice with the same prompt
along the same route waits (at most :data:`FORK_WAIT_S`) for that session and forks it (every node copies
the prompt's KV rows) instead of prefilling the prompt again.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Final

from services.node.engine.sessions import log_tag
from services.node.head.chain import SessionChain
from services.node.head.events import GenerationRequest
from services.node.hop.routing import RoutedHop

logger = logging.getLogger(__name__)

FORK_WAIT_S: Final = 30.0
"""How long a choice of an ``n > 1`` request waits for the first choice's prompt to be in, to fork it
(:mod:`meshwire.fork`), before it prefills its prompt itself."""


@dataclass
class ChoiceLeader:
    """The first choice of one ``n > 1`` request on this head: its prompt, its route, and its session once in."""

    group: str
    prompt: tuple[int, ...]
    route_token: str | None
    leader: asyncio.Future[SessionChain | None]

    def publish(self, chain: SessionChain) -> None:
        """The leader's prompt is in: hand its session to the choices waiting (``None`` if it moved route)."""
        if not self.leader.done():
            same = chain.prefilled and (chain.hop.token if chain.hop else None) == self.route_token
            self.leader.set_result(chain if same else None)

    def give_up(self) -> None:
        """The leader is done: a choice still waiting prefills its own prompt."""
        if not self.leader.done():
            self.leader.set_result(None)


@dataclass(frozen=True)
class Joined:
    """A request's place in its choice group."""

    lead: ChoiceLeader | None = None
    """The group it leads (it arrived first): publish its session once its prompt is in."""
    fork: SessionChain | None = None
    """The leader's session, to fork for this choice's first token."""


class ChoiceGroups:
    """The ``n > 1`` requests whose first choice is generating on this head, by the tracker's group id."""

    def __init__(self) -> None:
        self._groups: dict[str, ChoiceLeader] = {}

    async def join(self, request: GenerationRequest, hop: RoutedHop | None, session_id: str) -> Joined:
        """A choice's place: leading its group (the first to arrive), or, after waiting for the leader's prompt,
        its session to fork; nothing for a request that takes no part.

        A choice forks only a leader with the same prompt along the same route; a resumed answer, a prefill/decode
        split and a prompt whose tokens are scored take no part.
        """
        group = request.group
        if (group is None or request.resume or request.prefill is not None or len(request.prompt_ids) < 2
                or request.prompt_scoring(0) is not None):
            return Joined()
        token = None if hop is None else hop.token
        entry = self._groups.get(group.group)
        if entry is None:
            entry = ChoiceLeader(group.group, request.prompt_ids, token, asyncio.get_running_loop().create_future())
            self._groups[group.group] = entry
            return Joined(lead=entry)
        if entry.prompt != request.prompt_ids or entry.route_token != token:
            return Joined()
        try:
            return Joined(fork=await asyncio.wait_for(asyncio.shield(entry.leader), FORK_WAIT_S))
        except TimeoutError:
            logger.info("session %s: the first choice's prompt is not in after %.0f s; prefilling",
                        log_tag(session_id), FORK_WAIT_S)
        return Joined()

    def leave(self, lead: ChoiceLeader) -> None:
        """The leader's request ended: its group takes no more forks."""
        lead.give_up()
        if self._groups.get(lead.group) is lead:
            del self._groups[lead.group]
