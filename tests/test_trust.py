"""Trust, piece by piece: the route key ring and its rotation, join tokens, signed requests, JWK sets."""

from __future__ import annotations

import orjson
import pytest

from meshnet.tokens import parse_duration
from meshwire.hop_proof import (
    BODY_DIGEST,
    MAX_PROOF_AGE_S,
    NONCE,
    PROOF,
    SIGNER,
    ProofProblem,
    SeenProofs,
    check_body,
    check_claim,
    check_claim_headers,
    read_claim,
    sign_request,
)
from meshwire.registry import NodeRegistration
from meshwire.route_keys import Jwks, KeyProblem, KeySet, SigningKey, jwks_of
from services.tracker.join_tokens import TokenRefused, check_binding, check_token, mint
from services.tracker.keyring import KeyRing
from services.tracker.registry import RegistryPolicy
from services.tracker.store import MemoryStore
from services.tracker.trust import SERVE_REREAD_S, TrackerTrust

NOW = 1_700_000_000.0
TTL = 600.0
LEAD = 60.0


# --- the key ring ---------------------------------------------------------------------------------------------


def test_the_first_key_signs_at_once_and_a_rotated_key_only_after_its_lead():
    ring, first = KeyRing().rotated(NOW, 0.0, TTL)
    assert ring.signer(NOW) == first
    ring, second = ring.rotated(NOW + 100, LEAD, TTL)
    assert ring.signer(NOW + 100) == first, "a new key is published before it signs"
    assert {k.kid for k in ring.published(NOW + 100, TTL).keys} == {first.kid, second.kid}
    assert ring.signer(NOW + 100 + LEAD) == second


def test_an_old_key_stays_published_until_every_route_it_signed_has_expired():
    ring, first = KeyRing().rotated(NOW, 0.0, TTL)
    ring, second = ring.rotated(NOW + 100, LEAD, TTL)
    retired = NOW + 100 + LEAD  # the last route signed with the first key is signed just before this
    assert first.kid in {k.kid for k in ring.published(retired + TTL - 1, TTL).keys}
    assert [k.kid for k in ring.published(retired + TTL, TTL).keys] == [second.kid]


def test_a_key_is_due_for_rotation_by_age_only_when_rotation_is_on():
    ring, _ = KeyRing().rotated(NOW, 0.0, TTL)
    assert KeyRing().due_for_rotation(NOW, 0.0), "an empty ring needs its first key"
    assert not ring.due_for_rotation(NOW + 10**6, 0.0)
    assert not ring.due_for_rotation(NOW + 99, 100.0)
    assert ring.due_for_rotation(NOW + 100, 100.0)


def test_a_ring_round_trips_through_the_store_and_garbage_reads_as_empty():
    ring, _ = KeyRing().rotated(NOW, 0.0, TTL)
    assert KeyRing.parse(ring.dump()) == ring
    assert KeyRing.parse("{not json") == KeyRing()
    assert KeyRing.parse(None) == KeyRing()


async def test_trackers_sharing_a_store_sign_with_one_key_and_publish_one_set():
    store = MemoryStore(RegistryPolicy())
    clock = [NOW]
    a = TrackerTrust(store, secret="s", route_ttl_s=TTL, rotate_s=0, lead_s=0, clock=lambda: clock[0])
    b = TrackerTrust(store, secret="s", route_ttl_s=TTL, rotate_s=0, lead_s=0, clock=lambda: clock[0])
    await a.refresh()
    await b.refresh()
    assert a.signing_key().kid == b.signing_key().kid
    rotated = await a.rotate()
    await b.refresh()
    assert b.signing_key().kid == rotated.kid == a.signing_key().kid
    assert a.jwks() == b.jwks() and len(a.jwks().keys) == 2


