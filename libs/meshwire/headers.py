"""Names of the ``X-Meshnet-*`` HTTP headers, in one place.

The first group keeps the reference node server's names so its wire format
keeps working; the second group is what meshnet's protocol adds (version 2).
Header lookup on the receiving side is case-insensitive (see
:func:`meshwire.frames.header_lookup`); these constants are the canonical
spelling used when sending.
"""

from __future__ import annotations

from typing import Final

WIRE_VERSION: Final = "2"
"""Protocol version carried in :data:`WIRE`; a frame with another version is refused."""
SPECULATIVE_WIRE_VERSION: Final = "3"
"""The version a speculative frame (one with :data:`DRAFT`) carries: its answer is a run of tokens, and its
rejected positions are dropped from every hop's KV cache. A node that predates speculation refuses it
(400 ``wire_version``) instead of answering it as an ordinary chunk, which would be wrong."""
WIRE_VERSIONS: Final = frozenset({WIRE_VERSION, SPECULATIVE_WIRE_VERSION})
"""Versions a data frame may carry."""

PREFIX: Final = "X-Meshnet-"

# --- names shared with the reference node server ---------------------------
WIRE: Final = "X-Meshnet-Wire"
SHAPE: Final = "X-Meshnet-Shape"
DTYPE: Final = "X-Meshnet-Dtype"
SESSION: Final = "X-Meshnet-Session"
CHUNK_INDEX: Final = "X-Meshnet-Chunk-Index"
CHUNK_TOTAL: Final = "X-Meshnet-Chunk-Total"
ENCODING: Final = "X-Meshnet-Encoding"
HOP_INDEX: Final = "X-Meshnet-Hop-Index"
START_LAYER: Final = "X-Meshnet-Start-Layer"
ATTN_MASK: Final = "X-Meshnet-Attn-Mask"
POSITION_IDS: Final = "X-Meshnet-Position-Ids"
ROUTE: Final = "X-Meshnet-Route"

# --- meshnet additions ------------------------------------------------------
POSITION_OFFSET: Final = "X-Meshnet-Position-Offset"
STEP: Final = "X-Meshnet-Step"
SAMPLING: Final = "X-Meshnet-Sampling"
RESERVE: Final = "X-Meshnet-Reserve"
CONTROL: Final = "X-Meshnet-Control"
SAMPLE_DRAWS: Final = "X-Meshnet-Sample-Draws"
SAMPLE_IDS: Final = "X-Meshnet-Sample-Ids"
"""On a replayed frame of a grammar-constrained session: the generated token ids among the frame's
positions (base64 of little-endian uint32), which the new tail feeds its grammar before it samples."""
SCORE: Final = "X-Meshnet-Score"
"""On a prompt frame of a completion that echoes its prompt with log-probabilities: ``TOP:IDS``, the
alternatives wanted and, per position of the frame, the prompt token that follows it (base64 of
little-endian uint32); the tail answers each one's log-probability (``scored``)."""
LEASE: Final = "X-Meshnet-Lease"
PREFILL_ROUTE: Final = "X-Meshnet-Prefill-Route"
"""From the tracker to a head: a signed route through the mesh's prefill nodes (``meshwire.kv_handoff``)."""
PD_MIN_PROMPT_TOKENS: Final = "X-Meshnet-PD-Min-Prompt-Tokens"
"""With :data:`PREFILL_ROUTE`: the shortest prompt (in tokens) the head prefills along it."""
DRAFT: Final = "X-Meshnet-Draft"
"""On a speculative frame: the drafted token ids (comma-separated) its last positions propose; the tail
verifies them and answers the accepted run (see :mod:`meshwire.forward_step`)."""
PROGRESS: Final = "X-Meshnet-Progress"
"""From the tracker to a head: add the token ids behind each stream event (see :mod:`meshwire.resume`)."""
CHOICE_GROUP: Final = "X-Meshnet-Choice-Group"
"""From the tracker to a head: ``<group id>;<index>;<n>``, the choices of one ``n > 1`` request sent along one
route, whose prompt the head prefills once and forks (see :mod:`meshwire.fork`)."""
FORK_FROM: Final = "X-Meshnet-Fork-From"
"""On a session's first frame: ``<source session>:<positions>``, open it with a copy of the first ``positions``
KV rows of the source session of the same route (see :mod:`meshwire.fork`)."""
RECEIPTS: Final = "X-Meshnet-Receipts"
"""On a frame: ``chain``, the sender takes the step's receipts back in the answer body (``receipts``, issue 37); a
hop answers them only when asked, so a node older than receipts, which refuses unknown answer fields, is never
sent them."""

ALL: Final[tuple[str, ...]] = (
    WIRE, SHAPE, DTYPE, SESSION, CHUNK_INDEX, CHUNK_TOTAL, ENCODING, HOP_INDEX, START_LAYER,
    ATTN_MASK, POSITION_IDS, ROUTE, POSITION_OFFSET, STEP, SAMPLING, RESERVE, CONTROL,
    SAMPLE_DRAWS, SAMPLE_IDS, SCORE, LEASE, DRAFT, CHOICE_GROUP, FORK_FROM, RECEIPTS,
)
"""Every header name meshnet defines, canonical spelling."""
