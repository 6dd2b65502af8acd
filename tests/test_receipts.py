"""Receipts (:mod:`meshwire.receipts`, issue 37): a hop's signed statement of what it computed.

An honest receipt verifies with the hop key the route names; a forged one (a field changed, another key) and a
replayed one (shown for another route, session, step or positions, or shown twice) are refused.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from meshwire.receipts import (
    MAX_RECEIPT_AGE_S,
    MAX_RECEIPT_CHARS,
    Receipt,
    ReceiptProblem,
    SeenReceipts,
    answer_digest,
    make_receipt,
    parse_receipt,
    sha256_hex,
    verify_receipt,
)
from meshwire.route_keys import SigningKey, b64encode

HOP_KEY = SigningKey.generate()
STEP: dict[str, Any] = {"route_token": "route.token.signed", "session": "sess-1", "node_id": "back", "hop_index": 1,
                        "step": 3, "position_offset": 40, "positions": 1}
NOW = 1_800_000_000.0


def _receipt(**changes: Any) -> Receipt:
    return make_receipt(HOP_KEY, **{**STEP, **changes}, input_sha256=sha256_hex(b"frame in"),
                        output_sha256=answer_digest([17]), now=NOW)


def _verify(receipt: Receipt, key: SigningKey = HOP_KEY, **changes: Any) -> None:
    verify_receipt(receipt, key.private.public_key(), **{**STEP, **changes}, now=NOW + 1)


def test_an_honest_receipt_travels_as_one_line_and_verifies() -> None:
    receipt = _receipt()
    line = receipt.encode()
    assert "\n" not in line and len(line) <= MAX_RECEIPT_CHARS
    parsed = parse_receipt(line)
    assert parsed == receipt
    _verify(parsed)
    assert parsed.fields.output_sha256 == answer_digest([17]) != answer_digest([18])


def test_a_receipt_with_a_field_changed_is_refused_as_forged() -> None:
    receipt = _receipt()
    for name, value in (("output_sha256", answer_digest([18])), ("input_sha256", sha256_hex(b"other")),
                        ("step", 4), ("node_id", "mid")):
        forged = Receipt(fields=receipt.fields.model_copy(update={name: value}), signature=receipt.signature)
        with pytest.raises(ReceiptProblem, match="forged"):
            _verify(forged, **({name: value} if name in STEP else {}))


def test_a_receipt_signed_by_another_key_is_refused() -> None:
    other = SigningKey.generate()
    with pytest.raises(ReceiptProblem, match="forged"):
        _verify(make_receipt(other, **STEP, input_sha256=sha256_hex(b"x"), output_sha256=sha256_hex(b"y"), now=NOW))
    with pytest.raises(ReceiptProblem, match="forged"):
        _verify(_receipt(), key=other)


@pytest.mark.parametrize(("name", "value"), [("route_token", "another.route.token"), ("session", "sess-2"),
                                             ("step", 4), ("position_offset", 41), ("positions", 2),
                                             ("hop_index", 2)])
def test_a_receipt_shown_for_another_step_is_refused_as_a_replay(name: str, value: Any) -> None:
    with pytest.raises(ReceiptProblem, match="replay"):
        _verify(_receipt(), **{name: value})


def test_a_receipt_shown_twice_is_a_replay() -> None:
    seen = SeenReceipts(clock=lambda: NOW)
    receipt = _receipt()
    assert seen.first_time(receipt)
    assert not seen.first_time(parse_receipt(receipt.encode()))
    assert seen.first_time(_receipt(step=4))


def test_seen_receipts_are_bounded() -> None:
    seen = SeenReceipts(max_seen=8, clock=lambda: NOW)
    receipts = [_receipt(step=step) for step in range(20)]
    assert all(seen.first_time(receipt) for receipt in receipts)
    assert len(seen) <= 8


def test_a_stale_receipt_is_refused() -> None:
    receipt = make_receipt(HOP_KEY, **STEP, input_sha256=sha256_hex(b"a"), output_sha256=sha256_hex(b"b"),
                           now=time.time() - 2 * MAX_RECEIPT_AGE_S)
    with pytest.raises(ReceiptProblem, match="clock"):
        verify_receipt(receipt, HOP_KEY.private.public_key(), **STEP)


@pytest.mark.parametrize("line", ["", "nodot", "a" * (MAX_RECEIPT_CHARS + 1), f"{b64encode(b'{}')}.{'A' * 86}",
                                  f"{b64encode(b'not json')}.{'A' * 86}", "abc.def"])
def test_a_malformed_receipt_is_a_clear_error(line: str) -> None:
    with pytest.raises(ReceiptProblem, match="X-Meshnet-Receipt"):
        parse_receipt(line)
