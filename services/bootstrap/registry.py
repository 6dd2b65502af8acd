"""The bootstrap table: what source ranks registered, and the answers to look-ups.

This is the whole behaviour of ``PUT /route`` and ``GET /route`` with no HTTP
in it (``reference/bootstrap-spec.md``, rule by rule):

* A registration names ``role``, ``world_size``, ``dp_size``, ``rank_ip``,
  ``rank_port`` and ``engine_rank``; ``rank_port`` and ``engine_rank`` are
  integers (a JSON integer or a string of one); ``rank_ip`` is kept as sent.
* ``world_size`` and ``dp_size`` are first-wins (the first registration's
  values, as sent, stand); ``pp_size`` is last-wins.
* ``tp = world_size // dp_size`` from the request's own values. Only a
  ``Prefill`` is recorded, under DP group ``engine_rank // tp`` and TP rank
  ``engine_rank % tp`` (Euclidean division, as the reference); the same slot
  registered again is replaced.
* A ``cache-layouts`` registry also checks the layout and stage placement
  (:mod:`services.bootstrap.layout`), identical on every rank.

Meshnet's addition: a slot registered with a credential is *held*
(:mod:`meshwire.rank_proof`): by the public key that signed it, or by the mesh
secret, for ``hold_s`` after that registration (a meshnet prefill node
registers again well within it, so its hold lasts while it lives; a node that
restarts with a new key takes its slot back once the old hold lapsed).
Registering over a held slot needs that key's signature or the mesh secret;
anything else is refused 403 (:data:`SLOT_HELD`) and changes nothing. A
registration without a credential of a slot nobody holds behaves exactly as
the reference's.

Checks run in the reference's order, so a registration with several faults
gets the reference's message. Improvement over the reference: a refused
registration records nothing (the reference stored the sizes, and the layout,
of registrations it then refused), and the table is bounded (at most
``max_ranks`` slots, each ``rank_ip`` at most :data:`MAX_RANK_IP_BYTES`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

import orjson

from services.bootstrap import refusals
from services.bootstrap.integers import ABSENT, div_euclid, json_integer, query_integer, rem_euclid
from services.bootstrap.layout import (
    CacheLayout,
    LayoutError,
    StagePlacement,
    check_placement_covers,
    parse_layout_wire,
    parse_stage_placement,
)
from services.bootstrap.refusals import Refusal

logger = logging.getLogger(__name__)

RegistryKind = Literal["addresses", "cache-layouts"]
"""What a source node registers: addresses and sizes only, or also its cache layout."""

PREFILL_ROLE: Final = "Prefill"
"""The only role whose ranks are recorded in the table."""
SIZES_QUERY: Final = -1
"""``engine_rank`` and ``target_dp_group`` both this value ask for the node's sizes."""
REQUIRED_KEYS: Final = ("role", "world_size", "dp_size", "rank_ip")
"""Keys a registration must carry (checked in this order, before the two integers)."""
MAX_RANK_IP_BYTES: Final = 1024
"""Longest ``rank_ip`` kept, measured as compact JSON."""
DEFAULT_MAX_RANKS: Final = 65_536
"""Default number of (DP group, TP rank) slots the table holds."""
DEFAULT_HOLD_S: Final = 120.0
"""How long a signed registration holds its slot against others (a holder renews it by registering again)."""

FORBIDDEN: Final = 403
SECRET_HOLDER: Final = "secret"
"""The holder of a slot registered with the mesh secret (any other holder is a public key)."""
SLOT_HELD: Final = ("this rank slot is held by a signed registration: registering over it needs the same key's "
                    "signature or the mesh secret")

# --- texts of the cache layout checks that need the registry's state ---------------------
STAGE_COUNT_MISMATCH: Final = "CachePD placement does not match pipeline stage count"
INCOMPATIBLE_PLACEMENT: Final = "CachePD prefill ranks registered incompatible field placement"
INCOMPATIBLE_LAYOUTS: Final = "CachePD prefill ranks registered incompatible layouts"


