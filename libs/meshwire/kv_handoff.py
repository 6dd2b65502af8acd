"""Prefill/decode handoff: the wire between prefill nodes and the decode nodes that take their KV over.

A request with a long prompt is prefilled on the mesh's prefill nodes and
decoded on other nodes (``meshnet node --role prefill|decode``):

1. the decode route's head sends the prompt's token ids to the head of the
   prefill route (``POST`` :data:`PREFILL_PATH`, signed prefill route in
   ``X-Meshnet-Route``, its own signed decode route in :data:`DECODE_ROUTE`,
   the handoff id in ``X-Meshnet-Session``); the prefill route runs the prompt
   through every layer (frames carrying :data:`HOLD`, the decode route's
   digest, so every prefill hop keeps its KV for that route's nodes), its tail
   samples the first token, and the answer (:class:`PrefillAnswer`) says how
   many positions are held and in which DP group of the prefill group;
2. the decode route's first step carries :data:`HANDOFF_FROM`
   (:class:`HandoffSource`); each decode hop asks the bootstrap registry which
   prefill stage holds which layers (``cache_fields_by_stage``) and where
   that stage's rank serves (``GET /route``), checks that the registered
   cache layout is its own (:func:`cache_layout`), and pulls exactly the
   layers it runs (``POST`` :data:`PULL_PATH`, with its decode route in
   ``X-Meshnet-Route``) in chunks of whole pages, each a frame of shape
   ``[2 * layers, kv_heads, positions, head_dim]`` (K and V of each layer in
   turn). It then decodes on, with no recompute.

A prefill node holds a handoff's KV until every layer it holds was pulled, or
for a bounded time (``MESHNET_HANDOFF_TTL_S``), and frees it then.

No shared secret is involved (a node that joined by token holds none): both
calls are signed with the caller's hop key (:mod:`meshwire.hop_proof`), and
the tracker's signed routes say whose keys count. A prefill is accepted from
the head of the decode route it names; a pull from a node that decode route
names at layers covering those pulled, and only for the handoff made for that
route (its digest, :func:`route_digest`, is what the prefill hops hold it
under). A replayed pull is refused (each proof is answered once).

The cache layout is the bootstrap registry's ``cache-layouts`` wire form
(``reference/bootstrap-spec.md``): one group ``kv`` of pages of
:data:`PAGE_TOKENS` positions, one plane, one field per layer
(``layer.<L>.kv``: K and V of one position, ``[2, kv_heads, head_dim]``) in
the KV cache's element type. Two nodes whose layouts are equal hold KV the
other can use as is.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Final

import orjson
from pydantic import BaseModel, Field

from meshwire.fields import STRICT_MODEL
from meshwire.frames import FrameError, check_session_id
from meshwire.sampling_params import TokenLogprobs

PREFILL_PATH: Final = "/kv/prefill"
"""On a prefill route's head: run a prompt along the prefill route and hold its KV."""
PULL_PATH: Final = "/kv/pull"
"""On a prefill node: one chunk of a held handoff's KV for some of its layers."""

HOLD: Final = "X-Meshnet-Handoff-Hold"
"""On the frames of a prefill route: keep this session's KV for a handoff once its prompt ran, for the nodes
of the decode route whose :func:`route_digest` this is."""
DECODE_ROUTE: Final = "X-Meshnet-Decode-Route"
"""On a prefill request: the signed decode route (its head signs the request) the handoff is made for."""
HANDOFF_FROM: Final = "X-Meshnet-Handoff-From"
"""On a decode route's first frame: where its prompt's KV is held (:class:`HandoffSource`)."""
KV_LAYERS: Final = "X-Meshnet-KV-Layers"
"""On a pull: the layers wanted, ``A-B`` inclusive."""
KV_CHUNK_POSITIONS: Final = "X-Meshnet-KV-Chunk-Positions"
"""On a pull: positions per chunk (whole pages); chunk ``i`` is positions ``i*P..(i+1)*P-1``."""
KV_POSITIONS: Final = "X-Meshnet-KV-Positions"
"""On a pull's answer: the positions held in all (the chunks together)."""

HANDOFF_FAILED: Final = "handoff_failed"
"""The 409 code of a decode hop that could not take a handoff's KV over: the head prefills itself."""
UNKNOWN_HANDOFF: Final = "unknown_handoff"
"""The 404 code of a pull for a handoff this node does not hold (never, or freed)."""

