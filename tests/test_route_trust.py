"""A node's route keys: a key the tracker made moments after the node last fetched is still accepted."""

from __future__ import annotations

import asyncio

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


def test_a_flood_of_unknown_key_ids_fetches_once_per_window(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trust, "MIN_REFRESH_S", WINDOW_S)
    fetches: list[int] = []

    async def fetch() -> KeySet:
        fetches.append(1)
        return KeySet()

    async def scenario() -> None:
        keys = RouteTrust(KeySet(), fetch)
        await asyncio.gather(*(keys.ensure_kid(f"forged-{i}") for i in range(5)))

    asyncio.run(scenario())
    assert len(fetches) == 5  # one a window, serialised: never a burst of fetches at once