@dataclass(frozen=True)
class RankAddress:
    """One registered source rank: its control address, ``ip`` exactly as sent."""

    ip: Any
    port: int


@dataclass(frozen=True)
class _CacheLayoutRecord:
    """A checked ``cache-layouts`` registration's layout and placement."""

    wire: str
    layout: CacheLayout
    stages: StagePlacement


@dataclass(frozen=True)
class _Registration:
    """A registration that passed every check, ready to be recorded."""

    role: Any
    world_size: Any
    dp_size: Any
    pp_size: int | None
    slot: tuple[int, int] | None
    address: RankAddress
    cache: _CacheLayoutRecord | None


class BootstrapRegistry:
    """The table of one bootstrap service.

    Thread-safe: every operation holds one lock, so a registration is
    checked and recorded atomically.
    """

    def __init__(self, kind: RegistryKind, *, max_ranks: int = DEFAULT_MAX_RANKS, hold_s: float = DEFAULT_HOLD_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.kind: Final = kind
        self._max_ranks = max_ranks
        self._hold_s = hold_s
        self._clock = clock
        self._lock = threading.Lock()
        self._world_size: Any = None
        self._dp_size: Any = None
        self._pp_size: int | None = None
        self._ranks: dict[tuple[int, int], RankAddress] = {}
        self._holders: dict[tuple[int, int], tuple[str, float]] = {}
        """Held slots: the holder (a public key, or :data:`SECRET_HOLDER`) and until when."""
        self._cache_layout: tuple[str, CacheLayout] | None = None
        self._cache_stages: StagePlacement | None = None

    @property
    def registered_ranks(self) -> int:
        """How many (DP group, TP rank) slots hold an address."""
        with self._lock:
            return len(self._ranks)

    # --- PUT /route ---------------------------------------------------------------------

    def register(self, body: bytes, *, key: str | None = None, secret: bool = False) -> None:
        """Check and record one ``PUT /route`` body; :class:`Refusal` when refused.

        ``key`` is the public key that signed the registration (``None``: unsigned), ``secret`` whether it
        bears the mesh secret. A refused registration leaves the table as it was.
        """
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError:
            raise Refusal.internal(refusals.NOT_JSON) from None
        with self._lock:
            registration = self._check(data if isinstance(data, dict) else {})
            now = self._clock()
            if registration.slot is not None:
                held = self._holders.get(registration.slot)
                if held is not None and held[1] > now and not secret and key != held[0]:
                    raise Refusal(FORBIDDEN, SLOT_HELD)
            self._record(registration)
            if registration.slot is not None:
                holder = key if key is not None else SECRET_HOLDER if secret else None
                if holder is None:
                    self._holders.pop(registration.slot, None)
                else:
                    self._holders[registration.slot] = (holder, now + self._hold_s)
        if registration.slot is not None:
            logger.debug("rank %s registered at slot %s", registration.address, registration.slot)

    def _check(self, data: Mapping[str, Any]) -> _Registration:
        for key in REQUIRED_KEYS:
            if key not in data:
                raise Refusal.internal(refusals.missing(key))
        port = json_integer(data.get("rank_port", ABSENT), "rank_port")
        engine_rank = json_integer(data.get("engine_rank", ABSENT), "engine_rank")
        cache = self._check_cache_layout(data) if self.kind == "cache-layouts" else None
        pp_size = json_integer(data["pp_size"], "pp_size") if "pp_size" in data else None
        world = json_integer(data["world_size"], "world_size")
        dp = json_integer(data["dp_size"], "dp_size")
        if dp == 0:
            raise Refusal.internal(refusals.DP_SIZE_ZERO)
        tp = div_euclid(world, dp)
        slot: tuple[int, int] | None = None
        if data["role"] == PREFILL_ROLE:
            if tp == 0:
                raise Refusal.internal(refusals.WORLD_BELOW_DP)
            slot = (div_euclid(engine_rank, tp), rem_euclid(engine_rank, tp))
            self._check_room(slot)
        address = RankAddress(ip=data["rank_ip"], port=port)
        if len(orjson.dumps(address.ip)) > MAX_RANK_IP_BYTES:
            raise Refusal(refusals.BAD_REQUEST, f"rank_ip is longer than {MAX_RANK_IP_BYTES} bytes")
        return _Registration(
            role=data["role"], world_size=data["world_size"], dp_size=data["dp_size"],
            pp_size=pp_size, slot=slot, address=address, cache=cache,
        )

    def _check_cache_layout(self, data: Mapping[str, Any]) -> _CacheLayoutRecord:
        try:
            wire, layout = parse_layout_wire(data.get("cache_layout"))
            stages = parse_stage_placement(data.get("cache_fields_by_stage"))
            check_placement_covers(layout, stages)
        except LayoutError as error:
            raise Refusal.internal(str(error)) from None
        if len(stages) != json_integer(data.get("pp_size", ABSENT), "pp_size"):
            raise Refusal.internal(STAGE_COUNT_MISMATCH)
        if self._cache_stages is not None and self._cache_stages != stages:
            raise Refusal.internal(INCOMPATIBLE_PLACEMENT)
        if self._cache_layout is not None and not self._cache_layout[1].same_as(layout):
            raise Refusal.internal(INCOMPATIBLE_LAYOUTS)
        return _CacheLayoutRecord(wire=wire, layout=layout, stages=stages)

    def _check_room(self, slot: tuple[int, int]) -> None:
        if slot not in self._ranks and len(self._ranks) >= self._max_ranks:
            raise Refusal(refusals.INSUFFICIENT_STORAGE,
                          f"the bootstrap table is full ({self._max_ranks} ranks)")

    def _record(self, registration: _Registration) -> None:
        if registration.cache is not None:
            if self._cache_layout is None:
                self._cache_layout = (registration.cache.wire, registration.cache.layout)
            self._cache_stages = registration.cache.stages
        if self._world_size is None:
            self._world_size = registration.world_size
        if self._dp_size is None:
            self._dp_size = registration.dp_size
        if registration.pp_size is not None:
            self._pp_size = registration.pp_size
        if registration.slot is not None:
            self._ranks[registration.slot] = registration.address

    # --- GET /route -----------------------------------------------------------------------

    def route(self, query: Mapping[str, str]) -> dict[str, Any]:
        """Answer ``GET /route``: the node's sizes for ``-1/-1``, else one rank's address.

        ``query`` is the decoded query string. Raises :class:`Refusal` 400
        when a parameter is missing or empty, 500 when one is not an integer
        or no rank is registered there.
        """
        engine_text = query.get("engine_rank")
        group_text = query.get("target_dp_group")
        if not engine_text or not group_text:
            raise Refusal(refusals.BAD_REQUEST, refusals.MISSING_INPUTS)
        engine_rank = query_integer(engine_text, "engine_rank")
        dp_group = query_integer(group_text, "target_dp_group")
        with self._lock:
            if engine_rank == SIZES_QUERY and dp_group == SIZES_QUERY:
                return self._sizes()
            address = self._ranks.get((dp_group, engine_rank))
        if address is None:
            raise Refusal.internal(refusals.RANK_NOT_FOUND)
        return {"rank_ip": address.ip, "rank_port": address.port}

    def _sizes(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "prefill_tp_size": self._world_size,
            "prefill_dp_size": self._dp_size,
            "prefill_pp_size": 1 if self._pp_size is None else self._pp_size,
        }
        if self.kind == "cache-layouts":
            info["cache_layout"] = None if self._cache_layout is None else self._cache_layout[0]
            info["cache_fields_by_stage"] = (
                None if self._cache_stages is None else [list(stage) for stage in self._cache_stages]
            )
        return info
