"""The relay's binary messages and addresses, without a network."""

from __future__ import annotations

import pytest

from meshwire import limits
from meshwire.envelope import EnvelopeError, RelayRequest, RelayResponse, encode_mux
from meshwire.relay_client import (
    BACKOFF_JITTER,
    MuxError,
    MuxRequest,
    MuxResponse,
    MuxSignal,
    RelayError,
    backoff_delay,
    mux_url,
    peek_mux_id,
    read_mux,
    rpc_address,
    write_mux,
    ws_base,
)


def test_a_request_survives_encoding_with_its_body_untouched() -> None:
    body = bytes(range(256)) * 9
    message = MuxRequest(id=7, method="POST", path="/forward", headers={"X-Meshnet-Session": "s1"}, timeout_s=5.0)
    decoded, decoded_body = read_mux(write_mux(message, body))
    assert decoded == message
    assert decoded_body == body


def test_every_kind_of_message_is_told_apart_by_its_kind() -> None:
    messages = [
        MuxResponse(id=1, status=200, headers={"content-type": "application/json"}),
        MuxError(id=2, code="peer_disconnected", message="gone"),
        MuxSignal(kind="cancel", id=3),
        MuxSignal(kind="ping", id=4),
        MuxSignal(kind="pong", id=5),
    ]
    for message in messages:
        assert read_mux(write_mux(message))[0] == message


def test_a_header_of_an_unknown_kind_is_refused() -> None:
    with pytest.raises(EnvelopeError, match="kind"):
        read_mux(encode_mux({"kind": "teleport", "id": 1}, b""))


def test_a_request_without_a_method_is_refused_naming_the_field() -> None:
    with pytest.raises(EnvelopeError, match="method"):
        read_mux(encode_mux({"kind": "request", "id": 1, "path": "/forward"}, b""))


def test_a_control_message_may_not_carry_a_body() -> None:
    with pytest.raises(EnvelopeError, match="no body"):
        read_mux(encode_mux({"kind": "ping", "id": 1}, b"payload"))


def test_a_message_over_the_bound_is_refused_but_its_id_can_still_be_read() -> None:
    data = write_mux(MuxRequest(id=42, method="POST", path="/forward"), b"x" * 5000)
    with pytest.raises(EnvelopeError) as refused:
        read_mux(data, max_bytes=4096)
    assert refused.value.code == "too_large"
    assert peek_mux_id(data) == 42


def test_the_id_of_garbage_is_unknown() -> None:
    assert peek_mux_id(b"\x00\x00\x00\x05{oops") is None


def test_the_relay_addr_of_a_peer_is_its_rpc_url_and_the_mux_url_sits_beside_it() -> None:
    address = rpc_address("http://relay.example:8001/", "node-b")
    assert address == "ws://relay.example:8001/rpc/node-b"
    assert mux_url(address) == "ws://relay.example:8001/mux/node-b"
    assert mux_url("wss://relay.example/mesh/rpc/n1") == "wss://relay.example/mesh/mux/n1"


def test_an_address_that_is_not_an_rpc_url_is_refused_clearly() -> None:
    with pytest.raises(RelayError) as refused:
        mux_url("http://node-b:8100/forward")
    assert refused.value.code == "bad_request"
    assert "rpc" in str(refused.value)


def test_a_relay_url_must_be_a_websocket_or_http_url() -> None:
    assert ws_base("https://relay") == "wss://relay"
    with pytest.raises(ValueError, match="relay URL"):
        ws_base("relay:8001")


def test_backoff_grows_to_its_ceiling_and_is_jittered_below_it() -> None:
    delays = [backoff_delay(attempt, initial_s=0.25, max_s=4.0) for attempt in range(12)]
    assert all(0 < delay <= 4.0 for delay in delays)
    assert delays[0] <= 0.25
    assert delays[-1] >= 4.0 * (1 - BACKOFF_JITTER)


def test_a_mux_answer_with_a_header_over_the_bound_is_refused_naming_the_header() -> None:
    header = {"kind": "response", "id": 3, "status": 200, "headers": {"x-big": "a" * (limits.MAX_HEADER_VALUE_CHARS + 1)}}
    with pytest.raises(EnvelopeError, match="x-big") as refused:
        read_mux(encode_mux(header, b""))
    assert refused.value.code == "bad_header"


def test_an_envelope_answer_that_breaks_a_bound_is_an_envelope_error_naming_it() -> None:
    with pytest.raises(EnvelopeError, match="x-big") as refused:
        RelayResponse.of(200, {"x-big": "a" * (limits.MAX_HEADER_VALUE_CHARS + 1)}, b"")
    assert refused.value.code == "bad_envelope"
    with pytest.raises(EnvelopeError, match="headers"):
        RelayRequest.of("r1", "POST", "/forward", {f"h{i}": "v" for i in range(limits.RELAY_MAX_HEADERS + 1)}, b"")
