"""``n > 1`` from one prefill: the choices of one request share their prompt's KV.

The tracker sends every choice of an ``n > 1`` request along one route, each
marked with :data:`~meshwire.headers.CHOICE_GROUP` (:class:`ChoiceGroup`). At the
head the first choice of a group to arrive prefills its prompt as any request
does; the others wait for that prompt to be in, then open their session as a
*fork* of it: every node of the route copies the first ``P - 1`` KV rows of the
leader's session (``P``: the prompt's length) into the new session, and the
last prompt token runs as an ordinary one-token step with the follower's own
sampler. So the first token is sampled from exactly the logits a prefill gives,
and each choice equals the same request sent alone.

The fork travels in the new session's first frame (:data:`~meshwire.headers.FORK_FROM`,
:class:`ForkSource`). Each hop checks that the source session is open there,
was opened by the same signed route (no session can fork another route's) and
holds the positions; otherwise it refuses with 409 :data:`FORK_REFUSED` and the
head prefills that choice plainly (same output).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from meshwire import headers as h
from meshwire.frames import FrameError, check_session_id

FORK_REFUSED: Final = "fork_refused"
"""Error code of a hop that cannot open a session as a fork (the head prefills that choice instead)."""
MAX_CHOICES: Final = 128
"""Most choices one group may name (the OpenAI API allows ``n`` up to 128)."""
MAX_GROUP_ID_CHARS: Final = 64
"""Longest choice group id."""

_FORK = re.compile(r"n=(\d{1,10});s=(.+)")
_GROUP = re.compile(rf"([A-Za-z0-9_-]{{1,{MAX_GROUP_ID_CHARS}}});(\d{{1,3}});(\d{{1,3}})")


@dataclass(frozen=True)
class ForkSource:
    """The session a new session forks, and how many of its KV rows it copies."""

    session: str
    positions: int

    def header(self) -> str:
        return f"n={self.positions};s={self.session}"

    @classmethod
    def parse(cls, value: str) -> ForkSource:
        """Read :data:`~meshwire.headers.FORK_FROM`; :class:`FrameError` (``bad_header``) when it is not one."""
        match = _FORK.fullmatch(value.strip())
        if match is None:
            raise FrameError("bad_header", f"{h.FORK_FROM} must be 'n=POSITIONS;s=SESSION'")
        positions = int(match.group(1))
        if positions < 1:
            raise FrameError("bad_header", f"{h.FORK_FROM} copies no positions")
        return cls(session=check_session_id(match.group(2)), positions=positions)


@dataclass(frozen=True)
class ChoiceGroup:
    """Choice ``index`` of the ``n`` choices of one request (``group``: the tracker's random id for it)."""

    group: str
    index: int
    n: int

    def header(self) -> str:
        return f"{self.group};{self.index};{self.n}"

    @classmethod
    def parse(cls, value: str) -> ChoiceGroup:
        """Read :data:`~meshwire.headers.CHOICE_GROUP`; :class:`ValueError` naming what is wrong otherwise."""
        match = _GROUP.fullmatch(value.strip())
        if match is None:
            raise ValueError(f"{h.CHOICE_GROUP} must be 'GROUP;INDEX;N' (GROUP: 1-{MAX_GROUP_ID_CHARS} of "
                             "[A-Za-z0-9_-])")
        index, n = int(match.group(2)), int(match.group(3))
        if not 2 <= n <= MAX_CHOICES or index >= n:
            raise ValueError(f"{h.CHOICE_GROUP} must have 2 <= N <= {MAX_CHOICES} and INDEX < N")
        return cls(match.group(1), index, n)