PAGE_TOKENS: Final = 16
"""Positions per page of the layout; a pull chunk is a whole number of pages (but the last)."""
LAYOUT_GROUP: Final = "kv"
LAYOUT_PLANE: Final = "kv"
MAX_PROMPT_IDS: Final = 1 << 20
"""Most token ids a prefill request may carry (nodes bound it further by their own prompt limit)."""
MAX_PULL_ANSWER_EXTRA: Final = 1024
"""Slack over a chunk's announced size that a puller reads before refusing a body."""

_DIGEST = re.compile(r"^[0-9a-f]{64}$")
_HANDOFF = re.compile(r"^dp=(\d{1,6});n=(\d{1,9});s=([A-Za-z0-9._:\-]{1,128})$")
_LAYERS = re.compile(r"^\s*(\d{1,5})\s*-\s*(\d{1,5})\s*$")
_FIELD = re.compile(r"^layer\.(\d{1,5})\.kv$")


@dataclass(frozen=True)
class HandoffSource:
    """Where a decode route's prompt KV is held: the prefill route's session, its DP group, its length."""

    session: str
    dp_group: int
    positions: int

    def header(self) -> str:
        return f"dp={self.dp_group};n={self.positions};s={self.session}"

    @classmethod
    def parse(cls, value: str) -> HandoffSource:
        """Read :data:`HANDOFF_FROM`; :class:`FrameError` (``bad_header``) when it is not one."""
        match = _HANDOFF.match(value.strip())
        if match is None:
            raise FrameError("bad_header", f"{HANDOFF_FROM} must be 'dp=G;n=N;s=SESSION'")
        positions = int(match.group(2))
        if positions < 1:
            raise FrameError("bad_header", f"{HANDOFF_FROM} holds no positions")
        return cls(session=check_session_id(match.group(3)), dp_group=int(match.group(1)), positions=positions)


def route_digest(token: str) -> str:
    """The SHA-256 (hex) of a signed route token: what binds a held handoff to the decode route it is for."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def parse_digest(value: str) -> str:
    """Read :data:`HOLD` (a :func:`route_digest`); :class:`FrameError` (``bad_header``) when it is not one."""
    value = value.strip()
    if _DIGEST.match(value) is None:
        raise FrameError("bad_header", f"{HOLD} must be the SHA-256 (64 hex digits) of the decode route")
    return value


class PrefillRequest(BaseModel):
    """The body of ``POST /kv/prefill``: the prompt's token ids."""

    model_config = STRICT_MODEL

    ids: Annotated[tuple[int, ...], Field(min_length=1, max_length=MAX_PROMPT_IDS)]


class PrefillAnswer(BaseModel):
    """What ``POST /kv/prefill`` answers once the prompt ran along the prefill route."""

    model_config = STRICT_MODEL

    token: Annotated[int, Field(ge=0)]
    """The first generated token (sampled by the prefill route's tail)."""
    positions: Annotated[int, Field(ge=1)]
    """Positions of KV held on every prefill node (the prompt's length)."""
    dp_group: Annotated[int, Field(ge=0)]
    """The DP group (replica) of the prefill group this route is."""
    logprobs: TokenLogprobs | None = None
    node_timings_ms: dict[str, float] = Field(default_factory=dict, max_length=64)


def format_layers(first: int, last: int) -> str:
    return f"{first}-{last}"


def parse_layers(value: str | None) -> tuple[int, int]:
    """``A-B`` -> ``(A, B)``; :class:`FrameError` when missing or malformed."""
    match = _LAYERS.match(value or "")
    if match is None:
        raise FrameError("bad_header", f"{KV_LAYERS} must be 'A-B' (inclusive layers)")
    first, last = int(match.group(1)), int(match.group(2))
    if first > last:
        raise FrameError("bad_header", f"{KV_LAYERS} {first}-{last}: the first layer is after the last")
    return first, last


# --- the cache layout ----------------------------------------------------------------------


def field_id(layer: int) -> str:
    """The layout field holding layer ``layer``'s keys and values."""
    return f"layer.{layer}.kv"


def field_layer(field: str) -> int | None:
    """The layer of field id ``field``, or ``None`` when it names none."""
    match = _FIELD.match(field)
    return None if match is None else int(match.group(1))


