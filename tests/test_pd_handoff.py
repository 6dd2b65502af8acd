"""Prefill on prefill nodes, decode on decode nodes, the KV handed over through the bootstrap registry.

Real processes: a ``cache-layouts`` bootstrap registry, a tracker, prefill
nodes (``--role prefill``) and decode nodes (``--role decode``), the tiny
model in float32. Two shapes: one prefill node and one decode node each
holding every layer, and two prefill stages (0-1, 2-3) with two decode nodes
split differently (0-2, 3), so the decode head pulls from both stages.
A long prompt's answer equals transformers ``generate`` and the mesh's plain
path token for token; the decode nodes run no prompt position; the faults
fall back to the decode route's own prefill with the same answer. The third
shape, one prefill node and two decode nodes, runs on nodes that joined by
token (tests/test_pd_token.py). Handoff calls the test makes itself are signed
as the nodes of a decode route of its own (``tests.pd_mesh.decode_route``).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from meshwire import headers as h
from meshwire.kv_box import BOX, Opener
from meshwire.kv_handoff import (
    DECODE_ROUTE,
    KV_CHUNK_POSITIONS,
    KV_LAYERS,
    KV_SOURCE,
    PREFILL_PATH,
    PULL_PATH,
)
from meshwire.rank_proof import sign_registration
from meshwire.route_keys import SigningKey
from meshwire.routes import Route, RouteNode, issue_signed_route
from services.node.pd.kv_pull import LAYOUT_CACHE_S
from tests.pd_mesh import AUTH, PD_MIN_PROMPT_TOKENS, PdMesh, decode_route, signed, start_pd_mesh, wait_for
from tests.procs import TEST_ROUTE_KEY, node_hop_key, start_service, wait_healthy

LONG = [{"role": "user", "content": "Tell me a long story about the river and the old mill by the water."}]
"""Well over :data:`PD_MIN_PROMPT_TOKENS` tokens with the chat template."""
SHORT = [{"role": "user", "content": "Hi"}]
MAX_TOKENS = 12
SEEDED = {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "seed": 5}
HANDOFF_TTL_S = 15
MAX_HELD = 2

SHAPES = {
    "1+1": ({"p": (0, 3)}, {"d": (0, 3)}),
    "2+2": ({"p0": (0, 1), "p1": (2, 3)}, {"d0": (0, 2), "d1": (3, 3)}),
}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def mesh(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Iterator[PdMesh]:
    prefill, decode = SHAPES[request.param]
    running = start_pd_mesh(tiny_model_dir, prefill, decode,
                            prefill_env={"MESHNET_HANDOFF_TTL_S": str(HANDOFF_TTL_S),
                                         "MESHNET_HANDOFF_MAX_HELD": str(MAX_HELD)})
    running.extra.update(prefill=list(prefill), decode=list(decode), layers={**prefill, **decode},
                         model_dir=tiny_model_dir)
    try:
        yield running
    finally:
        running.stop()


def expected(reference: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]],
             sampling: dict[str, Any] | None) -> tuple[str, int, int]:
    """transformers ``generate``'s answer: text, completion tokens, prompt tokens."""
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    if sampling is None:
        out = reference.generate(**inputs, do_sample=False, max_new_tokens=MAX_TOKENS)
    else:
        torch.manual_seed(sampling["seed"])
        out = reference.generate(**inputs, do_sample=True, temperature=sampling["temperature"],
                                 top_p=sampling["top_p"], top_k=sampling["top_k"], max_new_tokens=MAX_TOKENS)
    prompt = inputs["input_ids"].shape[1]
    new = out[0, prompt:].tolist()
    return tokenizer.decode(new, skip_special_tokens=True), len(new), prompt


def args(sampling: dict[str, Any] | None) -> dict[str, Any]:
    if sampling is None:
        return {"temperature": 0}
    return {"temperature": sampling["temperature"], "top_p": sampling["top_p"], "seed": sampling["seed"],
            "extra_body": {"top_k": sampling["top_k"]}}


