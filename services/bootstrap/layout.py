"""The logical cache layout a cache-transfer (PD prefill) node registers.

A ``cache-layouts`` registration carries three things besides its address:

* ``cache_layout``: the layout's JSON wire form, a string;
* ``cache_fields_by_stage``: which of the layout's fields each pipeline stage
  holds, a list of lists of field ids;
* ``pp_size``: the number of pipeline stages (checked by the registry).

This module parses and checks the first two. A valid layout is a JSON object
of at most :data:`MAX_LAYOUT_BYTES` with ``plan``, ``group_specs`` and
``transfer_schema``; unknown top-level keys (``field_addresses``) and unknown
``plan`` keys are ignored, while groups, planes and fields must have exactly
their keys. Two layouts are the same when their parsed forms are equal: key
order and whitespace do not matter, list order does (:meth:`CacheLayout.canonical`).

Improvement over the reference's wording "integers": every count, size,
offset and shape dimension must be a non-negative integer, since a negative
byte count describes no cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import Annotated, Final, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError, model_validator

MAX_LAYOUT_BYTES: Final = 262_144
"""Largest layout wire form accepted, in bytes."""

# --- the refusal texts, in the order the checks run ------------------------------------
LAYOUT_NOT_A_STRING: Final = "CachePD bootstrap layout must be a string"
LAYOUT_INVALID: Final = "CachePD bootstrap layout is invalid"
PLACEMENT_MISSING: Final = "CachePD requires explicit stage field placement"
PLACEMENT_NOT_COVERING: Final = "cache stage placement must cover every logical field exactly once"

CacheDType = Literal[
    "uint8", "int8", "float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu",
    "bfloat16", "float16", "int32", "float32", "int64", "float64",
]
"""The element types a cache field may have."""

Count = Annotated[int, Field(ge=0)]
"""A size, count or offset: a JSON integer, never negative."""

StagePlacement = tuple[tuple[str, ...], ...]
"""Field ids held by each pipeline stage, stage 0 first."""

_EXACT: Final = ConfigDict(frozen=True, strict=True, extra="forbid")
_OPEN: Final = ConfigDict(frozen=True, strict=True, extra="ignore")
_KEPT: Final = ConfigDict(frozen=True, strict=True, extra="allow")


class LayoutError(ValueError):
    """A layout or placement is refused; ``str()`` is the exact refusal text."""


class CacheGroup(BaseModel):
    """A cache group of the plan: pages that share a block geometry."""

    model_config = _EXACT
    group_id: str
    cache_blocks_per_lcm_block: Count
    page_count: Count


class CachePlane(BaseModel):
    """A memory plane of the plan: one arena region holding fields."""

    model_config = _EXACT
    plane_id: str
    bytes_per_lcm_block: Count
    arena_offset_bytes: Count


class CacheField(BaseModel):
    """One logical field (a layer's K/V, say) placed in a group and a plane."""

    model_config = _EXACT
    group_id: str
    field_id: str
    plane_id: str
    shape: tuple[Count, ...]
    dtype: CacheDType
    field_offset_bytes: Count
    page_stride_bytes: Count


class CachePlan(BaseModel):
    """How the cache is cut into groups, planes and fields."""

    model_config = _OPEN
    prefix_granularity: Count
    lcm_block_bytes: Count
    num_lcm_blocks: Count
    groups: tuple[CacheGroup, ...]
    planes: tuple[CachePlane, ...]
    fields: tuple[CacheField, ...]
    resident_block_bytes: Count | None = None

    @model_validator(mode="after")
    def _fields_are_unique_and_placed(self) -> CachePlan:
        group_ids = {group.group_id for group in self.groups}
        plane_ids = {plane.plane_id for plane in self.planes}
        seen: set[str] = set()
        for field in self.fields:
            if field.field_id in seen:
                raise ValueError(f"field id {field.field_id!r} appears twice")
            seen.add(field.field_id)
            if field.group_id not in group_ids:
                raise ValueError(f"field {field.field_id!r} names unknown group {field.group_id!r}")
            if field.plane_id not in plane_ids:
                raise ValueError(f"field {field.field_id!r} names unknown plane {field.plane_id!r}")
        return self


class GroupSpec(BaseModel):
    """Per-group transfer attributes; only ``group_id`` is checked, the rest is kept as sent."""

    model_config = _KEPT
    group_id: str


class TransferSchema(BaseModel):
    """What a transfer carries; must hold a ``fields`` list, the rest is kept as sent."""

    model_config = _KEPT
    fields: tuple[JsonValue, ...]


class CacheLayout(BaseModel):
    """A node's logical cache layout, parsed from its wire form."""

    model_config = _OPEN
    plan: CachePlan
    group_specs: tuple[GroupSpec, ...]
    transfer_schema: TransferSchema

    @model_validator(mode="after")
    def _specs_name_plan_groups(self) -> CacheLayout:
        group_ids = {group.group_id for group in self.plan.groups}
        for spec in self.group_specs:
            if spec.group_id not in group_ids:
                raise ValueError(f"group spec names unknown group {spec.group_id!r}")
        return self

    @classmethod
    def from_wire(cls, wire: str) -> CacheLayout:
        """Parse a layout's wire form; :class:`LayoutError` when it is not a valid layout."""
        if len(wire.encode("utf-8")) > MAX_LAYOUT_BYTES:
            raise LayoutError(LAYOUT_INVALID)
        try:
            return cls.model_validate_json(wire)
        except ValidationError as error:
            raise LayoutError(LAYOUT_INVALID) from error

    @cached_property
    def canonical(self) -> bytes:
        """The parsed form as compact JSON with sorted keys: equal exactly when the layouts are."""
        return orjson.dumps(self.model_dump(mode="json"), option=orjson.OPT_SORT_KEYS)

    @cached_property
    def field_ids(self) -> frozenset[str]:
        """Every logical field id of the plan."""
        return frozenset(field.field_id for field in self.plan.fields)

    def same_as(self, other: CacheLayout) -> bool:
        """Whether ``other`` is the same layout (parsed forms equal)."""
        return self.canonical == other.canonical


def parse_layout_wire(value: object) -> tuple[str, CacheLayout]:
    """Check ``cache_layout``: an ASCII string holding a valid layout.

    Returns the wire string as sent (served back by ``GET /route``) and the
    parsed layout.
    """
    if not isinstance(value, str) or not value.isascii():
        raise LayoutError(LAYOUT_NOT_A_STRING)
    return value, CacheLayout.from_wire(value)


def parse_stage_placement(value: object) -> StagePlacement:
    """Check ``cache_fields_by_stage``'s shape: a list of lists of strings.

    A value that is not a list, or a stage that is not a list, is refused
    with :data:`PLACEMENT_MISSING`; a stage entry that is not a string with
    :data:`PLACEMENT_NOT_COVERING` (the reference's order: stage by stage).
    """
    if not isinstance(value, list):
        raise LayoutError(PLACEMENT_MISSING)
    stages: list[tuple[str, ...]] = []
    for stage in value:
        if not isinstance(stage, list):
            raise LayoutError(PLACEMENT_MISSING)
        if not all(isinstance(field_id, str) for field_id in stage):
            raise LayoutError(PLACEMENT_NOT_COVERING)
        stages.append(tuple(stage))
    return tuple(stages)


def check_placement_covers(layout: CacheLayout, stages: Sequence[Sequence[str]]) -> None:
    """Every field of ``layout`` is named exactly once across ``stages``.

    No duplicates, no unknown ids; a stage may be empty.
    """
    named = [field_id for stage in stages for field_id in stage]
    if len(named) != len(set(named)) or set(named) != layout.field_ids:
        raise LayoutError(PLACEMENT_NOT_COVERING)
