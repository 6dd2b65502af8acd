"""The session table: the KV budget admits what it can finish, refuses the rest, and frees on close or idleness."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from services.node.engine.sessions import SessionExists, SessionRefused, SessionTable

BUDGET = 100


@dataclass
class FakeCache:
    """A KV cache holding ``seq_len`` tokens of 10 bytes each."""

    seq_len: int = 0

    def nbytes(self) -> int:
        return self.seq_len * 10


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def table(clock: Clock) -> SessionTable:
    return SessionTable(kv_budget_tokens=BUDGET, max_sessions=3, idle_timeout_s=60, clock=clock)


def test_a_session_reserves_its_tokens_from_the_budget(table: SessionTable) -> None:
    table.open("a", 30, FakeCache())
    assert (table.reserved_tokens, table.free_tokens, len(table)) == (30, 70, 1)


def test_a_session_that_does_not_fit_the_budget_is_refused_with_a_retry_hint(table: SessionTable) -> None:
    table.open("a", 80, FakeCache())
    with pytest.raises(SessionRefused) as refused:
        table.open("b", 30, FakeCache())
    assert refused.value.code == "kv_budget" and refused.value.retry_after_s > 0
    assert "b" not in table


def test_closing_a_session_releases_its_reservation_for_the_next(table: SessionTable) -> None:
    table.open("a", 80, FakeCache())
    assert table.close("a")
    table.open("b", 90, FakeCache())
    assert table.free_tokens == 10


def test_a_session_count_over_the_maximum_is_refused(table: SessionTable) -> None:
    for name in "abc":
        table.open(name, 1, FakeCache())
    with pytest.raises(SessionRefused) as refused:
        table.open("d", 1, FakeCache())
    assert refused.value.code == "too_many_sessions"


def test_the_same_session_id_cannot_be_opened_twice(table: SessionTable) -> None:
    table.open("a", 10, FakeCache())
    with pytest.raises(SessionExists):
        table.open("a", 10, FakeCache())


def test_a_session_may_grow_past_its_reservation_only_while_the_budget_has_room(table: SessionTable) -> None:
    session = table.open("a", 10, FakeCache())
    table.open("b", 60, FakeCache())
    table.ensure_room(session, 40)
    assert session.reserved_tokens == 40
    with pytest.raises(SessionRefused):
        table.ensure_room(session, 41)


def test_used_tokens_and_bytes_count_what_the_caches_hold(table: SessionTable) -> None:
    table.open("a", 50, FakeCache(seq_len=7))
    table.open("b", 20, FakeCache(seq_len=3))
    assert (table.used_tokens, table.cache_bytes()) == (10, 100)


def test_an_idle_session_is_swept_and_a_recent_one_is_kept(table: SessionTable, clock: Clock) -> None:
    table.open("old", 10, FakeCache())
    clock.now += 50
    fresh = table.open("fresh", 10, FakeCache())
    clock.now += 20
    table.touch(fresh)
    assert table.sweep() == ["old"]
    assert "fresh" in table and table.reserved_tokens == 10


async def test_a_session_in_the_middle_of_a_step_is_not_swept(table: SessionTable, clock: Clock) -> None:
    session = table.open("busy", 10, FakeCache())
    clock.now += 120
    async with session.lock:
        assert table.sweep() == []
    assert table.sweep() == ["busy"]


def test_a_draining_node_refuses_new_sessions(table: SessionTable) -> None:
    table.drain()
    with pytest.raises(SessionRefused) as refused:
        table.open("a", 1, FakeCache())
    assert refused.value.code == "draining"


def test_a_closed_session_is_marked_closed_for_anyone_still_holding_it(table: SessionTable) -> None:
    session = table.open("a", 10, FakeCache())
    table.close("a")
    assert session.closed and not table.close("a")
