"""The node-to-node protocol of ``POST /forward``, beyond the frame itself.

A data frame (``meshwire.frames``) carries a session's hidden states; the
headers here say where it is in the route and in the session
(:class:`StepInfo`). A close frame has no body and only the headers of
:func:`close_headers`. The answer to either is :class:`ForwardAnswer`.
The head builds these headers for hop 1, and each hop rebuilds them for the
next with :meth:`StepInfo.for_next_hop`, so both sides share one definition.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Annotated, Final, Literal

from pydantic import BaseModel, Field

from meshwire import headers as h
from meshwire.fields import STRICT_MODEL
from meshwire.frames import FrameError, get_header, parse_attn_mask, parse_int_header, parse_position_ids
from meshwire.limits import MAX_HEADER_VALUE_CHARS, MAX_LAYERS, MAX_ROUTE_HOPS, MAX_SESSION_ID_CHARS

ControlVerb = Literal["close"]
CLOSE: Final[ControlVerb] = "close"
MAX_STEP: Final = 1 << 40
MAX_POSITION: Final = 1 << 32
MAX_RESERVE_TOKENS: Final = 1 << 32
MAX_SAMPLE_DRAWS: Final = 1 << 20
MAX_TIMING_ENTRIES: Final = MAX_ROUTE_HOPS
_SESSION_CHARS: Final = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._:-")


class ForwardAnswer(BaseModel):
    """A hop's ``200`` answer: the sampled token (tail, sampling frames) and per-node compute times.

    It is ``{"token": int | null, "node_timings_ms": {node_id: ms}}`` for a data
    frame, plus ``"closed"`` for a close frame.
    """

    model_config = STRICT_MODEL

    token: Annotated[int, Field(ge=0)] | None = None
    node_timings_ms: Annotated[dict[str, float], Field(max_length=MAX_TIMING_ENTRIES)] = Field(default_factory=dict)
    closed: bool | None = None
    """On a close frame: whether this hop held the session."""


@dataclass(frozen=True)
class StepInfo:
    """Where a data frame is: its hop in the route and its step in the session."""

    route_token: str
    hop_index: int
    start_layer: int
    step: int
    """The session's step counter; 0 opens the session."""
    position_offset: int
    """Absolute position of the frame's first token."""
    reserve: int | None = None
    """On step 0: KV tokens the session may grow to."""
    sampling: str | None = None
    """The ``X-Meshnet-Sampling`` JSON, passed along unchanged for the tail."""
    sample_draws: int | None = None
    """On a failover replay: draws the session's sampler has already made."""

    def headers(self) -> dict[str, str]:
        """The headers that carry this step, besides the frame's own."""
        out = {
            h.ROUTE: self.route_token,
            h.HOP_INDEX: str(self.hop_index),
            h.START_LAYER: str(self.start_layer),
            h.STEP: str(self.step),
            h.POSITION_OFFSET: str(self.position_offset),
        }
        if self.reserve is not None:
            out[h.RESERVE] = str(self.reserve)
        if self.sampling is not None:
            out[h.SAMPLING] = self.sampling
        if self.sample_draws is not None:
            out[h.SAMPLE_DRAWS] = str(self.sample_draws)
        return out

    def for_next_hop(self, start_layer: int) -> StepInfo:
        """The same step, addressed to the next hop."""
        return replace(self, hop_index=self.hop_index + 1, start_layer=start_layer)

    @classmethod
    def parse(cls, headers: Mapping[str, str], tokens: int) -> StepInfo:
        """Read a data frame's step headers; ``tokens`` is the frame's length (for positions).

        Raises :class:`FrameError` (``bad_header``) on anything missing or malformed.
        Reference-style ``Position-Ids``/``Attn-Mask`` headers are accepted when
        they say what the offset says (contiguous positions, no padding).
        """
        offset = parse_int_header(h.POSITION_OFFSET, get_header(headers, h.POSITION_OFFSET),
                                  minimum=0, maximum=MAX_POSITION)
        _check_reference_positions(headers, offset, tokens)
        sampling = get_header(headers, h.SAMPLING)
        if sampling is not None and len(sampling) > MAX_HEADER_VALUE_CHARS:
            raise FrameError("bad_header", f"{h.SAMPLING} is too long")
        reserve = get_header(headers, h.RESERVE)
        draws = get_header(headers, h.SAMPLE_DRAWS)
        return cls(
            route_token=get_header(headers, h.ROUTE) or "",
            hop_index=parse_int_header(h.HOP_INDEX, get_header(headers, h.HOP_INDEX),
                                       minimum=0, maximum=MAX_ROUTE_HOPS - 1),
            start_layer=parse_int_header(h.START_LAYER, get_header(headers, h.START_LAYER),
                                         minimum=0, maximum=MAX_LAYERS - 1),
            step=parse_int_header(h.STEP, get_header(headers, h.STEP), minimum=0, maximum=MAX_STEP),
            position_offset=offset,
            reserve=None if reserve is None else parse_int_header(h.RESERVE, reserve, minimum=1,
                                                                  maximum=MAX_RESERVE_TOKENS),
            sampling=sampling,
            sample_draws=None if draws is None else parse_int_header(h.SAMPLE_DRAWS, draws, minimum=0,
                                                                     maximum=MAX_SAMPLE_DRAWS),
        )


def _check_reference_positions(headers: Mapping[str, str], offset: int, tokens: int) -> None:
    positions = get_header(headers, h.POSITION_IDS)
    if positions is not None and parse_position_ids(positions) != tuple(range(offset, offset + tokens)):
        raise FrameError("bad_header", f"{h.POSITION_IDS} must be the contiguous positions "
                                       f"{offset}..{offset + tokens - 1} of the frame's tokens")
    mask = get_header(headers, h.ATTN_MASK)
    if mask is not None:
        values = parse_attn_mask(mask)
        if values and (len(values) < tokens or not all(values)):
            raise FrameError("bad_header", f"{h.ATTN_MASK} must be all ones: padded frames are not supported")


def check_session_id(session: str | None) -> str:
    """A session id as frames allow it (1-128 of ``[A-Za-z0-9._:-]``), for bodiless control frames."""
    if not session or len(session) > MAX_SESSION_ID_CHARS or not set(session) <= _SESSION_CHARS:
        raise FrameError("bad_header",
                         f"{h.SESSION} must be 1-{MAX_SESSION_ID_CHARS} characters of [A-Za-z0-9._:-]")
    return session


def close_headers(session: str, route_token: str, hop_index: int, start_layer: int) -> dict[str, str]:
    """Headers of a close frame: free ``session`` on the hop and pass the close on."""
    return {
        h.WIRE: h.WIRE_VERSION,
        h.SESSION: session,
        h.CONTROL: CLOSE,
        h.ROUTE: route_token,
        h.HOP_INDEX: str(hop_index),
        h.START_LAYER: str(start_layer),
    }
