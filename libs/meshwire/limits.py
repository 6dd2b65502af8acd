"""Named limits shared by every meshnet service.

Every size that crosses a process boundary is bounded; the bounds live here
so that the sender and the receiver agree on them. Service-specific limits
(KV budgets, sessions per node) live in each service's settings.
"""

from __future__ import annotations

from typing import Final

KIB: Final = 1 << 10
MIB: Final = 1 << 20

# --- activation frames ------------------------------------------------------
FRAME_MAX_RANK: Final = 4
"""Most dimensions an activation tensor may have (``[batch, tokens, hidden]`` needs 3)."""
FRAME_MAX_DIM: Final = 1 << 20
"""Largest single dimension of an activation tensor."""
FRAME_MAX_BYTES: Final = 64 * MIB
"""Largest frame body, counted after decompression."""
FRAME_MAX_CHUNKS: Final = 4096
"""Most chunks one chunked prefill may be split into."""
MAX_SESSION_ID_CHARS: Final = 128
"""Longest session id a frame may carry."""
MAX_HEADER_VALUE_CHARS: Final = 16 * KIB
"""Longest single ``X-Meshnet-*`` header value (the signed route is the largest)."""
MAX_POSITION_LIST: Final = 1 << 16
"""Most integers an ``X-Meshnet-Attn-Mask`` / ``X-Meshnet-Position-Ids`` header may list."""

# --- routes -------------------------------------------------------------------
ROUTE_TTL_S: Final = 600.0
"""Default lifetime of a signed route, seconds."""
MAX_ROUTE_TOKEN_BYTES: Final = 16 * KIB
"""Longest ``X-Meshnet-Route`` token accepted."""
MAX_ROUTE_HOPS: Final = 64
"""Most nodes one route may name."""
MAX_ID_CHARS: Final = 128
"""Longest node id / model name / lease string."""
MAX_URL_CHARS: Final = 2048
"""Longest endpoint or relay address."""
MAX_LAYERS: Final = 4096
"""Most decoder layers a model may have."""

# --- OpenAI front door --------------------------------------------------------
MAX_PROMPT_CHARS: Final = 1 << 20
"""Most characters in one prompt or in all of a chat's message contents together."""
MAX_MESSAGES: Final = 1024
"""Most messages in one chat request."""
MAX_CONTENT_PARTS: Final = 256
"""Most content parts in one message."""
MAX_TOKENS_LIMIT: Final = 32768
"""Largest ``max_tokens`` a request may ask for."""
MAX_STOP_SEQUENCES: Final = 4
"""Most stop sequences (OpenAI's own limit)."""
MAX_STOP_CHARS: Final = 256
"""Longest single stop sequence."""
MAX_TOP_K: Final = 1 << 20
"""Largest ``top_k`` extension value."""
MAX_API_KEYS: Final = 1024
"""Most client API keys ``MESHNET_API_KEYS`` may list (on the tracker and on a node)."""
MIN_TEMPERATURE: Final = 0.01
"""Smallest non-zero sampling temperature. Below it the logits divided by the temperature can
overflow float32 (``1e-45`` does), the softmax turns NaN and no token can be drawn; it would be
indistinguishable from greedy anyway, which ``temperature: 0`` asks for."""
MAX_REQUEST_BYTES: Final = 8 * MIB
"""Largest HTTP request body a JSON endpoint reads."""

# --- relay --------------------------------------------------------------------
RELAY_MAX_BODY_BYTES: Final = FRAME_MAX_BYTES + MIB
"""Largest HTTP body carried through the relay (a full frame, or a JSON answer)."""
RELAY_MAX_MESSAGE_BYTES: Final = 96 * MIB
"""Largest relay WebSocket message (a full frame plus base64 overhead and headers)."""
RELAY_MAX_HEADER_JSON_BYTES: Final = 64 * KIB
"""Largest JSON header block of a binary mux message."""
RELAY_MAX_HEADERS: Final = 64
"""Most HTTP headers one relayed request/response may carry."""
RELAY_MAX_PATH_CHARS: Final = 2048
"""Longest relayed request path."""
