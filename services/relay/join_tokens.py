"""Peers and callers admitted by their join tokens, as the tracker says.

A node that joined the mesh by a join token (``meshnet token create``) holds
no shared secret; it shows the relay its token instead. The relay does not
keep tokens: it asks the tracker (``POST /v1/tokens/check?node_id=ID`` with
the token as bearer) whether the token is valid and, for a peer, whether it
binds the peer id it connects under, so a node cannot serve under another's
id. A positive answer is remembered for :data:`ADMIT_TTL_S` (a revoked token
is refused by new connections at most that much later; the tracker has
already taken its node out of every route); a refusal for
:data:`REFUSE_TTL_S`, so a client repeating a bad token does not turn into
as many requests to the tracker.

A connection already open when its token is revoked is closed too
(:mod:`services.relay.token_watch`): every :data:`RECHECK_S` it asks again
(:meth:`TokenChecker.recheck`, an answer at most that old), so it is closed
within ``2 * RECHECK_S`` (under :data:`ADMIT_TTL_S`) of the revocation. Only
the tracker's refusal closes it: a tracker that cannot be reached closes nothing.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Final

import httpx

from meshwire.auth import AuthFailure

log = logging.getLogger(__name__)

TOKEN_PREFIX: Final = "mnj_"
CHECK_PATH: Final = "/v1/tokens/check"
ADMIT_TTL_S: Final = 10.0
"""How long a tracker's yes is believed: a revoked token is refused by new connections within this."""
REFUSE_TTL_S: Final = 5.0
RECHECK_S: Final = 4.0
"""How often an open connection admitted by a token asks again, and the oldest answer it takes."""
MAX_REMEMBERED: Final = 4096
TRACKER_TIMEOUT_S: Final = 5.0


def bearer_token(authorization: str | None) -> str | None:
    """The join token in an ``Authorization: Bearer mnj_...`` value, or ``None`` for anything else."""
    if not authorization:
        return None
    scheme, _, credential = authorization.strip().partition(" ")
    credential = credential.strip()
    return credential if scheme.lower() == "bearer" and credential.startswith(TOKEN_PREFIX) else None


class TokenChecker:
    """Asks the tracker(s) whether a join token admits a peer id (or any caller); answers remembered briefly."""

    def __init__(self, trackers: Sequence[str], clock: Callable[[], float] = time.monotonic) -> None:
        self._trackers = tuple(url.rstrip("/") for url in trackers)
        self._clock = clock
        self._answers: OrderedDict[str, tuple[float, AuthFailure | None]] = OrderedDict()
        """Per token and peer id: when the tracker was asked, and what it said."""
        self._http = httpx.AsyncClient(timeout=TRACKER_TIMEOUT_S, trust_env=False)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def check(self, token: str, peer_id: str | None) -> AuthFailure | None:
        """``None`` when ``token`` is valid (and binds ``peer_id``, when given); the refusal otherwise."""
        return (await self._verdict(token, peer_id, None))[0]

    async def recheck(self, token: str, peer_id: str | None) -> AuthFailure | None:
        """For a connection open on ``token``: the tracker's refusal (an answer at most :data:`RECHECK_S` old),
        or ``None`` while it still admits, or when no tracker could say."""
        failure, known = await self._verdict(token, peer_id, RECHECK_S)
        return failure if known else None

    async def _verdict(self, token: str, peer_id: str | None, max_age_s: float | None) -> tuple[AuthFailure | None,
                                                                                                     bool]:
        """The tracker's answer (remembered, or asked now) and whether a tracker gave it."""
        key = hashlib.sha256(f"{token}\n{peer_id or ''}".encode()).hexdigest()
        now = self._clock()
        remembered = self._answers.get(key)
        if remembered is not None:
            asked_at, answer = remembered
            ttl_s = ADMIT_TTL_S if answer is None else REFUSE_TTL_S
            if now - asked_at < (ttl_s if max_age_s is None else min(ttl_s, max_age_s)):
                return answer, True
        answer, known = await self._ask(token, peer_id)
        if not known:
            return answer, False  # no tracker could say: not remembered
        self._answers[key] = (now, answer)
        self._answers.move_to_end(key)
        while len(self._answers) > MAX_REMEMBERED:
            self._answers.popitem(last=False)
        return answer, True

    async def _ask(self, token: str, peer_id: str | None) -> tuple[AuthFailure | None, bool]:
        """The tracker's verdict, and whether one answered at all."""
        params = {"node_id": peer_id} if peer_id else {}
        for tracker in self._trackers:
            try:
                response = await self._http.post(f"{tracker}{CHECK_PATH}", params=params,
                                                 headers={"Authorization": f"Bearer {token}"})
            except httpx.HTTPError as exc:
                log.warning("cannot ask tracker %s about a join token: %s", tracker, exc)
                continue
            if response.status_code == 200:
                return None, True
            if response.status_code in (401, 403):
                return AuthFailure(403, _message(response)), True
            log.warning("tracker %s answered %d about a join token", tracker, response.status_code)
        return AuthFailure(403, "no tracker could check the join token; try again shortly"), False


def _message(response: httpx.Response) -> str:
    try:
        return f"join token refused: {response.json()['error']['message']}"[:300]
    except (ValueError, KeyError, TypeError):
        return "join token refused"
