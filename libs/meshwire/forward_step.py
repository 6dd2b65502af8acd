"""The contract of ``POST /forward`` beyond the tensor itself: parsed once, here.

A frame sent to a hop is either

* a **data frame** (:class:`DataRequest`): the frame's own headers
  (``meshwire.frames``: dtype, shape, session, chunk) plus the step headers of
  :class:`StepInfo` — where it is in the route (route token, hop index, start
  layer) and in the session (step, position, reserve, sampling, draws, draft); or
* a **close frame** (:class:`CloseRequest`): no body, ``X-Meshnet-Control:
  close``, the session and the route address (:func:`close_headers`).

The answer to either is :class:`ForwardAnswer`. The head writes these headers
for hop 1 and each hop rewrites them for the next with
:meth:`StepInfo.for_next_hop`; a receiving hop reads every header once with
:func:`parse_forward`, before it reads the body. So the writer and the reader
share one definition, and no service carries a copy of it.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Annotated, Final, Literal

from pydantic import BaseModel, Field, ValidationError

from meshwire import headers as h
from meshwire.fields import STRICT_MODEL, AsTuple
from meshwire.fork import ForkSource
from meshwire.frames import (
    FrameError,
    FrameLimits,
    FrameSpec,
    check_session_id,
    format_int_list,
    get_header,
    parse_attn_mask,
    parse_frame_headers,
    parse_int_header,
    parse_int_list,
    parse_position_ids,
)
from meshwire.kv_handoff import HANDOFF_FROM, HANDOFF_ROUTE, HOLD, HandoffSource, parse_digest
from meshwire.limits import MAX_HEADER_VALUE_CHARS, MAX_LAYERS, MAX_ROUTE_HOPS, MAX_TOKENS_LIMIT
from meshwire.receipts import MAX_CHAIN_RECEIPTS, MAX_RECEIPT_CHARS
from meshwire.sampling_params import MAX_REPLAY_IDS_PER_FRAME, MAX_TOP_LOGPROBS, SamplingParams, TokenLogprobs

ControlVerb = Literal["close"]
CLOSE: Final[ControlVerb] = "close"
MAX_STEP: Final = 1 << 40
"""Highest session step a frame may carry."""
MAX_POSITION: Final = 1 << 32
"""Highest absolute position of a frame's first token."""
MAX_RESERVE_TOKENS: Final = 1 << 32
"""Most KV tokens a session may ask to reserve on its first step."""
MAX_DRAFT_TOKENS: Final = 16
"""Most drafted tokens one speculative frame may carry (``--speculate-max`` is at most this)."""
MAX_SAMPLE_DRAWS: Final = MAX_TOKENS_LIMIT + MAX_DRAFT_TOKENS + 1
"""Most sampler draws a failover replay may ask the tail to skip: one a generated token, and a session
generates at most ``max_tokens`` (each of a request's ``n`` choices is its own session), plus one
speculative step's run past it. More is refused with 400 (each draw costs the tail's compute thread)."""
MAX_TIMING_ENTRIES: Final = MAX_ROUTE_HOPS
"""Most per-node timings one answer may carry (one per hop)."""
MAX_TOKEN_ID: Final = 1 << 31
"""Highest token id a draft may name."""


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
    logprobs: TokenLogprobs | None = None
    """With the token, when the session's sampling parameters ask for log-probabilities."""
    scored: Annotated[tuple[TokenLogprobs, ...], AsTuple, Field(max_length=MAX_REPLAY_IDS_PER_FRAME)] = ()
    """On a frame that asked (``X-Meshnet-Score``): the log-probability of each prompt token it named."""
    tokens: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1, max_length=MAX_DRAFT_TOKENS + 1)] | None = None
    """On a speculative frame (``X-Meshnet-Draft``): the verified run, the accepted drafted tokens then one
    the tail chose itself; ``token`` is its first. Every hop keeps the KV rows of the frame's first
    ``len(tokens)`` positions and drops the rest (the rejected drafts)."""
    run_logprobs: Annotated[list[TokenLogprobs], Field(max_length=MAX_DRAFT_TOKENS + 1)] | None = None
    """With ``tokens``, when the session asks for log-probabilities: one entry per token of the run."""
    unverified: bool | None = None
    """On a speculative frame's answer: ``true`` when a hop of the route does not take speculative frames (an
    older node), so the step went on as a plain one and its drafts were never judged (``tokens`` is one token)."""
    receipts: Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_RECEIPT_CHARS)]],
                        Field(min_length=1, max_length=MAX_CHAIN_RECEIPTS)] | None = None
    """The signed receipts of the step (:mod:`meshwire.receipts`): the answering hop's own, then those of every hop
    after it and of a shadow (issue 37), so the head holds the step's whole chain. Absent when no hop signs."""


