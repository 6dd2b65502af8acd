"""Relay messages: the reference JSON envelope and the binary mux codec, bounded and refusing junk."""

from __future__ import annotations

import base64
import json
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshwire import limits
from meshwire.envelope import (
    EnvelopeError,
    RelayRequest,
    RelayResponse,
    decode_mux,
    decode_request,
    decode_response,
    encode_mux,
)


def reference_request(body: bytes) -> str:
    """Exactly what the reference node's ``_relay_hop`` sends."""
    return json.dumps({
        "request_id": "18b2f0c1a2b3c4d5", "method": "POST", "path": "/forward",
        "headers": {"X-Meshnet-Shape": "1,1,4", "X-Meshnet-Dtype": "float32"},
        "body_base64": base64.b64encode(body).decode(),
    })


def envelope_refusal(raw: str | bytes, decode=decode_request, **kwargs) -> str:
    with pytest.raises(EnvelopeError) as caught:
        decode(raw, **kwargs)
    assert str(caught.value)
    return caught.value.code


# --- JSON envelope ------------------------------------------------------------------------


def test_the_reference_request_envelope_parses_and_its_body_decodes():
    request = decode_request(reference_request(b"\x00\x01\x02\xff"))
    assert (request.method, request.path) == ("POST", "/forward")
    assert request.headers["X-Meshnet-Dtype"] == "float32"
    assert request.body() == b"\x00\x01\x02\xff"


@settings(max_examples=50, deadline=None)
@given(body=st.binary(max_size=2048), status=st.integers(min_value=100, max_value=599))
def test_request_and_response_envelopes_round_trip_any_body(body, status):
    request = RelayRequest.of("r1", "POST", "/forward", {"A": "b"}, body)
    assert decode_request(request.model_dump_json()).body() == body
    response = RelayResponse.of(status, {"content-type": "application/json"}, body, request_id="r1")
    assert decode_response(response.model_dump_json()).body_bytes() == body


def test_a_response_without_request_id_and_with_the_reference_text_body_fallback_parses():
    response = decode_response('{"status": 502, "headers": {}, "body": "peer gone"}')
    assert response.request_id is None and response.body_bytes() == b"peer gone"


@pytest.mark.parametrize("mutation", [
    {"method": "BREW"},
    {"path": "forward"},
    {"path": "/has space"},
    {"request_id": ""},
    {"body_base64": 5},
    {"headers": {f"h{i}": "v" for i in range(limits.RELAY_MAX_HEADERS + 1)}},
    {"headers": {"A": 1}},
    {"surprise": True},
], ids=["method", "relative-path", "space-in-path", "empty-id", "body-not-string", "too-many-headers",
        "non-string-header", "unknown-key"])
def test_a_malformed_request_envelope_is_refused(mutation):
    raw = json.loads(reference_request(b"x"))
    raw.update(mutation)
    assert envelope_refusal(json.dumps(raw)) == "bad_envelope"


def test_a_body_that_is_not_base64_is_refused_when_read():
    raw = json.loads(reference_request(b"x"))
    raw["body_base64"] = "@@not-base64@@"
    with pytest.raises(EnvelopeError) as caught:
        decode_request(json.dumps(raw)).body()
    assert caught.value.code == "bad_envelope"


@pytest.mark.parametrize("raw", ["", "not json", "[]", "null", '{"status": 99}', '{"status": "200"}'])
def test_junk_responses_are_refused(raw):
    assert envelope_refusal(raw, decode=decode_response) == "bad_envelope"


def test_an_envelope_over_the_byte_limit_is_refused_before_parsing():
    assert envelope_refusal(reference_request(bytes(1024)), max_bytes=512) == "too_large"


# --- binary mux ---------------------------------------------------------------------------

headers_json = st.dictionaries(st.text(max_size=20), st.one_of(st.integers(min_value=-(1 << 63), max_value=(1 << 63) - 1), st.text(max_size=40), st.none()),
                               max_size=8)


@settings(max_examples=100, deadline=None)
@given(header=headers_json, body=st.binary(max_size=4096))
def test_any_header_and_body_round_trip_through_the_mux_codec(header, body):
    assert decode_mux(encode_mux(header, body)) == (header, body)


def test_the_mux_prefix_is_a_big_endian_u32_header_length():
    message = encode_mux({"id": 7}, b"BODY")
    (length,) = struct.unpack(">I", message[:4])
    assert message[4:4 + length] == b'{"id":7}' and message[4 + length:] == b"BODY"


@pytest.mark.parametrize(("message", "code"), [
    (b"", "truncated"),
    (b"\x00\x00\x00", "truncated"),
    (struct.pack(">I", 100) + b"{}", "truncated"),
    (struct.pack(">I", limits.RELAY_MAX_HEADER_JSON_BYTES + 1) + b"{}", "too_large"),
    (struct.pack(">I", 3) + b"{x}", "bad_header"),
    (struct.pack(">I", 2) + b"[]", "bad_header"),
    (struct.pack(">I", 0), "bad_header"),
])
def test_a_malformed_mux_message_is_refused(message, code):
    with pytest.raises(EnvelopeError) as caught:
        decode_mux(message)
    assert caught.value.code == code


def test_a_mux_message_over_the_byte_limit_is_refused():
    with pytest.raises(EnvelopeError) as caught:
        decode_mux(encode_mux({}, bytes(1000)), max_bytes=100)
    assert caught.value.code == "too_large"


def test_an_oversized_mux_header_is_refused_when_encoding():
    with pytest.raises(EnvelopeError):
        encode_mux({"x": "y" * limits.RELAY_MAX_HEADER_JSON_BYTES}, b"")


def test_a_mux_header_that_json_cannot_carry_is_refused_when_encoding():
    with pytest.raises(EnvelopeError) as caught:
        encode_mux({"id": 1 << 70}, b"")
    assert caught.value.code == "bad_header"