async def test_the_published_set_is_read_from_the_store_so_a_key_another_tracker_just_made_is_served():
    """A Redis restarted empty: tracker A makes a new key; B, asked for its keys before its next refresh,
    still serves it (a node that fetched from B would otherwise refuse A's routes)."""
    store = MemoryStore(RegistryPolicy())
    clock = [NOW]
    a = TrackerTrust(store, secret="s", route_ttl_s=TTL, rotate_s=0, lead_s=0, clock=lambda: clock[0])
    b = TrackerTrust(store, secret="s", route_ttl_s=TTL, rotate_s=0, lead_s=0, clock=lambda: clock[0])
    await a.refresh()
    await b.refresh()
    rotated = await a.rotate()
    assert rotated.kid not in {k.kid for k in b.jwks().keys}, "B's cached ring has not seen it yet"
    assert rotated.kid in {k.kid for k in (await b.current_jwks()).keys}


async def test_calls_for_the_published_set_read_the_store_at_most_once_per_interval():
    store = MemoryStore(RegistryPolicy())
    clock = [NOW]
    reads = []
    read_doc = store.read_doc

    async def counted(name):
        reads.append(name)
        return await read_doc(name)

    store.read_doc = counted  # type: ignore[method-assign]
    trust = TrackerTrust(store, secret="s", route_ttl_s=TTL, rotate_s=0, lead_s=0, clock=lambda: clock[0])
    for _ in range(50):
        await trust.current_jwks()
    assert len(reads) == 1
    clock[0] = NOW + SERVE_REREAD_S
    await trust.current_jwks()
    assert len(reads) == 2


async def test_a_tracker_rotates_a_key_that_reached_its_age():
    store = MemoryStore(RegistryPolicy())
    clock = [NOW]
    trust = TrackerTrust(store, secret="s", route_ttl_s=TTL, rotate_s=1000, lead_s=LEAD, clock=lambda: clock[0])
    first = (await trust.refresh()).keys[0]
    clock[0] = NOW + 1000
    ring = await trust.refresh()
    assert len(ring.keys) == 2 and trust.signing_key().kid == first.kid
    clock[0] = NOW + 1000 + LEAD
    assert trust.signing_key().kid == ring.keys[1].kid


# --- JWK sets ----------------------------------------------------------------------------------------------------


def test_the_jwk_set_has_exactly_the_standard_fields():
    key = SigningKey.generate()
    document = orjson.loads(jwks_of([key]).model_dump_json())
    assert document == {"keys": [{"kty": "OKP", "crv": "Ed25519", "kid": key.kid, "x": key.public_text}]}
    assert key.kid in KeySet.parse(orjson.dumps(document))


@pytest.mark.parametrize("document", [
    b"{}", b"[]", b"not json", b'{"keys": [{"kty": "RSA", "crv": "Ed25519", "kid": "a", "x": "b"}]}',
    b'{"keys": [{"kty": "OKP", "crv": "Ed25519", "kid": "a", "x": "short"}]}',
    b'{"keys": [{"kty": "OKP", "crv": "Ed25519", "kid": "a", "x": "' + b"A" * 43 + b'", "d": "private!"}]}',
    b" " * 20_000,
])
def test_a_document_that_is_not_a_jwk_set_of_public_ed25519_keys_is_refused(document):
    with pytest.raises(KeyProblem):
        KeySet.parse(document)


def test_a_signing_key_never_shows_its_private_half():
    key = SigningKey.generate()
    assert key.seed_text not in repr(key) and key.seed_text not in Jwks(keys=(key.jwk(),)).model_dump_json()


# --- signed requests --------------------------------------------------------------------------------------------


HEADERS = {"X-Meshnet-Route": "r.o.ute", "X-Meshnet-Session": "s1", "X-Meshnet-Step": "3", "Content-Type": "x"}


def received(headers: dict[str, str]) -> dict[str, str]:
    """Headers as a server sees them (lower-cased names)."""
    return {k.lower(): v for k, v in headers.items()}


