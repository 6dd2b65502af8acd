"""PD fallback reasons with real processes, beyond those test_pd_handoff asserts: a prefill node whose
handoffs may hold fewer bytes than a prompt's KV (``MESHNET_HANDOFF_MAX_BYTES``) cannot hand the prompt
over; a decode head whose bootstrap registry is gone cannot look the prefill group up; a pull that gets no
answer within the decode node's ``MESHNET_HANDOFF_PULL_TIMEOUT_S`` (``timeout``), a refusal
(``pull_refused``) or a body over the chunk's size (``bad_chunk``); and a decode head serving alone, with
no signed route of its own to hand the KV to (``no_route``). Every way the decode route prefills the prompt
itself and answers as transformers does, and the decode head counts the fallback under its reason and logs
why.

The pulls' failures come from a proxy in front of the prefill node (:mod:`tests.tcp_proxy`, the address the
node advertises): it passes every other call through, and answers ``POST /kv/pull`` as each test says: never
(the decode node's own timeout ends the wait, no sleep involved), with a 403, or with too many bytes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from meshwire import headers as h
from meshwire.kv_handoff import MAX_PULL_ANSWER_EXTRA, PULL_PATH
from meshwire.routes import Route, RouteNode, issue_signed_route, plan_start_layers
from tests.pd_mesh import (
    AUTH,
    DECODE_MAX_FRAME_BYTES,
    NUM_LAYERS,
    PD_MIN_PROMPT_TOKENS,
    PdMesh,
    start_pd_mesh,
)
from tests.procs import TEST_ROUTE_KEY, free_port, node_hop_key, pinned_node_env
from tests.tcp_proxy import PIPE, STALL, Proxy, answer

LONG: Final = [{"role": "user", "content": " ".join(["Tell me a long story about the river and the old mill."] * 12)}]
HANDOFF_MAX_BYTES: Final = 1 << 16
"""The least the setting allows: below the long prompt's KV on the tiny model."""
PULL_TIMEOUT_S: Final = 8.0
"""The decode node's ``MESHNET_HANDOFF_PULL_TIMEOUT_S`` where pulls go through the proxy: what a stalled pull
costs the test, and ample for a refused or overfilled pull to fail on its own reason first (the pull runs on
a background thread at a lower CPU priority, which a loaded machine may keep waiting)."""
MAX_TOKENS: Final = 8


def pd_counts(mesh: PdMesh, name: str) -> dict[str, float]:
    """The node's PD fallbacks by reason and PD requests by outcome (``fallback``, ``handoff``)."""
    text = httpx.get(f"{mesh.url(name)}/metrics", timeout=10).text
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "meshnet_node_pd_fallbacks_total":
                counts[sample.labels["reason"]] = sample.value
            elif sample.name == "meshnet_node_pd_requests_total":
                counts[sample.labels["outcome"]] = sample.value
    return counts