@dataclass(frozen=True)
class Scoring:
    """What ``X-Meshnet-Score`` asks of the tail: the log-probability of ``ids[j]`` after position ``j`` of the
    frame, with the ``top`` likeliest alternatives (a completion echoing its prompt with log-probabilities)."""

    ids: tuple[int, ...]
    top: int

    def header(self) -> str:
        return f"{self.top}:{encode_ids(self.ids)}"

    @classmethod
    def parse(cls, value: str, tokens: int) -> Scoring:
        top, sep, ids = value.partition(":")
        if not sep or not top.isdigit() or int(top) > MAX_TOP_LOGPROBS:
            raise FrameError("bad_header", f"{h.SCORE} must be TOP:IDS with TOP in 0..{MAX_TOP_LOGPROBS}")
        return cls(decode_ids(ids, tokens, h.SCORE), int(top))


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
    """The ``X-Meshnet-Sampling`` JSON, passed along unread; only the tail parses it (:meth:`sampling_params`)."""
    sample_draws: int | None = None
    """On a failover replay: draws the session's sampler has already made."""
    sample_ids: tuple[int, ...] | None = None
    """On a replayed frame of a grammar-constrained session: the generated token ids among its positions."""
    score: Scoring | None = None
    """On a prompt frame whose tokens' log-probabilities the tail must report."""
    hold: str | None = None
    """On a prefill route: keep the session's KV for a handoff once its prompt ran, for the decode route whose
    digest this is (``X-Meshnet-Handoff-Hold``, :func:`~meshwire.kv_handoff.route_digest`)."""
    handoff: HandoffSource | None = None
    """On a decode route's first frame: where the prompt's KV is held, to pull before the step."""
    draft: tuple[int, ...] | None = None
    """On a speculative frame of ``k + 1`` positions: the ``k`` drafted tokens its positions 1..k hold. The
    tail verifies them against its own picks and answers the accepted run (:attr:`ForwardAnswer.tokens`)."""
    fork: ForkSource | None = None
    """On a session's first frame: open it with a copy of the first rows of another session of the same route
    (:mod:`meshwire.fork`)."""

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
        if self.sample_ids:
            out[h.SAMPLE_IDS] = encode_ids(self.sample_ids)
        if self.score is not None and self.score.ids:
            out[h.SCORE] = self.score.header()
        if self.hold is not None:
            out[HOLD] = self.hold
        if self.handoff is not None:
            out[HANDOFF_FROM] = self.handoff.header()
            if self.handoff.route is not None:
                out[HANDOFF_ROUTE] = self.handoff.route
        if self.draft is not None:
            out[h.DRAFT] = format_int_list(self.draft)
        if self.fork is not None:
            out[h.FORK_FROM] = self.fork.header()
        return out

    @property
    def wire_version(self) -> str:
        """The ``X-Meshnet-Wire`` of a frame of this step: a speculative one needs
        :data:`~meshwire.headers.SPECULATIVE_WIRE_VERSION`."""
        return h.WIRE_VERSION if self.draft is None else h.SPECULATIVE_WIRE_VERSION

    def for_next_hop(self, start_layer: int) -> StepInfo:
        """The same step, addressed to the next hop."""
        return replace(self, hop_index=self.hop_index + 1, start_layer=start_layer)

    def sampling_params(self) -> SamplingParams | None:
        """The sampling parameters this frame carries (``None`` if it carries none).

        Raises :class:`FrameError` (``bad_header``) when they are not valid.
        """
        if self.sampling is None:
            return None
        try:
            return SamplingParams.model_validate_json(self.sampling)
        except ValidationError as exc:
            raise FrameError("bad_header", f"{h.SAMPLING} is not valid sampling parameters: "
                                           f"{exc.errors()[0]['msg']}") from None


@dataclass(frozen=True)
class HopAddress:
    """What every frame says about where it is going: the route, the hop's index in it, its first layer."""

    route_token: str
    """The signed route (``X-Meshnet-Route``); empty when the header is missing (the route check refuses it)."""
    hop_index: int
    start_layer: int


@dataclass(frozen=True)
class CloseRequest:
    """A close frame: free ``session`` on this hop and pass the close on."""

    address: HopAddress
    session: str


@dataclass(frozen=True)
class DataRequest:
    """A data frame's headers, read: how to decode its body (``spec``) and where its step is (``info``)."""

    address: HopAddress
    spec: FrameSpec
    info: StepInfo

    @property
    def session(self) -> str:
        return self.spec.session

    @property
    def tokens(self) -> int:
        """Positions the frame carries (its shape is ``[1, tokens, hidden]``)."""
        return self.spec.shape[1]


ForwardRequest = CloseRequest | DataRequest