def test_a_signed_request_verifies_with_the_signers_key_only():
    key = SigningKey.generate()
    sent = {**HEADERS, **sign_request(key, "front", "/forward", HEADERS, b"body", now=NOW)}
    claim = read_claim(received(sent))
    assert claim.signer == "front"
    check_claim(claim, key.private.public_key(), "/forward", received(sent), b"body", now=NOW + 1)
    with pytest.raises(ProofProblem) as caught:
        check_claim(claim, SigningKey.generate().private.public_key(), "/forward", received(sent), b"body", now=NOW)
    assert caught.value.status == 403


@pytest.mark.parametrize("change", ["body", "path", "header", "signer", "stale"])
def test_a_signed_request_changed_in_any_part_does_not_verify(change):
    key = SigningKey.generate()
    sent = {**HEADERS, **sign_request(key, "front", "/forward", HEADERS, b"body", now=NOW)}
    body, path, now = b"body", "/forward", NOW
    if change == "body":
        body = b"bodY"
    elif change == "path":
        path = "/forward/rows"
    elif change == "header":
        sent["X-Meshnet-Step"] = "4"
    elif change == "signer":
        sent[SIGNER] = "mid"
    else:
        now = NOW + MAX_PROOF_AGE_S + 1
    with pytest.raises(ProofProblem) as caught:
        check_claim(read_claim(received(sent)), key.private.public_key(), path, received(sent), body, now=now)
    assert caught.value.status == 403


def test_a_proof_verifies_from_the_headers_alone_and_binds_the_body_read_after():
    key = SigningKey.generate()
    sent = {**HEADERS, **sign_request(key, "front", "/forward", HEADERS, b"body", now=NOW)}
    claim = read_claim(received(sent))
    check_claim_headers(claim, key.private.public_key(), "/forward", received(sent), now=NOW)  # no body needed
    check_body(claim, b"body")
    with pytest.raises(ProofProblem):
        check_body(claim, b"another body")
    forged = {**received(sent), BODY_DIGEST.lower(): "0" * 64}  # declaring another digest breaks the signature
    with pytest.raises(ProofProblem) as caught:
        check_claim_headers(read_claim(forged), key.private.public_key(), "/forward", forged, now=NOW)
    assert caught.value.status == 403


def test_two_proofs_of_the_same_request_differ_by_their_nonce():
    key = SigningKey.generate()
    first, second = (sign_request(key, "tracker:k", "/v1/chat/completions", HEADERS, b"{}", now=NOW) for _ in range(2))
    assert first[NONCE] != second[NONCE] and first[PROOF] != second[PROOF]
    changed = {**received({**HEADERS, **first}), NONCE.lower(): second[NONCE]}
    with pytest.raises(ProofProblem):
        check_claim_headers(read_claim(changed), key.private.public_key(), "/v1/chat/completions", changed, now=NOW)


def test_a_proof_without_its_body_digest_is_a_401():
    sent = {**HEADERS, **sign_request(SigningKey.generate(), "front", "/forward", HEADERS, b"", now=NOW)}
    del sent[BODY_DIGEST]
    with pytest.raises(ProofProblem) as caught:
        read_claim(received(sent))
    assert caught.value.status == 401


@pytest.mark.parametrize("headers", [{}, {SIGNER: "front"}, {PROOF: "1.abc"}, {SIGNER: "front", PROOF: "garbage"},
                                     {SIGNER: "front", PROOF: "12." + "A" * 20}, {SIGNER: "x" * 500, PROOF: "1.a"}])
def test_missing_or_malformed_proof_headers_are_a_401(headers):
    with pytest.raises(ProofProblem) as caught:
        read_claim(received(headers))
    assert caught.value.status == 401


def test_a_proof_is_seen_once_within_its_age_and_forgotten_after_or_when_the_memory_is_full():
    clock = [NOW]
    seen = SeenProofs(max_seen=3, clock=lambda: clock[0])
    key = SigningKey.generate()
    sent = [{**HEADERS, "X-Meshnet-Step": str(i)} for i in range(4)]
    claims = [read_claim(received({**one, **sign_request(key, "d0", "/kv/pull", one, b"", now=NOW)})) for one in sent]
    assert seen.first_time(claims[0]) and not seen.first_time(claims[0]), "the same proof again is a replay"
    assert seen.first_time(claims[1]) and seen.first_time(claims[2]) and seen.first_time(claims[3])
    assert seen.first_time(claims[0]), "the oldest was pushed out by a full memory"
    clock[0] += 2 * MAX_PROOF_AGE_S + 1  # past any proof's age: forgotten (check_claim refuses them anyway)
    assert seen.first_time(claims[3])


