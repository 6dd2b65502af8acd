"""Activation frames: bit-exact round trips, the reference wire format, and every refusal."""

from __future__ import annotations

import math
import struct
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshwire import headers as h
from meshwire.frames import (
    ITEMSIZE,
    TORCH_DTYPES,
    FrameError,
    FrameLimits,
    check_frame_headers,
    decode_frame,
    encode_frame,
    format_attn_mask,
    format_position_ids,
    format_shape,
    parse_attn_mask,
    parse_position_ids,
    parse_shape,
)

DTYPES = list(TORCH_DTYPES)


def raw_bytes(tensor: torch.Tensor) -> bytes:
    """The tensor's bit pattern, independent of float comparison rules (NaN != NaN)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def tensor_from_bits(data: bytes, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=TORCH_DTYPES[dtype]).reshape(shape)  # type: ignore[index]


def frame_headers(**overrides: str | None) -> dict[str, str]:
    """Valid headers of a 1x2x4 float32 frame, with some replaced (None removes one)."""
    base = {
        h.WIRE: h.WIRE_VERSION, h.SHAPE: "1,2,4", h.DTYPE: "float32", h.SESSION: "s-1",
        h.CHUNK_INDEX: "0", h.CHUNK_TOTAL: "1",
    }
    names = {"wire": h.WIRE, "shape": h.SHAPE, "dtype": h.DTYPE, "session": h.SESSION,
             "chunk_index": h.CHUNK_INDEX, "chunk_total": h.CHUNK_TOTAL, "encoding": h.ENCODING}
    for key, value in overrides.items():
        if value is None:
            base.pop(names[key], None)
        else:
            base[names[key]] = value
    return base


GOOD_BODY = bytes(1 * 2 * 4 * 4)
DEFAULT_LIMITS = FrameLimits()


def refusal(headers: dict[str, str], body: bytes, limits: FrameLimits = DEFAULT_LIMITS) -> str:
    with pytest.raises(FrameError) as caught:
        decode_frame(headers, body, limits)
    assert str(caught.value), "a refusal must say what is wrong"
    return caught.value.code


# --- round trips ---------------------------------------------------------------------

shapes = st.lists(st.integers(min_value=1, max_value=9), min_size=1, max_size=4).map(tuple)


@st.composite
def bit_patterns(draw: st.DrawFn) -> tuple[str, tuple[int, ...], bytes]:
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(shapes)
    size = math.prod(shape) * ITEMSIZE[dtype]
    return dtype, shape, draw(st.binary(min_size=size, max_size=size))


@settings(max_examples=150, deadline=None)
@given(pattern=bit_patterns(), encoding=st.sampled_from(["identity", "zlib"]))
def test_every_bit_pattern_of_every_dtype_round_trips_exactly(pattern, encoding):
    dtype, shape, data = pattern
    tensor = tensor_from_bits(data, dtype, shape)
    headers, body = encode_frame(tensor, session="sess", encoding=encoding)
    frame = decode_frame(headers, body)
    assert frame.tensor.dtype == TORCH_DTYPES[dtype]
    assert tuple(frame.tensor.shape) == shape
    assert raw_bytes(frame.tensor) == data


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("encoding", ["identity", "zlib"])
def test_nan_inf_signed_zero_and_subnormals_keep_their_bits(dtype, encoding):
    torch_dtype = TORCH_DTYPES[dtype]  # type: ignore[index]
    finfo = torch.finfo(torch_dtype)
    values = torch.tensor([math.nan, -math.nan, math.inf, -math.inf, 0.0, -0.0, finfo.tiny / 2, finfo.max],
                          dtype=torch.float32).to(torch_dtype).reshape(1, 2, 4)
    if dtype == "float32":  # a NaN with a non-default payload
        values.view(torch.int32)[0, 0, 0] = struct.unpack("<i", b"\x01\x00\xc0\x7f")[0]
    headers, body = encode_frame(values, session="specials", encoding=encoding)
    assert raw_bytes(decode_frame(headers, body).tensor) == raw_bytes(values)


def test_a_non_contiguous_tensor_is_sent_in_c_order():
    tensor = torch.arange(24, dtype=torch.float32).reshape(1, 4, 6).transpose(1, 2)
    headers, body = encode_frame(tensor, session="t")
    assert headers[h.SHAPE] == "1,6,4"
    assert torch.equal(decode_frame(headers, body).tensor, tensor)


def test_the_body_is_little_endian():
    _headers, body = encode_frame(torch.tensor([[[1.0]]], dtype=torch.float32), session="le")
    assert body == struct.pack("<f", 1.0)


def test_a_zlib_frame_is_smaller_for_compressible_data_and_says_so():
    tensor = torch.zeros(1, 64, 64)
    headers, body = encode_frame(tensor, session="z", encoding="zlib")
    assert headers[h.ENCODING] == "zlib"
    assert len(body) < tensor.numel() * 4


# --- the reference node server's wire format ------------------------------------------


def test_encoding_uses_the_reference_header_names_and_formats():
    tensor = torch.zeros(1, 7, 16, dtype=torch.bfloat16)
    headers, body = encode_frame(tensor, session="abc", chunk_index=2, chunk_total=3,
                                 extra={h.HOP_INDEX: "1", h.START_LAYER: "5"})
    assert headers == {
        "X-Meshnet-Wire": "2", "X-Meshnet-Shape": "1,7,16", "X-Meshnet-Dtype": "bfloat16",
        "X-Meshnet-Session": "abc", "X-Meshnet-Chunk-Index": "2", "X-Meshnet-Chunk-Total": "3",
        "X-Meshnet-Hop-Index": "1", "X-Meshnet-Start-Layer": "5",
    }
    assert len(body) == 7 * 16 * 2


def test_header_lookup_ignores_case_and_the_frame_keeps_every_meshnet_header():
    headers, body = encode_frame(torch.ones(1, 1, 2), session="case", extra={h.STEP: "4"})
    shouted = {key.upper(): value for key, value in headers.items()}
    shouted["Content-Type"] = "application/octet-stream"
    frame = decode_frame(shouted, body)
    assert frame.session == "case"
    assert frame.header("X-Meshnet-Step") == "4"
    assert frame.headers["x-meshnet-step"] == "4"
    assert "content-type" not in frame.headers


def test_shape_position_ids_and_attention_mask_helpers_round_trip():
    assert format_shape((1, 7, 576)) == "1,7,576"
    assert parse_shape("1,7,576") == (1, 7, 576)
    assert parse_shape(" 1, 7 ,576 ") == (1, 7, 576)
    assert parse_position_ids(format_position_ids(range(5, 9))) == (5, 6, 7, 8)
    assert parse_attn_mask(format_attn_mask([1, 1, 0])) == (1, 1, 0)
    assert parse_position_ids("") == ()


@pytest.mark.parametrize("value", ["1,x", "1;2", "1.5", "0x10", "١"])
def test_malformed_position_ids_are_refused(value):
    with pytest.raises(FrameError) as caught:
        parse_position_ids(value)
    assert caught.value.code == "bad_header"


def test_negative_positions_and_non_binary_masks_are_refused():
    with pytest.raises(FrameError):
        parse_position_ids("0,-1")
    with pytest.raises(FrameError):
        parse_attn_mask("1,2")


def test_a_position_list_longer_than_the_limit_is_refused():
    with pytest.raises(FrameError):
        parse_position_ids(",".join(["1"] * 70_000))


# --- refusals, one class at a time ------------------------------------------------------


@pytest.mark.parametrize("body", [GOOD_BODY[:-1], GOOD_BODY + b"\x00", b""])
def test_a_body_whose_length_is_not_shape_times_itemsize_is_bad_length(body):
    assert refusal(frame_headers(), body) == "bad_length"


@pytest.mark.parametrize("dtype", ["int8", "float64", "FLOAT32", "", None])
def test_an_unknown_or_missing_dtype_is_unknown_dtype(dtype):
    assert refusal(frame_headers(dtype=dtype), GOOD_BODY) == "unknown_dtype"


@pytest.mark.parametrize("shape", ["", None, "1,,4", "0,8", "-1,8", "a,b", "1,2,3,4,5", "2097152", "8.0"])
def test_a_malformed_or_absurd_shape_is_bad_shape(shape):
    assert refusal(frame_headers(shape=shape), GOOD_BODY) == "bad_shape"


def test_a_shape_over_the_byte_limit_is_too_large():
    assert refusal(frame_headers(shape="1,1024,1024"), b"", FrameLimits(max_bytes=1 << 20)) == "too_large"


@pytest.mark.parametrize(("index", "total"), [("1", "1"), ("0", "0"), ("-1", "2"), ("0", "5000"),
                                              ("x", "1"), ("0", "1.0"), (None, "1"), ("0", None)])
def test_chunk_index_and_total_must_be_integers_with_index_below_total(index, total):
    assert refusal(frame_headers(chunk_index=index, chunk_total=total), GOOD_BODY) == "bad_chunk"


@pytest.mark.parametrize("encoding", ["gzip", "br", "zlib2"])
def test_an_unknown_encoding_is_bad_encoding(encoding):
    assert refusal(frame_headers(encoding=encoding), GOOD_BODY) == "bad_encoding"


def test_a_body_that_does_not_decompress_is_bad_encoding():
    assert refusal(frame_headers(encoding="zlib"), b"this is not zlib data at all") == "bad_encoding"


def test_a_truncated_or_padded_zlib_body_is_bad_encoding():
    compressed = zlib.compress(GOOD_BODY)
    assert refusal(frame_headers(encoding="zlib"), compressed[:-3]) == "bad_encoding"
    assert refusal(frame_headers(encoding="zlib"), compressed + b"junk") == "bad_encoding"


def test_a_zlib_body_that_inflates_to_another_size_is_bad_length():
    assert refusal(frame_headers(encoding="zlib"), zlib.compress(GOOD_BODY + b"\x00" * 4)) == "bad_length"
    assert refusal(frame_headers(encoding="zlib"), zlib.compress(GOOD_BODY[:-4])) == "bad_length"


def test_a_zip_bomb_is_refused_after_inflating_no_more_than_the_announced_size():
    bomb = zlib.compress(bytes(64 << 20), 9)  # 64 MiB of zeros in ~64 KiB
    headers = frame_headers(shape="1,256,1024", encoding="zlib")  # announces 1 MiB
    assert refusal(headers, bomb) == "bad_length"


def test_a_compressed_body_larger_than_its_content_could_be_is_too_large():
    assert refusal(frame_headers(encoding="zlib"), bytes(4096)) == "too_large"


@pytest.mark.parametrize("session", [None, "", "has space", "semi;colon", "x" * 129])
def test_a_missing_or_malformed_session_is_bad_header(session):
    assert refusal(frame_headers(session=session), GOOD_BODY) == "bad_header"


@pytest.mark.parametrize("wire", [None, "1", "4", ""])  # "3" is the speculative frames' version
def test_another_wire_version_is_wire_version(wire):
    assert refusal(frame_headers(wire=wire), GOOD_BODY) == "wire_version"


# --- checks before the body is read --------------------------------------------------------


def test_headers_alone_refuse_a_content_length_that_cannot_match():
    with pytest.raises(FrameError) as caught:
        check_frame_headers(frame_headers(), content_length=31, limits=FrameLimits())
    assert caught.value.code == "bad_length"


def test_headers_alone_accept_a_good_frame_and_an_unknown_length():
    check_frame_headers(frame_headers(), content_length=32, limits=FrameLimits())
    check_frame_headers(frame_headers(), content_length=None, limits=FrameLimits())


def test_headers_alone_refuse_an_oversized_frame():
    with pytest.raises(FrameError) as caught:
        check_frame_headers(frame_headers(shape="1,4096,4096"), content_length=None,
                            limits=FrameLimits(max_bytes=1 << 20))
    assert caught.value.code == "too_large"


# --- the sender refuses what a receiver would ------------------------------------------------


def test_encoding_an_unsupported_dtype_is_refused():
    with pytest.raises(FrameError) as caught:
        encode_frame(torch.zeros(1, 2, dtype=torch.int64), session="s")
    assert caught.value.code == "unknown_dtype"


def test_extra_headers_may_not_override_the_frames_own():
    with pytest.raises(ValueError, match="override"):
        encode_frame(torch.zeros(1, 2), session="s", extra={"x-meshnet-shape": "9"})


def test_encoding_a_bad_chunk_index_is_refused():
    with pytest.raises(FrameError) as caught:
        encode_frame(torch.zeros(1, 2), session="s", chunk_index=1, chunk_total=1)
    assert caught.value.code == "bad_chunk"
