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

The decode side trusts no address it cannot verify. The first decode frame
carries the signed prefill route itself (:data:`HANDOFF_ROUTE`); a decode hop
pulls each layer from the endpoint that route names for the prefill node
holding it (never from an address the bootstrap registry hands out, which
anyone could have registered), names that node in the pull
(:data:`KV_SOURCE`, signed, so a pull is good for that node alone), and
accepts a chunk only when its answer is signed with that node's hop key over
the chunk's headers and bytes, the puller's id and the pull's own proof
(:func:`sign_pull_answer`, :func:`pull_answer_problem`): an answer made for
another pull, another decode node or an older request does not verify.
The chunk is sealed to a fresh key the pull carries (:mod:`meshwire.kv_box`),
so a pull replayed by anyone else yields nothing they can read.

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Final

import orjson
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from pydantic import BaseModel, Field

from meshwire.fields import STRICT_MODEL
from meshwire.frames import FrameError, check_session_id
from meshwire.hop_proof import PROOF, SIGNER, ProofProblem, check_claim, read_claim, sign_request
from meshwire.limits import MAX_HEADER_VALUE_CHARS
from meshwire.route_keys import SigningKey
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
HANDOFF_ROUTE: Final = "X-Meshnet-Handoff-Route"
"""On a decode route's first frame, beside :data:`HANDOFF_FROM`: the signed prefill route that ran the prompt.
It names each prefill node's endpoint, layers and hop key: where to pull from, and whose signature the KV bears."""
KV_SOURCE: Final = "X-Meshnet-KV-Source"
"""On a pull (signed with it): the node id of the prefill node it is meant for; any other node refuses it."""
PULL_ANSWER_PATH: Final = "/kv/pull#answer"
"""The path a pull answer's signature is made over (never a request path, so a request proof is never an
answer's, nor the other way round)."""
KV_REQUESTER: Final = "x-meshnet-kv-requester"
KV_REQUEST_PROOF: Final = "x-meshnet-kv-request-proof"
"""Covered by a pull answer's signature without travelling: the puller's id and its request's proof."""

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
    """Where a decode route's prompt KV is held: the prefill route's session, its DP group, its length, and the
    signed prefill route that holds it (:data:`HANDOFF_ROUTE`; ``None`` from a sender that did not say, whose
    handoff a decode node then refuses)."""

    session: str
    dp_group: int
    positions: int
    route: str | None = None

    def header(self) -> str:
        return f"dp={self.dp_group};n={self.positions};s={self.session}"

    @classmethod
    def parse(cls, value: str, route: str | None = None) -> HandoffSource:
        """Read :data:`HANDOFF_FROM` (and :data:`HANDOFF_ROUTE`); :class:`FrameError` (``bad_header``) when it is
        not one."""
        match = _HANDOFF.match(value.strip())
        if match is None:
            raise FrameError("bad_header", f"{HANDOFF_FROM} must be 'dp=G;n=N;s=SESSION'")
        positions = int(match.group(2))
        if positions < 1:
            raise FrameError("bad_header", f"{HANDOFF_FROM} holds no positions")
        if route is not None and not 0 < len(route.strip()) <= MAX_HEADER_VALUE_CHARS:
            raise FrameError("bad_header", f"{HANDOFF_ROUTE} must be a signed route of at most "
                                           f"{MAX_HEADER_VALUE_CHARS} characters")
        return cls(session=check_session_id(match.group(3)), dp_group=int(match.group(1)), positions=positions,
                   route=None if route is None else route.strip())


# --- the signed pull answer ----------------------------------------------------------------------


def _answer_fields(headers: Mapping[str, str], requester: str, request_proof: str) -> dict[str, str]:
    """The headers a pull answer's signature covers: its own ``X-Meshnet-*`` ones (not the proof) and the
    request it answers."""
    fields = {name.lower(): value for name, value in headers.items()
              if name.lower().startswith("x-meshnet-") and name.lower() not in (SIGNER.lower(), PROOF.lower(),
                                                                                 KV_REQUESTER, KV_REQUEST_PROOF)}
    fields[KV_REQUESTER] = requester
    fields[KV_REQUEST_PROOF] = request_proof
    return fields


def sign_pull_answer(key: SigningKey, signer: str, headers: Mapping[str, str], body: bytes, *, requester: str,
                     request_proof: str) -> dict[str, str]:
    """The proof headers of a pull answer: ``signer`` (the prefill node, holding ``key``) vouches for these KV
    bytes and headers as its answer to ``requester``'s pull whose proof was ``request_proof``."""
    return sign_request(key, signer, PULL_ANSWER_PATH, _answer_fields(headers, requester, request_proof), body)


def pull_answer_problem(key: Ed25519PublicKey, signer: str, headers: Mapping[str, str], body: bytes | bytearray, *,
                        requester: str, request_proof: str) -> str | None:
    """Why a pull answer is not ``signer``'s (with ``key``) answer to this very pull; ``None`` when it is."""
    try:
        claim = read_claim(headers)
    except ProofProblem as exc:
        return f"the answer is not signed: {exc}"
    if claim.signer != signer:
        return f"the answer is signed by {claim.signer[:100]!r}, not by {signer!r}"
    try:
        check_claim(claim, key, PULL_ANSWER_PATH, _answer_fields(headers, requester, request_proof), body)
    except ProofProblem as exc:
        return f"the answer's signature does not hold: {exc}"
    return None


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
