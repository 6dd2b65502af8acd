"""A node's route keys: a key the tracker made moments after the node last fetched is still accepted."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from meshwire.route_keys import KeySet, SigningKey, jwks_of
from services.node.hop import trust
from services.node.hop.trust import RouteTrust

WINDOW_S = 0.2
"""The refetch window in these tests (the node's is :data:`services.node.hop.trust.MIN_REFRESH_S`)."""


def keys_of(*signing: SigningKey) -> KeySet:
    return KeySet.parse(jwks_of(list(signing)).model_dump_json())


def test_a_key_made_just_after_a_fetch_is_fetched_once_the_window_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trust, "MIN_REFRESH_S", WINDOW_S)
    old, new = SigningKey.generate(), SigningKey.generate()
    published = [keys_of(old)]
    fetches: list[int] = []

    async def fetch() -> KeySet:
        fetches.append(1)
        return published[-1]

    async def scenario() -> RouteTrust:
        keys = RouteTrust(KeySet(), fetch)
        await keys.refresh()  # at registration: the old key only
        published.append(keys_of(new))  # the store restarted empty: the trackers made a new key
        await keys.ensure_kid(new.kid)  # within the window of the last fetch: waits it out, then fetches
        return keys

    keys = asyncio.run(scenario())
    assert new.kid in keys.keys and len(fetches) == 2


def test_a_flood_of_unknown_key_ids_shares_one_fetch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trust, "MIN_REFRESH_S", WINDOW_S)
    fetches: list[int] = []

    async def fetch() -> KeySet:
        fetches.append(1)
        return KeySet()

    async def scenario() -> None:
        keys = RouteTrust(KeySet(), fetch)
        await asyncio.gather(*(keys.ensure_kid(f"forged-{i}") for i in range(200)))

    asyncio.run(scenario())
    assert len(fetches) == 1  # every made-up id waited on the same fetch: no queue of fetches, no lock held


def test_a_real_new_key_is_adopted_while_a_flood_of_made_up_ids_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Finding 6 of issue 34: made-up key ids used to take the lock and wait out the window one after another,
    so a route signed with a real new key waited behind all of them."""
    monkeypatch.setattr(trust, "MIN_REFRESH_S", WINDOW_S)
    old, new = SigningKey.generate(), SigningKey.generate()
    published = [keys_of(old)]
    started: list[float] = []

    async def fetch() -> KeySet:
        started.append(time.monotonic())
        await asyncio.sleep(0)
        return published[-1]

    async def scenario() -> tuple[bool, int, int]:
        keys = RouteTrust(KeySet(), fetch)
        await keys.refresh()
        stop = asyncio.Event()

        async def flood() -> int:
            sent = 0
            while not stop.is_set():
                await asyncio.gather(*(keys.ensure_kid(f"forged-{sent + i}") for i in range(50)))
                sent += 50
            return sent

        flooding = asyncio.create_task(flood())
        while len(started) < 2:  # the flood is under way: it made the tracker's keys be fetched once already
            await asyncio.sleep(WINDOW_S / 10)
        published.append(keys_of(old, new))  # the trackers rotate while the flood runs
        before = len(started)
        await keys.ensure_kid(new.kid)
        waited_for = len(started) - before
        still_flooding = not flooding.done()
        stop.set()
        return still_flooding and new.kid in keys.keys, await flooding, waited_for

    adopted, forged, waited_for = asyncio.run(scenario())
    assert adopted and forged >= 50
    assert waited_for <= 2  # the fetch under way (if any) and the next: not one per made-up id before it
    gaps = [b - a for a, b in itertools.pairwise(started)]
    assert all(gap >= WINDOW_S * 0.99 for gap in gaps), gaps  # at most one fetch a window, however many ids
