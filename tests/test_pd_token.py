"""Prefill/decode on nodes that joined by token: one prefill node, two decode nodes, no shared secret.

Real processes: a ``cache-layouts`` bootstrap registry, a tracker with an
admin key, one prefill node ``p`` (layers 0-3) and two decode nodes ``d0``
(0-1) and ``d1`` (2-3), each joined by a join token of its own and given a
mesh secret that is not the tracker's. The KV handoff is authorized by the
tracker's signed routes and the nodes' hop keys (:mod:`services.node.pd.kv_auth`):
a long prompt is prefilled on ``p``, each decode node pulls its own layers'
KV, and the answer equals transformers ``generate`` and the plain path token
for token (greedy and seeded), with no prompt position run on a decode node.
A pull that the decode route does not allow (unsigned, another node's key,
a node or layers the route does not name, another handoff's route, a replay)
is refused, and nothing is served for it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import httpx
import orjson
import pytest
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from meshwire import headers as h
from meshwire.kv_box import BOX, TAG_BYTES, BoxProblem, Opener
from meshwire.kv_handoff import (
    DECODE_ROUTE,
    KV_CHUNK_POSITIONS,
    KV_LAYERS,
    KV_SOURCE,
    PREFILL_PATH,
    PULL_PATH,
    pull_answer_problem,
)
from meshwire.route_keys import SigningKey
from meshwire.routes import Route, RouteNode, issue_signed_route
from tests.pd_mesh import AUTH, PD_MIN_PROMPT_TOKENS, PdMesh, decode_route, signed, start_pd_mesh, wait_for
from tests.procs import node_hop_key
from tests.test_pd_handoff import (
    LONG,
    MAX_TOKENS,
    SEEDED,
    args,
    chat,
    counters,
    delta,
    expected,
    held_now,
    prefill_route,
)

PREFILL: Final = {"p": (0, 3)}
DECODE: Final = {"d0": (0, 1), "d1": (2, 3)}
CLIENT_KEY: Final = "pd-token-client-key"
"""A client API key of the decode head: the plain path is asked with it (the mesh secret is no credential)."""
IDS: Final = list(range(5, 5 + 48))
"""A prompt the test prefills itself: three pages of KV."""
ONE_CHUNK: Final = "64"
"""Positions per pull chunk: the whole of :data:`IDS` in one chunk."""


@pytest.fixture(scope="module")
def mesh(tiny_model_dir: Path) -> Iterator[PdMesh]:
    running = start_pd_mesh(tiny_model_dir, PREFILL, DECODE, join_by_token=True,
                            node_env={"d0": {"MESHNET_API_KEYS": CLIENT_KEY}})
    running.extra.update(prefill=list(PREFILL), decode=list(DECODE))
    try:
        yield running
    finally:
        running.stop()


def plain_chat(mesh: PdMesh, sampling: dict[str, Any] | None) -> str:
    """The long prompt sent straight to the decode head as a client: no prefill route, the plain path."""
    body: dict[str, Any] = {"model": mesh.model, "messages": LONG, "max_tokens": MAX_TOKENS}
    extra = args(sampling)
    body.update(extra.pop("extra_body", {}))
    body.update(extra)
    response = httpx.post(f"{mesh.url('d0')}/v1/chat/completions", json=body,
                          headers={"Authorization": f"Bearer {CLIENT_KEY}"}, timeout=120)
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["message"]["content"])


@pytest.mark.parametrize("sampling", [None, SEEDED], ids=["greedy", "seeded"])
def test_a_long_prompt_is_handed_off_between_token_joined_nodes_and_equals_transformers_and_the_plain_path(
        mesh: PdMesh, reference: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
        sampling: dict[str, Any] | None) -> None:
    want_text, want_tokens, prompt_tokens = expected(reference, tokenizer, LONG, sampling)
    assert prompt_tokens >= PD_MIN_PROMPT_TOKENS
    before = counters(mesh)
    assert chat(mesh, LONG, sampling) == (want_text, want_tokens)
    after = counters(mesh)
    assert delta(after, before, "d0", "handoff") == 1 and delta(after, before, "d0", "fallback") == 0
    assert delta(after, before, "p", "positions") == prompt_tokens and delta(after, before, "p", "held") == 1
    for name in DECODE:  # each decode node pulled its own layers and ran no prompt position
        assert delta(after, before, name, "positions") == want_tokens - 1
        assert delta(after, before, name, "pulls") == 1
    wait_for(lambda: held_now(mesh, "p") == 0, "the handoff to be pulled whole and freed")
    assert delta(counters(mesh), before, "p", "pulled_free") == 1
    assert plain_chat(mesh, sampling) == want_text


def test_the_nodes_hold_no_mesh_secret(mesh: PdMesh) -> None:
    """The tracker's secret opens nothing on these nodes: what worked above worked on tokens and keys."""
    refused = httpx.post(f"{mesh.url('d0')}/v1/chat/completions", headers=AUTH, timeout=30,
                         json={"model": mesh.model, "messages": LONG, "max_tokens": 1})
    assert refused.status_code in (401, 403), refused.text
    assert httpx.post(f"{mesh.url('p')}{PULL_PATH}", headers=AUTH).status_code == 401


