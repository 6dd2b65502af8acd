"""The book of revoked node ids (services.tracker.revocations): bounded, aged out, newest told first."""

from __future__ import annotations

import asyncio

from meshwire.registry import MAX_REVOKED_NOTICE
from services.tracker.registry import RegistryPolicy
from services.tracker.revocations import KEEP_S, MAX_REVOKED, Revocations
from services.tracker.store.memory import MemoryStore


def test_a_revocation_is_forgotten_after_a_day_and_the_oldest_past_the_bound() -> None:
    book = Revocations()
    book.add("old", 0.0)
    book.add("new", KEEP_S)
    assert "old" in book and book.among(["old", "new", "other"]) == {"old", "new"}
    book.prune(KEEP_S + 1.0)
    assert "old" not in book and "new" in book
    for index in range(MAX_REVOKED + 5):
        book.add(f"n{index}", KEEP_S + index)
    assert len(book) == MAX_REVOKED and "new" not in book and f"n{MAX_REVOKED + 4}" in book


def test_a_heartbeat_answer_names_the_newest_revocations_within_its_bound() -> None:
    book = Revocations()
    for index in range(MAX_REVOKED_NOTICE + 10):
        book.add(f"n{index:05d}", float(index))
    told = book.notice()
    assert len(told) == MAX_REVOKED_NOTICE and "n00000" not in told and f"n{MAX_REVOKED_NOTICE + 9:05d}" in told


def test_a_node_that_joins_again_by_a_valid_token_is_no_longer_revoked() -> None:
    store = MemoryStore(RegistryPolicy())

    async def run() -> None:
        await store.revoke_node("a", 1.0)
        assert "a" in store.revocations
        await store.lift_revocation("a")
        assert "a" not in store.revocations

    asyncio.run(run())