# --- join tokens --------------------------------------------------------------------------------------------------


def registration(node_id: str = "node-a", model: str = "/models/tiny", layers: tuple[int, int] = (0, 1)
                 ) -> NodeRegistration:
    return NodeRegistration(node_id=node_id, model=model, endpoint="http://127.0.0.1:9000",
                            shard_start=layers[0], shard_end=layers[1])


def test_a_token_proves_its_record_and_binds_its_node_model_and_layers():
    token, record = mint("node-a", NOW, model="tiny", layers=(0, 1))
    assert check_token(token, record, NOW) == record
    check_binding(record, registration())
    for other, code in [(registration("node-b"), "token_node_mismatch"),
                        (registration(model="/models/other"), "token_model_mismatch"),
                        (registration(layers=(0, 3)), "token_layers_mismatch")]:
        with pytest.raises(TokenRefused) as caught:
            check_binding(record, other)
        assert (caught.value.status, caught.value.code) == (403, code)


def test_the_store_keeps_no_token_only_its_hash():
    token, record = mint("node-a", NOW)
    secret = token[len(f"mnj_{record.token_id}_"):]
    assert len(secret) == 43 and secret not in record.model_dump_json()


@pytest.mark.parametrize("case", ["wrong secret", "another token", "revoked", "expired", "garbage"])
def test_a_token_that_does_not_hold_is_refused(case):
    token, record = mint("node-a", NOW, ttl_s=100)
    other, _ = mint("node-a", NOW)
    now = NOW
    if case == "wrong secret":
        token = token[:-1] + ("A" if token[-1] != "A" else "B")
    elif case == "another token":
        token = other
    elif case == "revoked":
        record = record.model_copy(update={"revoked_at": NOW})
    elif case == "expired":
        now = NOW + 100
    else:
        token = "mnj_garbage"
    with pytest.raises(TokenRefused) as caught:
        check_token(token, record, now)
    assert caught.value.status == 403


async def test_the_shared_secret_cannot_register_an_id_a_token_binds():
    store = MemoryStore(RegistryPolicy())
    trust = TrackerTrust(store, secret="mesh-secret", route_ttl_s=TTL, rotate_s=0, lead_s=0, clock=lambda: NOW)
    assert await trust.admit("Bearer mesh-secret", registration()) is None
    token, record = mint("node-a", NOW)
    await store.put_token(record)
    with pytest.raises(TokenRefused) as caught:
        await trust.admit("Bearer mesh-secret", registration())
    assert caught.value.code == "token_required"
    assert await trust.admit(f"Bearer {token}", registration()) == record
    assert await trust.admit("Bearer mesh-secret", registration("node-b")) is None
    await store.put_token(record.model_copy(update={"revoked_at": NOW}))
    with pytest.raises(TokenRefused) as caught:  # revoked, the id does not come back by the secret either
        await trust.admit("Bearer mesh-secret", registration())
    assert caught.value.code == "token_required"
    with pytest.raises(TokenRefused) as caught:
        await trust.admit(f"Bearer {token}", registration())
    assert caught.value.code == "token_revoked"


@pytest.mark.parametrize(("text", "seconds"), [("3600", 3600.0), ("90s", 90.0), ("15m", 900.0), ("12h", 43200.0),
                                               ("30d", 2592000.0), ("1.5h", 5400.0)])
def test_a_token_ttl_reads_as_a_duration(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "0", "-5", "5y", "h", "1e9"])
def test_a_ttl_that_is_not_a_positive_duration_is_refused(text):
    with pytest.raises(ValueError):
        parse_duration(text)