def hold(mesh: PdMesh, session: str, route: str, head: str) -> None:
    """Prefill :data:`IDS` on ``p`` as ``head``, the head of decode route ``route``: a handoff held for it."""
    headers = {h.ROUTE: prefill_route(mesh), DECODE_ROUTE: route, h.SESSION: session,
               h.SAMPLING: '{"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0}'}
    body = orjson.dumps({"ids": IDS})
    answer = httpx.post(f"{mesh.url('p')}{PREFILL_PATH}", headers=signed(headers, head, PREFILL_PATH, body),
                        content=body, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.json()["positions"] == len(IDS)


def pull(mesh: PdMesh, session: str, route: str, signer: str, layers: str,
         key: SigningKey | None = None, source: str = "p") -> httpx.Response:
    headers = {h.ROUTE: route, h.SESSION: session, KV_LAYERS: layers, h.CHUNK_INDEX: "0",
               KV_CHUNK_POSITIONS: ONE_CHUNK, KV_SOURCE: source, BOX: Opener().public_text}
    return httpx.post(f"{mesh.url('p')}{PULL_PATH}", headers=signed(headers, signer, PULL_PATH, key=key),
                      timeout=30)


def served(mesh: PdMesh) -> float:
    return mesh.metric("p", "meshnet_node_kv_served_bytes_total")


def test_a_pull_the_decode_route_does_not_allow_is_refused_and_nothing_is_served(mesh: PdMesh) -> None:
    wait_for(lambda: held_now(mesh, "p") == 0, "no handoff held")
    mine = decode_route(mesh, {"x0": (0, 1), "x1": (2, 3)})
    theirs = decode_route(mesh, {"y0": (0, 3)})
    hold(mesh, "s-mine", mine, "x0")
    hold(mesh, "s-theirs", theirs, "y0")
    before = served(mesh)
    url = f"{mesh.url('p')}{PULL_PATH}"
    puller_box = Opener()
    unsigned = {h.ROUTE: mine, h.SESSION: "s-mine", KV_LAYERS: "0-1", h.CHUNK_INDEX: "0",
                KV_CHUNK_POSITIONS: ONE_CHUNK, KV_SOURCE: "p", BOX: puller_box.public_text}
    assert httpx.post(url, headers=unsigned).status_code == 401
    assert httpx.post(url, headers={**unsigned, **AUTH}).status_code == 401
    untrusted = issue_signed_route(Route(model=mesh.model, num_layers=4, nodes=(RouteNode(
        node_id="x0", endpoint="http://127.0.0.1:9", shard_start=0, shard_end=3,
        hop_key=node_hop_key("x0").public_text),)), SigningKey.generate()).token
    forged = {
        "another key in x0's name": (pull(mesh, "s-mine", mine, "x0", "0-1", key=SigningKey.generate()), "bad_proof"),
        "a node the route does not name": (pull(mesh, "s-mine", mine, "z", "0-1"), "bad_proof"),
        "layers the route gives another node": (pull(mesh, "s-mine", mine, "x1", "0-1"), "bad_layers"),
        "another handoff's request id": (pull(mesh, "s-theirs", mine, "x0", "0-1"), "bad_route"),
        "another decode route": (pull(mesh, "s-mine", theirs, "y0", "0-3"), "bad_route"),
        "a route the tracker did not sign": (pull(mesh, "s-mine", untrusted, "x0", "0-1"), "bad_route"),
        "a pull meant for another prefill node": (pull(mesh, "s-mine", mine, "x0", "0-1", source="q"), "wrong_node"),
    }
    for why, (answer, code) in forged.items():
        assert answer.status_code == 403 and answer.json()["error"]["code"] == code, (why, answer.text)
    assert served(mesh) == before, "a refused pull is served nothing"

    once = signed(unsigned, "x0", PULL_PATH)
    first = httpx.post(url, headers=once, timeout=30)
    assert first.status_code == 200, first.text
    p_key = node_hop_key("p").private.public_key()  # the answer is p's, to x0, for this very pull
    assert pull_answer_problem(p_key, "p", first.headers, first.content, requester="x0",
                               request_proof=once["X-Meshnet-Proof"]) is None
    assert pull_answer_problem(p_key, "p", first.headers, first.content, requester="x1",
                               request_proof=once["X-Meshnet-Proof"]) is not None
    opened = puller_box.open(first.headers[BOX], first.content, once["X-Meshnet-Proof"])  # x0 reads the KV
    assert len(opened) == len(first.content) - TAG_BYTES
    with pytest.raises(BoxProblem):  # whoever replays x0's captured pull gets bytes only x0 can open
        Opener().open(first.headers[BOX], first.content, once["X-Meshnet-Proof"])
    replayed = httpx.post(url, headers=once, timeout=30)
    assert replayed.status_code == 403 and replayed.json()["error"]["code"] == "replayed", replayed.text
    assert served(mesh) == before + len(first.content) - TAG_BYTES  # the KV bytes, sealed with a 16-byte tag

    assert pull(mesh, "s-mine", mine, "x1", "2-3").status_code == 200
    assert pull(mesh, "s-theirs", theirs, "y0", "0-3").status_code == 200
    wait_for(lambda: held_now(mesh, "p") == 0, "both handoffs to be pulled whole and freed")