def chat(mesh: PdMesh, messages: list[dict[str, str]], sampling: dict[str, Any] | None) -> tuple[str, int]:
    """A streamed chat through the tracker (as a client): the text and the completion tokens."""
    client = openai.OpenAI(base_url=f"{mesh.tracker.url}/v1", api_key="unused", timeout=120)
    chunks = list(client.chat.completions.create(model=mesh.model, messages=messages, stream=True,
                                                 max_tokens=MAX_TOKENS, stream_options={"include_usage": True},
                                                 **args(sampling)))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = next(c.usage for c in reversed(chunks) if c.usage is not None)
    return text, usage.completion_tokens


def plain_chat(mesh: PdMesh, messages: list[dict[str, str]], sampling: dict[str, Any] | None) -> str:
    """The same request sent straight to the decode head with no prefill route: the mesh's plain path."""
    head = mesh.extra["decode"][0]
    body: dict[str, Any] = {"model": mesh.model, "messages": messages, "max_tokens": MAX_TOKENS}
    extra = args(sampling)
    body.update(extra.pop("extra_body", {}))
    body.update(extra)
    response = httpx.post(f"{mesh.url(head)}/v1/chat/completions", json=body, headers=AUTH, timeout=120)
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["message"]["content"])


def counters(mesh: PdMesh) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for name in (name for name, service in mesh.nodes.items() if service.alive()):
        out[name] = {
            "positions": mesh.metric(name, "meshnet_node_positions_computed_total"),
            "handoff": mesh.metric(name, "meshnet_node_pd_requests_total", outcome="handoff"),
            "fallback": mesh.metric(name, "meshnet_node_pd_requests_total", outcome="fallback"),
            "held": mesh.metric(name, "meshnet_node_kv_handoffs_held_total"),
            "pulled_free": mesh.metric(name, "meshnet_node_kv_handoffs_freed_total", how="pulled"),
            "expired": mesh.metric(name, "meshnet_node_kv_handoffs_freed_total", how="expired"),
            "pulls": mesh.metric(name, "meshnet_node_kv_pulls_total", outcome="ok"),
        }
    return out


def delta(after: dict[str, dict[str, float]], before: dict[str, dict[str, float]], name: str, key: str) -> float:
    return after[name][key] - before[name][key]


def held_now(mesh: PdMesh, name: str) -> float:
    return mesh.metric(name, "meshnet_node_kv_handoffs_holding")


def prefill_route(mesh: PdMesh) -> str:
    """A prefill route through the prefill nodes, signed with the test's route key (the prefill nodes pin it)
    and naming their hop keys, as the tracker signs one."""
    view = mesh.node_view()
    nodes = tuple(RouteNode(node_id=name, endpoint=view[name]["endpoint"], shard_start=view[name]["shard_start"],
                            shard_end=view[name]["shard_end"], hop_key=node_hop_key(name).public_text)
                  for name in mesh.extra["prefill"])
    return issue_signed_route(Route(model=mesh.model, nodes=nodes, num_layers=4), TEST_ROUTE_KEY).token


TEST_DECODE = {"td": (0, 3)}
"""The decode route the test plays the head of when it asks a prefill itself (the node need not exist)."""


def direct_prefill(mesh: PdMesh, session: str, ids: list[int], headers: dict[str, str] | None = None,
                   body: bytes | None = None) -> httpx.Response:
    """A prefill asked by the test as the head of a decode route of its own (signed with its test hop key)."""
    head = mesh.extra["prefill"][0]
    base = {h.ROUTE: prefill_route(mesh), DECODE_ROUTE: decode_route(mesh, TEST_DECODE), h.SESSION: session,
            h.SAMPLING: '{"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0}', **(headers or {})}
    content = orjson.dumps({"ids": ids}) if body is None else body
    return httpx.post(f"{mesh.url(head)}{PREFILL_PATH}", headers=signed(base, "td", PREFILL_PATH, content),
                      content=content, timeout=60)


