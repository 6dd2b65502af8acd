"""A step's outcome, handed from whoever computed it to the session waiting for it.

The step engine and the row sender both work for many sessions at once and
give each its own outcome: a result, or the exception that is that session's
alone. :func:`settle` delivers one to the session's future, unless the
session went away meanwhile (its future cancelled); :func:`outcome_of`
captures one from an awaitable without letting it escape to the others.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


def settle(future: asyncio.Future[T], outcome: T | BaseException) -> None:
    """Give ``future`` its ``outcome`` (an exception is raised to its waiter); nothing if it is already done."""
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


async def outcome_of(call: Awaitable[T]) -> T | BaseException:
    """The result of ``call``, or the exception it raised, as a value."""
    try:
        return await call
    except Exception as exc:  # noqa: BLE001 - handed to the one session it belongs to
        return exc
