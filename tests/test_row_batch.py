"""meshwire.row_batch: several frames in one request, and their answers, row by row."""

from __future__ import annotations

import struct

import orjson
import pytest
import torch

from meshwire import headers as h
from meshwire.frames import FrameError, decode_frame, encode_frame
from meshwire.row_batch import MAX_ROWS, RowAnswer, decode_answers, decode_rows, encode_answers, encode_rows


def rows(count: int) -> list[tuple[dict[str, str], bytes]]:
    return [encode_frame(torch.full((1, 1, 8), float(i)), session=f"s-{i}", extra={h.STEP: str(i)})
            for i in range(count)]


def test_a_batch_carries_each_frame_whole_and_in_order() -> None:
    sent = rows(3)
    received = decode_rows(encode_rows(sent))
    assert [dict(r.headers) for r in received] == [headers for headers, _ in sent]
    for i, row in enumerate(received):
        frame = decode_frame(row.headers, row.body)
        assert frame.session == f"s-{i}" and torch.equal(frame.tensor, torch.full((1, 1, 8), float(i)))


@pytest.mark.parametrize("body", [
    b"", b"\x00\x00", struct.pack(">I", 1 << 30) + b"{}", struct.pack(">I", 2) + b"{}",
    struct.pack(">I", 11) + b'{"rows":[]}', struct.pack(">I", 9) + b"not json!",
], ids=["empty", "short", "huge index", "no rows key", "no rows", "not json"])
def test_a_malformed_batch_is_refused_naming_the_problem(body: bytes) -> None:
    with pytest.raises(FrameError):
        decode_rows(body)


def test_row_lengths_must_add_up_to_the_body() -> None:
    body = encode_rows(rows(2))
    with pytest.raises(FrameError, match="add up"):
        decode_rows(body + b"x")
    with pytest.raises(FrameError, match="add up"):
        decode_rows(body[:-1])


def test_a_batch_is_bounded_in_rows() -> None:
    with pytest.raises(ValueError, match=str(MAX_ROWS)):
        encode_rows(rows(1) * (MAX_ROWS + 1))
    index = orjson.dumps({"rows": [{"headers": {}, "length": 0}] * (MAX_ROWS + 1)})
    with pytest.raises(FrameError, match="rows"):
        decode_rows(struct.pack(">I", len(index)) + index)


def test_answers_come_back_one_per_row() -> None:
    answers = [RowAnswer(status=200, body={"token": 5, "node_timings_ms": {}}),
               RowAnswer(status=503, body={"error": {"code": "kv_budget"}}, retry_after="2")]
    assert decode_answers(encode_answers(answers), 2) == answers
    with pytest.raises(ValueError, match="3 frames"):
        decode_answers(encode_answers(answers), 3)
    with pytest.raises(ValueError):
        decode_answers(b"[1, 2]", 2)