def parse_forward(headers: Mapping[str, str], limits: FrameLimits | None = None) -> ForwardRequest:
    """Read every header of one ``POST /forward`` frame (case-insensitive), before its body.

    Raises :class:`FrameError` on anything missing or malformed. The route's
    signature is not checked here (that needs the verifier's key); the frame's
    body is not read (``spec`` says how many bytes to expect).
    """
    address = HopAddress(
        route_token=get_header(headers, h.ROUTE) or "",
        hop_index=parse_int_header(h.HOP_INDEX, get_header(headers, h.HOP_INDEX), minimum=0,
                                   maximum=MAX_ROUTE_HOPS - 1),
        start_layer=parse_int_header(h.START_LAYER, get_header(headers, h.START_LAYER), minimum=0,
                                     maximum=MAX_LAYERS - 1),
    )
    control = get_header(headers, h.CONTROL)
    if control is not None:
        if control.strip().lower() != CLOSE:
            raise FrameError("bad_header", f"unknown {h.CONTROL} {control[:40]!r}; the only one is {CLOSE!r}")
        wire = get_header(headers, h.WIRE)
        if wire is None or wire.strip() != h.WIRE_VERSION:
            raise FrameError("wire_version", f"{h.WIRE} must be {h.WIRE_VERSION!r}")
        return CloseRequest(address, check_session_id(get_header(headers, h.SESSION)))
    spec = parse_frame_headers(headers, limits)
    if len(spec.shape) != 3 or spec.shape[0] != 1:
        raise FrameError("bad_shape", f"frame shape {list(spec.shape)} is not [1, tokens, hidden]")
    return DataRequest(address, spec, _step_info(headers, address, spec.shape[1]))


def _step_info(headers: Mapping[str, str], address: HopAddress, tokens: int) -> StepInfo:
    """A data frame's step headers; ``tokens`` is the frame's length (for the positions check).

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
    sample_ids = get_header(headers, h.SAMPLE_IDS)
    score = get_header(headers, h.SCORE)
    hold = get_header(headers, HOLD)
    handoff = get_header(headers, HANDOFF_FROM)
    draft = _draft(get_header(headers, h.DRAFT), tokens)
    fork = get_header(headers, h.FORK_FROM)
    if draft is not None and (get_header(headers, h.WIRE) or "").strip() != h.SPECULATIVE_WIRE_VERSION:
        raise FrameError("wire_version", f"a frame with {h.DRAFT} carries {h.WIRE} {h.SPECULATIVE_WIRE_VERSION!r}")
    return StepInfo(
        route_token=address.route_token,
        hop_index=address.hop_index,
        start_layer=address.start_layer,
        step=parse_int_header(h.STEP, get_header(headers, h.STEP), minimum=0, maximum=MAX_STEP),
        position_offset=offset,
        reserve=None if reserve is None else parse_int_header(h.RESERVE, reserve, minimum=1,
                                                              maximum=MAX_RESERVE_TOKENS),
        sampling=sampling,
        sample_draws=None if draws is None else parse_int_header(h.SAMPLE_DRAWS, draws, minimum=0,
                                                                 maximum=MAX_SAMPLE_DRAWS),
        sample_ids=None if sample_ids is None else decode_ids(sample_ids, tokens),
        score=None if score is None else Scoring.parse(score, tokens),
        hold=None if hold is None else parse_digest(hold),
        handoff=None if handoff is None else HandoffSource.parse(handoff, get_header(headers, HANDOFF_ROUTE)),
        draft=draft,
        fork=None if fork is None else ForkSource.parse(fork),
    )


def encode_ids(ids: tuple[int, ...]) -> str:
    """Token ids as ``X-Meshnet-Sample-Ids`` carries them: base64 of little-endian uint32."""
    return base64.b64encode(b"".join(token.to_bytes(4, "little") for token in ids)).decode("ascii")


def decode_ids(value: str, tokens: int, name: str = h.SAMPLE_IDS) -> tuple[int, ...]:
    """The ids of an ``X-Meshnet-Sample-Ids`` (or ``name``) header on a frame of ``tokens`` positions (at most
    that many)."""
    if len(value) > 4 * ((4 * MAX_REPLAY_IDS_PER_FRAME + 2) // 3):
        raise FrameError("bad_header", f"{name} holds more than {MAX_REPLAY_IDS_PER_FRAME} ids")
    try:
        raw = base64.b64decode(value.strip(), validate=True)
    except (ValueError, binascii.Error):
        raise FrameError("bad_header", f"{name} is not base64") from None
    if len(raw) % 4 or not raw:
        raise FrameError("bad_header", f"{name} is not a list of 4-byte token ids")
    ids = tuple(int.from_bytes(raw[i:i + 4], "little") for i in range(0, len(raw), 4))
    if len(ids) > tokens:
        raise FrameError("bad_header", f"{name} names {len(ids)} tokens, more than the frame's {tokens}")
    if max(ids) >= 1 << 31:
        raise FrameError("bad_header", f"{name} names a token id out of range")
    return ids


def _draft(value: str | None, tokens: int) -> tuple[int, ...] | None:
    """The drafted tokens of a speculative frame: one fewer than its positions, at most :data:`MAX_DRAFT_TOKENS`."""
    if value is None:
        return None
    draft = parse_int_list(h.DRAFT, value, max_items=MAX_DRAFT_TOKENS)
    if not draft or any(not 0 <= token < MAX_TOKEN_ID for token in draft):
        raise FrameError("bad_header", f"{h.DRAFT} must list 1-{MAX_DRAFT_TOKENS} token ids")
    if len(draft) != tokens - 1:
        raise FrameError("bad_header", f"{h.DRAFT} lists {len(draft)} drafted tokens; a frame of {tokens} positions "
                                       f"verifies {tokens - 1}")
    return draft


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
