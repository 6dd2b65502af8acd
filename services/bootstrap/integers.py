"""Integers as the reference server reads them, and its Euclidean arithmetic.

The reference (Rust) parses a registration's integers with ``as_i64`` or, for
a string, ``trim().parse::<i64>()``: a JSON integer or a string of ASCII
digits with an optional sign and surrounding whitespace, within the signed
64-bit range. A JSON boolean or a float (even ``7000.0``) is not an integer.
It divides with ``div_euclid`` / ``rem_euclid``, which equal Python's ``//``
and ``%`` for a positive divisor and keep the remainder non-negative for a
negative one.
"""

from __future__ import annotations

import enum
import re
from typing import Final

from services.bootstrap.refusals import Refusal, missing, not_an_integer

I64_MIN: Final = -(1 << 63)
I64_MAX: Final = (1 << 63) - 1
_DIGITS: Final = re.compile(r"[+-]?[0-9]+")


class Absent(enum.Enum):
    """Marks a key missing from a JSON object (distinct from a JSON ``null``)."""

    ABSENT = "absent"


ABSENT: Final = Absent.ABSENT


def _in_range(value: int) -> bool:
    return I64_MIN <= value <= I64_MAX


def parse_text_integer(text: str) -> int | None:
    """``text.trim().parse::<i64>()``: the integer ``text`` spells, or ``None``."""
    stripped = text.strip()
    if not _DIGITS.fullmatch(stripped):
        return None
    value = int(stripped)
    return value if _in_range(value) else None


def json_integer(value: object, name: str) -> int:
    """Read the registration value ``name``: a JSON integer or a string of one.

    ``value`` is what the JSON object holds, or :data:`ABSENT` when it has
    no such key (a JSON ``null`` is present, and not an integer). Raises
    :class:`Refusal` 500 ``missing NAME`` or ``NAME is not an integer``.
    """
    if value is ABSENT:
        raise Refusal.internal(missing(name))
    if isinstance(value, int) and not isinstance(value, bool) and _in_range(value):
        return value
    if isinstance(value, str):
        parsed = parse_text_integer(value)
        if parsed is not None:
            return parsed
    raise Refusal.internal(not_an_integer(name))


def query_integer(text: str, name: str) -> int:
    """Read the query parameter ``name``; 500 ``NAME is not an integer`` when it is not one."""
    parsed = parse_text_integer(text)
    if parsed is None:
        raise Refusal.internal(not_an_integer(name))
    return parsed


def div_euclid(value: int, divisor: int) -> int:
    """Rust's ``i64::div_euclid``: the quotient whose remainder is never negative."""
    quotient = value // divisor
    return quotient + 1 if divisor < 0 and value % divisor != 0 else quotient


def rem_euclid(value: int, divisor: int) -> int:
    """Rust's ``i64::rem_euclid``: the remainder in ``0 .. |divisor|``."""
    return value - divisor * div_euclid(value, divisor)
