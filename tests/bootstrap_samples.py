"""Registrations and cache layouts shared by the bootstrap tests (the reference's own samples)."""

from __future__ import annotations

import json
from typing import Any

STAGES: list[list[str]] = [["layer.0.kv"], ["layer.1.kv"]]
"""The reference's two-stage placement of its two-field layout."""


def registration(engine_rank: int, port: int = 7000, **changes: Any) -> dict[str, Any]:
    """A Prefill rank of the reference's node (world 4, DP 2, so TP 2), with ``changes`` applied."""
    body: dict[str, Any] = {
        "role": "Prefill",
        "world_size": 4,
        "dp_size": 2,
        "rank_ip": "10.0.0.1",
        "rank_port": port,
        "engine_rank": engine_rank,
    }
    body.update(changes)
    return body


def layout_dict(page_count: int = 8) -> dict[str, Any]:
    """The reference's valid layout: one group, one plane, two fields (``layer.0.kv``, ``layer.1.kv``)."""
    return {
        "plan": {
            "prefix_granularity": 16,
            "lcm_block_bytes": 64,
            "num_lcm_blocks": page_count - 1,
            "groups": [{"group_id": "kv", "cache_blocks_per_lcm_block": 1, "page_count": page_count}],
            "planes": [{"plane_id": "p0", "bytes_per_lcm_block": 64, "arena_offset_bytes": 0}],
            "fields": [
                {"group_id": "kv", "field_id": "layer.0.kv", "plane_id": "p0", "shape": [16],
                 "dtype": "bfloat16", "field_offset_bytes": 0, "page_stride_bytes": 64},
                {"group_id": "kv", "field_id": "layer.1.kv", "plane_id": "p0", "shape": [16],
                 "dtype": "bfloat16", "field_offset_bytes": 32, "page_stride_bytes": 64},
            ],
            "resident_block_bytes": None,
        },
        "group_specs": [{"group_id": "kv", "attn_kind": "full_history", "rows_per_page": 16,
                         "entry_stride_tokens": 1, "sliding_window_tokens": None,
                         "replayable": False, "transfer_policy": "full_suffix", "shard_count": 1}],
        "transfer_schema": {"fields": []},
        "field_addresses": None,
    }


def layout(page_count: int = 8) -> str:
    """:func:`layout_dict`'s wire form."""
    return json.dumps(layout_dict(page_count))


def cache_registration(engine_rank: int, wire: str | None = None,
                       stages: list[list[str]] | None = None, **changes: Any) -> dict[str, Any]:
    """A cache-layouts registration: ``pp_size`` is the number of stages unless ``changes`` say otherwise."""
    stages = STAGES if stages is None else stages
    body = registration(engine_rank, 7000 + engine_rank)
    body.update(pp_size=len(stages), cache_layout=layout() if wire is None else wire,
                cache_fields_by_stage=stages)
    body.update(changes)
    return body