def moved(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


@pytest.fixture(scope="module")
def small_handoffs(tiny_model_dir: Path) -> Iterator[PdMesh]:
    running = start_pd_mesh(tiny_model_dir, {"p": (0, 3)}, {"d": (0, 3)},
                            prefill_env={"MESHNET_HANDOFF_MAX_BYTES": str(HANDOFF_MAX_BYTES)})
    try:
        yield running
    finally:
        running.stop()


def test_a_handoff_over_the_prefill_node_s_byte_bound_falls_back_as_prefill_failed(small_handoffs: PdMesh) -> None:
    mesh = small_handoffs
    before = pd_counts(mesh, "d")
    answer = httpx.post(f"{mesh.tracker.url}/v1/chat/completions", timeout=120,
                        json={"model": mesh.model, "messages": LONG, "max_tokens": 8, "temperature": 0})
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 8
    after = pd_counts(mesh, "d")
    assert moved(after, before, "prefill_failed") == 1 and moved(after, before, "fallback") == 1, after
    assert moved(after, before, "handoff") == 0, after
    refusals = [line for line in mesh.nodes["d"].log().splitlines() if "(prefill_failed)" in line]
    assert refusals and "does not fit" in refusals[-1] and f"of {HANDOFF_MAX_BYTES} bytes are held for handoffs" \
        in refusals[-1], refusals


@pytest.fixture(scope="module")
def plain_pd(tiny_model_dir: Path) -> Iterator[PdMesh]:
    running = start_pd_mesh(tiny_model_dir, {"p": (0, 3)}, {"d": (0, 3)})
    try:
        yield running
    finally:
        running.stop()


def test_a_decode_head_without_its_registry_falls_back_as_bootstrap(plain_pd: PdMesh) -> None:
    """The registry stops after every node registered: the prefill route still prefills, but the decode head
    cannot look up where the prompt's KV is, so its route prefills the prompt itself."""
    mesh = plain_pd
    mesh.bootstrap.stop()
    before = pd_counts(mesh, "d")
    answer = httpx.post(f"{mesh.tracker.url}/v1/chat/completions", timeout=120,
                        json={"model": mesh.model, "messages": LONG, "max_tokens": 8, "temperature": 0})
    assert answer.status_code == 200, answer.text
    after = pd_counts(mesh, "d")
    assert answer.json()["usage"]["completion_tokens"] == 8
    assert moved(after, before, "bootstrap") == 1 and moved(after, before, "fallback") == 1, after
    assert moved(after, before, "handoff") == 0, after
    refusals = [line for line in mesh.nodes["d"].log().splitlines() if "(bootstrap)" in line]
    assert refusals and "the bootstrap registry could not be asked" in refusals[-1], refusals


# --- pulls that fail on the wire, through a proxy in front of the prefill node ---------------------------


def pull_answers(action: Any) -> Any:
    """A proxy policy: ``action`` for ``POST /kv/pull``, every other call passed through."""
    return lambda line: action if line.startswith(f"POST {PULL_PATH} ".encode()) else PIPE


@pytest.fixture(scope="module")
def proxied(tiny_model_dir: Path) -> Iterator[tuple[PdMesh, Proxy]]:
    """A PD mesh whose prefill node ``p`` is reached through a proxy; the decode node ``d`` gives a pull
    :data:`PULL_TIMEOUT_S` and pins the test's route key (so a test can hand it a prefill route)."""
    port = free_port()
    with Proxy(port) as proxy:
        running = start_pd_mesh(tiny_model_dir, {"p": (0, 3)}, {"d": (0, 3)}, ports={"p": port}, node_env={
            "p": {"MESHNET_ADVERTISE": proxy.url},
            "d": {"MESHNET_HANDOFF_PULL_TIMEOUT_S": str(PULL_TIMEOUT_S), **pinned_node_env("d")}})
        try:
            yield running, proxy
        finally:
            proxy.policy = lambda line: PIPE
            running.stop()


@pytest.fixture(scope="module")
def greedy_answer(reference: Any, tokenizer: Any) -> str:
    """transformers ``generate``'s greedy answer to :data:`LONG`."""
    inputs = tokenizer.apply_chat_template(LONG, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert inputs["input_ids"].shape[1] >= PD_MIN_PROMPT_TOKENS
    with torch.no_grad():
        out = reference.generate(**inputs, do_sample=False, max_new_tokens=MAX_TOKENS)
    return str(tokenizer.decode(out[0, inputs["input_ids"].shape[1]:].tolist(), skip_special_tokens=True))


def ask_long(mesh: PdMesh) -> httpx.Response:
    """:data:`LONG`, greedy, asked of the tracker (which gives the decode head a prefill route with it)."""
    return httpx.post(f"{mesh.tracker.url}/v1/chat/completions", timeout=120,
                      json={"model": mesh.model, "messages": LONG, "max_tokens": MAX_TOKENS, "temperature": 0})


def assert_fell_back(mesh: PdMesh, before: dict[str, float], reason: str, why: str) -> None:
    after = pd_counts(mesh, "d")
    assert moved(after, before, reason) == 1 and moved(after, before, "fallback") == 1, after
    assert moved(after, before, "handoff") == 0, after
    refusals = [line for line in mesh.nodes["d"].log().splitlines() if f"({reason})" in line]
    assert refusals and why in refusals[-1], refusals


@pytest.mark.parametrize(("action", "reason", "why"), [
    (STALL, "timeout", f"pulling the prompt's KV took over {PULL_TIMEOUT_S:.0f} s"),
    (answer(403, b'{"error": {"message": "not yours", "code": "forbidden"}}'), "pull_refused",
     "refused the pull: HTTP 403"),
    (answer(200, bytes(DECODE_MAX_FRAME_BYTES + MAX_PULL_ANSWER_EXTRA + 1), "application/octet-stream"),
     "bad_chunk", "is over"),
], ids=["timeout", "pull_refused", "bad_chunk"])
def test_a_pull_that_fails_on_the_wire_falls_back_under_its_reason_and_answers_exactly(
        proxied: tuple[PdMesh, Proxy], greedy_answer: str, action: Any, reason: str, why: str) -> None:
    mesh, proxy = proxied
    proxy.policy = pull_answers(action)
    seen = len(proxy.lines)
    before = pd_counts(mesh, "d")
    try:
        response = ask_long(mesh)
    finally:
        proxy.policy = pull_answers(PIPE)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == greedy_answer
    assert_fell_back(mesh, before, reason, why)
    assert any(line.startswith(f"POST {PULL_PATH} ".encode()) for line in proxy.lines[seen:]), \
        "the decode node pulled through the proxy"


def test_a_decode_head_serving_alone_has_no_route_to_hand_the_kv_to(proxied: tuple[PdMesh, Proxy],
                                                                      greedy_answer: str) -> None:
    """Asked directly (no route from the tracker: it holds every layer and serves alone) with a prefill route,
    the decode head has no signed decode route the prefill nodes would hand the KV to: it prefills itself."""
    mesh, proxy = proxied
    prefill = plan_start_layers([RouteNode(node_id="p", endpoint=proxy.url, shard_start=0, shard_end=NUM_LAYERS - 1,
                                           hop_key=node_hop_key("p").public_text)])
    token = issue_signed_route(Route(model=mesh.model, nodes=prefill, num_layers=NUM_LAYERS), TEST_ROUTE_KEY).token
    before = pd_counts(mesh, "d")
    response = httpx.post(f"{mesh.url('d')}/v1/chat/completions", timeout=120,
                          headers={**AUTH, h.PREFILL_ROUTE: token, h.PD_MIN_PROMPT_TOKENS: str(PD_MIN_PROMPT_TOKENS)},
                          json={"model": mesh.model, "messages": LONG, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == greedy_answer
    assert_fell_back(mesh, before, "no_route", "no signed decode route")