@dataclass(frozen=True)
class KVShape:
    """What a shard's KV cache looks like, in the terms of the layout."""

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    """Element type the cache keeps keys and values in (``float32``...)."""
    itemsize: int
    max_positions: int

    @property
    def position_bytes_per_layer(self) -> int:
        """Bytes of K and V of one position of one layer."""
        return 2 * self.kv_heads * self.head_dim * self.itemsize


def cache_layout(shape: KVShape) -> dict[str, Any]:
    """The ``cache-layouts`` layout of a model's whole KV cache (every layer), as a JSON object."""
    page_count = max(1, math.ceil(shape.max_positions / PAGE_TOKENS))
    field_page = shape.position_bytes_per_layer * PAGE_TOKENS
    block = field_page * shape.num_layers
    return {
        "plan": {
            "prefix_granularity": PAGE_TOKENS,
            "lcm_block_bytes": block,
            "num_lcm_blocks": page_count,
            "groups": [{"group_id": LAYOUT_GROUP, "cache_blocks_per_lcm_block": 1, "page_count": page_count}],
            "planes": [{"plane_id": LAYOUT_PLANE, "bytes_per_lcm_block": block, "arena_offset_bytes": 0}],
            "fields": [
                {"group_id": LAYOUT_GROUP, "field_id": field_id(layer), "plane_id": LAYOUT_PLANE,
                 "shape": [2, shape.kv_heads, shape.head_dim], "dtype": shape.dtype,
                 "field_offset_bytes": layer * field_page, "page_stride_bytes": block}
                for layer in range(shape.num_layers)
            ],
            "resident_block_bytes": None,
        },
        "group_specs": [{"group_id": LAYOUT_GROUP, "attn_kind": "full_history", "rows_per_page": PAGE_TOKENS,
                         "entry_stride_tokens": 1, "sliding_window_tokens": None, "replayable": True,
                         "transfer_policy": "full_prefix", "shard_count": 1}],
        "transfer_schema": {"fields": [field_id(layer) for layer in range(shape.num_layers)]},
    }


def layout_wire(layout: dict[str, Any]) -> str:
    """A layout's wire form (compact JSON text)."""
    return orjson.dumps(layout).decode("utf-8")


def layout_difference(mine: dict[str, Any], registered: str | None) -> str | None:
    """Why the ``registered`` layout wire form is not ``mine`` (``None`` when they are the same)."""
    if registered is None:
        return "no prefill rank has registered a cache layout"
    try:
        theirs = orjson.loads(registered)
    except orjson.JSONDecodeError:
        return "the registered cache layout is not JSON"
    if theirs == mine:
        return None
    mine_fields = mine["plan"]["fields"]
    their_fields = theirs.get("plan", {}).get("fields", []) if isinstance(theirs, dict) else []
    if len(their_fields) != len(mine_fields):
        return f"the prefill group's layout has {len(their_fields)} layer fields, this node's {len(mine_fields)}"
    for key in ("dtype", "shape"):
        ours, other = mine_fields[0][key] if mine_fields else None, their_fields[0].get(key) if their_fields else None
        if ours != other:
            return f"the prefill group keeps KV with {key} {other}, this node with {key} {ours}"
    if theirs.get("plan", {}).get("prefix_granularity") != PAGE_TOKENS:
        return f"the prefill group's pages are not {PAGE_TOKENS} positions"
    return "the prefill group's cache layout differs from this node's"


def stage_placement(stages: Sequence[tuple[int, int]]) -> list[list[str]]:
    """``cache_fields_by_stage`` of a pipeline whose stage ``i`` holds layers ``stages[i]`` (inclusive)."""
    return [[field_id(layer) for layer in range(first, last + 1)] for first, last in stages]


def placement_layers(placement: Sequence[Sequence[str]]) -> list[tuple[int, ...]]:
    """The layers each stage of a ``cache_fields_by_stage`` placement holds (fields that name no layer dropped)."""
    out: list[tuple[int, ...]] = []
    for stage in placement:
        layers = (field_layer(field) for field in stage)
        out.append(tuple(sorted(layer for layer in layers if layer is not None)))
    return out


def chunk_positions(layers: int, shape: KVShape, max_bytes: int) -> int:
    """Positions per pull chunk of ``layers`` layers: whole pages, at most ``max_bytes`` a chunk (one page at least)."""
    per_position = layers * shape.position_bytes_per_layer
    pages = max(1, max_bytes // (per_position * PAGE_TOKENS))
    return pages * PAGE_TOKENS