# --- the answer ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sampling", [None, SEEDED], ids=["greedy", "seeded"])
def test_a_long_prompt_prefilled_on_prefill_nodes_equals_transformers_and_the_plain_path(
        mesh: PdMesh, reference: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
        sampling: dict[str, Any] | None) -> None:
    want_text, want_tokens, prompt_tokens = expected(reference, tokenizer, LONG, sampling)
    assert prompt_tokens >= PD_MIN_PROMPT_TOKENS
    before = counters(mesh)
    text, tokens = chat(mesh, LONG, sampling)
    after = counters(mesh)
    assert (text, tokens) == (want_text, want_tokens)
    head = mesh.extra["decode"][0]
    assert delta(after, before, head, "handoff") == 1 and delta(after, before, head, "fallback") == 0
    for name in mesh.extra["prefill"]:  # the prompt ran there, once, and the KV was pulled whole and freed
        assert delta(after, before, name, "positions") == prompt_tokens
        assert delta(after, before, name, "held") == 1
    wait_for(lambda: all(held_now(mesh, name) == 0 for name in mesh.extra["prefill"]), "the handoffs to be freed")
    for name in mesh.extra["decode"]:  # no prompt position on a decode node: only the fed-back tokens
        assert delta(after, before, name, "positions") == tokens - 1
        assert delta(after, before, name, "pulls") == 1
    assert plain_chat(mesh, LONG, sampling) == want_text


