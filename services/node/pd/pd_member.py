"""A prefill node's membership in the prefill group: registering its place in the bootstrap registry.

The tracker answers each heartbeat of a prefill node with its place in the
mesh's prefill group (:class:`~meshwire.pd_group.PrefillAssignment`). When
the place is new, the node registers it with the bootstrap registry exactly
as the registry's spec says: role ``Prefill``, the group's ``world_size``,
``dp_size`` and ``pp_size``, its dense stage-major ``engine_rank``, the
address it serves KV from (``rank_ip``/``rank_port``: its own), its cache
layout and ``cache_fields_by_stage`` (which layers' K and V each stage holds).
The registration is signed with the node's hop key (:mod:`meshwire.rank_proof`),
so the registry holds the slot for this key: nobody else can point it at
another address. The node registers again every :data:`REFRESH_S` to renew
that hold (a refused renewal is logged and changes nothing); a first
registration refused because another key holds the slot
(403, say this node restarted with a fresh hop key and the old hold has not
lapsed yet) is asked again every :data:`RETRY_HELD_S`.
Once the registry accepts it the node reports ``pd_rank`` in its heartbeats,
and only then do prefill routes use it. A refusal (say, a layout that
disagrees with the group's: another dtype) is logged with the registry's
text and kept in :attr:`PrefillMembership.error`; it is retried only when the
node's place changes. A registry that cannot be reached is retried on the
next heartbeat.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Final
from urllib.parse import urlsplit

from meshwire.bootstrap_client import (
    AsyncBootstrapClient,
    BootstrapError,
    BootstrapRefused,
    RankRegistration,
    RetryPolicy,
)
from meshwire.kv_handoff import KVShape, cache_layout, layout_wire, stage_placement
from meshwire.pd_group import PrefillAssignment
from meshwire.rank_proof import sign_registration
from meshwire.registry import RegistrationAnswer
from meshwire.route_keys import SigningKey

logger = logging.getLogger(__name__)

REGISTER_RETRY = RetryPolicy(attempts=3, backoff_s=0.2, max_backoff_s=1.0)
REFRESH_S: Final = 30.0
"""How often a registered node registers again, renewing its hold on its slot (the registry's ``slot_hold_s``,
120 s by default, is longer)."""
RETRY_HELD_S: Final = 10.0
"""How soon a registration refused because another key holds the slot is tried again."""
HELD: Final = 403


def rank_address(public_url: str) -> tuple[str, int]:
    """The ``rank_ip``/``rank_port`` of a node reached at ``public_url`` (where it serves ``/kv/pull``)."""
    parts = urlsplit(public_url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return parts.hostname or "127.0.0.1", port


class PrefillMembership:
    """Keeps this prefill node registered in the bootstrap registry under the place the tracker gives it."""

    def __init__(self, *, bootstrap_url: str, public_url: str, shape: KVShape, node_id: str,
                 hop_key: SigningKey, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._registered_at = 0.0
        self._retry_at: float | None = None
        self._client = AsyncBootstrapClient(bootstrap_url, retry=REGISTER_RETRY)
        self._node_id = node_id
        self._hop_key = hop_key
        self._address = rank_address(public_url)
        self._wire = layout_wire(cache_layout(shape))
        self.assignment: PrefillAssignment | None = None
        """The place the tracker last gave this node."""
        self.registered: PrefillAssignment | None = None
        """The place the registry accepted (``None`` until it did)."""
        self.error: str | None = None
        """The registry's refusal of the current place, if it refused it."""
        self._task: asyncio.Task[None] | None = None

    @property
    def pd_rank(self) -> int | None:
        """The engine rank this node is registered under for its current place, else ``None``."""
        if self.registered is None or self.registered != self.assignment:
            return None
        return self.registered.engine_rank

    def on_answer(self, answer: RegistrationAnswer) -> None:
        """Take the tracker's answer to a heartbeat: register a new place (or retry one the registry missed)."""
        place = answer.prefill_group
        if place != self.assignment:
            self.assignment, self.error, self._retry_at = place, None, None
        if place is None:
            return
        now = self._clock()
        if self.pd_rank is not None:
            due = now - self._registered_at >= REFRESH_S
        elif self.error is not None:
            due = self._retry_at is not None and now >= self._retry_at
        else:
            due = True
        if due and (self._task is None or self._task.done()):
            self._task = asyncio.create_task(self._register(place), name="bootstrap-register")

    def registration(self, place: PrefillAssignment) -> RankRegistration:
        """The ``PUT /route`` body of this node at ``place``."""
        ip, port = self._address
        return RankRegistration(role="Prefill", world_size=place.world_size, dp_size=place.dp_size, rank_ip=ip,
                                rank_port=port, engine_rank=place.engine_rank, pp_size=place.pp_size,
                                cache_layout=self._wire,
                                cache_fields_by_stage=tuple(tuple(stage) for stage in stage_placement(place.stages)))

    async def _register(self, place: PrefillAssignment) -> None:
        renewing = place == self.registered
        try:
            await self._client.register_rank(self.registration(place),
                                             lambda body: sign_registration(self._hop_key, self._node_id, body))
        except BootstrapRefused as exc:
            if renewing:  # the place stands as registered; the hold is asked again after REFRESH_S
                self._registered_at = self._clock()
                logger.warning("the bootstrap registry refused to renew this node's registration: %s", exc.message)
                return
            if place == self.assignment:
                self.error = exc.message
                self._retry_at = self._clock() + RETRY_HELD_S if exc.status == HELD else None
            logger.error("the bootstrap registry refused this prefill node (engine rank %d of %d, stage %d, DP "
                         "group %d): %s; it takes no prefill routes%s", place.engine_rank, place.world_size,
                         place.stage, place.dp_group, exc.message,
                         f" (asking again in {RETRY_HELD_S:.0f} s)" if exc.status == HELD else "")
            return
        except BootstrapError as exc:
            logger.warning("could not register with the bootstrap registry (retrying on the next heartbeat): %s", exc)
            return
        self.registered, self._registered_at, self.error, self._retry_at = place, self._clock(), None, None
        if renewing:
            return
        logger.info("registered in the bootstrap registry as prefill engine rank %d (stage %d of %d, DP group %d "
                    "of %d) serving KV at %s:%d", place.engine_rank, place.stage, place.pp_size, place.dp_group,
                    place.dp_size, *self._address)

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._client.aclose()
