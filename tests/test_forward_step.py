"""The step headers a grammar-constrained replay and an echoed prompt add: written once, read back, bounded."""

from __future__ import annotations

import pytest

from meshwire import headers as h
from meshwire.forward_step import Scoring, StepInfo, decode_ids, encode_ids, parse_forward
from meshwire.frames import FrameError
from meshwire.sampling_params import MAX_REPLAY_IDS_PER_FRAME

FRAME_HEADERS = {h.WIRE: h.WIRE_VERSION, h.SHAPE: "1,3,8", h.DTYPE: "float32", h.SESSION: "s-1",
                 h.HOP_INDEX: "1", h.START_LAYER: "2", h.CHUNK_INDEX: "0", h.CHUNK_TOTAL: "1"}


def step(**fields: object) -> StepInfo:
    return StepInfo(route_token="r", hop_index=1, start_layer=2, step=0, position_offset=0, **fields)  # type: ignore[arg-type]


def test_sample_ids_and_a_scoring_survive_the_trip_through_headers() -> None:
    info = step(sample_draws=2, sample_ids=(7, 1 << 30), score=Scoring((5, 6, 0), 3))
    parsed = parse_forward({**FRAME_HEADERS, **info.headers()})
    assert parsed.info.sample_ids == (7, 1 << 30)  # type: ignore[union-attr]
    assert parsed.info.score == Scoring((5, 6, 0), 3)  # type: ignore[union-attr]
    assert parsed.info.for_next_hop(3).score == info.score  # type: ignore[union-attr]


@pytest.mark.parametrize(("name", "value", "problem"), [
    (h.SAMPLE_IDS, "not base64!", "base64"),
    (h.SAMPLE_IDS, encode_ids((1, 2, 3, 4)), "more than the frame's 3"),
    (h.SAMPLE_IDS, "AAA=", "4-byte"),
    (h.SCORE, "21:" + encode_ids((1,)), "TOP:IDS"),
    (h.SCORE, encode_ids((1,)), "TOP:IDS"),
    (h.SCORE, "2:" + encode_ids((0xFFFFFFFF,)), "out of range"),
])
def test_a_malformed_header_is_a_frame_error_naming_it(name: str, value: str, problem: str) -> None:
    with pytest.raises(FrameError) as refused:
        parse_forward({**FRAME_HEADERS, h.STEP: "0", h.POSITION_OFFSET: "0", h.ROUTE: "r", name: value})
    assert refused.value.code == "bad_header" and problem in str(refused.value) and name in str(refused.value)


def test_a_header_over_the_bound_is_refused_before_it_is_decoded() -> None:
    with pytest.raises(FrameError, match=f"more than {MAX_REPLAY_IDS_PER_FRAME} ids"):
        decode_ids(encode_ids(tuple(range(MAX_REPLAY_IDS_PER_FRAME + 1))), 1 << 20)