def test_a_short_prompt_takes_the_plain_route_on_the_decode_nodes(
        mesh: PdMesh, reference: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    want_text, want_tokens, prompt_tokens = expected(reference, tokenizer, SHORT, None)
    assert prompt_tokens < PD_MIN_PROMPT_TOKENS
    before = counters(mesh)
    assert chat(mesh, SHORT, None) == (want_text, want_tokens)
    after = counters(mesh)
    head = mesh.extra["decode"][0]
    assert delta(after, before, head, "handoff") == delta(after, before, head, "fallback") == 0
    assert all(delta(after, before, name, "positions") == 0 for name in mesh.extra["prefill"])


def test_the_tracker_lists_roles_and_the_registry_holds_the_prefill_group(mesh: PdMesh) -> None:
    view = mesh.node_view()
    assert {name: view[name]["role"] for name in mesh.nodes} == {
        **{name: "prefill" for name in mesh.extra["prefill"]}, **{name: "decode" for name in mesh.extra["decode"]}}
    sizes = httpx.get(f"{mesh.bootstrap.url}/route", params={"engine_rank": -1, "target_dp_group": -1}).json()
    stages = len(mesh.extra["prefill"])
    assert (sizes["prefill_tp_size"], sizes["prefill_dp_size"], sizes["prefill_pp_size"]) == (stages, 1, stages)
    layers = mesh.extra["layers"]
    assert sizes["cache_fields_by_stage"] == [
        [f"layer.{i}.kv" for i in range(layers[name][0], layers[name][1] + 1)] for name in mesh.extra["prefill"]]
    assert orjson.loads(sizes["cache_layout"])["plan"]["fields"][0]["dtype"] == "float32"
    for stage, name in enumerate(mesh.extra["prefill"]):
        address = httpx.get(f"{mesh.bootstrap.url}/route", params={"engine_rank": stage, "target_dp_group": 0}).json()
        assert address == {"rank_ip": "127.0.0.1", "rank_port": mesh.nodes[name].port}
        assert view[name]["pd_rank"] == stage


# --- security and bounds --------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [PREFILL_PATH, PULL_PATH])
def test_the_kv_endpoints_refuse_unsigned_callers_and_the_mesh_secret_is_no_credential(mesh: PdMesh, path: str) -> None:
    route = {h.ROUTE: prefill_route(mesh), DECODE_ROUTE: decode_route(mesh, TEST_DECODE), h.SESSION: "s-forged",
             KV_LAYERS: "0-0", h.CHUNK_INDEX: "0", KV_CHUNK_POSITIONS: "16"}
    if path == PULL_PATH:
        route[h.ROUTE] = route[DECODE_ROUTE]
    forged = signed(route, "td", path, b"{}", key=SigningKey.generate())  # td's name, another key
    for name in (mesh.extra["prefill"][0], mesh.extra["decode"][0]):
        url = f"{mesh.url(name)}{path}"
        assert httpx.post(url, content=b"{}").status_code == 401
        assert httpx.post(url, content=b"{}", headers=AUTH).status_code == 401, "the mesh secret proves nothing"
        refused = httpx.post(url, content=b"{}", headers=forged)
        assert refused.status_code == (403 if name in mesh.extra["prefill"] else 409), refused.text
        assert refused.json()["error"]["code"] in ("bad_proof", "not_prefill")


def test_a_pull_of_a_handoff_nobody_holds_is_a_404_and_bad_headers_a_400(mesh: PdMesh) -> None:
    url = f"{mesh.url(mesh.extra['prefill'][0])}{PULL_PATH}"
    headers = {h.ROUTE: decode_route(mesh, TEST_DECODE), h.SESSION: "s-nobody", KV_LAYERS: "0-0",
               h.CHUNK_INDEX: "0", KV_CHUNK_POSITIONS: "16", KV_SOURCE: mesh.extra["prefill"][0],
               BOX: Opener().public_text}
    elsewhere = httpx.post(url, headers=signed({**headers, KV_SOURCE: "another-node"}, "td", PULL_PATH))
    assert elsewhere.status_code == 403 and elsewhere.json()["error"]["code"] == "wrong_node", elsewhere.text
    unsealable = httpx.post(url, headers=signed({**headers, BOX: "not-a-key"}, "td", PULL_PATH))
    assert unsealable.status_code == 400, unsealable.text
    missing = httpx.post(url, headers=signed(headers, "td", PULL_PATH))
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "unknown_handoff"
    assert httpx.post(url, headers=signed({**headers, KV_CHUNK_POSITIONS: "17"}, "td", PULL_PATH)).status_code == 400
    assert httpx.post(url, headers=signed({**headers, KV_LAYERS: "3-1"}, "td", PULL_PATH)).status_code == 400


def test_handoffs_are_bounded_in_number_and_freed_unpulled_after_their_ttl(mesh: PdMesh) -> None:
    head = mesh.extra["prefill"][0]
    wait_for(lambda: all(held_now(mesh, name) == 0 for name in mesh.extra["prefill"]), "no handoff held")
    before = counters(mesh)
    ids = list(range(5, 5 + 3 * 16))
    for index in range(MAX_HELD):
        answer = direct_prefill(mesh, f"s-held-{index}-{time.monotonic_ns()}", ids)
        assert answer.status_code == 200, answer.text
        assert answer.json()["positions"] == len(ids)
    refused = direct_prefill(mesh, f"s-over-{time.monotonic_ns()}", ids)
    assert refused.status_code == 503, refused.text
    assert all(held_now(mesh, name) == MAX_HELD for name in mesh.extra["prefill"])
    wait_for(lambda: all(held_now(mesh, name) == 0 for name in mesh.extra["prefill"]),
             "the unpulled handoffs to expire", timeout_s=HANDOFF_TTL_S * 6)
    after = counters(mesh)
    assert all(delta(after, before, name, "expired") == MAX_HELD for name in mesh.extra["prefill"])
    assert mesh.metric(head, "meshnet_node_kv_handoff_bytes") == 0


def test_a_prefill_request_with_a_bad_route_or_body_is_refused(mesh: PdMesh) -> None:
    assert direct_prefill(mesh, "s-bad-route", [1, 2, 3], {h.ROUTE: "nope.nope"}).status_code == 403
    assert direct_prefill(mesh, "s-bad-decode", [1, 2, 3], {DECODE_ROUTE: "nope.nope"}).status_code == 403
    bad = direct_prefill(mesh, "s-bad-body", [], body=b"not json")
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "bad_body"
    assert direct_prefill(mesh, "s-bad-token", [10 ** 6]).status_code == 400


def test_a_prefill_is_asked_by_the_decode_routes_head_once(mesh: PdMesh) -> None:
    """Signed by a node of the decode route that is not its head: 403; the same signed request twice: the
    second is a replay (403), whatever the first was answered."""
    head = mesh.extra["prefill"][0]
    two = decode_route(mesh, {"ta": (0, 1), "tb": (2, 3)})
    headers = {h.ROUTE: prefill_route(mesh), DECODE_ROUTE: two, h.SESSION: "s-not-head",
               h.SAMPLING: '{"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0}'}
    body = orjson.dumps({"ids": [10 ** 6]})
    url = f"{mesh.url(head)}{PREFILL_PATH}"
    not_head = httpx.post(url, headers=signed(headers, "tb", PREFILL_PATH, body), content=body)
    assert not_head.status_code == 403 and not_head.json()["error"]["code"] == "bad_proof", not_head.text
    once = signed(headers, "ta", PREFILL_PATH, body)
    assert httpx.post(url, headers=once, content=body).status_code == 400  # the token is out of vocabulary
    replayed = httpx.post(url, headers=once, content=body)
    assert replayed.status_code == 403 and replayed.json()["error"]["code"] == "replayed", replayed.text


# --- faults ---------------------------------------------------------------------------------------------------


def test_a_hijacked_registry_slot_is_refused_and_never_pulled_from_and_the_handoff_still_works(
        mesh: PdMesh, reference: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Issue 34's attack: point the last stage's registry slot at a listener. Unsigned, the prefill node's
    signed slot refuses it (403). Even forced there with the mesh secret (a registry an attacker controls), the
    decode nodes pull from the endpoints the tracker's signed prefill route names, so the listener hears
    nothing, the handoff is taken, and the answer is exact."""
    last_stage = len(mesh.extra["prefill"]) - 1
    name = mesh.extra["prefill"][last_stage]
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    place = httpx.get(f"{mesh.url(name)}/health").json()["prefill_group"]
    sizes = httpx.get(f"{mesh.bootstrap.url}/route", params={"engine_rank": -1, "target_dp_group": -1}).json()
    registration = {"role": "Prefill", "world_size": place["world_size"], "dp_size": place["dp_size"],
                    "rank_ip": "127.0.0.1", "rank_port": listener.getsockname()[1],
                    "engine_rank": place["engine_rank"], "pp_size": sizes["prefill_pp_size"],
                    "cache_layout": sizes["cache_layout"], "cache_fields_by_stage": sizes["cache_fields_by_stage"]}
    assert httpx.put(f"{mesh.bootstrap.url}/route", json=registration).status_code == 403
    assert httpx.put(f"{mesh.bootstrap.url}/route", json=registration, headers=AUTH).status_code == 200
    try:
        want_text, want_tokens, _ = expected(reference, tokenizer, LONG, SEEDED)
        before = counters(mesh)
        assert chat(mesh, LONG, SEEDED) == (want_text, want_tokens)
        after = counters(mesh)
        head = mesh.extra["decode"][0]
        assert delta(after, before, head, "handoff") == 1 and delta(after, before, head, "fallback") == 0
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()
        registration["rank_port"] = mesh.nodes[name].port  # back, held by the node's own key again
        raw = orjson.dumps(registration)
        restored = httpx.put(f"{mesh.bootstrap.url}/route", content=raw,
                             headers={"content-type": "application/json",
                                      **sign_registration(node_hop_key(name), name, raw), **AUTH})
        assert restored.status_code == 200


def test_a_registry_holding_another_layout_is_refused_with_its_reason_and_the_decode_route_prefills(
        mesh: PdMesh, reference: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """The registry restarted and a group whose KV is bfloat16 registered first: the decode head refuses that
    layout (saying why), the decode route prefills the prompt itself, and the answer is exact."""
    params = {"engine_rank": -1, "target_dp_group": -1}
    sizes = httpx.get(f"{mesh.bootstrap.url}/route", params=params).json()
    ranks = [httpx.get(f"{mesh.bootstrap.url}/route", params={"engine_rank": stage, "target_dp_group": 0}).json()
             for stage in range(sizes["prefill_pp_size"])]

    def registrations(layout: str) -> list[dict[str, Any]]:
        return [{"role": "Prefill", "world_size": sizes["prefill_tp_size"], "dp_size": sizes["prefill_dp_size"],
                 "engine_rank": stage, "pp_size": sizes["prefill_pp_size"], "cache_layout": layout,
                 "cache_fields_by_stage": sizes["cache_fields_by_stage"], **rank} for stage, rank in enumerate(ranks)]

    def restart_registry(layout: str) -> None:
        port = mesh.bootstrap.port
        mesh.bootstrap.stop()
        mesh.bootstrap = start_service("bootstrap", {"MESHNET_REGISTRY": "cache-layouts"}, port=port)
        for registration in registrations(layout):
            assert httpx.put(f"{mesh.bootstrap.url}/route", json=registration).status_code == 200
        time.sleep(LAYOUT_CACHE_S + 1)  # decode nodes ask the registry again once their copy is this old

    bf16 = orjson.loads(sizes["cache_layout"])
    for field in bf16["plan"]["fields"]:
        field["dtype"] = "bfloat16"
    head = mesh.extra["decode"][0]
    restart_registry(orjson.dumps(bf16).decode())
    try:
        want_text, want_tokens, _ = expected(reference, tokenizer, LONG, None)
        before = counters(mesh)
        assert chat(mesh, LONG, None) == (want_text, want_tokens)
        after = counters(mesh)
        assert delta(after, before, head, "fallback") == 1 and delta(after, before, head, "handoff") == 0
        assert all(delta(after, before, name, "positions") == 0 for name in mesh.extra["prefill"])
        assert mesh.metric(head, "meshnet_node_pd_fallbacks_total", reason="layout_mismatch") == 1
        assert ("refusing the prefill group's KV: the prefill group keeps KV with dtype bfloat16, this node with "
                "dtype float32") in mesh.nodes[head].log()
    finally:
        restart_registry(sizes["cache_layout"])


def test_a_dead_prefill_node_leaves_the_decode_route_to_prefill_and_the_answer_is_exact(
        mesh: PdMesh, reference: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Killed before the request: the tracker still lists it (its heartbeats have not lapsed yet), the prefill
    route fails, the decode route prefills the prompt itself. The node then comes back and takes prefills again."""
    name = mesh.extra["prefill"][0]
    mesh.nodes[name].kill()
    try:
        want_text, want_tokens, _ = expected(reference, tokenizer, LONG, None)
        head = mesh.extra["decode"][0]
        before = counters(mesh)
        assert chat(mesh, LONG, None) == (want_text, want_tokens)
        after = counters(mesh)
        # Within the node's TTL the tracker offers the dead group (a fallback); after it, no prefill route at all.
        assert delta(after, before, head, "handoff") == 0
    finally:
        service = mesh.nodes[name]
        mesh.nodes[name] = start_service("node", {k: v for k, v in service.env.items() if k.startswith("MESHNET_")
                                                  and k not in ("MESHNET_HOST", "MESHNET_PORT")},
                                         port=service.port, wait_ready=False)
        wait_healthy(mesh.nodes[name])
        wait_for(lambda: mesh.node_view()[name]["pd_rank"] is not None and mesh.node_view()[name]["state"] == "online",
                 "the prefill node to come back into the group", timeout_s=60)
    want_text, want_tokens, _ = expected(reference, tokenizer, LONG, None)
    assert chat(mesh, LONG, None) == (want_text, want_tokens)
