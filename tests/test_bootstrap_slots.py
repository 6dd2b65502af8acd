"""A rank slot registered with a credential is held: nobody without it can point the slot elsewhere.

The attack (issue 34, finding 1): anyone who reaches the bootstrap registry
re-registers a prefill rank's slot with the address of a listener of their
own, and decode nodes that trusted the registry sent it their pulls. A
meshnet prefill node signs its registration with its hop key
(:mod:`meshwire.rank_proof`); the registry then refuses any registration of
that slot not signed by the same key or bearing the mesh secret. Unsigned
registrations of unsigned slots keep the reference's behaviour (the same slot
registered again is replaced), so the reference's clients and conformance
suite are unaffected.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from meshwire.auth import DEFAULT_SECRET
from meshwire.kv_handoff import KVShape
from meshwire.pd_group import PrefillMember, plan_prefill_group
from meshwire.rank_proof import SIGNER_KEY, sign_registration
from meshwire.registry import RegistrationAnswer
from meshwire.route_keys import SigningKey
from services.bootstrap.app import create_app
from services.bootstrap.refusals import Refusal
from services.bootstrap.registry import SLOT_HELD, BootstrapRegistry
from services.bootstrap.settings import BootstrapSettings
from services.node.pd.pd_member import REFRESH_S, RETRY_HELD_S, PrefillMembership
from tests.bootstrap_samples import registration
from tests.procs import TEST_SECRET, Service, start_service

NODE_KEY = SigningKey.generate()
ATTACKER_KEY = SigningKey.generate()
SLOT = {"engine_rank": 1, "target_dp_group": 0}


@pytest.fixture(scope="module")
def bootstrap() -> Iterator[Service]:
    with start_service("bootstrap") as service:  # MESHNET_SECRET is the test secret
        yield service


def put(service: Service, body: dict[str, Any], headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.put(f"{service.url}/route", content=orjson.dumps(body),
                     headers={"content-type": "application/json", **(headers or {})})


def signed_put(service: Service, body: dict[str, Any], key: SigningKey, signer: str = "p1") -> httpx.Response:
    raw = orjson.dumps(body)
    return httpx.put(f"{service.url}/route", content=raw,
                     headers={"content-type": "application/json", **sign_registration(key, signer, raw)})


def address(service: Service) -> dict[str, Any]:
    return dict(httpx.get(f"{service.url}/route", params=SLOT).json())


def test_an_attacker_cannot_point_a_signed_slot_at_a_listener_of_its_own(bootstrap: Service) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    try:
        port = listener.getsockname()[1]
        assert signed_put(bootstrap, registration(1, port=7001, rank_ip="127.0.0.1"), NODE_KEY).status_code == 200
        hijack = registration(1, port=port, rank_ip="127.0.0.1")
        unsigned = put(bootstrap, hijack)
        assert (unsigned.status_code, unsigned.text) == (403, SLOT_HELD)
        other_key = signed_put(bootstrap, hijack, ATTACKER_KEY, signer="p1")
        assert (other_key.status_code, other_key.text) == (403, SLOT_HELD)
        wrong_secret = put(bootstrap, hijack, {"Authorization": "Bearer not-the-secret"})
        assert wrong_secret.status_code == 403
        assert address(bootstrap) == {"rank_ip": "127.0.0.1", "rank_port": 7001}, "nothing was recorded"
    finally:
        listener.close()


def test_a_signature_that_does_not_hold_is_refused_before_anything_is_recorded(bootstrap: Service) -> None:
    body = orjson.dumps(registration(1, port=7009, rank_ip="127.0.0.1"))
    headers = {"content-type": "application/json", **sign_registration(NODE_KEY, "p1", body)}
    altered = httpx.put(f"{bootstrap.url}/route", content=body.replace(b"7009", b"7010"), headers=headers)
    assert altered.status_code == 403
    swapped = httpx.put(f"{bootstrap.url}/route", content=body,
                        headers={**headers, SIGNER_KEY: ATTACKER_KEY.public_text})
    assert swapped.status_code == 403
    assert address(bootstrap)["rank_port"] != 7010


def test_the_holder_and_the_mesh_secret_may_register_over_a_held_slot(bootstrap: Service) -> None:
    assert signed_put(bootstrap, registration(1, port=7002, rank_ip="127.0.0.1"), NODE_KEY).status_code == 200
    assert address(bootstrap)["rank_port"] == 7002
    operator = put(bootstrap, registration(1, port=7003, rank_ip="127.0.0.1"),
                   {"Authorization": f"Bearer {TEST_SECRET}"})
    assert operator.status_code == 200
    assert address(bootstrap)["rank_port"] == 7003
    assert put(bootstrap, registration(1, port=7004, rank_ip="127.0.0.1")).status_code == 403, \
        "a slot the mesh secret registered is held too"


def test_unsigned_registrations_of_an_unsigned_slot_replace_it_as_the_reference_does(bootstrap: Service) -> None:
    for port in (7101, 7102):
        assert put(bootstrap, registration(2, port=port)).status_code == 200
        assert httpx.get(f"{bootstrap.url}/route", params={"engine_rank": 0, "target_dp_group": 1}).json() == {
            "rank_ip": "10.0.0.1", "rank_port": port}


def test_a_hold_lapses_unless_renewed_so_a_restarted_node_with_a_new_key_takes_its_slot_back() -> None:
    now = [0.0]
    table = BootstrapRegistry("addresses", hold_s=120.0, clock=lambda: now[0])
    old, new = NODE_KEY.public_text, ATTACKER_KEY.public_text
    table.register(orjson.dumps(registration(1, port=7001)), key=old)
    now[0] = 100.0
    table.register(orjson.dumps(registration(1, port=7001)), key=old)  # renewed: held until 220
    now[0] = 200.0
    with pytest.raises(Refusal) as refused:
        table.register(orjson.dumps(registration(1, port=7002)), key=new)
    assert (refused.value.status, refused.value.message) == (403, SLOT_HELD)
    with pytest.raises(Refusal):
        table.register(orjson.dumps(registration(1, port=7002)))
    now[0] = 221.0
    table.register(orjson.dumps(registration(1, port=7002)), key=new)
    assert table.route({"engine_rank": "1", "target_dp_group": "0"}) == {"rank_ip": "10.0.0.1", "rank_port": 7002}


def test_a_prefill_node_refused_for_a_held_slot_asks_again_and_renews_its_own_hold() -> None:
    """A node restarted with a fresh hop key: refused while its old key's hold lasts, registered once it lapsed
    (asked again every RETRY_HELD_S), then renewing its own hold every REFRESH_S."""
    group = plan_prefill_group([PrefillMember("p0", 0, 3)], 4)
    assert group is not None
    answer = RegistrationAnswer(lease="l", heartbeat_s=1, ttl_s=2, prefill_group=group.assignment("p0"))
    shape = KVShape(num_layers=4, kv_heads=2, head_dim=16, dtype="float32", itemsize=4, max_positions=4096)
    now = [0.0]

    async def scenario(url: str) -> list[int | None]:
        old = PrefillMembership(bootstrap_url=url, public_url="http://127.0.0.1:7001", shape=shape, node_id="p0",
                                hop_key=SigningKey.generate(), clock=lambda: now[0])
        new = PrefillMembership(bootstrap_url=url, public_url="http://127.0.0.1:7001", shape=shape, node_id="p0",
                                hop_key=SigningKey.generate(), clock=lambda: now[0])
        seen: list[int | None] = []
        for member in (old, new):
            member.on_answer(answer)
            assert member._task is not None
            await member._task
            seen.append(member.pd_rank)
        assert new.error == SLOT_HELD
        deadline = time.monotonic() + 60
        while new.pd_rank is None and time.monotonic() < deadline:  # the old key's hold lapses (2 s)
            now[0] += RETRY_HELD_S
            new.on_answer(answer)
            if new._task is not None:
                await new._task
            await asyncio.sleep(0.2)
        seen.append(new.pd_rank)
        first = new._task
        new.on_answer(answer)
        assert new._task is first, "no renewal before REFRESH_S"
        now[0] += REFRESH_S
        new.on_answer(answer)
        assert new._task is not first
        await new._task
        seen.append(new.pd_rank)
        await old.aclose()
        await new.aclose()
        return seen

    with start_service("bootstrap", {"MESHNET_SLOT_HOLD_S": "2"}) as service:
        assert asyncio.run(scenario(service.url)) == [0, None, 0, 0]


async def test_the_published_development_secret_proves_nothing() -> None:
    app = create_app(BootstrapSettings(secret=DEFAULT_SECRET))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://bootstrap") as http:
        answer = await http.put("/route", json=registration(0), headers={"Authorization": f"Bearer {DEFAULT_SECRET}"})
    assert answer.status_code == 403
